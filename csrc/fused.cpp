// The small operations of a decoder layer, each one op: residual add + RMSNorm, rotary
// embedding in place, SiLU(gate) x up.
//
// At a small batch a layer's elementwise work is a few thousand numbers, and what it costs is
// the operators: PyTorch runs RMSNorm as ~8 of them, the rotary embedding as ~12, each a few
// microseconds of dispatch, ~1,200 per step of the default model. Each op here does its work in
// one pass and rounds where the PyTorch sequence rounds (to the model's dtype after each of its
// operators), so a bf16 model computes the same numbers either way up to the order of a sum.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/util/Exception.h>

#include <cmath>

#include "ops.h"
#include "vec.h"

namespace quill {
namespace {

// v rounded to T and back: the rounding a PyTorch operator producing a T tensor makes. For
// fp32 the empty asm keeps the compiler from contracting this product and a later sum into
// one FMA, which would round once where PyTorch's two operators round twice.
template <typename T>
inline vfloat vrounded(vfloat v) {
  if constexpr (std::is_same_v<T, float>) {
    asm("" : "+v"(v));
    return v;
  } else {
    alignas(64) T tmp[kWidth];
    vstore(tmp, v);
    return vload(tmp);
  }
}

// out = weight * T(x * rsqrt(mean(x^2) + eps)), as HF's LlamaRMSNorm; with a residual,
// residual = T(residual + x) first, and the norm is of that.
template <typename T>
void norm_rows(const T* x, int64_t x_stride, T* residual, int64_t r_stride, const T* weight,
               T* out, int64_t rows, int64_t dim, float eps) {
  at::parallel_for(0, rows, 8, [&](int64_t begin, int64_t end) {
    for (int64_t m = begin; m < end; ++m) {
      const T* xr = x + m * x_stride;
      T* rr = residual ? residual + m * r_stride : nullptr;
      T* orow = out + m * dim;
      const T* src = xr;
      if (rr) {
        for (int64_t i = 0; i < dim; i += kWidth) vstore(rr + i, vadd(vload(rr + i), vload(xr + i)));
        src = rr;
      }
      vfloat squares = vzero();
      for (int64_t i = 0; i < dim; i += kWidth) {
        vfloat v = vload(src + i);
        squares = vfma(v, v, squares);
      }
      const float inverse = 1.0f / std::sqrt(vsum(squares) / float(dim) + eps);
      for (int64_t i = 0; i < dim; i += kWidth) {
        vfloat normed = vrounded<T>(vmul(vload(src + i), vset(inverse)));
        vstore(orow + i, vmul(vload(weight + i), normed));
      }
    }
  });
}

// x[h] = T(T(x * cos) + T(rotate_half(x) * sin)) over the heads of each row, in place.
template <typename T>
void rope_rows(T* x, int64_t row_stride, int64_t head_stride, int64_t heads, const T* cos,
               const T* sin, int64_t rows, int64_t dim) {
  const int64_t half = dim / 2;
  at::parallel_for(0, rows, 8, [&](int64_t begin, int64_t end) {
    for (int64_t m = begin; m < end; ++m) {
      const T* c = cos + m * dim;
      const T* s = sin + m * dim;
      for (int64_t h = 0; h < heads; ++h) {
        T* p = x + m * row_stride + h * head_stride;
        for (int64_t i = 0; i < half; i += kWidth) {
          vfloat lo = vload(p + i), hi = vload(p + half + i);
          // rotate_half(x) = (-hi, lo)
          vfloat new_lo = vadd(vrounded<T>(vmul(lo, vload(c + i))),
                               vrounded<T>(vmul(vsub(vzero(), hi), vload(s + i))));
          vfloat new_hi = vadd(vrounded<T>(vmul(hi, vload(c + half + i))),
                               vrounded<T>(vmul(lo, vload(s + half + i))));
          vstore(p + i, new_lo);
          vstore(p + half + i, new_hi);
        }
      }
    }
  });
}

// out = T(T(silu(gate)) * up), silu(g) = g / (1 + e^-g) in fp32. Items of 256 columns, so a
// single row (a decode) still spreads over the threads.
template <typename T>
void silu_mul_rows(const T* gate, int64_t g_stride, const T* up, int64_t u_stride, T* out,
                   int64_t rows, int64_t dim) {
  constexpr int64_t kChunk = 256;
  const int64_t chunks = (dim + kChunk - 1) / kChunk;
  const vfloat minus_log2e = vset(-1.4426950408889634f), one = vset(1.0f);
  at::parallel_for(0, rows * chunks, 1, [&](int64_t begin, int64_t end) {
    for (int64_t item = begin; item < end; ++item) {
      const int64_t m = item / chunks, first = (item % chunks) * kChunk;
      const int64_t last = std::min(dim, first + kChunk);
      for (int64_t i = first; i < last; i += kWidth) {
        vfloat g = vload(gate + m * g_stride + i);
        vfloat silu = vrounded<T>(vdiv(g, vadd(one, vexp2(vmul(g, minus_log2e)))));
        vstore(out + m * dim + i, vmul(silu, vload(up + m * u_stride + i)));
      }
    }
  });
}

void check_row_major(const at::Tensor& t, const char* what, const char* op) {
  TORCH_CHECK(t.dim() >= 2 && t.stride(-1) == 1, "quill::", op, ": ", what,
              " must have contiguous rows, got strides ", t.strides());
}

void check_dim(int64_t dim, const char* op) {
  TORCH_CHECK(dim % kWidth == 0, "quill::", op, ": the row length ", dim, " is not a multiple of ",
              kWidth);
}

template <typename Fn>
void by_dtype(at::ScalarType dtype, const char* op, Fn&& fn) {
  switch (dtype) {
    case at::kFloat: fn(float{}); break;
    case at::kBFloat16: fn(bf16{}); break;
    case at::kHalf: fn(fp16{}); break;
    default: TORCH_CHECK(false, "quill::", op, ": dtype ", dtype, " is not supported");
  }
}

}  // namespace

at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps) {
  check_row_major(x, "x", "rms_norm");
  TORCH_CHECK(x.dim() == 2 && weight.is_contiguous() && weight.numel() == x.size(1) &&
                  weight.scalar_type() == x.scalar_type(),
              "quill::rms_norm: x [rows, dim] and a contiguous weight [dim] of x's dtype");
  check_dim(x.size(1), "rms_norm");
  at::Tensor out = at::empty(x.sizes(), x.options());
  by_dtype(x.scalar_type(), "rms_norm", [&](auto tag) {
    using T = decltype(tag);
    norm_rows<T>(reinterpret_cast<const T*>(x.data_ptr()), x.stride(0), nullptr, 0,
                 reinterpret_cast<const T*>(weight.data_ptr()), reinterpret_cast<T*>(out.data_ptr()),
                 x.size(0), x.size(1), float(eps));
  });
  return out;
}

at::Tensor add_rms_norm(const at::Tensor& x, at::Tensor& residual, const at::Tensor& weight,
                        double eps) {
  check_row_major(x, "x", "add_rms_norm");
  check_row_major(residual, "residual", "add_rms_norm");
  TORCH_CHECK(x.dim() == 2 && residual.sizes() == x.sizes() && weight.is_contiguous() &&
                  weight.numel() == x.size(1) && residual.scalar_type() == x.scalar_type() &&
                  weight.scalar_type() == x.scalar_type(),
              "quill::add_rms_norm: x and residual [rows, dim] and a weight [dim], one dtype");
  check_dim(x.size(1), "add_rms_norm");
  at::Tensor out = at::empty(x.sizes(), x.options());
  by_dtype(x.scalar_type(), "add_rms_norm", [&](auto tag) {
    using T = decltype(tag);
    norm_rows<T>(reinterpret_cast<const T*>(x.data_ptr()), x.stride(0),
                 reinterpret_cast<T*>(residual.data_ptr()), residual.stride(0),
                 reinterpret_cast<const T*>(weight.data_ptr()), reinterpret_cast<T*>(out.data_ptr()),
                 x.size(0), x.size(1), float(eps));
  });
  return out;
}

void rope(at::Tensor& q, at::Tensor& k, const at::Tensor& cos, const at::Tensor& sin) {
  TORCH_CHECK(q.dim() == 3 && k.dim() == 3 && q.size(0) == k.size(0) && q.size(2) == k.size(2),
              "quill::rope: q and k must be [tokens, heads, head_dim]");
  TORCH_CHECK(q.stride(2) == 1 && k.stride(2) == 1, "quill::rope: heads must be contiguous");
  const int64_t rows = q.size(0), dim = q.size(2);
  TORCH_CHECK(cos.is_contiguous() && sin.is_contiguous() && cos.numel() == rows * dim &&
                  sin.numel() == rows * dim,
              "quill::rope: cos and sin must be contiguous [tokens, head_dim]");
  TORCH_CHECK(cos.scalar_type() == q.scalar_type() && sin.scalar_type() == q.scalar_type() &&
                  k.scalar_type() == q.scalar_type(),
              "quill::rope: q, k, cos and sin must share a dtype");
  check_dim(dim / 2, "rope");
  by_dtype(q.scalar_type(), "rope", [&](auto tag) {
    using T = decltype(tag);
    const T* c = reinterpret_cast<const T*>(cos.data_ptr());
    const T* s = reinterpret_cast<const T*>(sin.data_ptr());
    rope_rows<T>(reinterpret_cast<T*>(q.data_ptr()), q.stride(0), q.stride(1), q.size(1), c, s, rows, dim);
    rope_rows<T>(reinterpret_cast<T*>(k.data_ptr()), k.stride(0), k.stride(1), k.size(1), c, s, rows, dim);
  });
}

at::Tensor silu_mul(const at::Tensor& gate, const at::Tensor& up) {
  check_row_major(gate, "gate", "silu_mul");
  check_row_major(up, "up", "silu_mul");
  TORCH_CHECK(gate.dim() == 2 && up.sizes() == gate.sizes() && up.scalar_type() == gate.scalar_type(),
              "quill::silu_mul: gate and up must be [rows, dim] of one dtype");
  check_dim(gate.size(1), "silu_mul");
  at::Tensor out = at::empty(gate.sizes(), gate.options());
  by_dtype(gate.scalar_type(), "silu_mul", [&](auto tag) {
    using T = decltype(tag);
    silu_mul_rows<T>(reinterpret_cast<const T*>(gate.data_ptr()), gate.stride(0),
                     reinterpret_cast<const T*>(up.data_ptr()), up.stride(0),
                     reinterpret_cast<T*>(out.data_ptr()), gate.size(0), gate.size(1));
  });
  return out;
}

}  // namespace quill
