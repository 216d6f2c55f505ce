// Paged attention: every query of a step, decodes and prompt chunks alike, against its own
// sequence's keys and values, read in place through the block table.
//
// Why this shape: decode attention is a stream over the KV cache, so the kernel must read each
// block once, for all the query heads that share it (GQA), without first copying it anywhere and
// without padding a short sequence to the batch's longest. The work is cut into items of
// (sequence, tile of queries, range of keys), all KV heads together, so that a block's keys
// (and then its values) are one contiguous read; each item runs a flash-attention loop (fp32
// scores in base 2, online softmax) over tiles of kTileTokens keys, prefetching the next tile
// by hand (the blocks are scattered, which defeats the hardware prefetchers). When there are
// fewer items than the threads can share evenly, long key ranges are split across items and
// their partial results (max, sum, unnormalised output) merged afterwards. An int8 cache
// (codes with an fp16 scale per 32 dimensions of a token's head) is multiplied in integers as
// it is read: codes widened to int16 in registers against int16-rounded queries and weights
// (see "An int8 cache is multiplied in integers" below). No wider copy of a block is made.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty_like.h>
#include <c10/util/Exception.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <cmath>
#include <cstring>
#include <limits>
#include <memory>
#include <string>
#include <type_traits>
#include <vector>

#include "cache_layout.h"
#include "gemm.h"
#include "ops.h"

namespace quill {
namespace {

constexpr float kLog2e = 1.4426950408889634f;
constexpr float kNegInf = -std::numeric_limits<float>::infinity();
constexpr int kTileTokens = 128;      // keys per online-softmax update
constexpr int kChunkRows = 144;       // query rows (queries x heads) per prompt tile
constexpr int kMinSplitTokens = 256;  // a key range is split across threads only this coarsely
constexpr int kMaxCols = 1024;        // column vectors x segments of one product

struct Layout {
  int num_heads, num_kv_heads, head_dim, block_size, group;
  int64_t table_stride;
  const int32_t* block_tables;
  const int32_t* seq_lens;
  const int32_t* query_start;
  float scale;  // softmax scale times log2(e): the weights are 2^(score * scale - max)
  int window;   // > 0: a query at position p sees keys p - window + 1 .. p only
};

struct Item {
  int seq, q_begin, q_end;  // queries q_begin .. q_end - 1 of the sequence, every head
  int kv_begin, kv_end;              // keys; kv_begin is a multiple of the block size
  int64_t partial;                   // -1: writes its rows; else offset of its partial result
  int64_t cost;
};

struct Split {  // one query tile whose keys were split over `pieces` consecutive partials
  int seq, q_begin, q_end;
  int64_t first_partial;
  int pieces;
};

// Rows of a query tile: row r is KV head r / rows_per_head; within it, query i / G, head i % G.
int rows_of(const Layout& L, int q_begin, int q_end) { return (q_end - q_begin) * L.num_heads; }

// Cuts the step into items; splits key ranges only when the threads would otherwise idle.
void plan(const Layout& L, int num_seqs, int num_threads, std::vector<Item>& items,
          std::vector<Split>& splits, int64_t& partial_floats) {
  std::vector<Item> tiles;
  int64_t total = 0;
  for (int b = 0; b < num_seqs; ++b) {
    int q_len = L.query_start[b + 1] - L.query_start[b];
    if (q_len <= 0) continue;
    int first_pos = L.seq_lens[b] - q_len;
    int per_tile = q_len == 1 ? 1 : std::max(1, kChunkRows / L.num_heads);
    for (int i0 = 0; i0 < q_len; i0 += per_tile) {
      int i1 = std::min(q_len, i0 + per_tile);
      int visible = first_pos + i1;  // keys the tile's last query sees
      // Keys read, weighted by the rows reading them (the causal triangle counted half), plus
      // a fixed cost per item.
      int64_t cost = int64_t(rows_of(L, i0, i1)) * (visible - (i1 - i0) / 2) + 256;
      tiles.push_back({b, i0, i1, 0, visible, -1, cost});
      total += cost;
    }
  }
  int64_t target = num_threads > 1 ? std::max<int64_t>(total / (4 * num_threads), 1)
                                   : std::numeric_limits<int64_t>::max();
  const int bs = L.block_size;
  partial_floats = 0;
  for (const Item& t : tiles) {
    int pieces = 1;
    if (t.cost > target) {
      int64_t wanted = (t.cost + target - 1) / target;
      pieces = int(std::min<int64_t>(wanted, std::max(1, t.kv_end / kMinSplitTokens)));
    }
    int blocks = (t.kv_end + bs - 1) / bs;
    int per_piece = (blocks + pieces - 1) / std::max(pieces, 1);
    pieces = per_piece > 0 ? (blocks + per_piece - 1) / per_piece : 1;
    if (pieces <= 1) {
      items.push_back(t);
      continue;
    }
    int64_t piece_floats = int64_t(rows_of(L, t.q_begin, t.q_end)) * (L.head_dim + 2);
    splits.push_back({t.seq, t.q_begin, t.q_end, partial_floats, pieces});
    for (int j = 0; j < pieces; ++j) {
      Item p = t;
      p.kv_begin = j * per_piece * bs;
      p.kv_end = std::min(t.kv_end, (j + 1) * per_piece * bs);
      p.partial = partial_floats;
      p.cost = t.cost / pieces;
      partial_floats += piece_floats;
      items.push_back(p);
    }
  }
  std::stable_sort(items.begin(), items.end(),
                   [](const Item& a, const Item& b) { return a.cost > b.cost; });
}

struct Scratch {
  std::vector<float> q, s, o, m, l;
  std::vector<bf16> qb, pb;  // bf16 copies of the queries and weights for DotPairs
  std::vector<int16_t> qi, wi;  // int8 caches: queries, and weights per 32 dims, in int16
  std::vector<float> qis, wis;   // their scales
  void reserve(int rows, int dim) {
    auto grow = [](auto& v, size_t n) {
      if (v.size() < n) v.resize(n);
    };
    grow(q, size_t(rows) * dim);
    grow(s, size_t(rows) * kTileTokens);
    grow(o, size_t(rows) * dim);
    grow(m, rows);
    grow(l, rows);
    grow(qb, size_t(rows) * dim);
    grow(pb, size_t(rows) * kTileTokens);
    grow(qi, size_t(rows) * dim);
    grow(qis, size_t(rows) * dim / kScaleGroup + 1);
    grow(wi, size_t(rows) * dim / kScaleGroup * kTileTokens + 1);
    grow(wis, size_t(rows) * dim / kScaleGroup + 1);
  }
};

Scratch& thread_scratch() {
  thread_local Scratch scratch;
  return scratch;
}

// The next tile's blocks (`count`, every KV head's part of each: one contiguous run per
// block), for the products to prefetch as they run: issued a few lines per step of their inner
// loops, the requests overlap the arithmetic (~20% faster than issuing them all before each
// product, and twice the rate of no prefetch). Whole blocks, not one head's part at a time:
// scattered reads run at a rate that grows with the run's length (an int8 cache's 1 KB head
// chunks read ~30% slower than 3 KB blocks).
template <typename KT>
inline void plan_prefetch(Prefetch& pf, const KT* cache, const int32_t* blocks, int count,
                          int kv_heads, int64_t chunk) {
  const int lines = int(kv_heads * chunk * int64_t(sizeof(KT)) / 64);
  for (int j = 0; j < count; ++j)
    pf.bases[j] = reinterpret_cast<const char*>(cache + int64_t(blocks[j]) * kv_heads * chunk);
  pf.lines_per_base = lines;
  pf.total = count * lines;
  pf.done = pf.base = pf.line = 0;
  pf.stop = 1 << 30;
}

// How the cache's dtype is stored and multiplied (see gemm.h); bf16 keeps row pairs together.
template <typename QT, typename KT>
struct KindFor {
  using type = FmaPlain<KT>;
};
template <typename QT>
struct KindFor<QT, bf16> {
  using type = FmaPairs;
};
#if defined(QUILL_AVX512)
template <>
struct KindFor<bf16, bf16> {
  using type = DotPairs;
};
#endif

// S[r][j] = q_r . k_j for the rows of KV head h (Qh, Sh) over the tile's `nblk` blocks.
template <typename Kind, typename KT>
void key_product(int rows, int D, int BS, const typename Kind::AType* Qh, const KT* k_cache,
                 const int32_t* blocks, int nblk, int KVH, int h, int64_t chunk, float* Sh,
                 const KT** cols, Prefetch& pf) {
  constexpr int step = Kind::kStep;  // 2: bf16 blocks hold rows in interleaved pairs
  const int bvec = BS / kWidth, ncols = nblk * bvec;
  for (int j = 0; j < nblk; ++j) {
    const KT* base = k_cache + (int64_t(blocks[j]) * KVH + h) * chunk;
    for (int c = 0; c < bvec; ++c) cols[j * bvec + c] = base + c * kWidth * step;
  }
  small_gemm<Kind>(rows, ncols, D, Qh, D, cols, 0, D, int64_t(BS) * step, Sh, kTileTokens, false, &pf);
}

// An int8 cache is multiplied in integers: its codes widened to int16 and multiplied by the
// queries (keys) or the softmax weights (values) rounded to int16, two products summed into an
// int32 lane an instruction (vpdpwssd with AVX-512 VNNI; vpmaddwd with AVX2), then scaled to
// fp32 once per 32 dimensions (keys) or per tile (values). Its codes lie in the bf16 layout's
// pairs (csrc/cache_layout.h), the operands of those instructions. Rounding to int16 keeps
// 15 bits (scale max |x| / 32767 per 32 dimensions of a query, per tile and 32 dimensions of
// a row of weights times the values' scales): errors of ~1e-5, against the fp32 path's
// conversion of every code (2 instructions a 16) and a multiply-add per query head.
#if defined(QUILL_AVX512)
using vint = __m512i;
inline vint izero() { return _mm512_setzero_si512(); }
inline vint iset(int32_t x) { return _mm512_set1_epi32(x); }
inline vint widen(const int8_t* p) {  // 2 * kWidth codes -> int16
  return _mm512_cvtepi8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}
inline vint dot2(vint acc, vint codes, vint pair) { return _mm512_dpwssd_epi32(acc, codes, pair); }
inline vfloat ifloat(vint x) { return _mm512_cvtepi32_ps(x); }
inline void istore16(int16_t* p, vint x) {  // kWidth int32 -> int16, saturating
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), _mm512_cvtsepi32_epi16(x));
}
inline vint iround(vfloat x) { return _mm512_cvtps_epi32(x); }  // nearest even
constexpr int kIntRows = 6;
#else
using vint = __m256i;
inline vint izero() { return _mm256_setzero_si256(); }
inline vint iset(int32_t x) { return _mm256_set1_epi32(x); }
inline vint widen(const int8_t* p) {
  return _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
}
inline vint dot2(vint acc, vint codes, vint pair) { return _mm256_add_epi32(acc, _mm256_madd_epi16(codes, pair)); }
inline vfloat ifloat(vint x) { return _mm256_cvtepi32_ps(x); }
inline void istore16(int16_t* p, vint x) {
  const __m128i packed = _mm_packs_epi32(_mm256_castsi256_si128(x), _mm256_extracti128_si256(x, 1));
  _mm_storeu_si128(reinterpret_cast<__m128i*>(p), packed);
}
inline vint iround(vfloat x) { return _mm256_cvtps_epi32(x); }
constexpr int kIntRows = 3;
#endif
constexpr int kQuantMax = 32767;
constexpr int kIntCols = kScaleGroup / kWidth;  // vectors of one 32-dimension group

// Rows of fp32 (or 16-bit) values -> int16 codes and one fp32 scale per 32 of them, round to
// nearest even: the queries against an int8 key cache (the PyTorch path rounds them alike,
// quill/ops/reference.py).
template <typename QT>
void round_queries(const QT* src, int D, int16_t* codes, float* scales) {
  for (int g = 0; g < D / kScaleGroup; ++g) {
    vfloat amax = vzero();
    for (int c = 0; c < kIntCols; ++c) {
      const vfloat x = vload(src + g * kScaleGroup + c * kWidth);
      amax = vmax(amax, vmax(x, vsub(vzero(), x)));
    }
    const float scale = vhmax(amax) / kQuantMax;
    scales[g] = scale;
    const vfloat inv = vset(scale > 0.0f ? 1.0f / scale : 0.0f);
    for (int c = 0; c < kIntCols; ++c) {
      const vfloat x = vload(src + g * kScaleGroup + c * kWidth);
      istore16(codes + g * kScaleGroup + c * kWidth, iround(vmul(x, inv)));
    }
  }
}

// S[MR rows][NV vectors of keys] from int16 queries and an int8 cache's keys: per group, the
// integer dot products times the query's and the keys' scales. keys[v]: the vector's first key
// in its block's codes (pairs of dimensions, rows of 2 * block_size bytes); scales[v] likewise.
template <int MR, int NV>
void int_key_tile(const int16_t* q, const float* qs, int D, int BS, const int8_t* const* keys,
                  const fp16* const* scales, float* S, Prefetch* pf) {
  const int groups = D / kScaleGroup;
  for (int g = 0; g < groups; ++g) {
    vint acc[MR][NV];
    for (int m = 0; m < MR; ++m)
      for (int v = 0; v < NV; ++v) acc[m][v] = izero();
    for (int i = g * kScaleGroup / 2; i < (g + 1) * kScaleGroup / 2; ++i) {  // pairs of dims
      if (pf) pf->step(kPrefetchPerStep);
      vint b[NV];
      for (int v = 0; v < NV; ++v) b[v] = widen(keys[v] + int64_t(i) * BS * 2);
      for (int m = 0; m < MR; ++m) {
        int32_t pair;
        std::memcpy(&pair, q + int64_t(m) * D + 2 * i, sizeof(pair));
        const vint a = iset(pair);
        for (int v = 0; v < NV; ++v) acc[m][v] = dot2(acc[m][v], b[v], a);
      }
    }
    vfloat ks[NV];
    for (int v = 0; v < NV; ++v) ks[v] = vload(scales[v] + g * BS);
    for (int m = 0; m < MR; ++m) {
      const vfloat qsc = vset(qs[m * groups + g]);
      for (int v = 0; v < NV; ++v) {
        float* dst = S + m * kTileTokens + v * kWidth;
        const vfloat f = vmul(ifloat(acc[m][v]), qsc);
        vstore(dst, g == 0 ? vmul(f, ks[v]) : vfma(f, ks[v], vload(dst)));
      }
    }
  }
}

template <int NV, int... R>
constexpr auto int_key_kernels(std::integer_sequence<int, R...>) {
  return std::array{&int_key_tile<R + 1, NV>...};
}

// The int8 cache's key product: as key_product, for int16 queries (`q`, `qs`: the rows' codes
// and scales).
void key_product_int8(int rows, int D, int BS, const int16_t* q, const float* qs, const int8_t* k_cache,
                      const int32_t* blocks, int nblk, int KVH, int h, int64_t chunk, float* Sh, Prefetch& pf) {
  constexpr int NV = kMaxPanel;
  static constexpr auto wide = int_key_kernels<NV>(std::make_integer_sequence<int, kIntRows>{});
  static constexpr auto one = int_key_kernels<1>(std::make_integer_sequence<int, kIntRows>{});
  const int bvec = BS / kWidth, ncols = nblk * bvec, groups = D / kScaleGroup;
  const int8_t* keys[kMaxCols];
  const fp16* scales[kMaxCols];
  for (int j = 0; j < nblk; ++j) {
    const int8_t* base = k_cache + (int64_t(blocks[j]) * KVH + h) * chunk;
    for (int c = 0; c < bvec; ++c) {
      keys[j * bvec + c] = base + c * kWidth * 2;
      scales[j * bvec + c] = reinterpret_cast<const fp16*>(base + int64_t(D) * BS) + c * kWidth;
    }
  }
  for (int c = 0; c < ncols;) {
    const bool full = ncols - c >= NV;
    for (int m0 = 0; m0 < rows; m0 += kIntRows) {
      const int mr = std::min(kIntRows, rows - m0);
      (full ? wide : one)[mr - 1](q + int64_t(m0) * D, qs + m0 * groups, D, BS, keys + c, scales + c,
                                  Sh + m0 * kTileTokens + c * kWidth, &pf);
    }
    c += full ? NV : 1;
  }
  pf.finish();
}

// Per row and 32-dimension group: the weights times the values' scales for those dimensions,
// rounded to int16 with one scale for the tile (`codes` [rows][groups][kTileTokens], `scales`
// [rows][groups]); weights past the tile's `ntok` keys are zero. value_scales[c]: the scales
// of the tile's c-th vector of keys.
void round_weights(const float* P, int rows, int D, int BS, int ntok, const fp16* const* value_scales,
                   int16_t* codes, float* scales) {
  const int groups = D / kScaleGroup, nvec = (ntok + kWidth - 1) / kWidth;
  float w[kTileTokens];
  for (int r = 0; r < rows; ++r)
    for (int g = 0; g < groups; ++g) {
      vfloat vmaxw = vzero();
      for (int c = 0; c < nvec; ++c) {
        const vfloat x = vmul(vload(P + r * kTileTokens + c * kWidth), vload(value_scales[c] + g * BS));
        vstore(w + c * kWidth, x);
        vmaxw = vmax(vmaxw, x);
      }
      std::fill(w + ntok, w + nvec * kWidth, 0.0f);
      const float scale = vhmax(vmaxw) / kQuantMax;
      scales[r * groups + g] = scale;
      const vfloat inv = vset(scale > 0.0f ? 1.0f / scale : 0.0f);
      int16_t* out = codes + (int64_t(r) * groups + g) * kTileTokens;
      for (int c = 0; c < nvec; ++c) istore16(out + c * kWidth, iround(vmul(vload(w + c * kWidth), inv)));
    }
}

// O[MR rows][NG groups' columns] += the int16 weights' products with an int8 cache's values
// (pairs of keys, rows of 2 * head_dim bytes; `blocks` at the first group's columns), times
// each row's weight scale per group. w: row m's group g at w + m * ldw + g * kTileTokens.
template <int MR, int NG>
void int_value_tile(const int16_t* w, int64_t ldw, const float* ws, int64_t ldws, int D, int BS, int ntok,
                    const int8_t* const* blocks, float* O, Prefetch* pf) {
  constexpr int NV = NG * kIntCols;
  vint acc[MR][NV];
  for (int m = 0; m < MR; ++m)
    for (int v = 0; v < NV; ++v) acc[m][v] = izero();
  for (int j = 0, t0 = 0; t0 < ntok; ++j, t0 += BS) {
    const int8_t* row = blocks[j];
    const int t1 = std::min(ntok, t0 + BS);
    for (int t = t0; t < t1; t += 2, row += 2 * D) {
      if (pf) pf->step(kPrefetchPerStep);
      vint b[NV];
      for (int v = 0; v < NV; ++v) b[v] = widen(row + v * kWidth * 2);
      for (int m = 0; m < MR; ++m)
        for (int g = 0; g < NG; ++g) {
          int32_t pair;
          std::memcpy(&pair, w + m * ldw + g * kTileTokens + t, sizeof(pair));
          const vint a = iset(pair);
          for (int v = 0; v < kIntCols; ++v) acc[m][g * kIntCols + v] = dot2(acc[m][g * kIntCols + v], b[g * kIntCols + v], a);
        }
    }
  }
  for (int m = 0; m < MR; ++m)
    for (int g = 0; g < NG; ++g) {
      const vfloat scale = vset(ws[m * ldws + g]);
      for (int v = 0; v < kIntCols; ++v) {
        float* dst = O + m * D + (g * kIntCols + v) * kWidth;
        vstore(dst, vfma(ifloat(acc[m][g * kIntCols + v]), scale, vload(dst)));
      }
    }
}

template <int NG, int... R>
constexpr auto int_value_kernels(std::integer_sequence<int, R...>) {
  return std::array{&int_value_tile<R + 1, NG>...};
}

// The int8 cache's value product: as value_product, from the float weights P.
void value_product_int8(int rows, int D, int BS, int ntok, const float* Ph, const int8_t* v_cache,
                        const int32_t* blocks, int KVH, int h, int64_t chunk, float* Oh, int16_t* wcodes,
                        float* wscales, Prefetch& pf) {
  constexpr int NG = kRegisters == 32 ? 2 : 1;  // groups a pass (their accumulators in registers)
  static constexpr auto kernels = int_value_kernels<NG>(std::make_integer_sequence<int, kIntRows>{});
  static constexpr auto single = int_value_kernels<1>(std::make_integer_sequence<int, kIntRows>{});
  const int nblk = (ntok + BS - 1) / BS, groups = D / kScaleGroup, bvec = BS / kWidth;
  const int8_t* bases[kTileTokens];
  const fp16* scales[kMaxCols];
  for (int j = 0; j < nblk; ++j) {
    bases[j] = v_cache + (int64_t(blocks[j]) * KVH + h) * chunk;
    for (int c = 0; c < bvec; ++c)
      scales[j * bvec + c] = reinterpret_cast<const fp16*>(bases[j] + int64_t(D) * BS) + c * kWidth;
  }
  round_weights(Ph, rows, D, BS, ntok, scales, wcodes, wscales);
  const int first = pf.done, last = std::min(pf.stop, pf.total);
  for (int g = 0; g < groups;) {
    const int ng = groups - g >= NG ? NG : 1;
    const int8_t* group_bases[kTileTokens];
    for (int j = 0; j < nblk; ++j) group_bases[j] = bases[j] + g * kScaleGroup * 2;
    pf.stop = first + (last - first) * (g + ng) / groups;
    for (int m0 = 0; m0 < rows; m0 += kIntRows) {
      const int mr = std::min(kIntRows, rows - m0);
      (ng == NG ? kernels : single)[mr - 1](wcodes + (int64_t(m0) * groups + g) * kTileTokens,
                                            int64_t(groups) * kTileTokens, wscales + m0 * groups + g, groups, D, BS,
                                            ntok, group_bases, Oh + m0 * D + g * kScaleGroup, &pf);
    }
    g += ng;
  }
  pf.finish();
}

// Oh[r] += sum_j P[r][j] v_j for the rows of KV head h over the tile's `ntok` keys.
template <typename Kind, typename VT>
void value_product(int rows, int D, int BS, int ntok, const typename Kind::AType* Ph, const VT* v_cache,
                   const int32_t* blocks, int KVH, int h, int64_t chunk, float* Oh, const VT** cols,
                   Prefetch& pf) {
  constexpr int step = Kind::kStep;
  const int dvec = D / kWidth, nblk = (ntok + BS - 1) / BS;
  for (int j = 0; j < nblk; ++j) {
    const VT* base = v_cache + (int64_t(blocks[j]) * KVH + h) * chunk;
    for (int c = 0; c < dvec; ++c) cols[j * dvec + c] = base + c * kWidth * step;
  }
  small_gemm<Kind>(rows, dvec, ntok, Ph, kTileTokens, cols, dvec, BS, int64_t(D) * step, Oh, D, true, &pf);
}

template <typename QT, typename KT, typename VT>
void attend(const Layout& L, const Item& it, const Item* next, const QT* q, const KT* k_cache,
            const VT* v_cache, QT* out, float* partials) {
  using KindK = typename KindFor<QT, KT>::type;
  using KindV = typename KindFor<QT, VT>::type;
  using AK = typename KindK::AType;
  using AV = typename KindV::AType;
  constexpr CacheKind k_kind = std::is_same<KT, int8_t>::value ? CacheKind::kInt8
                               : std::is_same<KT, bf16>::value ? CacheKind::kPairs : CacheKind::kPlain;
  constexpr CacheKind v_kind = std::is_same<VT, int8_t>::value ? CacheKind::kInt8
                               : std::is_same<VT, bf16>::value ? CacheKind::kPairs : CacheKind::kPlain;
  // Tiles to prefetch ahead: an int8 tile takes half the time to compute, so its blocks are
  // asked for two tiles before they are read, as long before as a 16-bit tile's.
  constexpr int kLead = k_kind == CacheKind::kInt8 || v_kind == CacheKind::kInt8 ? 2 : 1;
  const int G = L.group, D = L.head_dim, BS = L.block_size, H = L.num_heads;
  const int KVH = L.num_kv_heads;
  const int M = rows_of(L, it.q_begin, it.q_end);
  const int MH = M / KVH;  // rows per KV head
  const int q0 = L.query_start[it.seq];
  const int q_len = L.query_start[it.seq + 1] - q0;
  const int first_pos = L.seq_lens[it.seq] - q_len;
  const int dvec = D / kWidth, bvec = BS / kWidth;
  const int64_t k_chunk = chunk_elems(k_kind, D, BS), v_chunk = chunk_elems(v_kind, D, BS);
  Scratch& sc = thread_scratch();
  sc.reserve(M, D);
  float *S = sc.s.data(), *O = sc.o.data();
  float *row_max = sc.m.data(), *row_sum = sc.l.data();
  AK* Q = nullptr;
  AV* P = nullptr;
  if constexpr (std::is_same<AK, float>::value) {
    Q = sc.q.data();
  } else {
    Q = sc.qb.data();
  }
  if constexpr (std::is_same<AV, float>::value) {
    P = S;  // the weights overwrite the scores in place
  } else {
    P = sc.pb.data();
  }
  auto token_of = [&](int r) { return q0 + it.q_begin + (r % MH) / G; };
  auto head_of = [&](int r) { return (r / MH) * G + (r % MH) % G; };

  const int groups = D / kScaleGroup;
  if constexpr (k_kind == CacheKind::kInt8) {
    for (int r = 0; r < M; ++r)
      round_queries<QT>(q + (int64_t(token_of(r)) * H + head_of(r)) * D, D, sc.qi.data() + int64_t(r) * D,
                        sc.qis.data() + r * groups);
  } else {
    for (int r = 0; r < M; ++r) {
      const QT* src = q + (int64_t(token_of(r)) * H + head_of(r)) * D;
      if constexpr (std::is_same<AK, QT>::value) {
        std::copy(src, src + D, Q + r * D);
      } else {
        for (int c = 0; c < dvec; ++c) vstore(Q + r * D + c * kWidth, vload(src + c * kWidth));
      }
    }
  }
  std::fill(O, O + int64_t(M) * D, 0.0f);
  std::fill(row_max, row_max + M, kNegInf);
  std::fill(row_sum, row_sum + M, 0.0f);

  const int32_t* table = L.block_tables + it.seq * L.table_stride;
  const KT* kcols[kMaxCols];
  const VT* vcols[kMaxCols];
  const vfloat scale = vset(L.scale);
  const int limit = std::min(it.kv_end, first_pos + it.q_end);
  const int tile = kTileTokens / BS * BS;  // whole blocks
  // With a sliding window no row sees a key before its first row's window: start at that
  // key's block (the rows' own masks take care of the rest).
  int begin = it.kv_begin;
  if (L.window > 0) begin = std::max(begin, (first_pos + it.q_begin - L.window + 1) / BS * BS);
  for (int t0 = begin; t0 < limit; t0 += tile) {
    const int t1 = std::min(limit, t0 + tile);
    const int ntok = t1 - t0;
    const int nblk = (ntok + BS - 1) / BS;
    const int ncols = nblk * bvec;
    const int32_t* blocks = table + t0 / BS;
    // The blocks of the tile `kLead` tiles on: this item's, or past its last one those of the
    // item this thread takes next, so that no item starts cold.
    const int ahead = t0 + kLead * tile;
    const int32_t* next_table = table + ahead / BS;
    int next_blocks = ahead < limit ? (std::min(limit, ahead + tile) - ahead + BS - 1) / BS : 0;
    if (ahead >= limit && next != nullptr) {
      const int end = begin + (limit - begin + tile - 1) / tile * tile;  // past the last tile
      const int from = next->kv_begin + (ahead - end);
      const int next_q0 = L.query_start[next->seq];
      const int next_limit = std::min(next->kv_end, L.seq_lens[next->seq] - (L.query_start[next->seq + 1] - next_q0) + next->q_end);
      next_table = L.block_tables + next->seq * L.table_stride + from / BS;
      next_blocks = from < next_limit ? (std::min(next_limit - from, tile) + BS - 1) / BS : 0;
    }

    // Ask for the next tile's keys while this one's scores compute, its values while this
    // one's values are summed (the blocks are scattered, which defeats the hardware
    // prefetchers: scattered 2 KB reads ran at 10 GB/s without, 24 with a prefetch ahead).
    Prefetch pf;
    plan_prefetch<KT>(pf, k_cache, next_table, next_blocks, KVH, k_chunk);
    for (int h = 0; h < KVH; ++h) {
      pf.stop = int(int64_t(pf.total) * (h + 1) / KVH);
      if constexpr (k_kind == CacheKind::kInt8) {
        key_product_int8(MH, D, BS, sc.qi.data() + int64_t(h) * MH * D, sc.qis.data() + h * MH * groups, k_cache,
                         blocks, nblk, KVH, h, k_chunk, S + h * MH * kTileTokens, pf);
      } else {
        key_product<KindK, KT>(MH, D, BS, Q + h * MH * D, k_cache, blocks, nblk, KVH, h, k_chunk,
                               S + h * MH * kTileTokens, kcols, pf);
      }
    }

    // Online softmax in base 2: mask past each row's last visible key, rescale what came before.
    for (int r = 0; r < M; ++r) {
      float* srow = S + r * kTileTokens;
      AV* prow = P + r * kTileTokens;
      const int pos = first_pos + it.q_begin + (r % MH) / G;
      const int visible = std::min(pos + 1, t1) - t0;
      // Keys before the row's window (sliding window attention) are masked like future ones.
      const int hidden = L.window > 0 ? std::max(0, pos - L.window + 1 - t0) : 0;
      if (visible <= hidden) {
        std::fill(prow, prow + ncols * kWidth, AV(0.0f));
        continue;
      }
      std::fill(srow, srow + hidden, kNegInf);
      std::fill(srow + visible, srow + ncols * kWidth, kNegInf);
      vfloat vm = vset(kNegInf);
      for (int c = 0; c < ncols; ++c) vm = vmax(vm, vload(srow + c * kWidth));
      const float new_max = std::max(row_max[r], vhmax(vm) * L.scale);
      const vfloat neg_max = vset(-new_max);
      vfloat vs = vzero();
      for (int c = 0; c < ncols; ++c) {
        vfloat p = vexp2(vfma(vload(srow + c * kWidth), scale, neg_max));
        vstore(prow + c * kWidth, p);
        vs = vadd(vs, p);
      }
      const float alpha = std::exp2(row_max[r] - new_max);  // 0 while nothing was seen
      row_sum[r] = row_sum[r] * alpha + vsum(vs);
      if (alpha != 1.0f) {
        const vfloat va = vset(alpha);
        for (int c = 0; c < dvec; ++c)
          vstore(O + r * D + c * kWidth, vmul(vload(O + r * D + c * kWidth), va));
      }
      row_max[r] = new_max;
    }

    // O += P V: rows are the tile's keys, one segment per block.
    plan_prefetch<VT>(pf, v_cache, next_table, next_blocks, KVH, v_chunk);
    for (int h = 0; h < KVH; ++h) {
      pf.stop = int(int64_t(pf.total) * (h + 1) / KVH);
      if constexpr (v_kind == CacheKind::kInt8) {
        value_product_int8(MH, D, BS, ntok, P + h * MH * kTileTokens, v_cache, blocks, KVH, h, v_chunk,
                           O + h * MH * D, sc.wi.data(), sc.wis.data(), pf);
      } else {
        value_product<KindV, VT>(MH, D, BS, ntok, P + h * MH * kTileTokens, v_cache, blocks, KVH, h, v_chunk,
                                 O + h * MH * D, vcols, pf);
      }
    }
  }

  if (it.partial >= 0) {  // a piece of a split key range: keep (O, max, sum) for the merge
    float* p = partials + it.partial;
    std::copy(O, O + int64_t(M) * D, p);
    std::copy(row_max, row_max + M, p + int64_t(M) * D);
    std::copy(row_sum, row_sum + M, p + int64_t(M) * D + M);
    return;
  }
  for (int r = 0; r < M; ++r) {
    QT* dst = out + (int64_t(token_of(r)) * H + head_of(r)) * D;
    const vfloat inv = vset(row_sum[r] > 0 ? 1.0f / row_sum[r] : 0.0f);
    for (int c = 0; c < dvec; ++c) vstore(dst + c * kWidth, vmul(vload(O + r * D + c * kWidth), inv));
  }
}

template <typename QT>
void merge(const Layout& L, const Split& sp, const float* partials, QT* out) {
  const int G = L.group, D = L.head_dim, H = L.num_heads;
  const int M = rows_of(L, sp.q_begin, sp.q_end);
  const int MH = M / L.num_kv_heads;
  const int64_t stride = int64_t(M) * (D + 2);
  const int q0 = L.query_start[sp.seq];
  for (int m = 0; m < M; ++m) {
    float top = kNegInf;
    for (int j = 0; j < sp.pieces; ++j)
      top = std::max(top, partials[sp.first_partial + j * stride + int64_t(M) * D + m]);
    QT* dst = out + (int64_t(q0 + sp.q_begin + (m % MH) / G) * H + (m / MH) * G + (m % MH) % G) * D;
    for (int c = 0; c < D / kWidth; ++c) {
      vfloat acc = vzero();
      float total = 0.0f;
      for (int j = 0; j < sp.pieces; ++j) {
        const float* p = partials + sp.first_partial + j * stride;
        const float w = top == kNegInf ? 0.0f : std::exp2(p[int64_t(M) * D + m] - top);
        total += w * p[int64_t(M) * D + M + m];
        acc = vfma(vset(w), vload(p + m * D + c * kWidth), acc);
      }
      vstore(dst + c * kWidth, vmul(acc, vset(total > 0 ? 1.0f / total : 0.0f)));
    }
  }
}

template <typename QT, typename KT, typename VT>
void run(const Layout& L, int num_seqs, const at::Tensor& q, const at::Tensor& k_cache,
         const at::Tensor& v_cache, at::Tensor& out) {
  const int threads = at::get_num_threads();
  std::vector<Item> items;
  std::vector<Split> splits;
  int64_t partial_floats = 0;
  plan(L, num_seqs, threads, items, splits, partial_floats);
  std::unique_ptr<float[]> partials(partial_floats ? new float[partial_floats] : nullptr);
  const QT* qp = reinterpret_cast<const QT*>(q.data_ptr());
  const KT* kp = reinterpret_cast<const KT*>(k_cache.data_ptr());
  const VT* vp = reinterpret_cast<const VT*>(v_cache.data_ptr());
  QT* op = reinterpret_cast<QT*>(out.data_ptr());
  std::atomic<size_t> next{0};
  at::parallel_for(0, threads, 1, [&](int64_t, int64_t) {
    // Each thread claims its next item before finishing this one, to prefetch its first keys.
    size_t i = next.fetch_add(1);
    while (i < items.size()) {
      const size_t j = next.fetch_add(1);
      const Item* after = j < items.size() ? &items[j] : nullptr;
      attend<QT, KT, VT>(L, items[i], after, qp, kp, vp, op, partials.get());
      i = j;
    }
  });
  if (!splits.empty()) {
    at::parallel_for(0, int64_t(splits.size()), 1, [&](int64_t begin, int64_t end) {
      for (int64_t i = begin; i < end; ++i) merge<QT>(L, splits[i], partials.get(), op);
    });
  }
}

// The cache dtypes taken: K and V alike, or one of them int8 beside a float one.
template <typename F>
void with_cache_types(at::ScalarType kt, at::ScalarType vt, const F& f) {
  auto with_float = [](at::ScalarType t, const auto& g) {
    switch (t) {
      case at::kFloat: return g(float{});
      case at::kBFloat16: return g(bf16{});
      case at::kHalf: return g(fp16{});
      default: TORCH_CHECK(false, "quill::paged_attention: KV cache dtype ", t, " is not supported");
    }
  };
  if (kt == at::kChar && vt == at::kChar) return f(int8_t{}, int8_t{});
  if (kt == at::kChar) return with_float(vt, [&](auto v) { return f(int8_t{}, v); });
  if (vt == at::kChar) return with_float(kt, [&](auto k) { return f(k, int8_t{}); });
  TORCH_CHECK(kt == vt, "quill::paged_attention: K cache ", kt, " and V cache ", vt,
              " differ (only int8 beside a float type)");
  return with_float(kt, [&](auto k) { return f(k, k); });
}

template <typename QT>
void run_q(const Layout& L, int num_seqs, const at::Tensor& q, const at::Tensor& k_cache,
           const at::Tensor& v_cache, at::Tensor& out) {
  with_cache_types(k_cache.scalar_type(), v_cache.scalar_type(), [&](auto k, auto v) {
    run<QT, decltype(k), decltype(v)>(L, num_seqs, q, k_cache, v_cache, out);
  });
}

template <typename QT, typename KT>
std::string kind_name() {
  using Kind = typename KindFor<QT, KT>::type;
  if constexpr (std::is_same<Kind, FmaPairs>::value) return "fp32 FMA on bf16 row pairs";
#if defined(QUILL_AVX512)
  if constexpr (std::is_same<Kind, DotPairs>::value) return "bf16 dot products (vdpbf16ps)";
#endif
  if constexpr (std::is_same<KT, fp16>::value) return "fp32 FMA on fp16 (F16C)";
#if defined(QUILL_AVX512)
  if constexpr (std::is_same<KT, int8_t>::value) return "int8 codes widened, int16 dot products (vpdpwssd)";
#else
  if constexpr (std::is_same<KT, int8_t>::value) return "int8 codes widened, int16 dot products (vpmaddwd)";
#endif
  return "fp32 FMA";
}

template <typename QT>
std::string kind_name_q(at::ScalarType k_dtype, at::ScalarType v_dtype) {
  std::string name;
  with_cache_types(k_dtype, v_dtype, [&](auto k, auto v) {
    const std::string kn = kind_name<QT, decltype(k)>();
    const std::string vn = kind_name<QT, decltype(v)>();
    name = kn == vn ? kn : "keys: " + kn + "; values: " + vn;
  });
  return name;
}

}  // namespace

std::string attention_kernel(at::ScalarType q_dtype, at::ScalarType k_dtype, at::ScalarType v_dtype) {
  std::string name;
  switch (q_dtype) {
    case at::kFloat: name = kind_name_q<float>(k_dtype, v_dtype); break;
    case at::kBFloat16: name = kind_name_q<bf16>(k_dtype, v_dtype); break;
    case at::kHalf: name = kind_name_q<fp16>(k_dtype, v_dtype); break;
    default: name = "unsupported";
  }
  return name + ", " + std::to_string(kWidth * 32) + "-bit vectors";
}

at::Tensor paged_attention(const at::Tensor& q_in, const at::Tensor& k, const at::Tensor& v,
                           at::Tensor& k_cache, at::Tensor& v_cache,
                           const at::Tensor& slot_mapping, const at::Tensor& block_tables,
                           const at::Tensor& seq_lens, const at::Tensor& query_start_loc,
                           double scale, int64_t window) {
  const char* op = "quill::paged_attention";
  TORCH_CHECK(window >= 0 && window <= (int64_t(1) << 30), op, ": window ", window, " out of range");
  const CacheGeometry g = cache_geometry(k_cache, v_cache, op);
  TORCH_CHECK(q_in.dim() == 3, op, ": q must be [tokens, heads, head_dim]");
  TORCH_CHECK(block_tables.scalar_type() == at::kInt && seq_lens.scalar_type() == at::kInt &&
                  query_start_loc.scalar_type() == at::kInt,
              op, ": block_tables, seq_lens and query_start_loc must be int32");
  TORCH_CHECK(block_tables.dim() == 2 && block_tables.is_contiguous(), op,
              ": block_tables must be a contiguous [seqs, blocks] tensor");
  TORCH_CHECK(seq_lens.dim() == 1 && seq_lens.is_contiguous() && query_start_loc.dim() == 1 &&
                  query_start_loc.is_contiguous(),
              op, ": seq_lens and query_start_loc must be contiguous vectors");
  const int num_seqs = int(seq_lens.numel());
  TORCH_CHECK(query_start_loc.numel() == num_seqs + 1 && block_tables.size(0) == num_seqs, op, ": ",
              num_seqs, " sequences but ", query_start_loc.numel(), " query offsets and ",
              block_tables.size(0), " block tables");
  const at::Tensor q = q_in.contiguous();
  const int num_heads = int(q.size(1)), D = g.head_dim, BS = g.block_size;
  TORCH_CHECK(q.size(2) == D, op, ": q's head_dim ", q.size(2), " is not the cache's ", D);
  TORCH_CHECK(num_heads % g.num_kv_heads == 0, op, ": ", num_heads, " heads are not a multiple of ",
              g.num_kv_heads, " KV heads");
  TORCH_CHECK(D % kWidth == 0 && (kTileTokens / kWidth) * (D / kWidth) <= kMaxCols, op, ": head_dim ", D,
              " must be a multiple of ", kWidth, " up to ", kMaxCols * kWidth * kWidth / kTileTokens);
  TORCH_CHECK(BS % kWidth == 0 && BS <= kTileTokens, op, ": block_size ", BS, " must be a multiple of ",
              kWidth, " up to ", kTileTokens);

  write_kv(k, v, k_cache, v_cache, slot_mapping);

  const int32_t* qsl = query_start_loc.data_ptr<int32_t>();
  const int32_t* lens = seq_lens.data_ptr<int32_t>();
  const int64_t tokens = q.size(0);
  TORCH_CHECK(num_seqs == 0 || qsl[0] == 0, op, ": query_start_loc must start at 0");
  for (int b = 0; b < num_seqs; ++b) {
    const int n = qsl[b + 1] - qsl[b];
    TORCH_CHECK(n >= 0 && qsl[b + 1] <= tokens, op, ": query_start_loc is not increasing within ", tokens,
                " tokens");
    TORCH_CHECK(lens[b] >= n && (lens[b] + BS - 1) / BS <= block_tables.size(1), op, ": sequence ", b, " has ",
                lens[b], " keys for ", n, " queries and ", block_tables.size(1), " blocks");
  }
  const int32_t* tables = block_tables.data_ptr<int32_t>();
  for (int b = 0; b < num_seqs; ++b)
    for (int j = 0; j < (lens[b] + BS - 1) / BS; ++j) {
      const int32_t id = tables[b * block_tables.size(1) + j];
      TORCH_CHECK(id >= 0 && id < g.num_blocks, op, ": block id ", id, " out of range");
    }

  at::Tensor out = at::empty_like(q);
  const int64_t used = num_seqs ? qsl[num_seqs] : 0;
  if (used < tokens) out.narrow(0, used, tokens - used).zero_();
  Layout L{num_heads,
           g.num_kv_heads,
           D,
           BS,
           num_heads / g.num_kv_heads,
           block_tables.size(1),
           tables,
           lens,
           qsl,
           float(scale) * kLog2e,
           int(window)};
  switch (q.scalar_type()) {
    case at::kFloat: run_q<float>(L, num_seqs, q, k_cache, v_cache, out); break;
    case at::kBFloat16: run_q<bf16>(L, num_seqs, q, k_cache, v_cache, out); break;
    case at::kHalf: run_q<fp16>(L, num_seqs, q, k_cache, v_cache, out); break;
    default: TORCH_CHECK(false, op, ": q dtype ", q.scalar_type(), " is not supported");
  }
  return out;
}

}  // namespace quill
