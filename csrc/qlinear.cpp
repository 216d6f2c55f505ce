// Products with quantized weights in blocks of 32 for steps of a few token rows: int8 (GGUF's
// Q8_0), 4-bit (GGUF's Q4_0 and Q4_1) and 5-bit codes with an offset (GGUF's Q5_1).
//
// A decode step reads every weight once for a handful of rows, so its time is the weights'
// bytes: the kernels stream them once per pass and keep up to kMaxRows token rows in
// registers, so one load of the weights feeds every row. The activations are quantized to int8
// once per call (per row and block of 32: scale = max |x| / 127, rounded to nearest even), and
// each block's product is an integer dot product, scaled by the weight's and the activation's
// scales into an fp32 sum.
//
// Weight layout (quill/ops/qlinear.py packs it): output rows in tiles of 16, and in a tile the
// 16 rows' 4 consecutive codes side by side, so one 64-byte load holds 4 inputs of 16 outputs,
// one 32-bit lane per output row.
// - Q8: codes int8 [N/16, K/4, 16, 4]; per (tile, block of 32 inputs) 16 fp16 scales and 16
//   int16 sums of the codes, [N/16, K/32, 16]. w = code * scale.
// - Q4: codes 0..15, two to a byte, [N/16, K/32, 4, 16, 4]: byte i of row r in step p holds
//   inputs 8p + i (low nibble) and 8p + 4 + i (high nibble) of the block; per (tile, block) 16
//   fp16 scales d and 16 fp16 offsets c: w = d * code + c (Q4_1: c = min; Q4_0: c = -8 d).
//   A block's product is d * sum(code * a) + c * sum(a).
// - Q5: codes 0..31 one a byte, laid out as Q8's, with Q4's fp16 d and c: w = d * code + c
//   (Q5_1: c = min), a block's product as Q4's.
//
// AVX-512 VNNI (vpdpbusd: u8 x s8, four products into each int32 lane): Q8 takes the activation
// in as u8 = q + 128 and takes 128 x the block's code sum off afterwards (exact in int32), or,
// for a single row, |q| against w with q's sign (no sums read; codes are in -127..127, which
// quill/ops/qlinear.py's pack keeps); Q4's and Q5's codes are the u8 operand as they are. AVX2
// (vpmaddubsw: u8 x s8 into saturating int16 pairs): Q8 multiplies |w| by q with w's sign, whose
// pair sums stay within 2 x 127 x 127 (no saturation); Q4 and Q5 multiply the codes (at most
// 2 x 31 x 127); then vpmaddwd into int32. The
// integer part is exact everywhere, so the libraries agree up to the order of the fp32 sums.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/util/Exception.h>

#include <algorithm>
#include <cmath>
#include <vector>

#include "ops.h"
#include "vec.h"

namespace quill {
namespace {

constexpr int kTile = 16;   // output rows per tile
constexpr int kBlock = 32;  // inputs per scale
#if defined(QUILL_AVX512)
constexpr int kMaxRows = 8;
#else
constexpr int kMaxRows = 4;
#endif

// The two weight formats: the bytes of one tile's block, and whether the AVX-512 kernel wants
// the activations offset to u8 (Q8: the activation is vpdpbusd's unsigned operand).
struct Q8 {
  static constexpr int64_t kBlockBytes = kBlock * kTile;
  static constexpr bool kOffsetActivations = true;
};
struct Q4 {
  static constexpr int64_t kBlockBytes = kBlock * kTile / 2;
  static constexpr bool kOffsetActivations = false;
};
struct Q5 {
  static constexpr int64_t kBlockBytes = kBlock * kTile;
  static constexpr bool kOffsetActivations = false;
};

// The activation rows, quantized: codes (offset by 128 where the format wants it), scales and
// per-block sums of the (signed) codes.
struct QuantizedRows {
  std::vector<int8_t> codes;   // [rows, K]
  std::vector<float> scales;   // [rows, K / 32]
  std::vector<float> sums;     // [rows, K / 32], as floats: Q4's c * scale * sum term
};

template <typename T>
void quantize_rows(const T* x, int64_t rows, int64_t k, int64_t stride, bool offset,
                   QuantizedRows& out) {
  const int64_t blocks = k / kBlock;
  out.codes.resize(rows * k);
  out.scales.resize(rows * blocks);
  out.sums.resize(rows * blocks);
  for (int64_t m = 0; m < rows; ++m) {
    const T* row = x + m * stride;
    for (int64_t b = 0; b < blocks; ++b) {
      const T* src = row + b * kBlock;
      const float scale = int8_scale(src, kBlock);
      const float inverse = scale > 0.0f ? 1.0f / scale : 0.0f;
      out.scales[m * blocks + b] = scale;
      int8_t* dst = out.codes.data() + m * k + b * kBlock;
      int sum = 0;
      for (int i = 0; i < kBlock; ++i) {
        // nearbyint: round half to even, as torch.round in the reference.
        int q = int(std::nearbyint(to_float(src[i]) * inverse));
        sum += q;
        dst[i] = offset ? int8_t(q ^ 0x80) : int8_t(q);  // q ^ 0x80 read as u8: q + 128
      }
      out.sums[m * blocks + b] = float(sum);
    }
  }
}

inline int32_t four_codes(const QuantizedRows& act, int64_t at) {
  int32_t four;
  std::memcpy(&four, act.codes.data() + at, 4);
  return four;
}

#if defined(QUILL_AVX512)

// Tiles done side by side: one row alone is a chain of dependent vpdpbusd per tile, so a few
// rows take several tiles at once, for independent chains and several weight streams.
constexpr int tiles_at_once(int rows) { return rows == 1 ? 8 : rows == 2 ? 4 : rows <= 4 ? 2 : 1; }

// One block's integer dot products of T tiles (`block` is the first tile's) with R rows.
template <typename F, int R, int T>
inline void block_dots(const uint8_t* block, int64_t tile_bytes, const QuantizedRows& act,
                       int64_t a0, int64_t k, __m512i (&dots)[T][R]) {
  for (int j = 0; j < T; ++j)
    for (int r = 0; r < R; ++r) dots[j][r] = _mm512_setzero_si512();
  if constexpr (std::is_same_v<F, Q8> && R == 1) {
    // One row: vpdpbusd of |a| with w carrying a's sign (a's 4 codes are the same in every
    // lane, so the sign is one byte mask for all 16 rows), which needs no code sums: a
    // batch-1 step reads 34 bytes per 32 weights, as Q8_0 stores them, not 36.
    const __m512i zero = _mm512_setzero_si512();
    for (int g = 0; g < kBlock / 4; ++g) {
      const __m512i a = _mm512_set1_epi32(four_codes(act, a0 + g * 4) ^ int32_t(0x80808080));
      const __mmask64 negative = _mm512_movepi8_mask(a);
      const __m512i magnitude = _mm512_abs_epi8(a);
      for (int j = 0; j < T; ++j) {
        __m512i w = _mm512_loadu_si512(block + j * tile_bytes + g * 64);
        w = _mm512_mask_sub_epi8(w, negative, zero, w);
        dots[j][0] = _mm512_dpbusd_epi32(dots[j][0], magnitude, w);
      }
    }
  } else if constexpr (std::is_same_v<F, Q8> || std::is_same_v<F, Q5>) {
    // One code a byte: Q8's activations are the unsigned operand (offset by 128), Q5's codes.
    for (int g = 0; g < kBlock / 4; ++g) {
      __m512i a[R];
      for (int r = 0; r < R; ++r) a[r] = _mm512_set1_epi32(four_codes(act, a0 + r * k + g * 4));
      for (int j = 0; j < T; ++j) {
        __m512i w = _mm512_loadu_si512(block + j * tile_bytes + g * 64);
        for (int r = 0; r < R; ++r) {
          if constexpr (std::is_same_v<F, Q8>) {
            dots[j][r] = _mm512_dpbusd_epi32(dots[j][r], a[r], w);
          } else {
            dots[j][r] = _mm512_dpbusd_epi32(dots[j][r], w, a[r]);
          }
        }
      }
    }
  } else {
    const __m512i low4 = _mm512_set1_epi8(0x0F);
    for (int p = 0; p < kBlock / 8; ++p) {
      __m512i lo_a[R], hi_a[R];
      for (int r = 0; r < R; ++r) {
        lo_a[r] = _mm512_set1_epi32(four_codes(act, a0 + r * k + p * 8));
        hi_a[r] = _mm512_set1_epi32(four_codes(act, a0 + r * k + p * 8 + 4));
      }
      for (int j = 0; j < T; ++j) {
        __m512i packed = _mm512_loadu_si512(block + j * tile_bytes + p * 64);
        __m512i lo = _mm512_and_si512(packed, low4);
        __m512i hi = _mm512_and_si512(_mm512_srli_epi16(packed, 4), low4);
        for (int r = 0; r < R; ++r) {
          dots[j][r] = _mm512_dpbusd_epi32(dots[j][r], lo, lo_a[r]);
          dots[j][r] = _mm512_dpbusd_epi32(dots[j][r], hi, hi_a[r]);
        }
      }
    }
  }
}

// R token rows times T consecutive tiles (16 x T output rows). No software prefetch: the
// weights are T sequential streams (one per tile), which the hardware prefetcher follows;
// prefetching each line 2-12 KB ahead measured 10-20% slower here (Zen 4), and so did one
// stream with the T tiles' blocks interleaved (the prefetcher runs fewer lines ahead of one
// stream than of four).
template <typename F, int R, int T>
void tile_rows(const uint8_t* codes, const fp16* scales, const void* extra, int64_t k,
               const QuantizedRows& act, int64_t row0, float* out[]) {
  const int64_t blocks = k / kBlock, tile_bytes = blocks * F::kBlockBytes;
  __m512 sum[T][R];
  for (int j = 0; j < T; ++j)
    for (int r = 0; r < R; ++r) sum[j][r] = _mm512_setzero_ps();
  for (int64_t b = 0; b < blocks; ++b) {
    __m512i dots[T][R];
    block_dots<F, R, T>(codes + b * F::kBlockBytes, tile_bytes, act, row0 * k + b * kBlock, k, dots);
    for (int j = 0; j < T; ++j) {
      const int64_t meta = j * blocks * kTile + b * kTile;
      __m512 wscale = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(scales + meta)));
      if constexpr (std::is_same_v<F, Q8> && R == 1) {
        __m512 d = _mm512_mul_ps(wscale, _mm512_set1_ps(act.scales[row0 * blocks + b]));
        sum[j][0] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dots[j][0]), d, sum[j][0]);
      } else if constexpr (std::is_same_v<F, Q8>) {
        const int16_t* sums = static_cast<const int16_t*>(extra) + meta;
        __m512i offset = _mm512_slli_epi32(
            _mm512_cvtepi16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(sums))), 7);
        for (int r = 0; r < R; ++r) {
          __m512 d = _mm512_mul_ps(wscale, _mm512_set1_ps(act.scales[(row0 + r) * blocks + b]));
          sum[j][r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_sub_epi32(dots[j][r], offset)), d, sum[j][r]);
        }
      } else {
        const fp16* offsets = static_cast<const fp16*>(extra) + meta;
        __m512 c = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(offsets)));
        for (int r = 0; r < R; ++r) {
          const float a_scale = act.scales[(row0 + r) * blocks + b];
          __m512 d = _mm512_mul_ps(wscale, _mm512_set1_ps(a_scale));
          sum[j][r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dots[j][r]), d, sum[j][r]);
          const float a_sum = a_scale * act.sums[(row0 + r) * blocks + b];
          sum[j][r] = _mm512_fmadd_ps(c, _mm512_set1_ps(a_sum), sum[j][r]);
        }
      }
    }
  }
  for (int j = 0; j < T; ++j)
    for (int r = 0; r < R; ++r) _mm512_storeu_ps(out[r] + j * kTile, sum[j][r]);
}

#else  // AVX2

// AVX2 holds 8 lanes: a tile is done as two halves of 8 rows (each 64-byte group's first and
// second 32 bytes).
template <typename F, int R>
void half_tile_rows(const uint8_t* codes, const fp16* scales, const fp16* offsets, int64_t k,
                    const QuantizedRows& act, int64_t row0, float* out[]) {
  const int64_t blocks = k / kBlock;
  const __m256i ones = _mm256_set1_epi16(1);
  __m256 sum[R];
  for (int r = 0; r < R; ++r) sum[r] = _mm256_setzero_ps();
  for (int64_t b = 0; b < blocks; ++b) {
    __m256i dots[R];
    for (int r = 0; r < R; ++r) dots[r] = _mm256_setzero_si256();
    const uint8_t* w = codes + b * F::kBlockBytes;
    const int64_t a0 = row0 * k + b * kBlock;
    if constexpr (std::is_same_v<F, Q8>) {
      for (int g = 0; g < kBlock / 4; ++g) {
        __m256i wv = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + g * 64));
        __m256i magnitude = _mm256_sign_epi8(wv, wv);
        for (int r = 0; r < R; ++r) {
          __m256i a = _mm256_sign_epi8(_mm256_set1_epi32(four_codes(act, a0 + r * k + g * 4)), wv);
          dots[r] = _mm256_add_epi32(dots[r], _mm256_madd_epi16(_mm256_maddubs_epi16(magnitude, a), ones));
        }
      }
    } else if constexpr (std::is_same_v<F, Q5>) {
      for (int g = 0; g < kBlock / 4; ++g) {
        __m256i wv = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + g * 64));
        for (int r = 0; r < R; ++r) {
          __m256i a = _mm256_set1_epi32(four_codes(act, a0 + r * k + g * 4));
          dots[r] = _mm256_add_epi32(dots[r], _mm256_madd_epi16(_mm256_maddubs_epi16(wv, a), ones));
        }
      }
    } else {
      const __m256i low4 = _mm256_set1_epi8(0x0F);
      for (int p = 0; p < kBlock / 8; ++p) {
        __m256i packed = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + p * 64));
        __m256i lo = _mm256_and_si256(packed, low4);
        __m256i hi = _mm256_and_si256(_mm256_srli_epi16(packed, 4), low4);
        for (int r = 0; r < R; ++r) {
          __m256i lo_a = _mm256_set1_epi32(four_codes(act, a0 + r * k + p * 8));
          __m256i hi_a = _mm256_set1_epi32(four_codes(act, a0 + r * k + p * 8 + 4));
          __m256i pairs = _mm256_add_epi16(_mm256_maddubs_epi16(lo, lo_a), _mm256_maddubs_epi16(hi, hi_a));
          dots[r] = _mm256_add_epi32(dots[r], _mm256_madd_epi16(pairs, ones));
        }
      }
    }
    const int64_t meta = b * kTile;
    __m256 wscale = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(scales + meta)));
    for (int r = 0; r < R; ++r) {
      const float a_scale = act.scales[(row0 + r) * blocks + b];
      __m256 d = _mm256_mul_ps(wscale, _mm256_set1_ps(a_scale));
      sum[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dots[r]), d, sum[r]);
      if constexpr (!std::is_same_v<F, Q8>) {
        __m256 c = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(offsets + meta)));
        const float a_sum = a_scale * act.sums[(row0 + r) * blocks + b];
        sum[r] = _mm256_fmadd_ps(c, _mm256_set1_ps(a_sum), sum[r]);
      }
    }
  }
  for (int r = 0; r < R; ++r) _mm256_storeu_ps(out[r], sum[r]);
}

constexpr int tiles_at_once(int) { return 1; }

template <typename F, int R, int T>
void tile_rows(const uint8_t* codes, const fp16* scales, const void* extra, int64_t k,
               const QuantizedRows& act, int64_t row0, float* out[]) {
  static_assert(T == 1, "the AVX2 kernel does one tile at a time");
  const fp16* offsets = std::is_same_v<F, Q8> ? nullptr : static_cast<const fp16*>(extra);
  float* upper[R];
  for (int r = 0; r < R; ++r) upper[r] = out[r] + 8;
  half_tile_rows<F, R>(codes, scales, offsets, k, act, row0, out);
  half_tile_rows<F, R>(codes + 32, scales + 8, offsets ? offsets + 8 : nullptr, k, act, row0, upper);
}

#endif

using TileFn = void (*)(const uint8_t*, const fp16*, const void*, int64_t, const QuantizedRows&,
                        int64_t, float**);

// For R rows, the kernels taking 1, 2, 4 and 8 tiles at once, up to tiles_at_once(R) (null
// above it): a thread's tiles go in the largest groups that fit, so its last few are not
// done one by one (a single tile is a latency-bound chain, ~4x slower per tile).
struct TileFns {
  TileFn by_log2[4];
  int max_tiles;

  // The widest kernel for `remaining` tiles; sets `tiles` to how many it takes.
  TileFn pick(int64_t remaining, int& tiles) const {
    int i = 3;
    while (i > 0 && ((1 << i) > max_tiles || (1 << i) > remaining)) --i;
    tiles = 1 << i;
    return by_log2[i];
  }
};

template <typename F, int R, int T>
constexpr TileFn kernel_if_fits() {
  if constexpr (T <= tiles_at_once(R)) {
    return &tile_rows<F, R, T>;
  } else {
    return nullptr;
  }
}

template <typename F, int R>
constexpr TileFns tile_fns() {
  return {{kernel_if_fits<F, R, 1>(), kernel_if_fits<F, R, 2>(), kernel_if_fits<F, R, 4>(),
           kernel_if_fits<F, R, 8>()},
          tiles_at_once(R)};
}

template <typename F>
const TileFns& tile_for(int rows) {
  static const TileFns table[] = {
      tile_fns<F, 1>(), tile_fns<F, 2>(), tile_fns<F, 3>(), tile_fns<F, 4>(),
#if defined(QUILL_AVX512)
      tile_fns<F, 5>(), tile_fns<F, 6>(), tile_fns<F, 7>(), tile_fns<F, 8>(),
#endif
  };
  return table[rows - 1];
}

template <typename T>
void store_rows(const float* src, T* dst, int64_t n, const float* bias) {
  for (int64_t i = 0; i < n; ++i) dst[i] = from_float<T>(src[i] + (bias ? bias[i] : 0.0f));
}

// Quantizes x, then runs the tiles over the threads (contiguous ranges of tiles per thread; a
// thread's results go through a small fp32 buffer, so every output dtype is one store loop).
template <typename F>
at::Tensor quantized_linear(const char* op, const at::Tensor& x, const uint8_t* codes,
                            const fp16* scales, const void* extra, int64_t tiles,
                            const std::optional<at::Tensor>& bias,
                            std::optional<at::ScalarType> out_dtype) {
  const int64_t rows = x.size(0), k = x.size(1), n = tiles * kTile, blocks = k / kBlock;
  TORCH_CHECK(x.stride(1) == 1, op, ": x's rows must be contiguous");
  const at::ScalarType dtype = output_dtype(x, out_dtype, op);
  const at::Tensor bias_f = float_bias(bias, n, op);
  const float* bias_p = bias_f.defined() ? bias_f.data_ptr<float>() : nullptr;
  at::Tensor out = at::empty({rows, n}, x.options().dtype(dtype));
  if (rows == 0) return out;

#if defined(QUILL_AVX512)
  const bool offset = F::kOffsetActivations;
#else
  const bool offset = false;
#endif
  QuantizedRows act;
  switch (x.scalar_type()) {
    case at::kFloat: quantize_rows(x.data_ptr<float>(), rows, k, x.stride(0), offset, act); break;
    case at::kBFloat16:
      quantize_rows(reinterpret_cast<const bf16*>(x.data_ptr()), rows, k, x.stride(0), offset, act);
      break;
    case at::kHalf:
      quantize_rows(reinterpret_cast<const fp16*>(x.data_ptr()), rows, k, x.stride(0), offset, act);
      break;
    default: TORCH_CHECK(false, op, ": x dtype ", x.scalar_type(), " is not supported");
  }
  const int64_t tile_bytes = blocks * F::kBlockBytes, tile_meta = blocks * kTile;
  const size_t extra_size = std::is_same_v<F, Q8> ? sizeof(int16_t) : sizeof(fp16);
  at::parallel_for(0, tiles, 1, [&](int64_t begin, int64_t end) {
    constexpr int kMaxTiles = 8;
    float buffer[kMaxRows][kMaxTiles * kTile];
    float* outs[kMaxRows];
    for (int r = 0; r < kMaxRows; ++r) outs[r] = buffer[r];
    for (int64_t row0 = 0; row0 < rows; row0 += kMaxRows) {
      const int r_count = int(std::min<int64_t>(kMaxRows, rows - row0));
      const TileFns& fns = tile_for<F>(r_count);
      for (int64_t t = begin; t < end;) {
        int group = 1;
        const TileFn fn = fns.pick(end - t, group);
        fn(codes + t * tile_bytes, scales + t * tile_meta,
           static_cast<const char*>(extra) + t * tile_meta * extra_size, k, act, row0, outs);
        const int64_t width = int64_t(group) * kTile;
        const float* b = bias_p ? bias_p + t * kTile : nullptr;
        for (int r = 0; r < r_count; ++r) {
          const int64_t o = (row0 + r) * n + t * kTile;
          switch (dtype) {
            case at::kFloat: store_rows(buffer[r], out.data_ptr<float>() + o, width, b); break;
            case at::kBFloat16:
              store_rows(buffer[r], reinterpret_cast<bf16*>(out.data_ptr()) + o, width, b);
              break;
            default: store_rows(buffer[r], reinterpret_cast<fp16*>(out.data_ptr()) + o, width, b);
          }
        }
        t += group;
      }
    }
  });
  return out;
}

void check_meta(const char* op, const at::Tensor& t, at::ScalarType dtype, int64_t n, int64_t k,
                const char* what) {
  TORCH_CHECK(t.scalar_type() == dtype && t.is_contiguous() && t.numel() == n * (k / kBlock), op,
              ": ", what, " must be contiguous ", dtype, " [N/16, K/32, 16]");
}

}  // namespace

at::Tensor q8_linear(const at::Tensor& x, const at::Tensor& codes, const at::Tensor& scales,
                     const at::Tensor& sums, const std::optional<at::Tensor>& bias,
                     std::optional<at::ScalarType> out_dtype) {
  const char* op = "quill::q8_linear";
  TORCH_CHECK(x.dim() == 2, op, ": x must be [rows, in_features], got ", x.sizes());
  TORCH_CHECK(codes.dim() == 4 && codes.size(2) == kTile && codes.size(3) == 4 &&
                  codes.scalar_type() == at::kChar && codes.is_contiguous(),
              op, ": codes must be contiguous int8 [N/16, K/4, 16, 4], got ", codes.sizes());
  const int64_t k = x.size(1), tiles = codes.size(0);
  TORCH_CHECK(codes.size(1) * 4 == k && k % kBlock == 0, op, ": x has ", k, " inputs, the weight ",
              codes.size(1) * 4, " (a multiple of 32 is needed)");
  check_meta(op, scales, at::kHalf, tiles * kTile, k, "scales");
  check_meta(op, sums, at::kShort, tiles * kTile, k, "sums");
  return quantized_linear<Q8>(op, x, reinterpret_cast<const uint8_t*>(codes.data_ptr()),
                              reinterpret_cast<const fp16*>(scales.data_ptr()), sums.data_ptr(),
                              tiles, bias, out_dtype);
}

at::Tensor q5_linear(const at::Tensor& x, const at::Tensor& codes, const at::Tensor& scales,
                     const at::Tensor& offsets, const std::optional<at::Tensor>& bias,
                     std::optional<at::ScalarType> out_dtype) {
  const char* op = "quill::q5_linear";
  TORCH_CHECK(x.dim() == 2, op, ": x must be [rows, in_features], got ", x.sizes());
  TORCH_CHECK(codes.dim() == 4 && codes.size(2) == kTile && codes.size(3) == 4 &&
                  codes.scalar_type() == at::kByte && codes.is_contiguous(),
              op, ": codes must be contiguous uint8 [N/16, K/4, 16, 4], got ", codes.sizes());
  const int64_t k = x.size(1), tiles = codes.size(0);
  TORCH_CHECK(codes.size(1) * 4 == k && k % kBlock == 0, op, ": x has ", k, " inputs, the weight ",
              codes.size(1) * 4, " (a multiple of 32 is needed)");
  check_meta(op, scales, at::kHalf, tiles * kTile, k, "scales");
  check_meta(op, offsets, at::kHalf, tiles * kTile, k, "offsets");
  return quantized_linear<Q5>(op, x, codes.data_ptr<uint8_t>(),
                              reinterpret_cast<const fp16*>(scales.data_ptr()), offsets.data_ptr(),
                              tiles, bias, out_dtype);
}

at::Tensor q4_linear(const at::Tensor& x, const at::Tensor& codes, const at::Tensor& scales,
                     const at::Tensor& offsets, const std::optional<at::Tensor>& bias,
                     std::optional<at::ScalarType> out_dtype) {
  const char* op = "quill::q4_linear";
  TORCH_CHECK(x.dim() == 2, op, ": x must be [rows, in_features], got ", x.sizes());
  TORCH_CHECK(codes.dim() == 5 && codes.size(2) == kBlock / 8 && codes.size(3) == kTile &&
                  codes.size(4) == 4 && codes.scalar_type() == at::kByte && codes.is_contiguous(),
              op, ": codes must be contiguous uint8 [N/16, K/32, 4, 16, 4], got ", codes.sizes());
  const int64_t k = x.size(1), tiles = codes.size(0);
  TORCH_CHECK(codes.size(1) * kBlock == k, op, ": x has ", k, " inputs, the weight ",
              codes.size(1) * kBlock);
  check_meta(op, scales, at::kHalf, tiles * kTile, k, "scales");
  check_meta(op, offsets, at::kHalf, tiles * kTile, k, "offsets");
  return quantized_linear<Q4>(op, x, codes.data_ptr<uint8_t>(),
                              reinterpret_cast<const fp16*>(scales.data_ptr()), offsets.data_ptr(),
                              tiles, bias, out_dtype);
}

}  // namespace quill
