// Writes a step's keys and values into the paged cache, in its layout and dtype.
//
// The layout is cache_layout.h's; the conversion to a float cache's dtype rounds to nearest
// even. An int8 cache gets, per 32 dimensions of a token's head, the fp16 scale
// s = fp16(max |x| / 127) and the codes round_half_even(x / s) clamped to [-127, 127]: a
// value that is a multiple of a representable scale round-trips exactly, any other is off by
// at most half a step (plus the scale's own rounding). The PyTorch reference does the same
// arithmetic in the same order (quill/ops/reference.py), so both write identical bytes.
// Tokens are independent, so they are spread over the threads.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <c10/util/Exception.h>

#include <algorithm>
#include <cmath>

#include "cache_layout.h"
#include "ops.h"
#include "vec.h"

namespace quill {
namespace {

// One token's head: `dim` values to `offset(d)` of the cache, as `kind` stores them.
template <typename IT, typename Offset>
void write_head(const IT* src, int dim, CacheKind kind, at::ScalarType dtype, void* cache, Offset offset,
                int64_t scale_base, int64_t scale_stride) {
  switch (kind) {
    case CacheKind::kInt8: {
      int8_t* codes = static_cast<int8_t*>(cache);
      for (int g0 = 0; g0 < dim; g0 += kScaleGroup) {
        float amax = 0.0f;
        for (int d = g0; d < g0 + kScaleGroup; ++d) amax = std::max(amax, std::fabs(to_float(src[d])));
        const fp16 scale16(amax / 127.0f);
        const float scale = float(scale16);
        std::memcpy(codes + scale_base + (g0 / kScaleGroup) * scale_stride, &scale16, sizeof(fp16));
        for (int d = g0; d < g0 + kScaleGroup; ++d) {
          const float code = scale > 0.0f ? std::nearbyint(to_float(src[d]) / scale) : 0.0f;
          codes[offset(d)] = int8_t(std::clamp(code, -127.0f, 127.0f));
        }
      }
      return;
    }
    default:
      switch (dtype) {
        case at::kFloat:
          for (int d = 0; d < dim; ++d) static_cast<float*>(cache)[offset(d)] = to_float(src[d]);
          return;
        case at::kBFloat16:
          for (int d = 0; d < dim; ++d) static_cast<bf16*>(cache)[offset(d)] = from_float<bf16>(to_float(src[d]));
          return;
        default:
          for (int d = 0; d < dim; ++d) static_cast<fp16*>(cache)[offset(d)] = from_float<fp16>(to_float(src[d]));
      }
  }
}

template <typename IT>
void write(const at::Tensor& k, const at::Tensor& v, at::Tensor& k_cache, at::Tensor& v_cache,
           const CacheGeometry& g, const int64_t* slots) {
  const int64_t tokens = k.size(0);
  const int heads = g.num_kv_heads, dim = g.head_dim, bs = g.block_size;
  const IT* kp = reinterpret_cast<const IT*>(k.data_ptr());
  const IT* vp = reinterpret_cast<const IT*>(v.data_ptr());
  void* kc = k_cache.data_ptr();
  void* vc = v_cache.data_ptr();
  const auto kt = k_cache.scalar_type(), vt = v_cache.scalar_type();
  const int64_t ks0 = k.stride(0), ks1 = k.stride(1), vs0 = v.stride(0), vs1 = v.stride(1);
  for (int64_t n = 0; n < tokens; ++n)
    TORCH_CHECK(slots[n] < g.num_blocks * bs, "quill::write_kv: slot ", slots[n], " past the cache's ",
                g.num_blocks * bs);
  at::parallel_for(0, tokens, 16, [&](int64_t begin, int64_t end) {
    for (int64_t n = begin; n < end; ++n) {
      const int64_t slot = slots[n];
      if (slot < 0) continue;
      const int64_t block = slot / bs;
      const int t = int(slot % bs);
      for (int h = 0; h < heads; ++h) {
        write_head(kp + n * ks0 + h * ks1, dim, g.k_kind, kt, kc,
                   [&](int d) { return g.key_offset(block, h, d, t); }, g.key_scale_offset(block, h, 0, t),
                   2 * bs);
        write_head(vp + n * vs0 + h * vs1, dim, g.v_kind, vt, vc,
                   [&](int d) { return g.value_offset(block, h, t, d); }, g.value_scale_offset(block, h, 0, t),
                   2 * bs);
      }
    }
  });
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
    case at::kFloat: return write<float>(k, v, k_cache, v_cache, g, slots);
    case at::kBFloat16: return write<bf16>(k, v, k_cache, v_cache, g, slots);
    case at::kHalf: return write<fp16>(k, v, k_cache, v_cache, g, slots);
    default: TORCH_CHECK(false, "quill::write_kv: k dtype ", k.scalar_type(), " is not supported");
  }
}

}  // namespace quill
