// K-quant (and IQ4_XS) tiles turned back into float weights [rows, K], in float32,
// bf16 or fp16: for the products of long prompt chunks on a machine whose float matrix product
// is faster than the integer tiles (AMX: bf16 at ~2.4 TFLOP/s against the tiles' ~0.8 TOP/s
// here), the weight is dequantized for the one product, a few MB of rows at a time (a buffer
// that stays in cache and is reused: a whole 8B projection would be new pages at each call). Whether that wins,
// and from how many rows, is measured at start-up (quill/model/stored.py).
//
// Single rows too (quill::kquant_tile_rows): the lookups of an embedding table kept in tiles
// for its tied head (the file's pages of it let go).
//
// The values are the reference's, exactly (quill/ops/kquant.py): (d x scale) x code, less
// dmin x min where there are mins, in float32, then rounded once to the output dtype.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/util/Exception.h>

#include <algorithm>
#include <cstring>
#include <type_traits>

#include "kquant.h"
#include "kquant_tiles.h"
#include "ops.h"
#include "vec.h"

namespace quill {
namespace {

using namespace kq;

// Row r of tile t's super-block s, read value by value into row (the row's K outputs).
template <int64_t Type, typename T>
void dequant_row(const uint8_t* sb, int t, int r, T* row, int64_t s) {
  using P = Place<Type>;
  {
    fp16 dh, mh;
    std::memcpy(&dh, sb + P::d(t) + 2 * r, 2);
    const float d = float(dh);
    float dmin = 0.0f;
    if constexpr (has_mins(Type)) {
      std::memcpy(&mh, sb + P::dmin(t) + 2 * r, 2);
      dmin = float(mh);
    }
    row += s * kSuper;
    for (int j = 0; j < 8; ++j)
      for (int p = 0; p < 4; ++p)
        for (int i = 0; i < 4; ++i) {
          const int lane = 4 * r + i;
          const uint8_t byte = sb[P::codes(4 * j + p, t) + lane];
          for (int h = 0; h < 2; ++h) {
            int q = h ? byte >> 4 : byte & 0x0F;
            const int vec = (4 * j + p) * 2 + h;
            if constexpr (Type == kQ5K) q |= ((sb[P::bits(vec, t) + lane % 8] >> (lane / 8)) & 1) << 4;
            if constexpr (Type == kQ6K) q |= ((sb[P::bits(vec, t) + lane % 16] >> (2 * (lane / 16))) & 3) << 4;
            const int at = 32 * j + 8 * p + 4 * h + i;
            float w;
            if constexpr (has_mins(Type)) {
              const float scale = d * float(sb[P::scales(j, t) + r]);
              w = scale * float(q) - dmin * float(sb[P::mins(j, t) + r]);
            } else if constexpr (Type == kQ6K) {
              w = d * float(int8_t(sb[P::scales(2 * j + p / 2, t) + r])) * float(q - 32);
            } else {
              w = d * float(int8_t(sb[P::scales(j, t) + r])) * float(kIQ4Values[q]);
            }
            row[at] = from_float<T>(w);
          }
        }
  }
}

// One tile's super-block (16 rows from out, `valid` of them real) read value by value.
template <int64_t Type, typename T>
void dequant_scalar(const uint8_t* sb, int t, int valid, T* out, int64_t k, int64_t s) {
  for (int r = 0; r < valid; ++r) dequant_row<Type, T>(sb, t, r, out + r * k, s);
}

#if defined(QUILL_AVX512)

// Stores 16 floats as rows a (lanes 0-7) and b (lanes 8-15), 8 values each.
template <typename T>
inline void store_pair(__m512 w, T* a, T* b) {
  if constexpr (std::is_same_v<T, float>) {
    _mm256_storeu_ps(a, _mm512_castps512_ps256(w));
    _mm256_storeu_ps(b, _mm512_extractf32x8_ps(w, 1));
  } else {
    __m256i v;
    if constexpr (std::is_same_v<T, bf16>) v = (__m256i)_mm512_cvtneps_pbh(w);
    else v = _mm512_cvtps_ph(w, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    _mm_storeu_si128(reinterpret_cast<__m128i*>(a), _mm256_castsi256_si128(v));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(b), _mm256_extracti128_si256(v, 1));
  }
}

// The same, 64 bytes of codes at a time: a vector holds 8 inputs of each of the 16 rows (4 in
// the low nibbles, the next 4 in the high); interleaving the nibbles' 32-bit lanes puts each
// row's 8 in order, two rows a 128-bit lane, widened and scaled by the rows' own factors.
template <int64_t Type, typename T>
void dequant_512(const uint8_t* sb, int t, int valid, T* out, int64_t k, int64_t s) {
  using P = Place<Type>;
  const __m512i low4 = _mm512_set1_epi8(0x0F);
  const __m512i table = _mm512_broadcast_i32x4(_mm_loadu_si128(reinterpret_cast<const __m128i*>(kIQ4Values)));
  const __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(sb + P::d(t))));
  __m512 dmin = _mm512_setzero_ps();
  if constexpr (has_mins(Type))
    dmin = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(sb + P::dmin(t))));
  // Lane pairs of rows (2m, 2m + 1): each row's factor on 8 lanes.
  __m512i pair[8];
  for (int m = 0; m < 8; ++m)
    pair[m] = _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_set1_epi32(2 * m)), _mm256_set1_epi32(2 * m + 1), 1);
  auto factors = [&](int unit) {
    const __m128i bytes = _mm_loadu_si128(reinterpret_cast<const __m128i*>(sb + P::scales(unit, t)));
    const __m512i sc = has_mins(Type) ? _mm512_cvtepu8_epi32(bytes) : _mm512_cvtepi8_epi32(bytes);
    return _mm512_mul_ps(d, _mm512_cvtepi32_ps(sc));
  };
  for (int j = 0; j < 8; ++j) {
    __m512 scale = factors(j), mins = _mm512_setzero_ps();
    if constexpr (has_mins(Type))
      mins = _mm512_mul_ps(dmin, _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(
          _mm_loadu_si128(reinterpret_cast<const __m128i*>(sb + P::mins(j, t))))));
    for (int p = 0; p < 4; ++p) {
      if constexpr (Type == kQ6K) {
        if (p % 2 == 0) scale = factors(2 * j + p / 2);
      }
      const __m512i packed = _mm512_loadu_si512(sb + P::codes(4 * j + p, t));
      __m512i lo = _mm512_and_si512(packed, low4), hi = _mm512_and_si512(_mm512_srli_epi16(packed, 4), low4);
      if constexpr (Type == kQ5K || Type == kQ6K) {
        for (int h = 0; h < 2; ++h) {
          const uint8_t* bits = sb + P::bits((4 * j + p) * 2 + h, t);
          __m512i top;
          if constexpr (Type == kQ5K) {
            uint64_t eight;
            std::memcpy(&eight, bits, 8);
            const __m512i b = _mm512_srlv_epi64(_mm512_set1_epi64(int64_t(eight)), _mm512_setr_epi64(0, 1, 2, 3, 4, 5, 6, 7));
            top = _mm512_slli_epi16(_mm512_and_si512(b, _mm512_set1_epi8(1)), 4);
          } else {
            const __m512i b = _mm512_srlv_epi64(_mm512_broadcast_i32x4(_mm_loadu_si128(reinterpret_cast<const __m128i*>(bits))),
                                                _mm512_setr_epi64(0, 0, 2, 2, 4, 4, 6, 6));
            top = _mm512_slli_epi16(_mm512_and_si512(b, _mm512_set1_epi8(3)), 4);
          }
          (h ? hi : lo) = _mm512_or_si512(h ? hi : lo, top);
        }
      }
      if constexpr (Type == kQ6K) {  // q - 32, signed
        lo = _mm512_sub_epi8(lo, _mm512_set1_epi8(32));
        hi = _mm512_sub_epi8(hi, _mm512_set1_epi8(32));
      }
      if constexpr (Type == kIQ4XS) {
        lo = _mm512_shuffle_epi8(table, lo);
        hi = _mm512_shuffle_epi8(table, hi);
      }
      alignas(64) uint8_t rows[2][64];  // [u][lane]: rows 4 lane + 2u, + 1, 8 codes each
      _mm512_store_si512(rows[0], _mm512_unpacklo_epi32(lo, hi));
      _mm512_store_si512(rows[1], _mm512_unpackhi_epi32(lo, hi));
      for (int lane = 0; lane < 4; ++lane)
        for (int u = 0; u < 2; ++u) {
          const int ra = 4 * lane + 2 * u;  // rows ra, ra + 1
          if (ra >= valid) continue;
          const __m128i these = _mm_load_si128(reinterpret_cast<const __m128i*>(rows[u] + 16 * lane));
          const __m512i q = Type == kQ4K || Type == kQ5K ? _mm512_cvtepu8_epi32(these) : _mm512_cvtepi8_epi32(these);
          __m512 w = _mm512_mul_ps(_mm512_cvtepi32_ps(q), _mm512_permutexvar_ps(pair[ra / 2], scale));
          if constexpr (has_mins(Type)) w = _mm512_sub_ps(w, _mm512_permutexvar_ps(pair[ra / 2], mins));
          T* a = out + ra * k + s * kSuper + 32 * j + 8 * p;
          if (ra + 1 < valid) {
            store_pair(w, a, a + k);
          } else {  // the last real row alone
            alignas(64) T spare[16];
            store_pair(w, spare, spare + 8);
            std::memcpy(a, spare, 8 * sizeof(T));
          }
        }
    }
  }
}

#endif

// Rows [first, end) (first a whole tile) into out [end - first, K].
template <int64_t Type, typename T>
void dequant_all(const uint8_t* tiles, int64_t group_bytes, int64_t first, int64_t end, int64_t supers, T* out) {
  const int64_t tsb = tile_super_bytes(Type);
  at::parallel_for(first / kTile, (end + kTile - 1) / kTile, 1, [&](int64_t begin, int64_t stop) {
    for (int64_t tile = begin; tile < stop; ++tile) {
      const uint8_t* group = tiles + (tile / kGroup) * group_bytes;
      const int t = int(tile % kGroup), valid = int(std::min<int64_t>(kTile, end - tile * kTile));
      T* rows = out + (tile * kTile - first) * supers * kSuper;
      for (int64_t s = 0; s < supers; ++s) {
        const uint8_t* sb = group + s * kGroup * tsb;
#if defined(QUILL_AVX512)
        dequant_512<Type, T>(sb, t, valid, rows, supers * kSuper, s);
#else
        dequant_scalar<Type, T>(sb, t, valid, rows, supers * kSuper, s);
#endif
      }
    }
  });
}

// fn(std::integral_constant<int64_t, type>): the tiled types, as a compile-time constant.
template <typename Fn>
void with_type(int64_t type, Fn&& fn) {
  switch (type) {
    case kQ4K: return fn(std::integral_constant<int64_t, kQ4K>{});
    case kQ5K: return fn(std::integral_constant<int64_t, kQ5K>{});
    case kQ6K: return fn(std::integral_constant<int64_t, kQ6K>{});
    default: return fn(std::integral_constant<int64_t, kIQ4XS>{});
  }
}

// The rows `ids` (of `n`) into out [count, K]: an embedding lookup of a table kept in tiles.
template <int64_t Type, typename T>
void rows_of(const uint8_t* tiles, int64_t group_bytes, const int64_t* ids, int64_t count, int64_t supers, T* out) {
  const int64_t tsb = tile_super_bytes(Type);
  at::parallel_for(0, count, 16, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      const int64_t tile = ids[i] / kTile;
      const uint8_t* group = tiles + (tile / kGroup) * group_bytes;
      for (int64_t s = 0; s < supers; ++s)
        dequant_row<Type, T>(group + s * kGroup * tsb, int(tile % kGroup), int(ids[i] % kTile),
                             out + i * supers * kSuper, s);
    }
  });
}

// fn(out's data as float*, bf16* or fp16*): the output dtypes both ops write.
template <typename Fn>
void with_output(const at::Tensor& out, const char* op, Fn&& fn) {
  switch (out.scalar_type()) {
    case at::kFloat: return fn(out.data_ptr<float>());
    case at::kBFloat16: return fn(reinterpret_cast<bf16*>(out.data_ptr()));
    case at::kHalf: return fn(reinterpret_cast<fp16*>(out.data_ptr()));
    default: TORCH_CHECK(false, op, ": dtype ", out.scalar_type(), " is not float32, bfloat16 or float16");
  }
}

// The checks both ops make of their tiles; returns the super-blocks a row holds.
int64_t checked_supers(const at::Tensor& tiles, int64_t type, int64_t out_features, const char* op) {
  const int64_t tsb = tile_super_bytes(type);
  TORCH_CHECK(tsb > 0, op, ": GGML type ", type, kTilesRead);
  TORCH_CHECK(tiles.dim() == 2 && tiles.scalar_type() == at::kByte && tiles.is_contiguous(), op,
              ": tiles must be contiguous uint8 [groups of 4 tiles, bytes] (quill::kquant_pack)");
  const int64_t supers = tiles.size(1) / (kGroup * tsb), groups = tiles.size(0);
  const int64_t n_tiles = (out_features + kTile - 1) / kTile;
  TORCH_CHECK(supers * kGroup * tsb == tiles.size(1), op, ": a group of ", tiles.size(1), " bytes is not whole super-blocks");
  TORCH_CHECK(out_features > 0 && (n_tiles + kGroup - 1) / kGroup == groups, op,
              ": ", groups, " groups of tiles do not hold ", out_features, " rows");
  return supers;
}

}  // namespace

at::Tensor kquant_tile_rows(const at::Tensor& tiles, int64_t type, int64_t out_features, const at::Tensor& ids,
                            at::ScalarType dtype) {
  const char* op = "quill::kquant_tile_rows";
  const int64_t supers = checked_supers(tiles, type, out_features, op);
  at::Tensor idx = ids.to(at::kLong).contiguous();
  const int64_t count = idx.numel();
  const int64_t* id = idx.data_ptr<int64_t>();
  for (int64_t i = 0; i < count; ++i)
    TORCH_CHECK(id[i] >= 0 && id[i] < out_features, op, ": id ", id[i], " is outside [0, ", out_features, ")");
  at::Tensor out = at::empty({count, supers * kSuper}, tiles.options().dtype(dtype));
  const uint8_t* w = tiles.data_ptr<uint8_t>();
  const int64_t g = tiles.stride(0);
  with_type(type, [&](auto t) {
    with_output(out, op, [&](auto* o) { rows_of<decltype(t)::value>(w, g, id, count, supers, o); });
  });
  return out;
}

at::Tensor kquant_tile_dequant(const at::Tensor& tiles, int64_t type, int64_t out_features, at::ScalarType dtype,
                               int64_t first, int64_t count) {
  const char* op = "quill::kquant_tile_dequant";
  const int64_t supers = checked_supers(tiles, type, out_features, op);
  if (count < 0) count = out_features - first;
  TORCH_CHECK(first >= 0 && first % kTile == 0 && first + count <= out_features, op, ": rows ", first, " to ",
              first + count, " are not whole tiles' rows of ", out_features);
  at::Tensor out = at::empty({count, supers * kSuper}, tiles.options().dtype(dtype));
  if (count == 0) return out;
  const uint8_t* w = tiles.data_ptr<uint8_t>();
  const int64_t end = first + count, g = tiles.stride(0);
  with_type(type, [&](auto t) {
    with_output(out, op, [&](auto* o) { dequant_all<decltype(t)::value>(w, g, first, end, supers, o); });
  });
  return out;
}

}  // namespace quill
