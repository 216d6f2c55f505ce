// Scoring rows of logits: each row's log-softmax at one token (its logprob) and that token's
// rank, without materialising the log-softmax (quill/model/prompt_logprobs.py).
//
// Scoring a prompt maps every prompt row through the output head; PyTorch's reduction of those
// logits (logsumexp, the comparison for the rank, their sums) took 0.23 ms a row of the default
// model's 49,152 logits here, as much as the head's product itself. Two vector passes over a
// row held in L2 (its maximum and how many logits beat the token's, then the sum of exponentials
// shifted by the maximum) take a few microseconds.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/util/Exception.h>

#include <cmath>
#include <limits>
#include <tuple>

#include "ops.h"
#include "vec.h"

namespace quill {
namespace {

inline uint32_t lanes_greater(vfloat v, vfloat t) {
#if defined(QUILL_AVX512)
  return _mm512_cmp_ps_mask(v, t, _CMP_GT_OQ);
#else
  return uint32_t(_mm256_movemask_ps(_mm256_cmp_ps(v, t, _CMP_GT_OQ)));
#endif
}

inline uint32_t lanes_unordered(vfloat v) {
#if defined(QUILL_AVX512)
  return _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
#else
  return uint32_t(_mm256_movemask_ps(_mm256_cmp_ps(v, v, _CMP_UNORD_Q)));
#endif
}

// (logprob of x[target], 1 + how many logits exceed it); NaN and 0 for a row holding NaN.
template <typename T>
std::pair<float, int64_t> score_row(const T* x, int64_t n, int64_t target) {
  const int64_t body = n - n % kWidth;
  const float t = to_float(x[target]);
  const vfloat tv = vset(t);
  vfloat best = vset(-std::numeric_limits<float>::infinity());
  int64_t above = 0;
  uint32_t nan = 0;
  for (int64_t i = 0; i < body; i += kWidth) {
    const vfloat v = vload(x + i);
    nan |= lanes_unordered(v);
    above += __builtin_popcount(lanes_greater(v, tv));
    best = vmax(best, v);
  }
  float m = vhmax(best);
  for (int64_t i = body; i < n; ++i) {
    const float v = to_float(x[i]);
    nan |= std::isnan(v);
    above += v > t;
    m = std::max(m, v);
  }
  if (nan) return {std::numeric_limits<float>::quiet_NaN(), 0};
  if (m == -std::numeric_limits<float>::infinity()) return {t, above + 1};  // all barred
  // sum of e^(x - m) as 2^((x - m) log2 e)
  constexpr float kLog2e = 1.4426950408889634f;
  const vfloat mv = vset(m), scale = vset(kLog2e);
  vfloat acc = vzero();
  for (int64_t i = 0; i < body; i += kWidth)
    acc = vadd(acc, vexp2(vmul(vsub(vload(x + i), mv), scale)));
  double sum = vsum(acc);
  for (int64_t i = body; i < n; ++i) sum += std::exp(double(to_float(x[i])) - m);
  const float lse = m + float(std::log(sum));
  return {t - lse, above + 1};
}

template <typename T>
void score_all(const at::Tensor& x, const int64_t* targets, float* logprob, int64_t* rank) {
  const int64_t rows = x.size(0), n = x.size(1), stride = x.stride(0);
  const T* p = x.data_ptr<T>();
  at::parallel_for(0, rows, 1, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      auto [lp, k] = score_row(p + r * stride, n, targets[r]);
      logprob[r] = lp;
      rank[r] = k;
    }
  });
}

}  // namespace

std::tuple<at::Tensor, at::Tensor> score_rows(const at::Tensor& x, const at::Tensor& targets) {
  const auto dtype = x.scalar_type();
  TORCH_CHECK(x.dim() == 2 && x.stride(1) == 1 && x.size(1) > 0 &&
                  (dtype == at::kFloat || dtype == at::kBFloat16),
              "quill::score_rows: x must be fp32 or bf16 [rows, n] with contiguous rows, got ",
              dtype, " ", x.sizes());
  TORCH_CHECK(targets.dim() == 1 && targets.size(0) == x.size(0) &&
                  targets.scalar_type() == at::kLong && targets.is_contiguous(),
              "quill::score_rows: targets must be int64 [rows]");
  const int64_t rows = x.size(0), n = x.size(1);
  const int64_t* t = targets.data_ptr<int64_t>();
  for (int64_t r = 0; r < rows; ++r)
    TORCH_CHECK(0 <= t[r] && t[r] < n, "quill::score_rows: target ", t[r], " out of range");
  at::Tensor logprob = at::empty({rows}, x.options().dtype(at::kFloat));
  at::Tensor rank = at::empty({rows}, x.options().dtype(at::kLong));
  if (dtype == at::kFloat)
    score_all<float>(x, t, logprob.data_ptr<float>(), rank.data_ptr<int64_t>());
  else
    score_all<bf16>(x, t, logprob.data_ptr<float>(), rank.data_ptr<int64_t>());
  return {logprob, rank};
}

}  // namespace quill
