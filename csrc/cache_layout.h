// The paged KV cache's layout, per layer, as the kernels read it (chosen by measurement;
// docs/benchmarks.md has the figures):
//
//   fp32, fp16:  k_cache [blocks, kv_heads, head_dim, block_size]   keys transposed in a block:
//                v_cache [blocks, kv_heads, block_size, head_dim]   one vector = one dimension
//                                                                   of consecutive keys
//   bf16:        k_cache [blocks, kv_heads, head_dim / 2, block_size, 2]
//                v_cache [blocks, kv_heads, block_size / 2, head_dim, 2]
//                the same, with rows interleaved in pairs (dimensions 2i, 2i + 1 of a key;
//                keys 2i, 2i + 1 of a value dimension): the layout of a bf16 dot product, and
//                split into two fp32 rows by a shift and a mask where there is none.
//   int8:        k_cache [blocks, kv_heads, head_dim * 17 / 16, block_size]
//                v_cache [blocks, kv_heads, block_size * 17 / 16, head_dim]
//                each (block, KV head) chunk holds the bf16 layout's codes, one byte each (keys
//                [head_dim / 2][block_size][2], values [block_size / 2][head_dim][2]: the
//                operands of a 2-way int16 dot product once widened), and after the codes its
//                scales: fp16 [head_dim / 32][block_size], one per 32 dimensions of a token's
//                head (value = code * scale), for keys and values alike. Scales inside the
//                chunk keep the cache two tensors a layer, so whatever moves blocks moves them
//                with their codes.
//
// A block of one KV head is contiguous in every layout. K and V may differ in dtype.
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/util/Exception.h>

#include <vector>

namespace quill {

constexpr int kScaleGroup = 32;  // dimensions of a token's head that share one int8 scale

enum class CacheKind { kPlain, kPairs, kInt8 };

inline CacheKind cache_kind(const at::Tensor& cache) {
  switch (cache.scalar_type()) {
    case at::kBFloat16: return CacheKind::kPairs;
    case at::kChar: return CacheKind::kInt8;
    default: return CacheKind::kPlain;
  }
}

// Elements (bytes for int8) of one (block, KV head) chunk.
inline int64_t chunk_elems(CacheKind kind, int head_dim, int block_size) {
  const int64_t codes = int64_t(head_dim) * block_size;
  return kind == CacheKind::kInt8 ? codes + codes / 16 : codes;
}

struct CacheGeometry {
  int64_t num_blocks;
  int num_kv_heads, head_dim, block_size;
  CacheKind k_kind, v_kind;

  int64_t k_chunk() const { return chunk_elems(k_kind, head_dim, block_size); }
  int64_t v_chunk() const { return chunk_elems(v_kind, head_dim, block_size); }
  // Offset of key dimension d of token t (slot offset in its block) of (block, head).
  int64_t key_offset(int64_t block, int head, int d, int t) const {
    const int64_t base = (block * num_kv_heads + head) * k_chunk();
    if (k_kind == CacheKind::kPlain) return base + int64_t(d) * block_size + t;
    return base + (int64_t(d / 2) * block_size + t) * 2 + d % 2;
  }
  int64_t value_offset(int64_t block, int head, int t, int d) const {
    const int64_t base = (block * num_kv_heads + head) * v_chunk();
    if (v_kind == CacheKind::kPlain) return base + int64_t(t) * head_dim + d;
    return base + (int64_t(t / 2) * head_dim + d) * 2 + t % 2;
  }
  // Byte offset of the fp16 scale of dimensions 32g .. 32g + 31 of token t (int8 chunks).
  int64_t key_scale_offset(int64_t block, int head, int g, int t) const {
    return (block * num_kv_heads + head) * k_chunk() + int64_t(head_dim) * block_size +
           2 * (int64_t(g) * block_size + t);
  }
  int64_t value_scale_offset(int64_t block, int head, int g, int t) const {
    return (block * num_kv_heads + head) * v_chunk() + int64_t(head_dim) * block_size +
           2 * (int64_t(g) * block_size + t);
  }
};

inline CacheGeometry cache_geometry(const at::Tensor& k_cache, const at::Tensor& v_cache, const char* op) {
  TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous(), op, ": the caches must be contiguous");
  CacheGeometry g{};
  g.k_kind = cache_kind(k_cache);
  g.v_kind = cache_kind(v_cache);
  for (const at::Tensor* c : {&k_cache, &v_cache}) {
    const auto t = c->scalar_type();
    TORCH_CHECK(t == at::kFloat || t == at::kHalf || t == at::kBFloat16 || t == at::kChar, op,
                ": KV cache dtype ", t, " is not supported");
    TORCH_CHECK(c->dim() == (cache_kind(*c) == CacheKind::kPairs ? 5 : 4), op, ": a ", t,
                " cache has the wrong rank (", c->sizes(), "; csrc/cache_layout.h has the layouts)");
  }
  g.num_blocks = k_cache.size(0);
  g.num_kv_heads = int(k_cache.size(1));
  switch (g.k_kind) {
    case CacheKind::kPairs:
      TORCH_CHECK(k_cache.size(4) == 2, op, ": a bf16 K cache must be [blocks, kv_heads, head_dim / 2, block_size, 2]");
      g.head_dim = int(k_cache.size(2) * 2);
      break;
    case CacheKind::kInt8:
      TORCH_CHECK(k_cache.size(2) % 17 == 0, op,
                  ": an int8 K cache must be [blocks, kv_heads, head_dim * 17 / 16, block_size]");
      g.head_dim = int(k_cache.size(2) / 17 * 16);
      TORCH_CHECK(g.head_dim % kScaleGroup == 0, op, ": an int8 KV cache needs head_dim a multiple of ",
                  kScaleGroup, ", not ", g.head_dim);
      break;
    default: g.head_dim = int(k_cache.size(2));
  }
  g.block_size = int(k_cache.size(3));
  std::vector<int64_t> want;
  switch (g.v_kind) {
    case CacheKind::kPairs: want = {g.num_blocks, g.num_kv_heads, g.block_size / 2, g.head_dim, 2}; break;
    case CacheKind::kInt8:
      TORCH_CHECK(g.block_size % 16 == 0 && g.head_dim % kScaleGroup == 0, op,
                  ": an int8 V cache needs block_size a multiple of 16 and head_dim of ", kScaleGroup);
      want = {g.num_blocks, g.num_kv_heads, g.block_size / 16 * 17, g.head_dim};
      break;
    default: want = {g.num_blocks, g.num_kv_heads, g.block_size, g.head_dim};
  }
  TORCH_CHECK(v_cache.sizes() == at::IntArrayRef(want), op, ": the V cache's shape ", v_cache.sizes(),
              " does not match the K cache's ", k_cache.sizes(), " (expected ", at::IntArrayRef(want), ")");
  return g;
}

}  // namespace quill
