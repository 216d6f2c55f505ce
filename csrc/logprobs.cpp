// Scoring rows of logits: each row's log-softmax at one token (its logprob), that token's rank
// and the row's most likely token with its logprob (the top 1 lm-evaluation-harness asks for),
// without materialising the log-softmax (quill/model/prompt_logprobs.py).
//
// Scoring a prompt maps every prompt row through the output head; PyTorch's reduction of those
// logits (logsumexp, the comparison for the rank, their sums) took 0.23 ms a row of the default
// model's 49,152 logits here, as much as the head's product itself, and torch.max for the top 1
// another 0.03 ms. Two vector passes over a row held in L2 (its maximum and how many logits beat
// the token's, then the sum of exponentials shifted by the maximum and the first lane equal to
// it) take a few microseconds.
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

struct RowScore {
  float logprob;    // log-softmax at the target
  int64_t rank;     // 1 + how many logits exceed the target's
  int64_t best;     // the most likely token (the first of equal maxima, as torch.max)
  float best_logprob;
};

// One row's score; a row holding NaN gets NaN logprobs, rank 0 and its first NaN as `best`.
template <typename T>
RowScore score_row(const T* x, int64_t n, int64_t target) {
  constexpr float kNan = std::numeric_limits<float>::quiet_NaN();
  constexpr float kInf = std::numeric_limits<float>::infinity();
  const int64_t body = n - n % kWidth;
  const float t = to_float(x[target]);
  const vfloat tv = vset(t);
  vfloat best = vset(-kInf);
  int64_t above = 0;
  uint32_t nan = 0;
  for (int64_t i = 0; i < body; i += kWidth) {
    const vfloat v = vload(x + i);
    nan |= lanes_nan(v);
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
  if (nan) {
    int64_t first = 0;
    while (!std::isnan(to_float(x[first]))) ++first;
    return {kNan, 0, first, kNan};
  }
  if (m == -kInf) return {t, above + 1, 0, -kInf};  // every token barred
  // The sum of e^(x - m) as 2^((x - m) log2 e); the first lane equal to m on the way.
  constexpr float kLog2e = 1.4426950408889634f;
  const vfloat mv = vset(m), scale = vset(kLog2e);
  vfloat acc = vzero();
  int64_t arg = -1;
  for (int64_t i = 0; i < body; i += kWidth) {
    const vfloat v = vload(x + i);
    if (arg < 0) {
      const uint32_t hit = lanes_equal(v, mv);
      if (hit) arg = i + __builtin_ctz(hit);
    }
    acc = vadd(acc, vexp2(vmul(vsub(v, mv), scale)));
  }
  double sum = vsum(acc);
  for (int64_t i = body; i < n; ++i) {
    const float v = to_float(x[i]);
    if (arg < 0 && v == m) arg = i;
    sum += std::exp(double(v) - m);
  }
  const float lse = m + float(std::log(sum));
  return {t - lse, above + 1, arg, m - lse};
}

template <typename T>
void score_all(const at::Tensor& x, const int64_t* targets, float* logprob, int64_t* rank,
               int64_t* best, float* best_logprob) {
  const int64_t rows = x.size(0), n = x.size(1), stride = x.stride(0);
  const T* p = x.data_ptr<T>();
  at::parallel_for(0, rows, 1, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const RowScore s = score_row(p + r * stride, n, targets[r]);
      logprob[r] = s.logprob;
      rank[r] = s.rank;
      best[r] = s.best;
      best_logprob[r] = s.best_logprob;
    }
  });
}

}  // namespace

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> score_rows(const at::Tensor& x,
                                                                      const at::Tensor& targets) {
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
  at::Tensor best = at::empty({rows}, x.options().dtype(at::kLong));
  at::Tensor best_logprob = at::empty({rows}, x.options().dtype(at::kFloat));
  auto run = dtype == at::kFloat ? score_all<float> : score_all<bf16>;
  run(x, t, logprob.data_ptr<float>(), rank.data_ptr<int64_t>(), best.data_ptr<int64_t>(),
      best_logprob.data_ptr<float>());
  return {logprob, rank, best, best_logprob};
}

}  // namespace quill
