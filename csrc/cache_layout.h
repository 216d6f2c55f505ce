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
//
// A block of one KV head is contiguous either way (head_dim x block_size elements).
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/util/Exception.h>

namespace quill {

struct CacheGeometry {
  int64_t num_blocks;
  int num_kv_heads, head_dim, block_size;
  bool pairs;  // the bf16 interleaved layout

  // Offset of key dimension d of token t (slot offset in its block) of (block, head).
  int64_t key_offset(int64_t block, int head, int d, int t) const {
    const int64_t base = (block * num_kv_heads + head) * int64_t(head_dim) * block_size;
    if (!pairs) return base + int64_t(d) * block_size + t;
    return base + (int64_t(d / 2) * block_size + t) * 2 + d % 2;
  }
  int64_t value_offset(int64_t block, int head, int t, int d) const {
    const int64_t base = (block * num_kv_heads + head) * int64_t(head_dim) * block_size;
    if (!pairs) return base + int64_t(t) * head_dim + d;
    return base + (int64_t(t / 2) * head_dim + d) * 2 + t % 2;
  }
};

inline CacheGeometry cache_geometry(const at::Tensor& k_cache, const at::Tensor& v_cache, const char* op) {
  TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous(), op, ": the caches must be contiguous");
  TORCH_CHECK(k_cache.scalar_type() == v_cache.scalar_type(), op, ": the K and V caches differ in dtype");
  const bool pairs = k_cache.scalar_type() == at::kBFloat16;
  CacheGeometry g{};
  g.pairs = pairs;
  if (pairs) {
    TORCH_CHECK(k_cache.dim() == 5 && v_cache.dim() == 5 && k_cache.size(4) == 2 && v_cache.size(4) == 2, op,
                ": a bf16 cache must be k [blocks, kv_heads, head_dim / 2, block_size, 2] and "
                "v [blocks, kv_heads, block_size / 2, head_dim, 2]");
    g.num_blocks = k_cache.size(0);
    g.num_kv_heads = int(k_cache.size(1));
    g.head_dim = int(k_cache.size(2) * 2);
    g.block_size = int(k_cache.size(3));
    TORCH_CHECK(v_cache.size(0) == g.num_blocks && v_cache.size(1) == g.num_kv_heads &&
                    v_cache.size(2) * 2 == g.block_size && v_cache.size(3) == g.head_dim,
                op, ": the V cache's shape ", v_cache.sizes(), " does not match the K cache's ", k_cache.sizes());
  } else {
    TORCH_CHECK(k_cache.dim() == 4 && v_cache.dim() == 4, op,
                ": an fp32 / fp16 cache must be k [blocks, kv_heads, head_dim, block_size] and "
                "v [blocks, kv_heads, block_size, head_dim]");
    g.num_blocks = k_cache.size(0);
    g.num_kv_heads = int(k_cache.size(1));
    g.head_dim = int(k_cache.size(2));
    g.block_size = int(k_cache.size(3));
    TORCH_CHECK(v_cache.size(0) == g.num_blocks && v_cache.size(1) == g.num_kv_heads &&
                    v_cache.size(2) == g.block_size && v_cache.size(3) == g.head_dim,
                op, ": the V cache's shape ", v_cache.sizes(), " does not match the K cache's ", k_cache.sizes());
  }
  return g;
}

}  // namespace quill
