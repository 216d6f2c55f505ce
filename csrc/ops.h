// The CPU functions behind quill's torch.library ops (registered in ops.cpp).
#pragma once

#include <ATen/core/Tensor.h>

#include <optional>
#include <string>
#include <tuple>

namespace quill {

// What the products check alike: the output's dtype (out_dtype, else x's: float32, bf16 or
// fp16), and an optional bias of n elements as contiguous float32 (undefined when absent).
at::ScalarType output_dtype(const at::Tensor& x, std::optional<at::ScalarType> out_dtype, const char* op);
at::Tensor float_bias(const std::optional<at::Tensor>& bias, int64_t n, const char* op);

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
// window > 0: a query at position p sees only the `window` keys p - window + 1 .. p (sliding
// window attention, as Mistral's and Gemma's local layers).
at::Tensor paged_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                           at::Tensor& k_cache, at::Tensor& v_cache,
                           const at::Tensor& slot_mapping, const at::Tensor& block_tables,
                           const at::Tensor& seq_lens, const at::Tensor& query_start_loc,
                           double scale, int64_t window = 0);

// How paged_attention multiplies for these dtypes in this library, for the start-up log.
std::string attention_kernel(at::ScalarType q_dtype, at::ScalarType k_dtype, at::ScalarType v_dtype);

// Reads `buffer` (fp32) `repeats` times with `num_threads` threads (1, or all of torch's) and
// returns [best seconds of one read, checksum] as float64: the machine's read bandwidth, which
// each kernel's achieved rate is judged against. chunk_bytes > 0 reads it in chunks of that
// size in a scattered order, prefetched as the attention kernel prefetches its blocks.
at::Tensor read_probe(const at::Tensor& buffer, int64_t num_threads, int64_t repeats,
                      int64_t chunk_bytes);

// x [rows, K] (fp32, bf16 or fp16) times int8 weights in blocks of 32 (GGUF's Q8_0), packed
// by quill/ops/qlinear.py: codes [N/16, K/4, 16, 4], fp16 scales and int16 code sums
// [N/16, K/32, 16]. The activations are quantized to int8 per row and block; fp32 sums.
// Returns [rows, N] in out_dtype (x's dtype when not given).
at::Tensor q8_linear(const at::Tensor& x, const at::Tensor& codes, const at::Tensor& scales,
                     const at::Tensor& sums, const std::optional<at::Tensor>& bias,
                     std::optional<at::ScalarType> out_dtype);

// The same with 4-bit weights (GGUF's Q4_0 / Q4_1): codes two to a byte [N/16, K/32, 4, 16, 4],
// per (tile, block) fp16 scales d and offsets c [N/16, K/32, 16]: w = d * code + c.
at::Tensor q4_linear(const at::Tensor& x, const at::Tensor& codes, const at::Tensor& scales,
                     const at::Tensor& offsets, const std::optional<at::Tensor>& bias,
                     std::optional<at::ScalarType> out_dtype);

// The same with 5-bit codes and an offset (GGUF's Q5_1): codes 0..31 one a byte, in q8_linear's
// layout [N/16, K/4, 16, 4], scales d and offsets c as q4_linear's: w = d * code + c.
at::Tensor q5_linear(const at::Tensor& x, const at::Tensor& codes, const at::Tensor& scales,
                     const at::Tensor& offsets, const std::optional<at::Tensor>& bias,
                     std::optional<at::ScalarType> out_dtype);

// x [rows, K] (fp32, bf16 or fp16) times a weight stored in a GGUF K-quant type (`type`: GGML's
// number, 12 Q4_K, 13 Q5_K, 14 Q6_K) as the file lays it out: uint8 [N, bytes per row], rows of
// super-blocks of 256 (kquant.cpp). Output column row_map[n] (n when not given) gets row n's
// product. Returns [rows, N] in out_dtype (x's dtype when not given).
at::Tensor kquant_linear(const at::Tensor& x, const at::Tensor& weight, int64_t type,
                         const std::optional<at::Tensor>& row_map,
                         const std::optional<at::Tensor>& bias,
                         std::optional<at::ScalarType> out_dtype);

// Such a weight repacked in tiles of 16 rows, in groups of 4 tiles (kquant_tiles.cpp), rows
// taken in `row_order` (row n of the result is the weight's row row_order[n]; in order when not
// given), the last group padded with zero rows: uint8 [ceil(N / 64), bytes per group].
at::Tensor kquant_pack(const at::Tensor& weight, int64_t type, const std::optional<at::Tensor>& row_order);
// The rows `ids` of such tiles holding `out_features` rows, dequantized: [len(ids), K].
at::Tensor kquant_tile_rows(const at::Tensor& tiles, int64_t type, int64_t out_features, const at::Tensor& ids,
                            at::ScalarType dtype);
// Rows [first, first + count) of such tiles (count -1: to the end) back as float weights
// [count, K] in `dtype` (kquant_dequant.cpp).
at::Tensor kquant_tile_dequant(const at::Tensor& tiles, int64_t type, int64_t out_features, at::ScalarType dtype,
                               int64_t first, int64_t count);

// x [rows, K] times tiles from kquant_pack holding `out_features` rows: [rows, out_features].
at::Tensor kquant_tile_linear(const at::Tensor& x, const at::Tensor& tiles, int64_t type,
                              int64_t out_features, const std::optional<at::Tensor>& bias,
                              std::optional<at::ScalarType> out_dtype);

// The rows `ids` of such a weight, dequantized to `dtype` ([len(ids), K]).
at::Tensor kquant_rows(const at::Tensor& weight, int64_t type, const at::Tensor& ids,
                       at::ScalarType dtype);

// x [rows, K] (fp32, bf16 or fp16) times a float weight [N, K] as stored (fp32, bf16 or fp16,
// contiguous rows) in fp32 (dense.cpp): the small-step product of an unquantized model.
at::Tensor dense_linear(const at::Tensor& x, const at::Tensor& weight,
                        const std::optional<at::Tensor>& bias,
                        std::optional<at::ScalarType> out_dtype);

// The small ops of a decoder layer (fused.cpp), rounding where PyTorch's sequences round.
// rms_norm: weight * T(x * rsqrt(mean(x^2) + eps)) per row. add_rms_norm: residual += x (in
// place), then the norm of residual. rope: q and k [tokens, heads, head_dim] rotated in place
// by cos and sin [tokens, head_dim] (rotate_half form). silu_mul: T(silu(gate)) * up.
at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps);
at::Tensor add_rms_norm(const at::Tensor& x, at::Tensor& residual, const at::Tensor& weight,
                        double eps);
void rope(at::Tensor& q, at::Tensor& k, const at::Tensor& cos, const at::Tensor& sin);
at::Tensor silu_mul(const at::Tensor& gate, const at::Tensor& up);

// A decoder layer on int8, 4-bit or float weights (layer.cpp): residual += x, norm, q/k/v, rope, attention
// (writing the step's keys and values), o, residual += o, norm, gate/up, SiLU x up, down.
// Each weight is [codes, scales, sums] as q8_linear takes them, [codes, scales, offsets] as
// q4_linear does, or [weight] as dense_linear does; returns the down projection
// (not yet added to the residual).
at::Tensor decoder_layer(const at::Tensor& x, at::Tensor& residual, const at::Tensor& input_norm,
                            const at::Tensor& post_norm, double eps, at::TensorList qkv,
                            at::TensorList o, at::TensorList gate_up, at::TensorList down,
                            int64_t num_heads, int64_t num_kv_heads, int64_t intermediate_size,
                            const at::Tensor& cos, const at::Tensor& sin, at::Tensor& k_cache,
                            at::Tensor& v_cache, const at::Tensor& slot_mapping,
                            const at::Tensor& block_tables, const at::Tensor& seq_lens,
                            const at::Tensor& query_start_loc, double scale);

// Each fp32 row's argmax as torch.argmax(x, -1) picks it (argmax.cpp).
at::Tensor argmax_rows(const at::Tensor& x);

// Each row's log-softmax at its target, the target's rank (1 + logits above it), the row's
// argmax and its log-softmax, for fp32 or bf16 rows (logprobs.cpp).
std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> score_rows(const at::Tensor& x,
                                                                      const at::Tensor& targets);

// Every layer of the model by decoder_layer in turn: norms two per layer (input, post), the
// weights flattened (tensors_per_weight[4 * layer + p] of them for product p: 1 or 3), one k
// and v cache per layer. Returns the last layer's down projection.
at::Tensor decoder_stack(const at::Tensor& x, at::Tensor& residual, at::TensorList norms,
                         double eps, at::TensorList weights, at::IntArrayRef tensors_per_weight,
                         int64_t num_heads, int64_t num_kv_heads, int64_t intermediate_size,
                         const at::Tensor& cos, const at::Tensor& sin, at::TensorList k_caches,
                         at::TensorList v_caches, const at::Tensor& slot_mapping,
                         const at::Tensor& block_tables, const at::Tensor& seq_lens,
                         const at::Tensor& query_start_loc, double scale);

// "avx2" or "avx512": the instruction set this library was compiled for.
std::string isa();

}  // namespace quill
