// A whole decoder layer in one op, for small steps (int8, 4-bit or native float products).
//
// At batch 1 a layer's products and attention take ~200 us, and calling its ~10 ops from
// Python (module calls, the dispatcher, argument checks) added ~100 us more: a third of the
// step. This op calls the same kernels (q8_linear, add_rms_norm, rope, paged_attention,
// silu_mul, q4_linear for 4-bit weights, dense_linear for float ones) one after another from
// C++, so the numbers are those of the op-by-op path, bit for bit; quill/model/llama.py takes
// it when every product of the layer runs natively for the step's rows. decoder_stack runs
// every layer so, in one call per step: 30 calls from Python, each with its 21 arguments
// converted, cost ~0.4 ms of a ~9 ms batch-1 step here.
#include <ATen/core/Tensor.h>
#include <c10/util/Exception.h>

#include "ops.h"

namespace quill {

namespace {

// int8 weights are [codes (int8), scales, sums], 4-bit ones [codes (uint8), scales, offsets],
// float ones [weight].
at::Tensor product(const at::Tensor& x, at::TensorList w, const char* what) {
  if (w.size() == 1) return dense_linear(x, w[0], std::nullopt, std::nullopt);
  TORCH_CHECK(w.size() == 3, "quill::decoder_layer: ", what,
              " must be [weight] or [codes, scales, sums or offsets]");
  if (w[0].scalar_type() == at::kByte) return q4_linear(x, w[0], w[1], w[2], std::nullopt, std::nullopt);
  return q8_linear(x, w[0], w[1], w[2], std::nullopt, std::nullopt);
}

}  // namespace

at::Tensor decoder_layer(const at::Tensor& x, at::Tensor& residual, const at::Tensor& input_norm,
                            const at::Tensor& post_norm, double eps, at::TensorList qkv,
                            at::TensorList o, at::TensorList gate_up, at::TensorList down,
                            int64_t num_heads, int64_t num_kv_heads, int64_t intermediate_size,
                            const at::Tensor& cos, const at::Tensor& sin, at::Tensor& k_cache,
                            at::Tensor& v_cache, const at::Tensor& slot_mapping,
                            const at::Tensor& block_tables, const at::Tensor& seq_lens,
                            const at::Tensor& query_start_loc, double scale) {
  const int64_t n = x.size(0), head_dim = cos.size(1);
  const int64_t q_size = num_heads * head_dim, kv_size = num_kv_heads * head_dim;
  at::Tensor h = add_rms_norm(x, residual, input_norm, eps);
  at::Tensor qkv_out = product(h, qkv, "qkv");
  TORCH_CHECK(qkv_out.size(1) >= q_size + 2 * kv_size, "quill::decoder_layer: qkv has ",
              qkv_out.size(1), " outputs, fewer than q + k + v");
  at::Tensor q = qkv_out.narrow(1, 0, q_size).view({n, num_heads, head_dim});
  at::Tensor k = qkv_out.narrow(1, q_size, kv_size).view({n, num_kv_heads, head_dim});
  at::Tensor v = qkv_out.narrow(1, q_size + kv_size, kv_size).view({n, num_kv_heads, head_dim});
  rope(q, k, cos, sin);
  at::Tensor attn = paged_attention(q, k, v, k_cache, v_cache, slot_mapping, block_tables,
                                    seq_lens, query_start_loc, scale);
  at::Tensor o_out = product(attn.view({n, q_size}), o, "o");
  h = add_rms_norm(o_out.narrow(1, 0, x.size(1)), residual, post_norm, eps);
  at::Tensor gu = product(h, gate_up, "gate_up");
  at::Tensor act = silu_mul(gu.narrow(1, 0, intermediate_size),
                            gu.narrow(1, intermediate_size, intermediate_size));
  return product(act, down, "down").narrow(1, 0, x.size(1));
}

at::Tensor decoder_stack(const at::Tensor& x, at::Tensor& residual, at::TensorList norms,
                         double eps, at::TensorList weights, at::IntArrayRef tensors_per_weight,
                         int64_t num_heads, int64_t num_kv_heads, int64_t intermediate_size,
                         const at::Tensor& cos, const at::Tensor& sin, at::TensorList k_caches,
                         at::TensorList v_caches, const at::Tensor& slot_mapping,
                         const at::Tensor& block_tables, const at::Tensor& seq_lens,
                         const at::Tensor& query_start_loc, double scale) {
  const int64_t layers = int64_t(k_caches.size());
  TORCH_CHECK(layers > 0 && int64_t(v_caches.size()) == layers &&
                  int64_t(norms.size()) == 2 * layers &&
                  int64_t(tensors_per_weight.size()) == 4 * layers,
              "quill::decoder_stack: per layer two norms, four weights and a k and v cache");
  int64_t total = 0;
  for (int64_t count : tensors_per_weight) total += count;
  TORCH_CHECK(total == int64_t(weights.size()), "quill::decoder_stack: ", weights.size(),
              " weight tensors, but tensors_per_weight adds up to ", total);
  at::Tensor h = x;
  size_t next = 0;
  for (int64_t l = 0; l < layers; ++l) {
    at::TensorList w[4];
    for (int p = 0; p < 4; ++p) {
      const size_t count = size_t(tensors_per_weight[4 * l + p]);
      w[p] = weights.slice(next, count);
      next += count;
    }
    at::Tensor k_cache = k_caches[l], v_cache = v_caches[l];
    h = decoder_layer(h, residual, norms[2 * l], norms[2 * l + 1], eps, w[0], w[1], w[2], w[3],
                      num_heads, num_kv_heads, intermediate_size, cos, sin, k_cache, v_cache,
                      slot_mapping, block_tables, seq_lens, query_start_loc, scale);
  }
  return h;
}

}  // namespace quill
