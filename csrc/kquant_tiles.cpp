// K-quant weights (Q4_K, Q5_K, Q6_K) and IQ4_XS repacked once at load into tiles of 16 output rows, for
// the products of steps of many token rows (prompt chunks, many streams): a vector holds 4
// inputs of 16 rows, one 32-bit lane per row, so one load of weights feeds every token row with
// broadcast activations and no horizontal sums (as csrc/qlinear.cpp's Q8 and Q4 tiles). The
// values are the file's, exactly: codes, integer scales and mins, fp16 d and dmin, only moved.
//
// A tile's super-block (256 inputs of 16 rows), as write_tile_block builds it (then spread over
// its group of 4 tiles by Place, below):
// - codes, 2048 bytes: for sub-block j (32 inputs) and step p (0..3), 64 bytes, byte 4r + i the
//   low nibbles of row r's input 32j + 8p + i (low) and 32j + 8p + 4 + i (high), as Q4's tiles;
// - Q5_K: the fifth bits, 512 bytes: per (j, p) and nibble half h, 8 bytes: bit c of byte t is
//   the bit of lane 8c + t of that 64-byte vector;
// - Q6_K: the top two bits, 1024 bytes: per (j, p, h) 16 bytes: bits 2c, 2c + 1 of byte t are
//   those of lane 16c + t;
// - Q4_K, Q5_K: scales then mins, 8 x 16 bytes each (sub-block j's, row r at 16j + r); Q6_K:
//   16 x 16 signed scales (group of 16 inputs g, row r at 16g + r); IQ4_XS: 8 x 16 signed
//   scales (its 6-bit scales less 32), its codes as Q4_K's (the table's index, 0..15);
// - d (then dmin for Q4_K, Q5_K): 16 fp16 each.
//
// The integer dot product of a sub-block (u8 codes x s8 activations) is exact; times its scale
// into int32 (and the mins times the activation's sums; Q6_K's offset of 32 likewise), then one
// float multiply by d x the activation's scale per super-block: what kquant.cpp computes, so
// quill/ops/kquant.py's reference_linear holds both to float rounding.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/zeros.h>
#include <c10/util/Exception.h>

#include <algorithm>

#include "kquant.h"
#include "kquant_tiles.h"
#include "ops.h"
#include "vec.h"

namespace quill {
namespace {

using namespace kq;

#if defined(QUILL_AVX512)
constexpr int kMaxRows = 8;
#else
constexpr int kMaxRows = 4;
#endif
constexpr int64_t kPrefetch = 1;

// Moves one tile's contiguous super-block (write_tile_block's layout) into its group's.
template <int64_t Type>
void place_tile_block(const uint8_t* tile, int t, uint8_t* group_super) {
  using P = Place<Type>;
  for (int c = 0; c < 32; ++c) std::memcpy(group_super + P::codes(c, t), tile + 64 * c, 64);
  for (int v = 0; v < 64 && P::kBits; ++v)
    std::memcpy(group_super + P::bits(v, t), tile + 2048 + P::kBitsUnit * v, P::kBitsUnit);
  const uint8_t* after = tile + 2048 + P::kBits;
  for (int j = 0; j < scale_bytes(Type) / 16; ++j) std::memcpy(group_super + P::scales(j, t), after + 16 * j, 16);
  const int64_t d_at = scale_bytes(Type) + (has_mins(Type) ? 128 : 0);
  if constexpr (has_mins(Type)) {
    for (int j = 0; j < 8; ++j) std::memcpy(group_super + P::mins(j, t), after + 128 + 16 * j, 16);
    std::memcpy(group_super + P::dmin(t), after + d_at + 32, 32);
  }
  std::memcpy(group_super + P::d(t), after + d_at, 32);
}

void place_tile_block(int64_t type, const uint8_t* tile, int t, uint8_t* group_super) {
  switch (type) {
    case kQ4K: return place_tile_block<kQ4K>(tile, t, group_super);
    case kQ5K: return place_tile_block<kQ5K>(tile, t, group_super);
    case kIQ4XS: return place_tile_block<kIQ4XS>(tile, t, group_super);
    default: return place_tile_block<kQ6K>(tile, t, group_super);
  }
}

// One weight row's codes of a super-block, 0..15 / 0..31 / 0..63, and its scales (Q4_K, Q5_K:
// sc[8], mn[8]; Q6_K: sc as int8[16]; IQ4_XS: sc[8] less 32) and d, dmin.
struct RowBlock {
  uint8_t q[kSuper];
  int16_t sc[16];
  uint8_t mn[8];
  fp16 d, dmin;
};

void read_row_block(const uint8_t* b, int64_t type, RowBlock& out) {
  if (type == kQ4K || type == kQ5K) {
    std::memcpy(&out.d, b, 2);
    std::memcpy(&out.dmin, b + 2, 2);
    uint8_t sc[8];
    scales_and_mins(b + 4, sc, out.mn);
    for (int j = 0; j < 8; ++j) out.sc[j] = sc[j];
    const uint8_t* qh = b + 16;
    const uint8_t* qs = type == kQ5K ? b + 48 : b + 16;
    for (int j = 0; j < 8; ++j)
      for (int l = 0; l < 32; ++l) {
        int q = (qs[32 * (j / 2) + l] >> (4 * (j % 2))) & 0x0F;
        if (type == kQ5K) q |= ((qh[l] >> j) & 1) << 4;
        out.q[32 * j + l] = uint8_t(q);
      }
  } else if (type == kIQ4XS) {
    std::memcpy(&out.d, b, 2);
    out.dmin = fp16(0.0f);
    iq4xs_scales(b, out.sc);
    for (int j = 0; j < 8; ++j)
      for (int l = 0; l < 16; ++l) {
        out.q[32 * j + l] = b[8 + 16 * j + l] & 0x0F;
        out.q[32 * j + 16 + l] = b[8 + 16 * j + l] >> 4;
      }
  } else {
    const uint8_t* ql = b;
    const uint8_t* qh = b + 128;
    for (int g = 0; g < 16; ++g) out.sc[g] = reinterpret_cast<const int8_t*>(b + 192)[g];
    std::memcpy(&out.d, b + 208, 2);
    out.dmin = fp16(0.0f);
    for (int h = 0; h < 2; ++h)
      for (int l = 0; l < 32; ++l)
        for (int part = 0; part < 4; ++part) {
          const int byte = ql[64 * h + l + 32 * (part % 2)];
          const int low = part < 2 ? byte & 0x0F : byte >> 4;
          out.q[128 * h + 32 * part + l] = uint8_t(low | (((qh[32 * h + l] >> (2 * part)) & 3) << 4));
        }
  }
}

// Writes one tile's super-block from its 16 rows (null rows: padding, all zero).
void write_tile_block(const RowBlock* rows[kTile], int64_t type, uint8_t* out) {
  std::memset(out, 0, tile_super_bytes(type));
  uint8_t* codes = out;
  uint8_t* bits = out + 2048;
  uint8_t* after = bits + bits_bytes(type);
  for (int r = 0; r < kTile; ++r) {
    const RowBlock* row = rows[r];
    if (!row) continue;
    for (int j = 0; j < 8; ++j)
      for (int p = 0; p < 4; ++p)
        for (int i = 0; i < 4; ++i) {
          const int lane = 4 * r + i;
          const uint8_t lo = row->q[32 * j + 8 * p + i], hi = row->q[32 * j + 8 * p + 4 + i];
          codes[(4 * j + p) * 64 + lane] = uint8_t((lo & 0x0F) | ((hi & 0x0F) << 4));
          const uint8_t top[2] = {uint8_t(lo >> 4), uint8_t(hi >> 4)};
          for (int h = 0; h < 2; ++h) {
            const int vec = (4 * j + p) * 2 + h;
            if (type == kQ5K) bits[vec * 8 + lane % 8] |= uint8_t((top[h] & 1) << (lane / 8));
            if (type == kQ6K) bits[vec * 16 + lane % 16] |= uint8_t((top[h] & 3) << (2 * (lane / 16)));
          }
        }
    if (!has_mins(type)) {  // Q6_K, IQ4_XS: signed scales, d
      for (int g = 0; g < scale_bytes(type) / 16; ++g) after[16 * g + r] = uint8_t(int8_t(row->sc[g]));
      std::memcpy(after + scale_bytes(type) + 2 * r, &row->d, 2);
    } else {
      for (int j = 0; j < 8; ++j) {
        after[16 * j + r] = uint8_t(row->sc[j]);
        after[128 + 16 * j + r] = row->mn[j];
      }
      std::memcpy(after + 256 + 2 * r, &row->d, 2);
      std::memcpy(after + 288 + 2 * r, &row->dmin, 2);
    }
  }
}

inline int32_t four_codes(const int8_t* a) {
  int32_t four;
  std::memcpy(&four, a, 4);
  return four;
}

#if defined(QUILL_AVX512)

// The high bits of a codes vector (its 8 or 16 bytes at `bits`), in place at bit 4 and up.
template <int64_t Type>
inline __m512i high_bits(const uint8_t* bits) {
  if constexpr (Type == kQ5K) {
    uint64_t eight;
    std::memcpy(&eight, bits, 8);
    const __m512i shifts = _mm512_setr_epi64(0, 1, 2, 3, 4, 5, 6, 7);
    const __m512i b = _mm512_srlv_epi64(_mm512_set1_epi64(int64_t(eight)), shifts);
    return _mm512_slli_epi16(_mm512_and_si512(b, _mm512_set1_epi8(1)), 4);
  } else {
    const __m512i shifts = _mm512_setr_epi64(0, 0, 2, 2, 4, 4, 6, 6);
    const __m512i b = _mm512_srlv_epi64(
        _mm512_broadcast_i32x4(_mm_loadu_si128(reinterpret_cast<const __m128i*>(bits))), shifts);
    return _mm512_slli_epi16(_mm512_and_si512(b, _mm512_set1_epi8(3)), 4);
  }
}

// R token rows (from m0) over T consecutive tiles from tile t0 of a group: out[r] gets 16 x T
// floats.
template <int64_t Type, int R, int T>
void tile_rows(const uint8_t* group, int t0, int64_t supers, const Activations& act, int64_t m0,
               float* out[]) {
  using P = Place<Type>;
  // Accumulators per tile and row: where few (a token row or two), the low and the high
  // nibbles' products in chains of their own, twice the independent work in flight; where
  // many, one each, so that all stay in registers.
  constexpr int S = R * T >= 4 ? 1 : 2;
  const int64_t tsb = tile_super_bytes(Type), groups = act.k / 16;
  const __m512i low4 = _mm512_set1_epi8(0x0F);
  const __m512i table = _mm512_broadcast_i32x4(_mm_loadu_si128(reinterpret_cast<const __m128i*>(kIQ4Unsigned)));
  __m512 acc[T][R];
  for (int t = 0; t < T; ++t)
    for (int r = 0; r < R; ++r) acc[t][r] = _mm512_setzero_ps();
  for (int64_t s = 0; s < supers; ++s) {
    __m512i isum[T][R], msum[T][R];
    for (int t = 0; t < T; ++t)
      for (int r = 0; r < R; ++r) isum[t][r] = msum[t][r] = _mm512_setzero_si512();
    const int8_t* a0 = act.row(m0) + s * kSuper;
    const uint8_t* sb = group + s * kGroup * tsb;
    for (int j = 0; j < 8; ++j) {
      // The hardware prefetcher alone keeps too few lines in flight for a thread's one stream
      // (36 against 40 GB/s of the row-major kernel's several); an eighth of the group's
      // super-block kPrefetch ahead per sub-block (past the group's end: the next group's), by
      // the pass over the group's first tile (later passes find the group in L2).
      if (t0 == 0) {
        const uint8_t* ahead = sb + kPrefetch * kGroup * tsb + j * (kGroup * tsb / 8);
        for (int64_t line = 0; line < kGroup * tsb / 8; line += 64)
          _mm_prefetch(reinterpret_cast<const char*>(ahead + line), _MM_HINT_T0);
      }
      __m512i dot[T][R][S];
      for (int t = 0; t < T; ++t)
        for (int r = 0; r < R; ++r)
          for (int i = 0; i < S; ++i) dot[t][r][i] = _mm512_setzero_si512();
      for (int p = 0; p < 4; ++p) {
        __m512i lo_a[R], hi_a[R];
        for (int r = 0; r < R; ++r) {
          const int8_t* a = a0 + r * act.k + 32 * j + 8 * p;
          lo_a[r] = _mm512_set1_epi32(four_codes(a));
          hi_a[r] = _mm512_set1_epi32(four_codes(a + 4));
        }
        for (int t = 0; t < T; ++t) {
          const __m512i packed = _mm512_loadu_si512(sb + P::codes(4 * j + p, t0 + t));
          __m512i lo = _mm512_and_si512(packed, low4);
          __m512i hi = _mm512_and_si512(_mm512_srli_epi16(packed, 4), low4);
          if constexpr (Type == kQ5K || Type == kQ6K) {
            lo = _mm512_or_si512(lo, high_bits<Type>(sb + P::bits((4 * j + p) * 2, t0 + t)));
            hi = _mm512_or_si512(hi, high_bits<Type>(sb + P::bits((4 * j + p) * 2 + 1, t0 + t)));
          }
          if constexpr (Type == kIQ4XS) {  // the values plus 128; the 128 leaves below
            lo = _mm512_shuffle_epi8(table, lo);
            hi = _mm512_shuffle_epi8(table, hi);
          }
          for (int r = 0; r < R; ++r) {
            dot[t][r][0] = _mm512_dpbusd_epi32(dot[t][r][0], lo, lo_a[r]);
            dot[t][r][S - 1] = _mm512_dpbusd_epi32(dot[t][r][S - 1], hi, hi_a[r]);
          }
        }
        if constexpr (Type == kQ6K) {
          if (p % 2 == 0) continue;
          // Steps 2g, 2g + 1 are the sub-block's group g of 16 inputs: folded in at once, so
          // the accumulators are free for the next group.
          const int g = 2 * j + p / 2;
          for (int t = 0; t < T; ++t) {
            const __m512i sc = _mm512_cvtepi8_epi32(_mm_loadu_si128(
                reinterpret_cast<const __m128i*>(sb + P::scales(g, t0 + t))));
            for (int r = 0; r < R; ++r) {
              const int16_t sum = act.sums16[(m0 + r) * groups + s * 16 + g];
              const __m512i both = S == 2 ? _mm512_add_epi32(dot[t][r][0], dot[t][r][S - 1]) : dot[t][r][0];
              const __m512i centred = _mm512_sub_epi32(both, _mm512_set1_epi32(32 * sum));
              isum[t][r] = _mm512_add_epi32(isum[t][r], _mm512_mullo_epi32(centred, sc));
              for (int i = 0; i < S; ++i) dot[t][r][i] = _mm512_setzero_si512();
            }
          }
        }
      }
      if constexpr (Type == kIQ4XS) {
        for (int t = 0; t < T; ++t) {
          const __m512i sc = _mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(sb + P::scales(j, t0 + t))));
          for (int r = 0; r < R; ++r) {
            const int16_t sum = act.sums32[(m0 + r) * (groups / 2) + s * 8 + j];
            const __m512i both = S == 2 ? _mm512_add_epi32(dot[t][r][0], dot[t][r][S - 1]) : dot[t][r][0];
            const __m512i centred = _mm512_sub_epi32(both, _mm512_set1_epi32(128 * sum));
            isum[t][r] = _mm512_add_epi32(isum[t][r], _mm512_mullo_epi32(centred, sc));
          }
        }
      }
      if constexpr (has_mins(Type)) {
        for (int t = 0; t < T; ++t) {
          const __m512i sc = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(sb + P::scales(j, t0 + t))));
          const __m512i mn = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(sb + P::mins(j, t0 + t))));
          for (int r = 0; r < R; ++r) {
            const int16_t sum = act.sums32[(m0 + r) * (groups / 2) + s * 8 + j];
            const __m512i both = S == 2 ? _mm512_add_epi32(dot[t][r][0], dot[t][r][S - 1]) : dot[t][r][0];
            isum[t][r] = _mm512_add_epi32(isum[t][r], _mm512_mullo_epi32(both, sc));
            msum[t][r] = _mm512_add_epi32(msum[t][r], _mm512_mullo_epi32(mn, _mm512_set1_epi32(sum)));
          }
        }
      }
    }
    for (int t = 0; t < T; ++t) {
      const __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(sb + P::d(t0 + t))));
      const __m512 dmin = !has_mins(Type) ? _mm512_setzero_ps()
          : _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(sb + P::dmin(t0 + t))));
      for (int r = 0; r < R; ++r) {
        const __m512 scale = _mm512_set1_ps(act.scales[(m0 + r) * supers + s]);
        acc[t][r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(isum[t][r]), _mm512_mul_ps(d, scale), acc[t][r]);
        if constexpr (has_mins(Type))
          acc[t][r] = _mm512_fnmadd_ps(_mm512_cvtepi32_ps(msum[t][r]), _mm512_mul_ps(dmin, scale), acc[t][r]);
      }
    }
  }
  for (int t = 0; t < T; ++t)
    for (int r = 0; r < R; ++r) _mm512_storeu_ps(out[r] + t * kTile, acc[t][r]);
}

constexpr int tiles_at_once(int rows) { return rows == 1 ? 4 : rows == 2 ? 2 : 1; }

#else  // AVX2: a tile as two halves of 8 rows

template <int64_t Type>
inline __m256i high_bits_half(const uint8_t* bits, int half) {
  if constexpr (Type == kQ5K) {
    uint64_t eight;
    std::memcpy(&eight, bits, 8);
    const __m256i shifts = half ? _mm256_setr_epi64x(4, 5, 6, 7) : _mm256_setr_epi64x(0, 1, 2, 3);
    const __m256i b = _mm256_srlv_epi64(_mm256_set1_epi64x(int64_t(eight)), shifts);
    return _mm256_slli_epi16(_mm256_and_si256(b, _mm256_set1_epi8(1)), 4);
  } else {
    const __m256i shifts = half ? _mm256_setr_epi64x(4, 4, 6, 6) : _mm256_setr_epi64x(0, 0, 2, 2);
    const __m256i b = _mm256_srlv_epi64(
        _mm256_broadcastsi128_si256(_mm_loadu_si128(reinterpret_cast<const __m128i*>(bits))), shifts);
    return _mm256_slli_epi16(_mm256_and_si256(b, _mm256_set1_epi8(3)), 4);
  }
}

inline __m256i dot4(__m256i u8, __m256i s8) {
  return _mm256_madd_epi16(_mm256_maddubs_epi16(u8, s8), _mm256_set1_epi16(1));
}

template <int64_t Type, int R>
void half_tile_rows(const uint8_t* group, int t, int64_t supers, const Activations& act, int64_t m0,
                    int half, float* out[]) {
  using P = Place<Type>;
  const int64_t tsb = tile_super_bytes(Type), groups = act.k / 16;
  const __m256i low4 = _mm256_set1_epi8(0x0F);
  const __m256i table = _mm256_broadcastsi128_si256(_mm_loadu_si128(reinterpret_cast<const __m128i*>(kIQ4Values)));
  __m256 acc[R];
  for (int r = 0; r < R; ++r) acc[r] = _mm256_setzero_ps();
  for (int64_t s = 0; s < supers; ++s) {
    const uint8_t* sb = group + s * kGroup * tsb;
    __m256i isum[R], msum[R];
    for (int r = 0; r < R; ++r) isum[r] = msum[r] = _mm256_setzero_si256();
    const int8_t* a0 = act.row(m0) + s * kSuper;
    for (int j = 0; j < 8; ++j) {
      __m256i dot[R][2];
      for (int r = 0; r < R; ++r) dot[r][0] = dot[r][1] = _mm256_setzero_si256();
      for (int p = 0; p < 4; ++p) {
        const int g = Type == kQ6K ? p / 2 : 0;
        const __m256i packed = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(sb + P::codes(4 * j + p, t) + 32 * half));
        __m256i lo = _mm256_and_si256(packed, low4);
        __m256i hi = _mm256_and_si256(_mm256_srli_epi16(packed, 4), low4);
        if constexpr (Type == kQ5K || Type == kQ6K) {
          lo = _mm256_or_si256(lo, high_bits_half<Type>(sb + P::bits((4 * j + p) * 2, t), half));
          hi = _mm256_or_si256(hi, high_bits_half<Type>(sb + P::bits((4 * j + p) * 2 + 1, t), half));
        }
        if constexpr (Type == kIQ4XS) {
          // Signed values: |w| x (a with w's sign), whose pairs stay within int16 (the values
          // plus 128 would not, without VNNI).
          const __m256i w_lo = _mm256_shuffle_epi8(table, lo), w_hi = _mm256_shuffle_epi8(table, hi);
          lo = _mm256_abs_epi8(w_lo);
          hi = _mm256_abs_epi8(w_hi);
          for (int r = 0; r < R; ++r) {
            const int8_t* a = a0 + r * act.k + 32 * j + 8 * p;
            dot[r][0] = _mm256_add_epi32(dot[r][0], dot4(lo, _mm256_sign_epi8(_mm256_set1_epi32(four_codes(a)), w_lo)));
            dot[r][0] = _mm256_add_epi32(dot[r][0], dot4(hi, _mm256_sign_epi8(_mm256_set1_epi32(four_codes(a + 4)), w_hi)));
          }
          continue;
        }
        for (int r = 0; r < R; ++r) {
          const int8_t* a = a0 + r * act.k + 32 * j + 8 * p;
          dot[r][g] = _mm256_add_epi32(dot[r][g], dot4(lo, _mm256_set1_epi32(four_codes(a))));
          dot[r][g] = _mm256_add_epi32(dot[r][g], dot4(hi, _mm256_set1_epi32(four_codes(a + 4))));
        }
      }
      if constexpr (Type == kQ6K) {
        for (int g = 0; g < 2; ++g) {
          const __m256i sc = _mm256_cvtepi8_epi32(_mm_loadl_epi64(
              reinterpret_cast<const __m128i*>(sb + P::scales(2 * j + g, t) + 8 * half)));
          for (int r = 0; r < R; ++r) {
            const int16_t sum = act.sums16[(m0 + r) * groups + s * 16 + 2 * j + g];
            const __m256i centred = _mm256_sub_epi32(dot[r][g], _mm256_set1_epi32(32 * sum));
            isum[r] = _mm256_add_epi32(isum[r], _mm256_mullo_epi32(centred, sc));
          }
        }
      } else if constexpr (Type == kIQ4XS) {
        const __m256i sc = _mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(sb + P::scales(j, t) + 8 * half)));
        for (int r = 0; r < R; ++r) isum[r] = _mm256_add_epi32(isum[r], _mm256_mullo_epi32(dot[r][0], sc));
      } else {
        const __m256i sc = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(sb + P::scales(j, t) + 8 * half)));
        const __m256i mn = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(sb + P::mins(j, t) + 8 * half)));
        for (int r = 0; r < R; ++r) {
          const int16_t sum = act.sums32[(m0 + r) * (groups / 2) + s * 8 + j];
          isum[r] = _mm256_add_epi32(isum[r], _mm256_mullo_epi32(dot[r][0], sc));
          msum[r] = _mm256_add_epi32(msum[r], _mm256_mullo_epi32(mn, _mm256_set1_epi32(sum)));
        }
      }
    }
    const __m256 d = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(sb + P::d(t) + 16 * half)));
    const __m256 dmin = !has_mins(Type) ? _mm256_setzero_ps()
        : _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(sb + P::dmin(t) + 16 * half)));
    for (int r = 0; r < R; ++r) {
      const __m256 scale = _mm256_set1_ps(act.scales[(m0 + r) * supers + s]);
      acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(isum[r]), _mm256_mul_ps(d, scale), acc[r]);
      if constexpr (has_mins(Type))
        acc[r] = _mm256_fnmadd_ps(_mm256_cvtepi32_ps(msum[r]), _mm256_mul_ps(dmin, scale), acc[r]);
    }
  }
  for (int r = 0; r < R; ++r) _mm256_storeu_ps(out[r] + 8 * half, acc[r]);
}

template <int64_t Type, int R, int T>
void tile_rows(const uint8_t* group, int t0, int64_t supers, const Activations& act, int64_t m0,
               float* out[]) {
  static_assert(T == 1, "the AVX2 kernel does one tile at a time");
  half_tile_rows<Type, R>(group, t0, supers, act, m0, 0, out);
  half_tile_rows<Type, R>(group, t0, supers, act, m0, 1, out);
}

constexpr int tiles_at_once(int) { return 1; }

#endif

using TileFn = void (*)(const uint8_t*, int, int64_t, const Activations&, int64_t, float**);

template <int64_t Type, int R>
TileFn tile_fn(int tiles) {
  if constexpr (tiles_at_once(R) >= 4) {
    if (tiles >= 4) return &tile_rows<Type, R, 4>;
  }
  if constexpr (tiles_at_once(R) >= 2) {
    if (tiles >= 2) return &tile_rows<Type, R, 2>;
  }
  return &tile_rows<Type, R, 1>;
}

template <int64_t Type>
TileFn pick_rows(int rows, int tiles) {
  switch (rows) {
    case 1: return tile_fn<Type, 1>(tiles);
    case 2: return tile_fn<Type, 2>(tiles);
    case 3: return tile_fn<Type, 3>(tiles);
#if defined(QUILL_AVX512)
    case 4: return tile_fn<Type, 4>(tiles);
    case 5: return tile_fn<Type, 5>(tiles);
    case 6: return tile_fn<Type, 6>(tiles);
    case 7: return tile_fn<Type, 7>(tiles);
    default: return tile_fn<Type, 8>(tiles);
#else
    default: return tile_fn<Type, 4>(tiles);
#endif
  }
}

TileFn pick(int64_t type, int rows, int tiles) {
  switch (type) {
    case kQ4K: return pick_rows<kQ4K>(rows, tiles);
    case kQ5K: return pick_rows<kQ5K>(rows, tiles);
    case kIQ4XS: return pick_rows<kIQ4XS>(rows, tiles);
    default: return pick_rows<kQ6K>(rows, tiles);
  }
}

int group_of(int64_t type, int rows, int remaining) {
  (void)type;
  const int most = tiles_at_once(rows);
  return most >= 4 && remaining >= 4 ? 4 : most >= 2 && remaining >= 2 ? 2 : 1;
}

template <typename T>
void store_row(T* dst, const float* src, int64_t n, const float* bias) {
  for (int64_t i = 0; i < n; ++i) dst[i] = from_float<T>(src[i] + (bias ? bias[i] : 0.0f));
}

}  // namespace

at::Tensor kquant_pack(const at::Tensor& weight, int64_t type, const std::optional<at::Tensor>& row_order) {
  const char* op = "quill::kquant_pack";
  const int64_t bytes = block_bytes(type);
  TORCH_CHECK(tile_super_bytes(type) > 0, op, ": GGML type ", type, kTilesRead);
  TORCH_CHECK(weight.dim() == 2 && weight.scalar_type() == at::kByte && weight.stride(1) == 1, op,
              ": weight must be uint8 [rows, bytes per row] with contiguous rows");
  const int64_t n = weight.size(0), supers = weight.size(1) / bytes;
  TORCH_CHECK(supers * bytes == weight.size(1), op, ": a row of ", weight.size(1), " bytes is not whole super-blocks");
  const int64_t* order = nullptr;
  at::Tensor order_c;
  if (row_order.has_value() && row_order->defined()) {
    order_c = row_order->to(at::kLong).contiguous();
    TORCH_CHECK(order_c.numel() == n, op, ": row_order has ", order_c.numel(), " entries, not ", n);
    order = order_c.data_ptr<int64_t>();
  }
  const int64_t groups = (n + kGroup * kTile - 1) / (kGroup * kTile), tsb = tile_super_bytes(type);
  const int64_t tiles = groups * kGroup;
  at::Tensor out = at::empty({groups, supers * kGroup * tsb}, weight.options());
  const uint8_t* w = weight.data_ptr<uint8_t>();
  const int64_t stride = weight.stride(0);
  at::parallel_for(0, tiles, 1, [&](int64_t begin, int64_t end) {
    std::vector<RowBlock> blocks(kTile);
    std::vector<uint8_t> tile(tsb);
    for (int64_t t = begin; t < end; ++t)
      for (int64_t s = 0; s < supers; ++s) {
        const RowBlock* rows[kTile];
        for (int r = 0; r < kTile; ++r) {
          const int64_t row = t * kTile + r;
          rows[r] = nullptr;
          if (row >= n) continue;
          const int64_t from = order ? order[row] : row;
          TORCH_CHECK(from >= 0 && from < n, op, ": row_order names row ", from);
          read_row_block(w + from * stride + s * bytes, type, blocks[r]);
          rows[r] = &blocks[r];
        }
        write_tile_block(rows, type, tile.data());
        uint8_t* group = out.data_ptr<uint8_t>() + (t / kGroup) * out.stride(0);
        place_tile_block(type, tile.data(), int(t % kGroup), group + s * kGroup * tsb);
      }
  });
  return out;
}

at::Tensor kquant_tile_linear(const at::Tensor& x, const at::Tensor& tiles, int64_t type,
                              int64_t out_features, const std::optional<at::Tensor>& bias,
                              std::optional<at::ScalarType> out_dtype) {
  const char* op = "quill::kquant_tile_linear";
  const int64_t tsb = tile_super_bytes(type);
  TORCH_CHECK(tsb > 0, op, ": GGML type ", type, kTilesRead);
  TORCH_CHECK(x.dim() == 2 && x.stride(1) == 1, op, ": x must be [rows, in_features] with contiguous rows");
  TORCH_CHECK(tiles.dim() == 2 && tiles.scalar_type() == at::kByte && tiles.is_contiguous(), op,
              ": tiles must be contiguous uint8 [groups of 4 tiles, bytes] (quill::kquant_pack)");
  const int64_t rows = x.size(0), k = x.size(1), supers = k / kSuper, groups = tiles.size(0);
  TORCH_CHECK(k % kSuper == 0 && tiles.size(1) == supers * kGroup * tsb, op, ": x has ", k,
              " inputs; the tiles hold ", tiles.size(1) / (kGroup * tsb) * kSuper);
  const int64_t n_tiles = (out_features + kTile - 1) / kTile;
  TORCH_CHECK(out_features > 0 && (n_tiles + kGroup - 1) / kGroup == groups, op,
              ": ", groups, " groups of tiles do not hold ", out_features, " rows");
  const at::ScalarType dtype = output_dtype(x, out_dtype, op);
  const at::Tensor bias_f = float_bias(bias, out_features, op);
  const float* bias_p = bias_f.defined() ? bias_f.data_ptr<float>() : nullptr;
  at::Tensor out = at::empty({rows, out_features}, x.options().dtype(dtype));
  if (rows == 0) return out;
  Activations act;
  quantize_input(x, nullptr, act, op);
  const uint8_t* w = tiles.data_ptr<uint8_t>();
  const int64_t group_bytes = tiles.stride(0);
  at::parallel_for(0, groups, 1, [&](int64_t begin, int64_t end) {
    float buffer[kMaxRows][4 * kTile];
    float* outs[kMaxRows];
    for (int r = 0; r < kMaxRows; ++r) outs[r] = buffer[r];
    for (int64_t g = begin; g < end; ++g) {
      const int64_t t0 = g * kGroup, t1 = std::min(n_tiles, t0 + kGroup);
      for (int64_t m0 = 0; m0 < rows; m0 += kMaxRows) {
        const int r_count = int(std::min<int64_t>(kMaxRows, rows - m0));
        for (int64_t t = t0; t < t1;) {
          const int group = group_of(type, r_count, int(t1 - t));
          pick(type, r_count, group)(w + g * group_bytes, int(t - t0), supers, act, m0, outs);
          const int64_t first = t * kTile, count = std::min<int64_t>(group * kTile, out_features - first);
          const float* b = bias_p ? bias_p + first : nullptr;
          for (int r = 0; r < r_count; ++r) {
            const int64_t at = (m0 + r) * out_features + first;
            switch (dtype) {
              case at::kFloat: store_row(out.data_ptr<float>() + at, buffer[r], count, b); break;
              case at::kBFloat16: store_row(reinterpret_cast<bf16*>(out.data_ptr()) + at, buffer[r], count, b); break;
              default: store_row(reinterpret_cast<fp16*>(out.data_ptr()) + at, buffer[r], count, b);
            }
          }
          t += group;
        }
      }
    }
  });
  return out;
}

}  // namespace quill
