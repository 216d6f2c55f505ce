// Products with int8 weights in blocks of 32 (GGUF's Q8_0) for steps of a few token rows.
//
// A decode step reads every weight once for a handful of rows, so its time is the weights'
// bytes: the kernel streams them once per pass and keeps up to kMaxRows token rows in
// registers, so one load of the weights feeds every row. The activations are quantized to int8
// once per call (per row and block of 32: scale = max |x| / 127, rounded to nearest even), and
// each block's product is an integer dot product, scaled by the weight's and the activation's
// scales into an fp32 sum.
//
// Weight layout (quill/ops/qlinear.py packs it): output rows in tiles of 16, and in a tile the
// 16 rows' 4 consecutive codes side by side, so one 64-byte load holds 4 inputs of 16 outputs,
// one 32-bit lane per output row: codes [N/16, K/4, 16, 4]. Per (tile, block of 32 inputs): 16
// fp16 scales and 16 int16 sums of the codes, [N/16, K/32, 16].
//
// AVX-512 VNNI (vpdpbusd: u8 x s8, four products into each int32 lane): the activation goes in
// as u8 = q + 128, and 128 x the block's code sum comes off afterwards (exact in int32).
// AVX2 (vpmaddubsw: u8 x s8 into saturating int16 pairs): |w| times q with w's sign, whose pair
// sums stay within 2 x 127 x 127 (no saturation), then vpmaddwd into int32. The integer part
// is exact on both, so the two libraries agree up to the order of the fp32 sums.
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
constexpr int64_t kBlockStride = kBlock * kTile;  // bytes from a tile's block to its next
constexpr int64_t kMetaStride = kTile;            // values, likewise, of scales and sums
#if defined(QUILL_AVX512)
constexpr int kMaxRows = 8;
#else
constexpr int kMaxRows = 4;
#endif

// One token row's activations, quantized: codes (offset by 128 for vpdpbusd) and scales.
struct QuantizedRows {
  std::vector<int8_t> codes;  // [rows, K]
  std::vector<float> scales;  // [rows, K / 32]
};

template <typename T>
void quantize_rows(const T* x, int64_t rows, int64_t k, int64_t stride, QuantizedRows& out) {
  const int64_t blocks = k / kBlock;
  out.codes.resize(rows * k);
  out.scales.resize(rows * blocks);
  for (int64_t m = 0; m < rows; ++m) {
    const T* row = x + m * stride;
    for (int64_t b = 0; b < blocks; ++b) {
      const T* src = row + b * kBlock;
      vfloat amax = vzero();
      for (int i = 0; i < kBlock; i += kWidth) {
        vfloat v = vload(src + i);
        amax = vmax(amax, vmax(v, vsub(vzero(), v)));
      }
      const float scale = vhmax(amax) / 127.0f;
      const float inverse = scale > 0.0f ? 1.0f / scale : 0.0f;
      out.scales[m * blocks + b] = scale;
      int8_t* dst = out.codes.data() + m * k + b * kBlock;
      for (int i = 0; i < kBlock; ++i) {
        // nearbyint: round half to even, as torch.round in the reference.
        int q = int(std::nearbyint(to_float(src[i]) * inverse));
#if defined(QUILL_AVX512)
        dst[i] = int8_t(q ^ 0x80);  // as u8: q + 128
#else
        dst[i] = int8_t(q);
#endif
      }
    }
  }
}

#if defined(QUILL_AVX512)

// Tiles done side by side: one row alone is a chain of dependent vpdpbusd per tile, so a few
// rows take several tiles at once, for independent chains and several weight streams.
constexpr int tiles_at_once(int rows) { return rows == 1 ? 8 : rows == 2 ? 4 : rows <= 4 ? 2 : 1; }

// R token rows times T consecutive tiles (16 x T output rows). No software prefetch: the
// weights are T sequential streams (one per tile), which the hardware prefetcher follows;
// prefetching each line 2-12 KB ahead measured 10-20% slower here (Zen 4), and so did one
// stream with the T tiles' blocks interleaved (the prefetcher runs fewer lines ahead of one
// stream than of four).
template <int R, int T>
void tile_rows(const int8_t* codes, const fp16* scales, const int16_t* sums, int64_t k,
               const QuantizedRows& act, int64_t row0, float* out[]) {
  const int64_t blocks = k / kBlock;
  __m512 sum[T][R];
  for (int j = 0; j < T; ++j)
    for (int r = 0; r < R; ++r) sum[j][r] = _mm512_setzero_ps();
  for (int64_t b = 0; b < blocks; ++b) {
    __m512i dots[T][R];
    for (int j = 0; j < T; ++j)
      for (int r = 0; r < R; ++r) dots[j][r] = _mm512_setzero_si512();
    const int8_t* block = codes + b * kBlockStride;
    for (int g = 0; g < kBlock / 4; ++g) {
      __m512i a[R];
      for (int r = 0; r < R; ++r) {
        int32_t four;
        std::memcpy(&four, act.codes.data() + (row0 + r) * k + b * kBlock + g * 4, 4);
        a[r] = _mm512_set1_epi32(four);
      }
      for (int j = 0; j < T; ++j) {
        const int8_t* w = block + j * k * kTile + g * 64;
        __m512i wv = _mm512_loadu_si512(w);
        for (int r = 0; r < R; ++r) dots[j][r] = _mm512_dpbusd_epi32(dots[j][r], a[r], wv);
      }
    }
    for (int j = 0; j < T; ++j) {
      const int64_t meta = j * blocks * kTile + b * kMetaStride;
      __m512i offset = _mm512_slli_epi32(
          _mm512_cvtepi16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(sums + meta))), 7);
      __m512 wscale = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(scales + meta)));
      for (int r = 0; r < R; ++r) {
        __m512 d = _mm512_mul_ps(wscale, _mm512_set1_ps(act.scales[(row0 + r) * blocks + b]));
        sum[j][r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_sub_epi32(dots[j][r], offset)), d, sum[j][r]);
      }
    }
  }
  for (int j = 0; j < T; ++j)
    for (int r = 0; r < R; ++r) _mm512_storeu_ps(out[r] + j * kTile, sum[j][r]);
}

#else  // AVX2

// AVX2 holds 8 lanes: a tile is done as two halves of 8 rows (each 64-byte group's first and
// second 32 bytes).
template <int R>
void half_tile_rows(const int8_t* codes, const fp16* scales, int64_t k, const QuantizedRows& act,
                    int64_t row0, float* out[]) {
  const int64_t blocks = k / kBlock;
  const __m256i ones = _mm256_set1_epi16(1);
  __m256 sum[R];
  for (int r = 0; r < R; ++r) sum[r] = _mm256_setzero_ps();
  for (int b = 0; b < blocks; ++b) {
    __m256i dots[R];
    for (int r = 0; r < R; ++r) dots[r] = _mm256_setzero_si256();
    const int8_t* w = codes + b * kBlockStride;
    for (int g = 0; g < kBlock / 4; ++g) {
      __m256i wv = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + g * 64));
      __m256i magnitude = _mm256_sign_epi8(wv, wv);
      for (int r = 0; r < R; ++r) {
        int32_t four;
        std::memcpy(&four, act.codes.data() + (row0 + r) * k + b * kBlock + g * 4, 4);
        __m256i signed_a = _mm256_sign_epi8(_mm256_set1_epi32(four), wv);
        __m256i pairs = _mm256_maddubs_epi16(magnitude, signed_a);
        dots[r] = _mm256_add_epi32(dots[r], _mm256_madd_epi16(pairs, ones));
      }
    }
    __m256 wscale = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(scales + b * kMetaStride)));
    for (int r = 0; r < R; ++r) {
      __m256 d = _mm256_mul_ps(wscale, _mm256_set1_ps(act.scales[(row0 + r) * blocks + b]));
      sum[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dots[r]), d, sum[r]);
    }
  }
  for (int r = 0; r < R; ++r) _mm256_storeu_ps(out[r], sum[r]);
}

constexpr int tiles_at_once(int) { return 1; }

template <int R, int T>
void tile_rows(const int8_t* codes, const fp16* scales, const int16_t*, int64_t k,
               const QuantizedRows& act, int64_t row0, float* out[]) {
  static_assert(T == 1, "the AVX2 kernel does one tile at a time");
  float* upper[R];
  for (int r = 0; r < R; ++r) upper[r] = out[r] + 8;
  half_tile_rows<R>(codes, scales, k, act, row0, out);
  half_tile_rows<R>(codes + 32, scales + 8, k, act, row0, upper);
}

#endif

using TileFn = void (*)(const int8_t*, const fp16*, const int16_t*, int64_t, const QuantizedRows&,
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

template <int R, int T>
constexpr TileFn kernel_if_fits() {
  if constexpr (T <= tiles_at_once(R)) {
    return &tile_rows<R, T>;
  } else {
    return nullptr;
  }
}

template <int R>
constexpr TileFns tile_fns() {
  return {{kernel_if_fits<R, 1>(), kernel_if_fits<R, 2>(), kernel_if_fits<R, 4>(),
           kernel_if_fits<R, 8>()},
          tiles_at_once(R)};
}

const TileFns& tile_for(int rows) {
  static const TileFns table[] = {
      tile_fns<1>(), tile_fns<2>(), tile_fns<3>(), tile_fns<4>(),
#if defined(QUILL_AVX512)
      tile_fns<5>(), tile_fns<6>(), tile_fns<7>(), tile_fns<8>(),
#endif
  };
  return table[rows - 1];
}

template <typename T>
void store_rows(const float* src, T* dst, int64_t n, const float* bias) {
  for (int64_t i = 0; i < n; ++i) dst[i] = from_float<T>(src[i] + (bias ? bias[i] : 0.0f));
}

}  // namespace

at::Tensor q8_linear(const at::Tensor& x, const at::Tensor& codes, const at::Tensor& scales,
                     const at::Tensor& sums, const std::optional<at::Tensor>& bias,
                     std::optional<at::ScalarType> out_dtype) {
  TORCH_CHECK(x.dim() == 2, "quill::q8_linear: x must be [rows, in_features], got ", x.sizes());
  TORCH_CHECK(codes.dim() == 4 && codes.size(2) == kTile && codes.size(3) == 4 &&
                  codes.scalar_type() == at::kChar && codes.is_contiguous(),
              "quill::q8_linear: codes must be contiguous int8 [N/16, K/4, 16, 4], got ", codes.sizes());
  const int64_t rows = x.size(0), k = x.size(1), tiles = codes.size(0), n = tiles * kTile;
  TORCH_CHECK(codes.size(1) * 4 == k && k % kBlock == 0, "quill::q8_linear: x has ", k,
              " inputs, the weight ", codes.size(1) * 4, " (a multiple of 32 is needed)");
  TORCH_CHECK(scales.scalar_type() == at::kHalf && scales.is_contiguous() && scales.numel() == n * (k / kBlock),
              "quill::q8_linear: scales must be contiguous fp16 [N/16, K/32, 16]");
  TORCH_CHECK(sums.scalar_type() == at::kShort && sums.is_contiguous() && sums.numel() == n * (k / kBlock),
              "quill::q8_linear: sums must be contiguous int16 [N/16, K/32, 16]");
  TORCH_CHECK(x.stride(1) == 1, "quill::q8_linear: x's rows must be contiguous");
  const at::ScalarType dtype = out_dtype.value_or(x.scalar_type());
  at::Tensor bias_f;
  if (bias.has_value() && bias->defined()) {
    TORCH_CHECK(bias->numel() == n, "quill::q8_linear: bias has ", bias->numel(), " elements, not ", n);
    bias_f = bias->to(at::kFloat).contiguous();
  }
  const float* bias_p = bias_f.defined() ? bias_f.data_ptr<float>() : nullptr;
  at::Tensor out = at::empty({rows, n}, x.options().dtype(dtype));
  if (rows == 0) return out;

  QuantizedRows act;
  switch (x.scalar_type()) {
    case at::kFloat: quantize_rows(x.data_ptr<float>(), rows, k, x.stride(0), act); break;
    case at::kBFloat16:
      quantize_rows(reinterpret_cast<const bf16*>(x.data_ptr()), rows, k, x.stride(0), act);
      break;
    case at::kHalf:
      quantize_rows(reinterpret_cast<const fp16*>(x.data_ptr()), rows, k, x.stride(0), act);
      break;
    default: TORCH_CHECK(false, "quill::q8_linear: x dtype ", x.scalar_type(), " is not supported");
  }
  TORCH_CHECK(dtype == at::kFloat || dtype == at::kBFloat16 || dtype == at::kHalf,
              "quill::q8_linear: out_dtype ", dtype, " is not supported");

  const int8_t* cp = codes.data_ptr<int8_t>();
  const fp16* sp = reinterpret_cast<const fp16*>(scales.data_ptr());
  const int16_t* up = sums.data_ptr<int16_t>();
  const int64_t blocks = k / kBlock;
  // Contiguous ranges of tiles per thread; a thread's tile results go through a small fp32
  // buffer so every output dtype is one store loop.
  at::parallel_for(0, tiles, 1, [&](int64_t begin, int64_t end) {
    constexpr int kMaxTiles = 8;
    float buffer[kMaxRows][kMaxTiles * kTile];
    float* outs[kMaxRows];
    for (int r = 0; r < kMaxRows; ++r) outs[r] = buffer[r];
    for (int64_t row0 = 0; row0 < rows; row0 += kMaxRows) {
      const int r_count = int(std::min<int64_t>(kMaxRows, rows - row0));
      const TileFns& fns = tile_for(r_count);
      for (int64_t t = begin; t < end;) {
        int group = 1;
        const TileFn fn = fns.pick(end - t, group);
        fn(cp + t * k * kTile, sp + t * blocks * kTile, up + t * blocks * kTile, k, act, row0, outs);
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

}  // namespace quill
