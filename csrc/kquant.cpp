// Products with GGUF's K-quant weights read as the file stores them: Q2_K to Q6_K and IQ4_XS
// rows of super-blocks of 256 weights, straight from the memory-mapped file (no copy, no repack).
//
// The layouts (ggml's, checked bit for bit against the `gguf` package's dequantizers in
// tests/test_kquant.py):
// - Q4_K, 144 bytes: fp16 d, fp16 dmin, 12 bytes of eight 6-bit scales and eight 6-bit mins,
//   128 bytes of 4-bit codes. Sub-block j (32 weights) is w = d * sc_j * q - dmin * m_j; byte
//   l of 32-byte chunk c holds sub-block 2c's weight l (low nibble) and 2c+1's (high nibble).
// - Q5_K, 176 bytes: Q4_K's fields and 32 bytes of fifth bits before the codes: bit j of byte l
//   is the fifth bit of sub-block j's weight l.
// - Q6_K, 210 bytes: 128 bytes of low nibbles, 64 of high 2-bit pairs, 16 int8 scales (one per
//   16 weights), fp16 d last; w = d * sc * (q - 32), q in 0..63. In each half of 128 weights,
//   byte l (of 64) holds weight l's low nibble and weight 64 + l's high nibble; byte l (of 32)
//   of the high pairs holds weights l, 32 + l, 64 + l and 96 + l's top two bits, in that order.
// - IQ4_XS, 136 bytes: fp16 d, a uint16 and 4 bytes of eight 6-bit sub-block scales (kquant.h),
//   128 bytes of 4-bit codes; sub-block j is w = d * (ls_j - 32) * K[q], K ggml's table of 16
//   values. Byte l of the sub-block's 16 holds weight l (low nibble) and 16 + l (high).
// - Q2_K, 84 bytes: 16 bytes of scales (low nibble) and mins (high), one per 16 weights, 64 bytes
//   of 2-bit codes, fp16 d, fp16 dmin; w = d * sc * q - dmin * m. In each half of 128 weights,
//   bits 2j, 2j + 1 of byte l (of 32) are weight 32j + l.
// - Q3_K, 110 bytes: 32 bytes of third bits (bit i of byte l: weight 32i + l), 64 bytes of 2-bit
//   codes as Q2_K's, 12 bytes of sixteen 6-bit scales (kquant.h), fp16 d; w = d * (sc - 32) *
//   (low - 4 where the third bit is clear).
//
// The activations are quantized once per call to int8 per row and super-block (scale =
// max |x| / 127, rounded half to even), with their sums over each 16 values, as llama.cpp's
// Q8_K: then a sub-block's product is an integer dot product (u8 codes x s8 activations, exact
// in int16 pairs: at most 2 x 63 x 127), times its integer scale into int32, and one float
// multiply per super-block. The mins and Q6_K's offset of 32 leave the inner loop through the
// activation sums. Rows are up to kMaxRows tokens per pass over a weight row; a thread takes a
// block of weight rows and runs every group of token rows over it while it sits in cache, so a
// prompt chunk reads the weights once.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/util/Exception.h>

#include <algorithm>
#include <cmath>
#include <vector>

#include "kquant.h"
#include "ops.h"
#include "vec.h"

namespace quill {
namespace {

using namespace kq;

#if defined(QUILL_AVX512)
constexpr int kMaxRows = 8;     // token rows per pass over a weight row
#else
constexpr int kMaxRows = 4;
#endif
constexpr int kRowBlock = 16;   // weight rows a thread keeps in cache over every token group
constexpr int kAheadRows = 8;   // how far ahead a weight row is prefetched

// Where a super-block's groups of 16 activations are kept (in 16s) so that a vector of codes
// meets its activations side by side. The AVX-512 kernel reads Q4_K and Q5_K's codes 64 bytes
// at a time, whose low nibbles are sub-blocks 4p and 4p + 2 and high nibbles 4p + 1 and 4p + 3.
// IQ4_XS's low nibbles are the first 16 weights of each sub-block a vector holds (4 with
// AVX-512, 2 with AVX2), its high nibbles their last 16.
constexpr int kInterleaved[16] = {0, 1, 4, 5, 2, 3, 6, 7, 8, 9, 12, 13, 10, 11, 14, 15};
#if defined(QUILL_AVX512)
constexpr int kIQ4Order[16] = {0, 4, 1, 5, 2, 6, 3, 7, 8, 12, 9, 13, 10, 14, 11, 15};
#else
constexpr int kIQ4Order[16] = {0, 2, 1, 3, 4, 6, 5, 7, 8, 10, 9, 11, 12, 14, 13, 15};
#endif

// The mins' term of one super-block for one row, kept as 4 float lanes (summed at the end):
// dmin * the row's scale * sum_j m_j * (the row's sum over sub-block j).
inline __m128 min_term(__m128 acc, __m128i mins16, const int16_t* sums32, float scale) {
  const __m128i dots = _mm_madd_epi16(mins16, _mm_loadu_si128(reinterpret_cast<const __m128i*>(sums32)));
  return _mm_fmadd_ps(_mm_cvtepi32_ps(dots), _mm_set1_ps(scale), acc);
}

// Q2_K's mins for R rows: dmin * the row's scale * sum_g m_g * (the row's sum over group g
// of 16), m_g the high nibbles of the super-block's first 16 bytes.
template <int R>
inline void q2k_min_terms(const uint8_t* b, float dmin, const Activations& act, int64_t m0, int64_t s,
                          int64_t supers, __m128 offsets[R]) {
  const __m128i packed = _mm_loadu_si128(reinterpret_cast<const __m128i*>(b));
  const __m128i mins8 = _mm_and_si128(_mm_srli_epi16(packed, 4), _mm_set1_epi8(0x0F));
  const __m128i mins_lo = _mm_cvtepu8_epi16(mins8), mins_hi = _mm_cvtepu8_epi16(_mm_srli_si128(mins8, 8));
  for (int r = 0; r < R; ++r) {
    const int16_t* s16 = act.sums16.data() + ((m0 + r) * supers + s) * 16;
    const float scale = dmin * act.scales[(m0 + r) * supers + s];
    offsets[r] = min_term(min_term(offsets[r], mins_lo, s16, scale), mins_hi, s16 + 8, scale);
  }
}

inline float hsum4(__m128 s) {
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

inline __m256i nibbles_low(__m256i x) { return _mm256_and_si256(x, _mm256_set1_epi8(0x0F)); }
inline __m256i nibbles_high(__m256i x) {
  return _mm256_and_si256(_mm256_srli_epi16(x, 4), _mm256_set1_epi8(0x0F));
}
inline __m256i load32(const void* p) { return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)); }

// acc += the pairs of p (int16) times s (int16), summed in pairs into int32.
inline __m256i madd_acc(__m256i acc, __m256i p, __m256i s) {
#if defined(QUILL_AVX512)
  return _mm256_dpwssd_epi32(acc, p, s);
#else
  return _mm256_add_epi32(acc, _mm256_madd_epi16(p, s));
#endif
}

inline float hsum(__m256 v) { return hsum4(_mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1))); }

// One weight row (`supers` super-blocks) against R activation rows from `m0`: out[r].
template <int64_t Type, int R>
void dot_row(const uint8_t* w, int64_t supers, const Activations& act, int64_t m0, float out[R]) {
  __m256 acc[R];
  __m128 offsets[R];
  for (int r = 0; r < R; ++r) {
    acc[r] = _mm256_setzero_ps();
    offsets[r] = _mm_setzero_ps();
  }
  const int64_t groups = act.k / 16;
  for (int64_t s = 0; s < supers; ++s) {
    const uint8_t* b = w + s * block_bytes(Type);
    __m256i isum[R];
    for (int r = 0; r < R; ++r) isum[r] = _mm256_setzero_si256();
    float d, dmin = 0.0f;
    if constexpr (Type == kQ4K || Type == kQ5K) {
      d = half_at(b);
      dmin = half_at(b + 2);
      uint8_t sc[8], mn[8];
      scales_and_mins(b + 4, sc, mn);
      const uint8_t* qh = b + 16;
      const uint8_t* qs = Type == kQ5K ? b + 48 : b + 16;
      const __m256i high = Type == kQ5K ? load32(qh) : _mm256_setzero_si256();
      for (int c = 0; c < 4; ++c) {
        const __m256i x = load32(qs + 32 * c);
        __m256i lo = nibbles_low(x), hi = nibbles_high(x);
        if constexpr (Type == kQ5K) {
          const __m256i one = _mm256_set1_epi8(1);
          lo = _mm256_or_si256(lo, _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(high, 2 * c), one), 4));
          hi = _mm256_or_si256(hi, _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(high, 2 * c + 1), one), 4));
        }
        const __m256i s_lo = _mm256_set1_epi16(sc[2 * c]), s_hi = _mm256_set1_epi16(sc[2 * c + 1]);
        for (int r = 0; r < R; ++r) {
          const int8_t* a = act.row(m0 + r) + s * kSuper + 64 * c;
          isum[r] = madd_acc(isum[r], _mm256_maddubs_epi16(lo, load32(a)), s_lo);
          isum[r] = madd_acc(isum[r], _mm256_maddubs_epi16(hi, load32(a + 32)), s_hi);
        }
      }
      // The mins: dmin * sum_j m_j * (the activation's sum over sub-block j's 32 values).
      const __m128i mins16 = _mm_cvtepu8_epi16(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(mn)));
      for (int r = 0; r < R; ++r) {
        const int16_t* s32 = act.sums32.data() + (m0 + r) * (groups / 2) + s * 8;
        offsets[r] = min_term(offsets[r], mins16, s32, dmin * act.scales[(m0 + r) * supers + s]);
      }
    } else if constexpr (Type == kIQ4XS) {
      // The values are signed: |w| x (a with w's sign), whose pairs stay within int16.
      d = half_at(b);
      int16_t sc[8];
      iq4xs_scales(b, sc);
      const __m256i table = _mm256_broadcastsi128_si256(_mm_loadu_si128(reinterpret_cast<const __m128i*>(kIQ4Values)));
      for (int c = 0; c < 4; ++c) {  // sub-blocks 2c (low 128-bit lane) and 2c + 1
        const __m256i x = load32(b + 8 + 32 * c);
        const __m256i w_lo = _mm256_shuffle_epi8(table, nibbles_low(x));
        const __m256i w_hi = _mm256_shuffle_epi8(table, nibbles_high(x));
        const __m256i abs_lo = _mm256_abs_epi8(w_lo), abs_hi = _mm256_abs_epi8(w_hi);
        const __m256i scale = _mm256_set_m128i(_mm_set1_epi16(sc[2 * c + 1]), _mm_set1_epi16(sc[2 * c]));
        for (int r = 0; r < R; ++r) {
          const int8_t* a = act.row(m0 + r) + s * kSuper + 64 * c;
          isum[r] = madd_acc(isum[r], _mm256_maddubs_epi16(abs_lo, _mm256_sign_epi8(load32(a), w_lo)), scale);
          isum[r] = madd_acc(isum[r], _mm256_maddubs_epi16(abs_hi, _mm256_sign_epi8(load32(a + 32), w_hi)), scale);
        }
      }
    } else if constexpr (Type == kQ2K) {
      // 2-bit codes, 32 bytes a half of 128: bits 2j of byte l are weight 32j + l. Each group
      // of 16 has a 4-bit scale (low nibble) and min (high); the mins leave through the sums.
      const uint8_t* sc = b;
      d = half_at(b + 80);
      dmin = half_at(b + 82);
      for (int h = 0; h < 2; ++h) {
        const __m256i x = load32(b + 16 + 32 * h);
        for (int j = 0; j < 4; ++j) {
          const __m256i q = _mm256_and_si256(_mm256_srli_epi16(x, 2 * j), _mm256_set1_epi8(3));
          const int g = 8 * h + 2 * j;  // this vector's two groups of 16: g, g + 1
          const __m256i scale = _mm256_set_m128i(_mm_set1_epi16(sc[g + 1] & 0x0F), _mm_set1_epi16(sc[g] & 0x0F));
          for (int r = 0; r < R; ++r) {
            const int8_t* a = act.row(m0 + r) + s * kSuper + 128 * h + 32 * j;
            isum[r] = madd_acc(isum[r], _mm256_maddubs_epi16(q, load32(a)), scale);
          }
        }
      }
      q2k_min_terms<R>(b, dmin, act, m0, s, supers, offsets);
    } else if constexpr (Type == kQ3K) {
      // Q2_K's arrangement of 2-bit codes, and a third bit for weight 32i + l at bit i of byte
      // l of the 32 before them: u = low | third << 2 in 0..7, w = d * sc * (u - 4); the 4
      // leaves through the sums, as Q6_K's 32.
      d = half_at(b + 108);
      const __m128i sc8 = _mm_sub_epi8(q3k_scales(b + 96), _mm_set1_epi8(32));  // within int8
      const __m256i scales16 = _mm256_cvtepi8_epi16(sc8);
      alignas(16) int8_t sc[16];  // each broadcast below from memory (a vector store, whole)
      _mm_store_si128(reinterpret_cast<__m128i*>(sc), sc8);
      const __m256i third = load32(b);
      const __m256i one = _mm256_set1_epi8(1);
      for (int h = 0; h < 2; ++h) {
        const __m256i x = load32(b + 32 + 32 * h);
        for (int j = 0; j < 4; ++j) {
          const int i = 4 * h + j;
          const __m256i u = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(x, 2 * j), _mm256_set1_epi8(3)),
                                            _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(third, i), one), 2));
          const __m256i scale = _mm256_set_m128i(_mm_set1_epi16(sc[2 * i + 1]), _mm_set1_epi16(sc[2 * i]));
          for (int r = 0; r < R; ++r) {
            const int8_t* a = act.row(m0 + r) + s * kSuper + 32 * i;
            isum[r] = madd_acc(isum[r], _mm256_maddubs_epi16(u, load32(a)), scale);
          }
        }
      }
      for (int r = 0; r < R; ++r) {
        const int16_t* s16 = act.sums16.data() + (m0 + r) * groups + s * 16;
        const __m256i sums = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(s16));
        isum[r] = _mm256_sub_epi32(isum[r], _mm256_slli_epi32(_mm256_madd_epi16(sums, scales16), 2));
      }
    } else {  // Q6_K
      const uint8_t* ql = b;
      const uint8_t* qh = b + 128;
      const int8_t* sc = reinterpret_cast<const int8_t*>(b + 192);
      d = half_at(b + 208);
      for (int h = 0; h < 2; ++h) {
        const __m256i high = load32(qh + 32 * h);
        for (int c = 0; c < 2; ++c) {
          const __m256i x = load32(ql + 64 * h + 32 * c);
          const __m256i three = _mm256_set1_epi8(3);
          // Weights 32c + l (low nibbles, bits 2c of the high byte) and 64 + 32c + l (high
          // nibbles, bits 4 + 2c) of this half.
          const __m256i lo = _mm256_or_si256(
              nibbles_low(x), _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(high, 2 * c), three), 4));
          const __m256i hi = _mm256_or_si256(
              nibbles_high(x), _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(high, 4 + 2 * c), three), 4));
          const int g_lo = 8 * h + 2 * c, g_hi = 8 * h + 4 + 2 * c;  // their scales' groups of 16
          const __m256i s_lo = _mm256_set_m128i(_mm_set1_epi16(sc[g_lo + 1]), _mm_set1_epi16(sc[g_lo]));
          const __m256i s_hi = _mm256_set_m128i(_mm_set1_epi16(sc[g_hi + 1]), _mm_set1_epi16(sc[g_hi]));
          for (int r = 0; r < R; ++r) {
            const int8_t* a = act.row(m0 + r) + s * kSuper + 128 * h + 32 * c;
            isum[r] = madd_acc(isum[r], _mm256_maddubs_epi16(lo, load32(a)), s_lo);
            isum[r] = madd_acc(isum[r], _mm256_maddubs_epi16(hi, load32(a + 64)), s_hi);
          }
        }
      }
      // The offset of 32: -32 * sum_g sc_g * (the activation's sum over group g).
      const __m256i scales16 = _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(sc)));
      for (int r = 0; r < R; ++r) {
        const int16_t* s16 = act.sums16.data() + (m0 + r) * groups + s * 16;
        const __m256i sums = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(s16));
        isum[r] = _mm256_sub_epi32(isum[r], _mm256_slli_epi32(_mm256_madd_epi16(sums, scales16), 5));
      }
    }
    for (int r = 0; r < R; ++r) {
      const float scale = d * act.scales[(m0 + r) * supers + s];
      acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(isum[r]), _mm256_set1_ps(scale), acc[r]);
    }
  }
  for (int r = 0; r < R; ++r) out[r] = hsum(acc[r]) - hsum4(offsets[r]);
}

#if defined(QUILL_AVX512)

inline __m512i load64(const void* p) { return _mm512_loadu_si512(p); }
inline __m512i two_halves(int16_t lo, int16_t hi) {
  return _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_set1_epi16(lo)), _mm256_set1_epi16(hi), 1);
}

// The same with 64-byte vectors: Q4_K and Q5_K's activations interleaved (kInterleaved).
template <int64_t Type, int R>
void dot_row_512(const uint8_t* w, int64_t supers, const Activations& act, int64_t m0, float out[R]) {
  __m512 acc[R];
  __m128 offsets[R];
  for (int r = 0; r < R; ++r) {
    acc[r] = _mm512_setzero_ps();
    offsets[r] = _mm_setzero_ps();
  }
  const int64_t groups = act.k / 16;
  const __m512i low4 = _mm512_set1_epi8(0x0F);
  for (int64_t s = 0; s < supers; ++s) {
    const uint8_t* b = w + s * block_bytes(Type);
    __m512i isum[R];
    for (int r = 0; r < R; ++r) isum[r] = _mm512_setzero_si512();
    float d, dmin = 0.0f;
    if constexpr (Type == kQ4K || Type == kQ5K) {
      d = half_at(b);
      dmin = half_at(b + 2);
      uint8_t sc[8], mn[8];
      scales_and_mins(b + 4, sc, mn);
      const uint8_t* qs = Type == kQ5K ? b + 48 : b + 16;
      __m512i high = _mm512_setzero_si512();
      if constexpr (Type == kQ5K) high = _mm512_broadcast_i64x4(load32(b + 16));
      for (int p = 0; p < 2; ++p) {
        const __m512i x = load64(qs + 64 * p);
        __m512i lo = _mm512_and_si512(x, low4), hi = _mm512_and_si512(_mm512_srli_epi16(x, 4), low4);
        if constexpr (Type == kQ5K) {
          // Fifth bits of sub-blocks 4p, 4p + 2 (low) and 4p + 1, 4p + 3 (high).
          const __m512i one = _mm512_set1_epi8(1);
          const __m512i shift_lo = _mm512_inserti64x4(_mm512_set1_epi16(4 * p), _mm256_set1_epi16(4 * p + 2), 1);
          const __m512i shift_hi = _mm512_add_epi16(shift_lo, _mm512_set1_epi16(1));
          lo = _mm512_or_si512(lo, _mm512_slli_epi16(_mm512_and_si512(_mm512_srlv_epi16(high, shift_lo), one), 4));
          hi = _mm512_or_si512(hi, _mm512_slli_epi16(_mm512_and_si512(_mm512_srlv_epi16(high, shift_hi), one), 4));
        }
        const __m512i s_lo = two_halves(sc[4 * p], sc[4 * p + 2]);
        const __m512i s_hi = two_halves(sc[4 * p + 1], sc[4 * p + 3]);
        for (int r = 0; r < R; ++r) {
          const int8_t* a = act.row(m0 + r) + s * kSuper + 128 * p;
          isum[r] = _mm512_dpwssd_epi32(isum[r], _mm512_maddubs_epi16(lo, load64(a)), s_lo);
          isum[r] = _mm512_dpwssd_epi32(isum[r], _mm512_maddubs_epi16(hi, load64(a + 64)), s_hi);
        }
      }
      const __m128i mins16 = _mm_cvtepu8_epi16(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(mn)));
      for (int r = 0; r < R; ++r) {
        const int16_t* s32 = act.sums32.data() + (m0 + r) * (groups / 2) + s * 8;
        offsets[r] = min_term(offsets[r], mins16, s32, dmin * act.scales[(m0 + r) * supers + s]);
      }
    } else if constexpr (Type == kIQ4XS) {
      // The codes' values plus 128, unsigned (kIQ4Unsigned): a sub-block's dot product in
      // int32 lanes (dpbusd: no int16 pairs to overflow), times its scale; the 128 comes off
      // through the activation sums below.
      d = half_at(b);
      int16_t sc[8];
      iq4xs_scales(b, sc);
      const __m512i table = _mm512_broadcast_i32x4(_mm_loadu_si128(reinterpret_cast<const __m128i*>(kIQ4Unsigned)));
      const __m512i scales32 = _mm512_cvtepi16_epi32(_mm256_castsi128_si256(_mm_loadu_si128(reinterpret_cast<const __m128i*>(sc))));
      for (int p = 0; p < 2; ++p) {  // sub-blocks 4p .. 4p + 3, one a 128-bit lane
        const __m512i x = load64(b + 8 + 64 * p);
        const __m512i lo = _mm512_shuffle_epi8(table, _mm512_and_si512(x, low4));
        const __m512i hi = _mm512_shuffle_epi8(table, _mm512_and_si512(_mm512_srli_epi16(x, 4), low4));
        const __m512i lanes = _mm512_add_epi32(_mm512_set1_epi32(4 * p),
            _mm512_setr_epi32(0, 0, 0, 0, 1, 1, 1, 1, 2, 2, 2, 2, 3, 3, 3, 3));
        const __m512i scale = _mm512_permutexvar_epi32(lanes, scales32);
        for (int r = 0; r < R; ++r) {
          const int8_t* a = act.row(m0 + r) + s * kSuper + 128 * p;
          const __m512i dot = _mm512_dpbusd_epi32(_mm512_dpbusd_epi32(_mm512_setzero_si512(), lo, load64(a)), hi, load64(a + 64));
          isum[r] = _mm512_add_epi32(isum[r], _mm512_mullo_epi32(dot, scale));
        }
      }
      // 128 x sum_j sc_j x (the activation's sum over sub-block j).
      const __m128i scales16 = _mm_loadu_si128(reinterpret_cast<const __m128i*>(sc));
      for (int r = 0; r < R; ++r) {
        const int16_t* s32 = act.sums32.data() + (m0 + r) * (groups / 2) + s * 8;
        const __m128i off = _mm_slli_epi32(_mm_madd_epi16(scales16, _mm_loadu_si128(reinterpret_cast<const __m128i*>(s32))), 7);
        isum[r] = _mm512_sub_epi32(isum[r], _mm512_zextsi128_si512(off));
      }
    } else if constexpr (Type == kQ2K || Type == kQ3K) {
      // A vector is weights 128h + 64p + 0..63 in order: the half's code bytes shifted by 4p
      // (low 32 bytes) and 4p + 2 (high), so its 128-bit lanes are the groups of 16
      // 8h + 4p .. 8h + 4p + 3, whose scales are spread across them from one vector of 16.
      __m256i scales16;
      const uint8_t* qs = b + (Type == kQ2K ? 16 : 32);
      __m512i third = _mm512_setzero_si512();
      if constexpr (Type == kQ2K) {
        d = half_at(b + 80);
        dmin = half_at(b + 82);
        scales16 = _mm256_cvtepu8_epi16(_mm_and_si128(_mm_loadu_si128(reinterpret_cast<const __m128i*>(b)), _mm_set1_epi8(0x0F)));
      } else {
        d = half_at(b + 108);
        scales16 = _mm256_sub_epi16(_mm256_cvtepu8_epi16(q3k_scales(b + 96)), _mm256_set1_epi16(32));
        third = _mm512_broadcast_i64x4(load32(b));
      }
      const __m512i scales = _mm512_castsi256_si512(scales16);
      const __m512i lane_group = _mm512_setr_epi32(0, 0, 0, 0, 0x00010001, 0x00010001, 0x00010001, 0x00010001,
          0x00020002, 0x00020002, 0x00020002, 0x00020002, 0x00030003, 0x00030003, 0x00030003, 0x00030003);
      const __m512i three = _mm512_set1_epi8(3), one = _mm512_set1_epi8(1);
      for (int h = 0; h < 2; ++h) {
        const __m512i x = _mm512_broadcast_i64x4(load32(qs + 32 * h));
        for (int p = 0; p < 2; ++p) {
          const __m512i shifts = _mm512_inserti64x4(_mm512_set1_epi16(int16_t(4 * p)), _mm256_set1_epi16(int16_t(4 * p + 2)), 1);
          __m512i u = _mm512_and_si512(_mm512_srlv_epi16(x, shifts), three);
          if constexpr (Type == kQ3K) {
            // Third bits of weights 32i + l, i = 4h + 2p (low 32 bytes) and 4h + 2p + 1 (high).
            const int i = 4 * h + 2 * p;
            const __m512i at = _mm512_inserti64x4(_mm512_set1_epi16(int16_t(i)), _mm256_set1_epi16(int16_t(i + 1)), 1);
            u = _mm512_or_si512(u, _mm512_slli_epi16(_mm512_and_si512(_mm512_srlv_epi16(third, at), one), 2));
          }
          const __m512i scale = _mm512_permutexvar_epi16(_mm512_add_epi16(lane_group, _mm512_set1_epi16(int16_t(8 * h + 4 * p))), scales);
          for (int r = 0; r < R; ++r) {
            const int8_t* a = act.row(m0 + r) + s * kSuper + 128 * h + 64 * p;
            isum[r] = _mm512_dpwssd_epi32(isum[r], _mm512_maddubs_epi16(u, load64(a)), scale);
          }
        }
      }
      if constexpr (Type == kQ2K) {  // the mins: dmin * sum_g m_g * (the sum over group g)
        q2k_min_terms<R>(b, dmin, act, m0, s, supers, offsets);
      } else {  // the offset of 4: -4 * sum_g sc_g * (the sum over group g)
        for (int r = 0; r < R; ++r) {
          const int16_t* s16 = act.sums16.data() + (m0 + r) * groups + s * 16;
          const __m256i sums = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(s16));
          const __m256i off = _mm256_slli_epi32(_mm256_madd_epi16(sums, scales16), 2);
          isum[r] = _mm512_sub_epi32(isum[r], _mm512_zextsi256_si512(off));
        }
      }
    } else {  // Q6_K: natural order; 64 bytes of low nibbles a half
      const uint8_t* ql = b;
      const uint8_t* qh = b + 128;
      const int8_t* sc = reinterpret_cast<const int8_t*>(b + 192);
      d = half_at(b + 208);
      // Each scale 8 times (one per pair of 16 int16 lanes' 8 pairs): lanes of 4 groups.
      const __m128i sc16 = _mm_loadu_si128(reinterpret_cast<const __m128i*>(sc));
      const __m256i scales = _mm256_broadcastsi128_si256(sc16);
      const __m256i group_lanes = _mm256_setr_epi8(
          0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1, 2, 2, 2, 2, 2, 2, 2, 2, 3, 3, 3, 3, 3, 3, 3, 3);
      const __m512i three = _mm512_set1_epi8(3);
      const __m512i shifts_lo = _mm512_inserti64x4(_mm512_setzero_si512(), _mm256_set1_epi16(2), 1);
      const __m512i shifts_hi = _mm512_add_epi16(shifts_lo, _mm512_set1_epi16(4));
      for (int h = 0; h < 2; ++h) {
        const __m512i x = load64(ql + 64 * h);
        const __m512i high = _mm512_broadcast_i64x4(load32(qh + 32 * h));
        const __m512i lo = _mm512_or_si512(_mm512_and_si512(x, low4),
            _mm512_slli_epi16(_mm512_and_si512(_mm512_srlv_epi16(high, shifts_lo), three), 4));
        const __m512i hi = _mm512_or_si512(_mm512_and_si512(_mm512_srli_epi16(x, 4), low4),
            _mm512_slli_epi16(_mm512_and_si512(_mm512_srlv_epi16(high, shifts_hi), three), 4));
        // Groups of 16: 8h .. 8h + 3 for the low nibbles' 64 weights, 8h + 4 .. 8h + 7 above;
        // each group's scale on the 8 int16 lanes of its pairs.
        const __m256i first = _mm256_add_epi8(group_lanes, _mm256_set1_epi8(char(8 * h)));
        const __m512i scale_lo = _mm512_cvtepi8_epi16(_mm256_shuffle_epi8(scales, first));
        const __m512i scale_hi = _mm512_cvtepi8_epi16(
            _mm256_shuffle_epi8(scales, _mm256_add_epi8(first, _mm256_set1_epi8(4))));
        for (int r = 0; r < R; ++r) {
          const int8_t* a = act.row(m0 + r) + s * kSuper + 128 * h;
          isum[r] = _mm512_dpwssd_epi32(isum[r], _mm512_maddubs_epi16(lo, load64(a)), scale_lo);
          isum[r] = _mm512_dpwssd_epi32(isum[r], _mm512_maddubs_epi16(hi, load64(a + 64)), scale_hi);
        }
      }
      const __m256i scales16 = _mm256_cvtepi8_epi16(sc16);
      for (int r = 0; r < R; ++r) {
        const int16_t* s16 = act.sums16.data() + (m0 + r) * groups + s * 16;
        const __m256i sums = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(s16));
        const __m256i off = _mm256_slli_epi32(_mm256_madd_epi16(sums, scales16), 5);
        isum[r] = _mm512_sub_epi32(isum[r], _mm512_zextsi256_si512(off));
      }
    }
    for (int r = 0; r < R; ++r) {
      const float scale = d * act.scales[(m0 + r) * supers + s];
      acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(isum[r]), _mm512_set1_ps(scale), acc[r]);
    }
  }
  for (int r = 0; r < R; ++r) out[r] = _mm512_reduce_add_ps(acc[r]) - hsum4(offsets[r]);
}

#endif

using RowFn = void (*)(const uint8_t*, int64_t, const Activations&, int64_t, float*);

template <int64_t Type>
RowFn row_fn(int rows) {
#if defined(QUILL_AVX512)
  switch (rows) {
    case 1: return &dot_row_512<Type, 1>;
    case 2: return &dot_row_512<Type, 2>;
    case 3: return &dot_row_512<Type, 3>;
    case 4: return &dot_row_512<Type, 4>;
    case 5: return &dot_row_512<Type, 5>;
    case 6: return &dot_row_512<Type, 6>;
    case 7: return &dot_row_512<Type, 7>;
    default: return &dot_row_512<Type, 8>;
  }
#else
  switch (rows) {
    case 1: return &dot_row<Type, 1>;
    case 2: return &dot_row<Type, 2>;
    case 3: return &dot_row<Type, 3>;
    default: return &dot_row<Type, 4>;
  }
#endif
}

RowFn pick(int64_t type, int rows) {
  switch (type) {
    case kQ4K: return row_fn<kQ4K>(rows);
    case kQ5K: return row_fn<kQ5K>(rows);
    case kIQ4XS: return row_fn<kIQ4XS>(rows);
    case kQ2K: return row_fn<kQ2K>(rows);
    case kQ3K: return row_fn<kQ3K>(rows);
    default: return row_fn<kQ6K>(rows);
  }
}

template <typename T>
void store(T* dst, float v) { *dst = from_float<T>(v); }

}  // namespace

at::Tensor kquant_linear(const at::Tensor& x, const at::Tensor& weight, int64_t type,
                         const std::optional<at::Tensor>& row_map,
                         const std::optional<at::Tensor>& bias,
                         std::optional<at::ScalarType> out_dtype) {
  const char* op = "quill::kquant_linear";
  const int64_t bytes = block_bytes(type);
  TORCH_CHECK(bytes > 0, op, ": GGML type ", type, kTypesRead);
  TORCH_CHECK(x.dim() == 2 && x.stride(1) == 1, op, ": x must be [rows, in_features] with contiguous rows");
  TORCH_CHECK(weight.dim() == 2 && weight.scalar_type() == at::kByte && weight.stride(1) == 1, op,
              ": weight must be uint8 [out_features, bytes per row] with contiguous rows");
  const int64_t rows = x.size(0), k = x.size(1), n = weight.size(0), supers = k / kSuper;
  TORCH_CHECK(k % kSuper == 0 && weight.size(1) == supers * bytes, op, ": x has ", k,
              " inputs; a row of ", weight.size(1), " bytes holds ", weight.size(1) / bytes * kSuper);
  const at::ScalarType dtype = output_dtype(x, out_dtype, op);
  const int32_t* map = nullptr;
  at::Tensor map_c;
  if (row_map.has_value() && row_map->defined()) {
    map_c = row_map->to(at::kInt).contiguous();
    TORCH_CHECK(map_c.numel() == n, op, ": row_map has ", map_c.numel(), " entries, not ", n);
    map = map_c.data_ptr<int32_t>();
  }
  const at::Tensor bias_f = float_bias(bias, n, op);
  const float* bias_p = bias_f.defined() ? bias_f.data_ptr<float>() : nullptr;
  at::Tensor out = at::empty({rows, n}, x.options().dtype(dtype));
  if (rows == 0 || n == 0) return out;
  Activations act;
#if defined(QUILL_AVX512)
  const int* order = type == kIQ4XS ? kIQ4Order : type == kQ4K || type == kQ5K ? kInterleaved : nullptr;
#else
  const int* order = type == kIQ4XS ? kIQ4Order : nullptr;
#endif
  quantize_input(x, order, act, op);
  const uint8_t* w = weight.data_ptr<uint8_t>();
  const int64_t row_bytes = weight.stride(0);
  const int64_t blocks_of_rows = (n + kRowBlock - 1) / kRowBlock;
  at::parallel_for(0, blocks_of_rows, 1, [&](int64_t begin, int64_t end) {
    float values[kMaxRows];
    for (int64_t blk = begin; blk < end; ++blk) {
      const int64_t n0 = blk * kRowBlock, n1 = std::min(n, n0 + kRowBlock);
      for (int64_t m0 = 0; m0 < rows; m0 += kMaxRows) {
        const int r_count = int(std::min<int64_t>(kMaxRows, rows - m0));
        const RowFn fn = pick(type, r_count);
        for (int64_t j = n0; j < n1; ++j) {
          // Ask for a row kAheadRows on while this one computes: a decode step's rows come from
          // memory, not cache, and the hardware prefetchers alone left a Q2_K model's rows at
          // 8 GB/s (22 hot).
          if (m0 == 0 && j + kAheadRows < n) {
            const char* ahead = reinterpret_cast<const char*>(w + (j + kAheadRows) * row_bytes);
            for (int64_t at = 0; at < row_bytes; at += 64) _mm_prefetch(ahead + at, _MM_HINT_T0);
          }
          fn(w + j * row_bytes, supers, act, m0, values);
          const int64_t col = map ? map[j] : j;
          const float b = bias_p ? bias_p[j] : 0.0f;
          for (int r = 0; r < r_count; ++r) {
            const int64_t at = (m0 + r) * n + col;
            switch (dtype) {
              case at::kFloat: store(out.data_ptr<float>() + at, values[r] + b); break;
              case at::kBFloat16: store(reinterpret_cast<bf16*>(out.data_ptr()) + at, values[r] + b); break;
              default: store(reinterpret_cast<fp16*>(out.data_ptr()) + at, values[r] + b);
            }
          }
        }
      }
    }
  });
  return out;
}

// Rows of a K-quant weight, dequantized (the embedding lookup of a table stored so).
at::Tensor kquant_rows(const at::Tensor& weight, int64_t type, const at::Tensor& ids,
                       at::ScalarType dtype) {
  const char* op = "quill::kquant_rows";
  const int64_t bytes = block_bytes(type);
  TORCH_CHECK(bytes > 0, op, ": GGML type ", type, kTypesRead);
  TORCH_CHECK(weight.dim() == 2 && weight.scalar_type() == at::kByte && weight.stride(1) == 1, op,
              ": weight must be uint8 [rows, bytes per row] with contiguous rows");
  const int64_t supers = weight.size(1) / bytes, k = supers * kSuper;
  at::Tensor idx = ids.to(at::kLong).contiguous();
  const int64_t count = idx.numel();
  at::Tensor out = at::empty({count, k}, weight.options().dtype(at::kFloat));
  const int64_t* id = idx.data_ptr<int64_t>();
  for (int64_t i = 0; i < count; ++i)
    TORCH_CHECK(id[i] >= 0 && id[i] < weight.size(0), op, ": id ", id[i], " is outside [0, ", weight.size(0), ")");
  at::parallel_for(0, count, 1, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      const uint8_t* row = weight.data_ptr<uint8_t>() + id[i] * weight.stride(0);
      float* dst = out.data_ptr<float>() + i * k;
      for (int64_t s = 0; s < supers; ++s) {
        const uint8_t* b = row + s * bytes;
        float* y = dst + s * kSuper;
        if (type == kQ4K || type == kQ5K) {
          const float d = half_at(b), dmin = half_at(b + 2);
          uint8_t sc[8], mn[8];
          scales_and_mins(b + 4, sc, mn);
          const uint8_t* qh = b + 16;
          const uint8_t* qs = type == kQ5K ? b + 48 : b + 16;
          for (int j = 0; j < 8; ++j) {
            const float scale = d * sc[j], min = dmin * mn[j];
            for (int l = 0; l < 32; ++l) {
              int q = (qs[32 * (j / 2) + l] >> (4 * (j % 2))) & 0x0F;
              if (type == kQ5K) q |= ((qh[l] >> j) & 1) << 4;
              y[32 * j + l] = scale * float(q) - min;
            }
          }
        } else if (type == kIQ4XS) {
          const float d = half_at(b);
          int16_t sc[8];
          iq4xs_scales(b, sc);
          for (int j = 0; j < 8; ++j) {
            const float scale = d * float(sc[j]);
            const uint8_t* qs = b + 8 + 16 * j;
            for (int l = 0; l < 16; ++l) {
              y[32 * j + l] = scale * float(kIQ4Values[qs[l] & 0x0F]);
              y[32 * j + 16 + l] = scale * float(kIQ4Values[qs[l] >> 4]);
            }
          }
        } else if (type == kQ2K || type == kQ3K) {
          // Weight 32i + l: bits 2 (i % 4) of code byte 32 (i / 4) + l; Q3_K's third bit at bit i
          // of byte l (clear: less 4).
          const uint8_t* qs = b + (type == kQ2K ? 16 : 32);
          alignas(16) uint8_t sc3[16];
          if (type == kQ3K) _mm_store_si128(reinterpret_cast<__m128i*>(sc3), q3k_scales(b + 96));
          const float d = half_at(b + (type == kQ2K ? 80 : 108)), dmin = type == kQ2K ? half_at(b + 82) : 0.0f;
          for (int i = 0; i < 8; ++i)
            for (int l = 0; l < 32; ++l) {
              const int low = (qs[32 * (i / 4) + l] >> (2 * (i % 4))) & 3;
              const int g = (32 * i + l) / 16;
              if (type == kQ2K) {
                y[32 * i + l] = d * float(b[g] & 0x0F) * float(low) - dmin * float(b[g] >> 4);
              } else {
                const int q = low - (((b[l] >> i) & 1) ? 0 : 4);
                y[32 * i + l] = d * float(int(sc3[g]) - 32) * float(q);
              }
            }
        } else {  // Q6_K
          const uint8_t* ql = b;
          const uint8_t* qh = b + 128;
          const int8_t* sc = reinterpret_cast<const int8_t*>(b + 192);
          const float d = half_at(b + 208);
          for (int h = 0; h < 2; ++h)
            for (int l = 0; l < 32; ++l)
              for (int part = 0; part < 4; ++part) {
                // part 0/1: low nibbles of bytes l and 32 + l; 2/3: their high nibbles.
                const int byte = ql[64 * h + l + 32 * (part % 2)];
                const int low = part < 2 ? byte & 0x0F : byte >> 4;
                const int q = low | (((qh[32 * h + l] >> (2 * part)) & 3) << 4);
                const int pos = 128 * h + 32 * part + l;
                y[pos] = d * float(sc[pos / 16]) * float(q - 32);
              }
        }
      }
    }
  });
  return dtype == at::kFloat ? out : out.to(dtype);
}

}  // namespace quill
