// Float weights (fp32, bf16, fp16) times a few activation rows: the products of a small step on
// an unquantized model, and of the output head.
//
// For one row PyTorch's F.linear streamed a bf16 weight at ~10 GB/s here (oneDNN packs for a
// GEMM; MKL's fp32 GEMV reached 11-15 GB/s on AVX2), where a plain read runs at 30-50. This op
// reads the weight as it is stored (row-major [N, K], no repacking, so a tied head is the
// embedding table itself): each thread takes a contiguous range of output rows, one at a time
// (two at a time, sharing each activation load, measured 10-15% slower for fp16 weights at 4-8
// rows here), and widens each weight vector to fp32 once for R activation rows (widened to fp32
// once per call). Products and sums in fp32, a bias added
// in fp32, one rounding to the output dtype.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/util/Exception.h>

#include <algorithm>
#include <vector>

#include "ops.h"
#include "vec.h"

namespace quill {

namespace {

#if defined(QUILL_AVX512)
constexpr int kMaxRows = 8;
#else
constexpr int kMaxRows = 4;
#endif

// Weight rows are read one after another, each once for R activation rows (R accumulators),
// so a thread's range is one sequential stream: 8 rows side by side (8 streams 1-3 KB long)
// read at 14 GB/s here against 30-45 for one stream, the hardware prefetcher's preference.
// out[r] = sum_k w[k] * x[r][k]; x is fp32 with row stride ldx.
template <typename T, int R>
void dot_row(const T* w, const float* x, int64_t ldx, int64_t k, float* out, int64_t ldo) {
  vfloat acc[R], acc2[R];  // two chains per row: one FMA's latency does not bound one row
  for (int r = 0; r < R; ++r) acc[r] = acc2[r] = vzero();
  const int64_t body = k - k % (2 * kWidth);
  for (int64_t i = 0; i < body; i += 2 * kWidth) {
    const vfloat w0 = vload(w + i), w1 = vload(w + i + kWidth);
    for (int r = 0; r < R; ++r) {
      acc[r] = vfma(w0, vload(x + r * ldx + i), acc[r]);
      acc2[r] = vfma(w1, vload(x + r * ldx + i + kWidth), acc2[r]);
    }
  }
  for (int r = 0; r < R; ++r) {
    float sum = vsum(vadd(acc[r], acc2[r]));
    for (int64_t i = body; i < k; ++i) sum += to_float(w[i]) * x[r * ldx + i];
    out[r * ldo] = sum;
  }
}

#if defined(QUILL_AVX512)
// bf16 weights and bf16 activations: vdpbf16ps multiplies 32 pairs per instruction (products
// exact in fp32, fp32 sums), half the instructions of widening both to fp32; x is bf16 here.
template <int R>
void dot_row_pairs(const bf16* w, const bf16* x, int64_t ldx, int64_t k, float* out,
                   int64_t ldo) {
  __m512 acc[R];
  for (int r = 0; r < R; ++r) acc[r] = _mm512_setzero_ps();
  const int64_t body = k - k % 32;
  for (int64_t i = 0; i < body; i += 32) {
    const __m512bh wv = (__m512bh)_mm512_loadu_si512(w + i);
    for (int r = 0; r < R; ++r)
      acc[r] = _mm512_dpbf16_ps(acc[r], wv, (__m512bh)_mm512_loadu_si512(x + r * ldx + i));
  }
  for (int r = 0; r < R; ++r) {
    float sum = _mm512_reduce_add_ps(acc[r]);
    for (int64_t i = body; i < k; ++i) sum += to_float(w[i]) * to_float(x[r * ldx + i]);
    out[r * ldo] = sum;
  }
}
#endif

// One weight row against R activation rows (x: fp32 rows, or bf16 ones for the pairs kernel).
using RowFn = void (*)(const void* w, const void* x, int64_t ldx, int64_t k, float* out,
                       int64_t ldo);

template <typename T, int R, bool kPairs>
void dot_row_erased(const void* w, const void* x, int64_t ldx, int64_t k, float* out,
                    int64_t ldo) {
#if defined(QUILL_AVX512)
  if constexpr (kPairs) {
    dot_row_pairs<R>(static_cast<const bf16*>(w), static_cast<const bf16*>(x), ldx, k, out, ldo);
    return;
  }
#endif
  dot_row<T, R>(static_cast<const T*>(w), static_cast<const float*>(x), ldx, k, out, ldo);
}

template <typename T, bool kPairs>
RowFn row_fn(int rows) {
  static const RowFn table[] = {
      &dot_row_erased<T, 1, kPairs>, &dot_row_erased<T, 2, kPairs>,
      &dot_row_erased<T, 3, kPairs>, &dot_row_erased<T, 4, kPairs>,
#if defined(QUILL_AVX512)
      &dot_row_erased<T, 5, kPairs>, &dot_row_erased<T, 6, kPairs>,
      &dot_row_erased<T, 7, kPairs>, &dot_row_erased<T, 8, kPairs>,
#endif
  };
  return table[rows - 1];
}

template <typename T>
void store(const float* src, T* dst, int64_t n, const float* bias) {
  for (int64_t i = 0; i < n; ++i) dst[i] = from_float<T>(src[i] + (bias ? bias[i] : 0.0f));
}

template <typename T>
void widen_rows(const T* x, int64_t rows, int64_t k, int64_t ldx, float* out) {
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t i = 0; i < k; ++i) out[r * k + i] = to_float(x[r * ldx + i]);
}

// x as the kernel reads it: [rows, k] contiguous, fp32, or bf16 for the pairs kernel.
at::Tensor activations(const at::Tensor& x, bool pairs) {
  if (pairs) return x.contiguous();
  const int64_t rows = x.size(0), k = x.size(1);
  at::Tensor x_f = at::empty({rows, k}, x.options().dtype(at::kFloat));
  float* out = x_f.data_ptr<float>();
  switch (x.scalar_type()) {
    case at::kFloat: widen_rows(x.data_ptr<float>(), rows, k, x.stride(0), out); break;
    case at::kBFloat16:
      widen_rows(reinterpret_cast<const bf16*>(x.data_ptr()), rows, k, x.stride(0), out);
      break;
    case at::kHalf:
      widen_rows(reinterpret_cast<const fp16*>(x.data_ptr()), rows, k, x.stride(0), out);
      break;
    default: TORCH_CHECK(false, "quill::dense_linear: x dtype ", x.scalar_type(), " is not supported");
  }
  return x_f;
}

template <typename W, bool kPairs>
void run(const at::Tensor& x, const W* w, int64_t ldw, int64_t n, const float* bias,
         at::Tensor& out) {
  const int64_t rows = x.size(0), k = x.size(1);
  const char* xp = static_cast<const char*>(x.data_ptr());
  const size_t x_elem = x.element_size();
  const at::ScalarType dtype = out.scalar_type();
  // Enough output rows per thread (32 KB of weights) that a thread's range is worth waking it.
  const int64_t grain = std::max<int64_t>(16, 32768 / std::max<int64_t>(k * sizeof(W), 1));
  at::parallel_for(0, n, grain, [&](int64_t begin, int64_t end) {
    constexpr int64_t kChunk = 64;  // output rows per store
    float buffer[kMaxRows * kChunk];
    // Chunks of weight rows outside, groups of token rows inside: a step of more than kMaxRows
    // rows reads each chunk (64 rows, 256 KB at K = 2,048 in bf16) from memory once and again
    // from cache for its next groups, not the thread's whole range once a group.
    for (int64_t c0 = begin; c0 < end; c0 += kChunk) {
      const int64_t c1 = std::min(end, c0 + kChunk);
      for (int64_t row0 = 0; row0 < rows; row0 += kMaxRows) {
        const int r_count = int(std::min<int64_t>(kMaxRows, rows - row0));
        const RowFn fn = row_fn<W, kPairs>(r_count);
        const void* x_rows = xp + row0 * k * x_elem;
        for (int64_t o = c0; o < c1; ++o) fn(w + o * ldw, x_rows, k, k, buffer + (o - c0), kChunk);
        const float* b = bias ? bias + c0 : nullptr;
        for (int r = 0; r < r_count; ++r) {
          const int64_t at = (row0 + r) * n + c0;
          const float* src = buffer + r * kChunk;
          switch (dtype) {
            case at::kFloat: store(src, out.data_ptr<float>() + at, c1 - c0, b); break;
            case at::kBFloat16:
              store(src, reinterpret_cast<bf16*>(out.data_ptr()) + at, c1 - c0, b);
              break;
            default: store(src, reinterpret_cast<fp16*>(out.data_ptr()) + at, c1 - c0, b);
          }
        }
      }
    }
  });
}

}  // namespace

at::Tensor dense_linear(const at::Tensor& x, const at::Tensor& weight,
                        const std::optional<at::Tensor>& bias,
                        std::optional<at::ScalarType> out_dtype) {
  const char* op = "quill::dense_linear";
  TORCH_CHECK(x.dim() == 2 && x.stride(1) == 1, op, ": x must be [rows, in_features] with contiguous rows, got ",
              x.sizes());
  TORCH_CHECK(weight.dim() == 2 && weight.stride(1) == 1, op,
              ": weight must be [out_features, in_features] with contiguous rows, got ",
              weight.sizes());
  const int64_t rows = x.size(0), k = x.size(1), n = weight.size(0);
  TORCH_CHECK(weight.size(1) == k, op, ": x has ", k, " inputs, the weight ", weight.size(1));
  const at::ScalarType dtype = output_dtype(x, out_dtype, op);
  const at::Tensor bias_f = float_bias(bias, n, op);
  at::Tensor out = at::empty({rows, n}, x.options().dtype(dtype));
  if (rows == 0 || n == 0) return out;
  const float* b = bias_f.defined() ? bias_f.data_ptr<float>() : nullptr;
  const int64_t ldw = weight.stride(0);
  switch (weight.scalar_type()) {
    case at::kFloat: run<float, false>(activations(x, false), weight.data_ptr<float>(), ldw, n, b, out); break;
    case at::kBFloat16: {
      const bf16* w = reinterpret_cast<const bf16*>(weight.data_ptr());
#if defined(QUILL_AVX512)
      if (x.scalar_type() == at::kBFloat16) {
        run<bf16, true>(activations(x, true), w, ldw, n, b, out);
        break;
      }
#endif
      run<bf16, false>(activations(x, false), w, ldw, n, b, out);
      break;
    }
    case at::kHalf:
      run<fp16, false>(activations(x, false), reinterpret_cast<const fp16*>(weight.data_ptr()), ldw, n, b, out);
      break;
    default: TORCH_CHECK(false, op, ": weight dtype ", weight.scalar_type(), " is not supported");
  }
  return out;
}

}  // namespace quill
