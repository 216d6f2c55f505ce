// Small matrix products for attention tiles: C[M][N] (+)= A[M][K] * B[K][N], fp32 accumulation.
//
// A (the queries, or the softmax weights) is row-major. B is read one SIMD vector of columns at
// a time, in place from the cache: its rows come in segments (one per cache block), and each
// segment s gives a base pointer per vector of columns, cols[s * seg_stride + v], so neither the
// blocks of a sequence nor a tile's columns from different blocks need copying together first.
// Element (k, v) of segment s lies at cols[s * seg_stride + v] + (k / step) * ldb.
//
// Three ways to multiply, by how B is stored:
// - FmaPlain<T>: B in fp32 or fp16, one row per load, widened to fp32, fused multiply-add;
// - FmaPairs: B in bf16 with rows k and k + 1 interleaved, so one load gives two fp32 rows
//   (a shift and a mask split them; no conversion instruction needed);
// - DotPairs (AVX-512 BF16 only): the same layout, with A in bf16 too, multiplied by vdpbf16ps,
//   which does both rows' products and the sum in one instruction: half the arithmetic work.
// The micro-kernel keeps an MR x NV tile of C in registers and interleaves accumulators over k
// when the tile is small (a decode's few query heads), to keep enough FMAs in flight.
#pragma once

#include <algorithm>
#include <array>
#include <cstdint>
#include <cstring>
#include <utility>

#include "vec.h"

namespace quill {

#if defined(QUILL_AVX512)
constexpr int kRegisters = 32;
#else
constexpr int kRegisters = 16;
#endif
constexpr int kMaxPanel = kRegisters == 32 ? 4 : 2;  // vectors of columns per micro-kernel

template <typename T>
struct FmaPlain {
  using AType = float;
  using BType = T;
  static constexpr int kStep = 1;  // rows of B per load
  static constexpr int rows(int nv) { return kRegisters == 32 ? 6 : (nv == 2 ? 3 : 4); }
  static constexpr int chains(int mr, int nv) {  // interleaved k-accumulators
    int budget = kRegisters - nv - 2;
    int ks = 12 / (mr * nv);
    ks = ks < 1 ? 1 : (ks > 4 ? 4 : ks);
    while (ks > 1 && ks * mr * nv > budget) --ks;
    return ks;
  }
};

struct FmaPairs {
  using AType = float;
  using BType = bf16;
  static constexpr int kStep = 2;
  static constexpr int rows(int nv) {
    return kRegisters == 32 ? (nv == 4 ? 4 : 6) : (nv == 2 ? 4 : 6);
  }
};

#if defined(QUILL_AVX512)
struct DotPairs {
  using AType = bf16;
  using BType = bf16;
  static constexpr int kStep = 2;
  static constexpr int rows(int) { return 6; }
};
#endif

// Splits one load of interleaved bf16 row pairs into fp32 rows k (even) and k + 1 (odd).
inline void split_pairs(const bf16* p, vfloat& even, vfloat& odd) {
#if defined(QUILL_AVX512)
  __m512i x = _mm512_loadu_si512(p);
  even = _mm512_castsi512_ps(_mm512_slli_epi32(x, 16));
  odd = _mm512_castsi512_ps(_mm512_and_si512(x, _mm512_set1_epi32(int(0xFFFF0000u))));
#else
  __m256i x = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  even = _mm256_castsi256_ps(_mm256_slli_epi32(x, 16));
  odd = _mm256_castsi256_ps(_mm256_and_si256(x, _mm256_set1_epi32(int(0xFFFF0000u))));
#endif
}

// Cache lines to ask for while a product runs: a few per step of its inner loop, so that the
// requests overlap the arithmetic instead of stalling it in one burst (the next tile's blocks).
struct Prefetch {
  const char* bases[64];  // one per block
  int lines_per_base = 0, total = 0, done = 0;
  int stop = 1 << 30;     // lines to have asked for by the end of the current product
  int base = 0, line = 0;  // where `done` is: line `line` of bases[base] (no division a step)
  void step(int n) {
    for (int end = std::min(std::min(total, stop), done + n); done < end; ++done) {
      _mm_prefetch(bases[base] + 64 * line, _MM_HINT_T1);
      if (++line == lines_per_base) {
        line = 0;
        ++base;
      }
    }
  }
  void finish() { step(total); }
};
constexpr int kPrefetchPerStep = 4;  // 2-4 measured alike; a burst of all at once ~20% slower

template <int MR, int NV>
using Tile = std::array<std::array<vfloat, NV>, MR>;

template <int MR, int NV>
inline void tile_init(Tile<MR, NV>& acc, const float* C, int64_t ldc, bool accumulate) {
  for (int m = 0; m < MR; ++m)
    for (int v = 0; v < NV; ++v) acc[m][v] = accumulate ? vload(C + m * ldc + v * kWidth) : vzero();
}

template <int MR, int NV>
inline void tile_add_store(const Tile<MR, NV>& a, const Tile<MR, NV>* b, int nb, float* C, int64_t ldc) {
  for (int m = 0; m < MR; ++m)
    for (int v = 0; v < NV; ++v) {
      vfloat x = a[m][v];
      for (int j = 0; j < nb; ++j) x = vadd(x, b[j][m][v]);
      vstore(C + m * ldc + v * kWidth, x);
    }
}

template <int MR, int NV, typename T>
__attribute__((always_inline)) inline void fma_plain_rows(Tile<MR, NV>& acc, const float* A, int64_t lda, int k,
                                                          const T* const* b, int64_t row_offset) {
  vfloat bv[NV];
  for (int v = 0; v < NV; ++v) bv[v] = vload(b[v] + row_offset);
  for (int m = 0; m < MR; ++m) {
    vfloat a = vset(A[m * lda + k]);
    for (int v = 0; v < NV; ++v) acc[m][v] = vfma(a, bv[v], acc[m][v]);
  }
}

template <int MR, int NV, typename Kind>
struct Micro;

template <int MR, int NV, typename T>
struct Micro<MR, NV, FmaPlain<T>> {
  static void run(const float* A, int64_t lda, const T* const* cols, int64_t seg_stride, int seg_rows,
                  int64_t ldb, float* C, int64_t ldc, int K, bool accumulate, Prefetch* pf) {
    constexpr int KS = FmaPlain<T>::chains(MR, NV);
    Tile<MR, NV> acc[KS];
    tile_init<MR, NV>(acc[0], C, ldc, accumulate);
    for (int s = 1; s < KS; ++s) tile_init<MR, NV>(acc[s], C, ldc, false);
    for (int k0 = 0, s = 0; k0 < K; k0 += seg_rows, ++s) {
      const T* b[NV];
      for (int v = 0; v < NV; ++v) b[v] = cols[s * seg_stride + v];
      const int n = K - k0 < seg_rows ? K - k0 : seg_rows;
      int r = 0;
      for (; r + KS <= n; r += KS) {
        if (pf) pf->step(kPrefetchPerStep);
#pragma GCC unroll 4
        for (int u = 0; u < KS; ++u) fma_plain_rows<MR, NV, T>(acc[u], A, lda, k0 + r + u, b, (r + u) * ldb);
      }
      for (; r < n; ++r) fma_plain_rows<MR, NV, T>(acc[0], A, lda, k0 + r, b, r * ldb);
    }
    tile_add_store<MR, NV>(acc[0], acc + 1, KS - 1, C, ldc);
  }
};

template <int MR, int NV>
struct Micro<MR, NV, FmaPairs> {
  static void run(const float* A, int64_t lda, const bf16* const* cols, int64_t seg_stride, int seg_rows,
                  int64_t ldb, float* C, int64_t ldc, int K, bool accumulate, Prefetch* pf) {
    // One accumulator takes both rows of a pair: MR x NV chains (>= 8) hide the FMA latency.
    Tile<MR, NV> acc;
    tile_init<MR, NV>(acc, C, ldc, accumulate);
    for (int k0 = 0, s = 0; k0 < K; k0 += seg_rows, ++s) {
      const bf16* b[NV];
      for (int v = 0; v < NV; ++v) b[v] = cols[s * seg_stride + v];
      const int n = K - k0 < seg_rows ? K - k0 : seg_rows;
      for (int r = 0; r < n; r += 2) {
        if (pf) pf->step(kPrefetchPerStep);
        vfloat be[NV], bo[NV];
        for (int v = 0; v < NV; ++v) split_pairs(b[v] + (r / 2) * ldb, be[v], bo[v]);
        const bool both = r + 1 < n;  // an odd row count ends on half a pair
        for (int m = 0; m < MR; ++m) {
          vfloat ae = vset(A[m * lda + k0 + r]);
          for (int v = 0; v < NV; ++v) acc[m][v] = vfma(ae, be[v], acc[m][v]);
          if (both) {
            vfloat ao = vset(A[m * lda + k0 + r + 1]);
            for (int v = 0; v < NV; ++v) acc[m][v] = vfma(ao, bo[v], acc[m][v]);
          }
        }
      }
    }
    tile_add_store<MR, NV>(acc, nullptr, 0, C, ldc);
  }
};

#if defined(QUILL_AVX512)
template <int MR, int NV>
struct Micro<MR, NV, DotPairs> {
  static void run(const bf16* A, int64_t lda, const bf16* const* cols, int64_t seg_stride, int seg_rows,
                  int64_t ldb, float* C, int64_t ldc, int K, bool accumulate, Prefetch* pf) {
    Tile<MR, NV> acc;
    tile_init<MR, NV>(acc, C, ldc, accumulate);
    const __m512i keep_even = _mm512_set1_epi32(0xFFFF);
    for (int k0 = 0, s = 0; k0 < K; k0 += seg_rows, ++s) {
      const bf16* b[NV];
      for (int v = 0; v < NV; ++v) b[v] = cols[s * seg_stride + v];
      const int n = K - k0 < seg_rows ? K - k0 : seg_rows;
      for (int r = 0; r < n; r += 2) {
        if (pf) pf->step(kPrefetchPerStep);
        __m512i bv[NV];
        for (int v = 0; v < NV; ++v) bv[v] = _mm512_loadu_si512(b[v] + (r / 2) * ldb);
        if (r + 1 == n) {
          // Half a pair: the odd row may be a stale slot (even NaN); zero it, whatever A holds.
          for (int v = 0; v < NV; ++v) bv[v] = _mm512_and_si512(bv[v], keep_even);
        }
        for (int m = 0; m < MR; ++m) {
          int32_t pair;
          std::memcpy(&pair, A + m * lda + k0 + r, sizeof(pair));
          if (r + 1 == n) pair &= 0xFFFF;
          __m512bh a = (__m512bh)_mm512_set1_epi32(pair);
          for (int v = 0; v < NV; ++v) acc[m][v] = _mm512_dpbf16_ps(acc[m][v], a, (__m512bh)bv[v]);
        }
      }
    }
    tile_add_store<MR, NV>(acc, nullptr, 0, C, ldc);
  }
};
#endif

template <typename Kind, int NV, int... R>
constexpr auto row_kernels(std::integer_sequence<int, R...>) {
  return std::array{&Micro<R + 1, NV, Kind>::run...};
}

template <typename Kind, int NV>
void panel(int M, int K, const typename Kind::AType* A, int64_t lda, const typename Kind::BType* const* cols,
           int64_t seg_stride, int seg_rows, int64_t ldb, float* C, int64_t ldc, bool accumulate,
           Prefetch* pf) {
  constexpr int MR = Kind::rows(NV);
  static constexpr auto kernels = row_kernels<Kind, NV>(std::make_integer_sequence<int, MR>{});
  for (int m0 = 0; m0 < M; m0 += MR) {
    const int rows = M - m0 < MR ? M - m0 : MR;
    kernels[rows - 1](A + m0 * lda, lda, cols, seg_stride, seg_rows, ldb, C + m0 * ldc, ldc, K, accumulate, pf);
  }
}

// C[M][ncols * kWidth] (+)= A[M][K] * B, K rows of B in segments of seg_rows (see above).
template <typename Kind>
void small_gemm(int M, int ncols, int K, const typename Kind::AType* A, int64_t lda,
                const typename Kind::BType* const* cols, int64_t seg_stride, int seg_rows, int64_t ldb,
                float* C, int64_t ldc, bool accumulate, Prefetch* pf = nullptr) {
  for (int c = 0; c < ncols;) {
    const int left = ncols - c;
    float* Cc = C + c * kWidth;
    if (kMaxPanel >= 4 && left >= 4) {
      panel<Kind, kMaxPanel >= 4 ? 4 : 1>(M, K, A, lda, cols + c, seg_stride, seg_rows, ldb, Cc, ldc, accumulate, pf);
      c += 4;
    } else if (left >= 2) {
      panel<Kind, 2>(M, K, A, lda, cols + c, seg_stride, seg_rows, ldb, Cc, ldc, accumulate, pf);
      c += 2;
    } else {
      panel<Kind, 1>(M, K, A, lda, cols + c, seg_stride, seg_rows, ldb, Cc, ldc, accumulate, pf);
      c += 1;
    }
  }
  if (pf) pf->finish();
}

}  // namespace quill
