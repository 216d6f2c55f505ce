// quill's native ops, registered with torch.library under the `quill` namespace, and the
// checks the products share.
//
// Schemas mark the caches the ops write (`Tensor(a!)`), so torch.compile and functionalization
// see the mutation; the fake (meta) kernels live in quill/ops/fake.py.
#include <torch/library.h>

#include "ops.h"

namespace quill {

at::ScalarType output_dtype(const at::Tensor& x, std::optional<at::ScalarType> out_dtype, const char* op) {
  const at::ScalarType dtype = out_dtype.value_or(x.scalar_type());
  TORCH_CHECK(dtype == at::kFloat || dtype == at::kBFloat16 || dtype == at::kHalf, op,
              ": out_dtype ", dtype, " is not supported");
  return dtype;
}

at::Tensor float_bias(const std::optional<at::Tensor>& bias, int64_t n, const char* op) {
  if (!bias.has_value() || !bias->defined()) return at::Tensor();
  TORCH_CHECK(bias->numel() == n, op, ": bias has ", bias->numel(), " elements, not ", n);
  return bias->to(at::kFloat).contiguous();
}

std::string isa() {
#if defined(QUILL_AVX512)
  return "avx512";
#else
  return "avx2";
#endif
}

}  // namespace quill

TORCH_LIBRARY(quill, m) {
  m.def("write_kv(Tensor k, Tensor v, Tensor(a!) k_cache, Tensor(b!) v_cache, Tensor slot_mapping) -> ()");
  m.def(
      "paged_attention(Tensor q, Tensor k, Tensor v, Tensor(a!) k_cache, Tensor(b!) v_cache, "
      "Tensor slot_mapping, Tensor block_tables, Tensor seq_lens, Tensor query_start_loc, "
      "float scale, int window=0) -> Tensor");
  m.def("read_probe(Tensor buffer, int num_threads, int repeats, int chunk_bytes=0) -> Tensor");
  m.def(
      "q8_linear(Tensor x, Tensor codes, Tensor scales, Tensor sums, Tensor? bias=None, "
      "ScalarType? out_dtype=None) -> Tensor");
  m.def(
      "q4_linear(Tensor x, Tensor codes, Tensor scales, Tensor offsets, Tensor? bias=None, "
      "ScalarType? out_dtype=None) -> Tensor");
  m.def(
      "q5_linear(Tensor x, Tensor codes, Tensor scales, Tensor offsets, Tensor? bias=None, "
      "ScalarType? out_dtype=None) -> Tensor");
  m.def("dense_linear(Tensor x, Tensor weight, Tensor? bias=None, ScalarType? out_dtype=None) -> Tensor");
  m.def(
      "kquant_linear(Tensor x, Tensor weight, int type, Tensor? row_map=None, Tensor? bias=None, "
      "ScalarType? out_dtype=None) -> Tensor");
  m.def("kquant_rows(Tensor weight, int type, Tensor ids, ScalarType dtype) -> Tensor");
  m.def("kquant_pack(Tensor weight, int type, Tensor? row_order=None) -> Tensor");
  m.def("kquant_tile_rows(Tensor tiles, int type, int out_features, Tensor ids, ScalarType dtype) -> Tensor");
  m.def("kquant_tile_dequant(Tensor tiles, int type, int out_features, ScalarType dtype, int first=0, int count=-1) -> Tensor");
  m.def(
      "kquant_tile_linear(Tensor x, Tensor tiles, int type, int out_features, Tensor? bias=None, "
      "ScalarType? out_dtype=None) -> Tensor");
  m.def("rms_norm(Tensor x, Tensor weight, float eps) -> Tensor");
  m.def("add_rms_norm(Tensor x, Tensor(a!) residual, Tensor weight, float eps) -> Tensor");
  m.def("rope(Tensor(a!) q, Tensor(b!) k, Tensor cos, Tensor sin) -> ()");
  m.def("silu_mul(Tensor gate, Tensor up) -> Tensor");
  m.def(
      "decoder_layer(Tensor x, Tensor(a!) residual, Tensor input_norm, Tensor post_norm, "
      "float eps, Tensor[] qkv, Tensor[] o, Tensor[] gate_up, Tensor[] down, int num_heads, "
      "int num_kv_heads, int intermediate_size, Tensor cos, Tensor sin, Tensor(b!) k_cache, "
      "Tensor(c!) v_cache, Tensor slot_mapping, Tensor block_tables, Tensor seq_lens, "
      "Tensor query_start_loc, float scale) -> Tensor");
  m.def(
      "decoder_stack(Tensor x, Tensor(a!) residual, Tensor[] norms, float eps, Tensor[] weights, "
      "int[] tensors_per_weight, int num_heads, int num_kv_heads, int intermediate_size, "
      "Tensor cos, Tensor sin, Tensor(b!)[] k_caches, Tensor(c!)[] v_caches, Tensor slot_mapping, "
      "Tensor block_tables, Tensor seq_lens, Tensor query_start_loc, float scale) -> Tensor");
  m.def("argmax_rows(Tensor x) -> Tensor");
  m.def("score_rows(Tensor x, Tensor targets) -> (Tensor, Tensor, Tensor, Tensor)");
  m.def("isa() -> str", &quill::isa);
  m.def("attention_kernel(ScalarType q_dtype, ScalarType k_dtype, ScalarType v_dtype) -> str", &quill::attention_kernel);
}

TORCH_LIBRARY_IMPL(quill, CPU, m) {
  m.impl("write_kv", &quill::write_kv);
  m.impl("paged_attention", &quill::paged_attention);
  m.impl("read_probe", &quill::read_probe);
  m.impl("q8_linear", &quill::q8_linear);
  m.impl("q4_linear", &quill::q4_linear);
  m.impl("q5_linear", &quill::q5_linear);
  m.impl("dense_linear", &quill::dense_linear);
  m.impl("kquant_linear", &quill::kquant_linear);
  m.impl("kquant_rows", &quill::kquant_rows);
  m.impl("kquant_pack", &quill::kquant_pack);
  m.impl("kquant_tile_dequant", &quill::kquant_tile_dequant);
  m.impl("kquant_tile_rows", &quill::kquant_tile_rows);
  m.impl("kquant_tile_linear", &quill::kquant_tile_linear);
  m.impl("rms_norm", &quill::rms_norm);
  m.impl("add_rms_norm", &quill::add_rms_norm);
  m.impl("rope", &quill::rope);
  m.impl("silu_mul", &quill::silu_mul);
  m.impl("argmax_rows", &quill::argmax_rows);
  m.impl("score_rows", &quill::score_rows);
  m.impl("decoder_stack", &quill::decoder_stack);
  m.impl("decoder_layer", &quill::decoder_layer);
}
