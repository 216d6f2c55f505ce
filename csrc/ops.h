// The CPU functions behind quill's torch.library ops (registered in ops.cpp).
#pragma once

#include <ATen/core/Tensor.h>

#include <string>

namespace quill {

// The caches are one layer's, in cache_layout.h's layout (fp32, fp16 or bf16, whatever the
// model's dtype).

// Writes the step's keys and values ([tokens, kv_heads, head_dim]) at their cache slots
// (block * block_size + offset); a negative slot is skipped.
void write_kv(const at::Tensor& k, const at::Tensor& v, at::Tensor& k_cache, at::Tensor& v_cache,
              const at::Tensor& slot_mapping);

// Writes k and v (as write_kv), then attends every query of the step to its sequence's keys.
// q [tokens, heads, head_dim]; sequence b owns the query rows
// query_start_loc[b] .. query_start_loc[b + 1] - 1, which sit at the last positions of its
// seq_lens[b] keys (causal: query i of n sees keys 0 .. seq_lens[b] - n + i); its keys are in
// the blocks block_tables[b][0 ..]. Rows past query_start_loc[-1] (padding) come back zero.
at::Tensor paged_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                           at::Tensor& k_cache, at::Tensor& v_cache,
                           const at::Tensor& slot_mapping, const at::Tensor& block_tables,
                           const at::Tensor& seq_lens, const at::Tensor& query_start_loc,
                           double scale);

// How paged_attention multiplies for these dtypes in this library, for the start-up log.
std::string attention_kernel(at::ScalarType q_dtype, at::ScalarType kv_dtype);

// Reads `buffer` (fp32) `repeats` times with `num_threads` threads (1, or all of torch's) and
// returns [best seconds of one read, checksum] as float64: the machine's read bandwidth, which
// each kernel's achieved rate is judged against. chunk_bytes > 0 reads it in chunks of that
// size in a scattered order, prefetched as the attention kernel prefetches its blocks.
at::Tensor read_probe(const at::Tensor& buffer, int64_t num_threads, int64_t repeats,
                      int64_t chunk_bytes);

// "avx2" or "avx512": the instruction set this library was compiled for.
std::string isa();

}  // namespace quill
