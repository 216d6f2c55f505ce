// One fp32 SIMD vector type for the instruction set this library is compiled for.
//
// Each library is compiled once per instruction set (quill/ops/build.py): QUILL_AVX512 selects
// 512-bit vectors (16 floats), otherwise 256-bit AVX2 (8 floats). The kernels are written once
// against these few functions: loads that widen bf16 / fp16 / fp32 storage to fp32, fused
// multiply-add, reductions, and a base-2 exponential for the softmax. Arithmetic is always fp32;
// 16-bit types are only a storage format.
#pragma once

#include <immintrin.h>

#include <cstdint>
#include <cstring>

#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

namespace quill {

using bf16 = c10::BFloat16;
using fp16 = c10::Half;

#if defined(QUILL_AVX512)

constexpr int kWidth = 16;
using vfloat = __m512;

inline vfloat vzero() { return _mm512_setzero_ps(); }
inline vfloat vset(float x) { return _mm512_set1_ps(x); }
inline vfloat vload(const float* p) { return _mm512_loadu_ps(p); }
inline vfloat vload(const bf16* p) {
  __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}
inline vfloat vload(const fp16* p) {
  return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}
inline void vstore(float* p, vfloat v) { _mm512_storeu_ps(p, v); }
inline void vstore(bf16* p, vfloat v) {
  // Round to nearest even, as c10::BFloat16(float) does (AVX512_BF16 instruction).
  __m256bh h = _mm512_cvtneps_pbh(v);
  std::memcpy(p, &h, sizeof(h));
}
inline void vstore(fp16* p, vfloat v) {
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), _mm512_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT));
}
inline vfloat vfma(vfloat a, vfloat b, vfloat c) { return _mm512_fmadd_ps(a, b, c); }
inline vfloat vmul(vfloat a, vfloat b) { return _mm512_mul_ps(a, b); }
inline vfloat vdiv(vfloat a, vfloat b) { return _mm512_div_ps(a, b); }
inline vfloat vadd(vfloat a, vfloat b) { return _mm512_add_ps(a, b); }
inline vfloat vsub(vfloat a, vfloat b) { return _mm512_sub_ps(a, b); }
inline vfloat vmax(vfloat a, vfloat b) { return _mm512_max_ps(a, b); }
inline float vsum(vfloat v) { return _mm512_reduce_add_ps(v); }
inline float vhmax(vfloat v) { return _mm512_reduce_max_ps(v); }
inline vfloat vround(vfloat v) {
  return _mm512_roundscale_ps(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
}
// x where x >= lo, else 0.
inline vfloat vzero_below(vfloat x, vfloat value, float lo) {
  __mmask16 keep = _mm512_cmp_ps_mask(x, vset(lo), _CMP_GE_OQ);
  return _mm512_maskz_mov_ps(keep, value);
}
// Bit i set where lane i of v is NaN, equals m, is greater than t (ordered comparisons).
inline uint32_t lanes_nan(vfloat v) { return _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q); }
inline uint32_t lanes_equal(vfloat v, vfloat m) { return _mm512_cmp_ps_mask(v, m, _CMP_EQ_OQ); }
inline uint32_t lanes_greater(vfloat v, vfloat t) { return _mm512_cmp_ps_mask(v, t, _CMP_GT_OQ); }
inline vfloat vpow2i(vfloat n) {  // 2^n for integral n in [-126, 127]
  __m512i e = _mm512_slli_epi32(_mm512_add_epi32(_mm512_cvtps_epi32(n), _mm512_set1_epi32(127)), 23);
  return _mm512_castsi512_ps(e);
}

#else  // AVX2 + FMA + F16C

constexpr int kWidth = 8;
using vfloat = __m256;

inline vfloat vzero() { return _mm256_setzero_ps(); }
inline vfloat vset(float x) { return _mm256_set1_ps(x); }
inline vfloat vload(const float* p) { return _mm256_loadu_ps(p); }
inline vfloat vload(const bf16* p) {
  __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}
inline vfloat vload(const fp16* p) {
  return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
}
inline void vstore(float* p, vfloat v) { _mm256_storeu_ps(p, v); }
inline void vstore(bf16* p, vfloat v) {
  // Round to nearest even by integer arithmetic (no bf16 instructions here); NaN stays NaN.
  __m256i bits = _mm256_castps_si256(v);
  __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(bits, 16), _mm256_set1_epi32(1));
  __m256i rounded = _mm256_add_epi32(bits, _mm256_add_epi32(lsb, _mm256_set1_epi32(0x7FFF)));
  __m256i nan = _mm256_castps_si256(_mm256_cmp_ps(v, v, _CMP_UNORD_Q));
  rounded = _mm256_blendv_epi8(rounded, _mm256_or_si256(bits, _mm256_set1_epi32(0x400000)), nan);
  __m256i hi = _mm256_srli_epi32(rounded, 16);
  __m128i packed = _mm_packus_epi32(_mm256_castsi256_si128(hi), _mm256_extracti128_si256(hi, 1));
  _mm_storeu_si128(reinterpret_cast<__m128i*>(p), packed);
}
inline void vstore(fp16* p, vfloat v) {
  _mm_storeu_si128(reinterpret_cast<__m128i*>(p), _mm256_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT));
}
inline vfloat vfma(vfloat a, vfloat b, vfloat c) { return _mm256_fmadd_ps(a, b, c); }
inline vfloat vmul(vfloat a, vfloat b) { return _mm256_mul_ps(a, b); }
inline vfloat vdiv(vfloat a, vfloat b) { return _mm256_div_ps(a, b); }
inline vfloat vadd(vfloat a, vfloat b) { return _mm256_add_ps(a, b); }
inline vfloat vsub(vfloat a, vfloat b) { return _mm256_sub_ps(a, b); }
inline vfloat vmax(vfloat a, vfloat b) { return _mm256_max_ps(a, b); }
inline float vsum(vfloat v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}
inline float vhmax(vfloat v) {
  __m128 s = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_max_ps(s, _mm_movehl_ps(s, s));
  s = _mm_max_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}
inline vfloat vround(vfloat v) { return _mm256_round_ps(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC); }
inline vfloat vzero_below(vfloat x, vfloat value, float lo) {
  return _mm256_and_ps(_mm256_cmp_ps(x, vset(lo), _CMP_GE_OQ), value);
}
inline uint32_t lanes_nan(vfloat v) {
  return uint32_t(_mm256_movemask_ps(_mm256_cmp_ps(v, v, _CMP_UNORD_Q)));
}
inline uint32_t lanes_equal(vfloat v, vfloat m) {
  return uint32_t(_mm256_movemask_ps(_mm256_cmp_ps(v, m, _CMP_EQ_OQ)));
}
inline uint32_t lanes_greater(vfloat v, vfloat t) {
  return uint32_t(_mm256_movemask_ps(_mm256_cmp_ps(v, t, _CMP_GT_OQ)));
}
inline vfloat vpow2i(vfloat n) {
  __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_castsi256_ps(e);
}

#endif

// 2^x, relative error below 2e-7; exactly 0 for x below -126 (and for -inf).
inline vfloat vexp2(vfloat x) {
  vfloat xc = vmax(x, vset(-126.0f));
  vfloat n = vround(xc);
  vfloat r = vsub(xc, n);  // in [-0.5, 0.5]
  // Taylor series of e^(r ln 2) to degree 6 (truncation error ~1.2e-7 on this interval).
  vfloat p = vset(1.5403530393381606e-4f);
  p = vfma(p, r, vset(1.3333558146428443e-3f));
  p = vfma(p, r, vset(9.6181291076284772e-3f));
  p = vfma(p, r, vset(5.5504108664821580e-2f));
  p = vfma(p, r, vset(2.4022650695910071e-1f));
  p = vfma(p, r, vset(6.9314718055994531e-1f));
  p = vfma(p, r, vset(1.0f));
  return vzero_below(x, vmul(p, vpow2i(n)), -126.0f);
}

// max |x| over n values (n whole vectors) / 127: the scale of an int8 block quantizer (Q8_0's
// blocks of 32 in qlinear.cpp, Q8_K's super-blocks of 256 in kquant.h).
template <typename T>
inline float int8_scale(const T* x, int n) {
  vfloat amax = vzero();
  for (int i = 0; i < n; i += kWidth) {
    const vfloat v = vload(x + i);
    amax = vmax(amax, vmax(v, vsub(vzero(), v)));
  }
  return vhmax(amax) / 127.0f;
}

inline float to_float(float x) { return x; }
inline float to_float(bf16 x) { return static_cast<float>(x); }
inline float to_float(fp16 x) { return static_cast<float>(x); }

template <typename T>
inline T from_float(float x) {
  return static_cast<T>(x);
}

}  // namespace quill
