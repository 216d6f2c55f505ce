// Writes a step's keys and values into the paged cache, in its layout and dtype.
//
// The layout is cache_layout.h's; the conversion to the cache's dtype rounds to nearest even.
// Tokens are independent, so they are spread over the threads.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <c10/util/Exception.h>

#include "cache_layout.h"
#include "ops.h"
#include "vec.h"

namespace quill {
namespace {

template <typename IT, typename KT>
void write(const at::Tensor& k, const at::Tensor& v, at::Tensor& k_cache, at::Tensor& v_cache,
           const CacheGeometry& g, const int64_t* slots) {
  const int64_t tokens = k.size(0);
  const int heads = g.num_kv_heads, dim = g.head_dim, bs = g.block_size;
  const IT* kp = reinterpret_cast<const IT*>(k.data_ptr());
  const IT* vp = reinterpret_cast<const IT*>(v.data_ptr());
  KT* kc = reinterpret_cast<KT*>(k_cache.data_ptr());
  KT* vc = reinterpret_cast<KT*>(v_cache.data_ptr());
  const int64_t ks0 = k.stride(0), ks1 = k.stride(1), vs0 = v.stride(0), vs1 = v.stride(1);
  for (int64_t n = 0; n < tokens; ++n)
    TORCH_CHECK(slots[n] < g.num_blocks * bs, "quill::write_kv: slot ", slots[n], " past the cache's ",
                g.num_blocks * bs);
  at::parallel_for(0, tokens, 16, [&](int64_t begin, int64_t end) {
    for (int64_t n = begin; n < end; ++n) {
      const int64_t slot = slots[n];
      if (slot < 0) continue;
      const int64_t block = slot / bs;
      const int offset = int(slot % bs);
      for (int h = 0; h < heads; ++h) {
        const IT* ksrc = kp + n * ks0 + h * ks1;
        const IT* vsrc = vp + n * vs0 + h * vs1;
        for (int d = 0; d < dim; ++d) {
          kc[g.key_offset(block, h, d, offset)] = from_float<KT>(to_float(ksrc[d]));
          vc[g.value_offset(block, h, offset, d)] = from_float<KT>(to_float(vsrc[d]));
        }
      }
    }
  });
}

template <typename IT>
void write_from(const at::Tensor& k, const at::Tensor& v, at::Tensor& k_cache, at::Tensor& v_cache,
                const CacheGeometry& g, const int64_t* slots) {
  switch (k_cache.scalar_type()) {
    case at::kFloat: return write<IT, float>(k, v, k_cache, v_cache, g, slots);
    case at::kBFloat16: return write<IT, bf16>(k, v, k_cache, v_cache, g, slots);
    case at::kHalf: return write<IT, fp16>(k, v, k_cache, v_cache, g, slots);
    default: TORCH_CHECK(false, "quill::write_kv: KV cache dtype ", k_cache.scalar_type(), " is not supported");
  }
}

}  // namespace

void write_kv(const at::Tensor& k, const at::Tensor& v, at::Tensor& k_cache, at::Tensor& v_cache,
              const at::Tensor& slot_mapping) {
  const CacheGeometry g = cache_geometry(k_cache, v_cache, "quill::write_kv");
  TORCH_CHECK(k.dim() == 3 && v.dim() == 3, "quill::write_kv: k and v must be [tokens, kv_heads, head_dim]");
  TORCH_CHECK(k.sizes() == v.sizes() && k.scalar_type() == v.scalar_type(), "quill::write_kv: k and v differ");
  TORCH_CHECK(k.stride(2) == 1 && v.stride(2) == 1, "quill::write_kv: head_dim must be contiguous");
  TORCH_CHECK(k.size(1) == g.num_kv_heads && k.size(2) == g.head_dim, "quill::write_kv: k is ", k.sizes(),
              " but the cache holds [", g.num_kv_heads, ", ", g.head_dim, "] per token");
  TORCH_CHECK(slot_mapping.scalar_type() == at::kLong && slot_mapping.dim() == 1 && slot_mapping.is_contiguous(),
              "quill::write_kv: slot_mapping must be a contiguous int64 vector");
  TORCH_CHECK(slot_mapping.numel() == k.size(0), "quill::write_kv: ", slot_mapping.numel(), " slots for ",
              k.size(0), " tokens");
  const int64_t* slots = slot_mapping.data_ptr<int64_t>();
  switch (k.scalar_type()) {
    case at::kFloat: return write_from<float>(k, v, k_cache, v_cache, g, slots);
    case at::kBFloat16: return write_from<bf16>(k, v, k_cache, v_cache, g, slots);
    case at::kHalf: return write_from<fp16>(k, v, k_cache, v_cache, g, slots);
    default: TORCH_CHECK(false, "quill::write_kv: k dtype ", k.scalar_type(), " is not supported");
  }
}

}  // namespace quill
