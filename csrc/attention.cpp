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
// their partial results (max, sum, unnormalised output) merged afterwards. Items are handed out
// largest first from an atomic counter, so uneven contexts do not leave a thread idle.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty_like.h>
#include <c10/util/Exception.h>

#include <algorithm>
#include <atomic>
#include <cmath>
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
  }
};

Scratch& thread_scratch() {
  thread_local Scratch scratch;
  return scratch;
}

// The next tile's part of one KV head (`count` blocks), for the products to prefetch as they
// run: issued a few lines per step of their inner loops, the requests overlap the arithmetic
// (~20% faster than issuing them all before each product, and twice the rate of no prefetch).
template <typename KT>
inline void plan_prefetch(Prefetch& pf, const KT* cache, const int32_t* blocks, int count,
                          int kv_heads, int h, int64_t head_elems, int lines) {
  for (int j = 0; j < count; ++j)
    pf.bases[j] = reinterpret_cast<const char*>(cache + (int64_t(blocks[j]) * kv_heads + h) * head_elems);
  pf.lines_per_base = lines;
  pf.total = count * lines;
  pf.done = 0;
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

template <typename QT, typename KT>
void attend(const Layout& L, const Item& it, const Item* next, const QT* q, const KT* k_cache,
            const KT* v_cache, QT* out, float* partials) {
  using Kind = typename KindFor<QT, KT>::type;
  using A = typename Kind::AType;
  constexpr int step = Kind::kStep;  // 2: bf16 blocks hold rows in interleaved pairs
  const int G = L.group, D = L.head_dim, BS = L.block_size, H = L.num_heads;
  const int KVH = L.num_kv_heads;
  const int M = rows_of(L, it.q_begin, it.q_end);
  const int MH = M / KVH;  // rows per KV head
  const int q0 = L.query_start[it.seq];
  const int q_len = L.query_start[it.seq + 1] - q0;
  const int first_pos = L.seq_lens[it.seq] - q_len;
  const int dvec = D / kWidth, bvec = BS / kWidth;
  const int64_t head_elems = int64_t(D) * BS;  // one KV head's part of a block
  Scratch& sc = thread_scratch();
  sc.reserve(M, D);
  float *S = sc.s.data(), *O = sc.o.data();
  float *row_max = sc.m.data(), *row_sum = sc.l.data();
  A* Q = nullptr;
  A* P = nullptr;
  if constexpr (std::is_same<A, float>::value) {
    Q = sc.q.data();
    P = S;  // the weights overwrite the scores in place
  } else {
    Q = sc.qb.data();
    P = sc.pb.data();
  }
  auto token_of = [&](int r) { return q0 + it.q_begin + (r % MH) / G; };
  auto head_of = [&](int r) { return (r / MH) * G + (r % MH) % G; };

  for (int r = 0; r < M; ++r) {
    const QT* src = q + (int64_t(token_of(r)) * H + head_of(r)) * D;
    if constexpr (std::is_same<A, QT>::value) {
      std::copy(src, src + D, Q + r * D);
    } else {
      for (int c = 0; c < dvec; ++c) vstore(Q + r * D + c * kWidth, vload(src + c * kWidth));
    }
  }
  std::fill(O, O + int64_t(M) * D, 0.0f);
  std::fill(row_max, row_max + M, kNegInf);
  std::fill(row_sum, row_sum + M, 0.0f);

  const int32_t* table = L.block_tables + it.seq * L.table_stride;
  const KT* cols[kMaxCols];
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
    const int first_block = t0 / BS;
    // The blocks of the next tile: this item's, or after its last one the first of the item
    // this thread takes next, so that no item starts cold.
    const int32_t* next_table = table + t1 / BS;
    int next_blocks = t1 < limit ? (std::min(limit, t1 + tile) - t1 + BS - 1) / BS : 0;
    if (t1 >= limit && next != nullptr) {
      const int next_q0 = L.query_start[next->seq];
      const int next_limit = std::min(next->kv_end, L.seq_lens[next->seq] - (L.query_start[next->seq + 1] - next_q0) + next->q_end);
      next_table = L.block_tables + next->seq * L.table_stride + next->kv_begin / BS;
      next_blocks = (std::min(next_limit - next->kv_begin, tile) + BS - 1) / BS;
    }

    // Ask for the next tile's keys while this one's scores compute, its values while this
    // one's values are summed (the blocks are scattered, which defeats the hardware
    // prefetchers: scattered 2 KB reads ran at 10 GB/s without, 24 with a prefetch ahead).
    Prefetch pf;
    const int lines = int(head_elems * int64_t(sizeof(KT)) / 64);
    for (int h = 0; h < KVH; ++h) {
      plan_prefetch<KT>(pf, k_cache, next_table, next_blocks, KVH, h, head_elems, lines);
      // Scores S[r][j] = q_r . k_j: columns are the tile's keys, block by block.
      for (int j = 0; j < nblk; ++j) {
        const KT* base = k_cache + (int64_t(table[first_block + j]) * KVH + h) * head_elems;
        for (int c = 0; c < bvec; ++c) cols[j * bvec + c] = base + c * kWidth * step;
      }
      small_gemm<Kind>(MH, ncols, D, Q + h * MH * D, D, cols, 0, D, int64_t(BS) * step,
                       S + h * MH * kTileTokens, kTileTokens, false, &pf);
    }

    // Online softmax in base 2: mask past each row's last visible key, rescale what came before.
    for (int r = 0; r < M; ++r) {
      float* srow = S + r * kTileTokens;
      A* prow = P + r * kTileTokens;
      const int pos = first_pos + it.q_begin + (r % MH) / G;
      const int visible = std::min(pos + 1, t1) - t0;
      // Keys before the row's window (sliding window attention) are masked like future ones.
      const int hidden = L.window > 0 ? std::max(0, pos - L.window + 1 - t0) : 0;
      if (visible <= hidden) {
        std::fill(prow, prow + ncols * kWidth, A(0.0f));
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
    for (int h = 0; h < KVH; ++h) {
      plan_prefetch<KT>(pf, v_cache, next_table, next_blocks, KVH, h, head_elems, lines);
      for (int j = 0; j < nblk; ++j) {
        const KT* base = v_cache + (int64_t(table[first_block + j]) * KVH + h) * head_elems;
        for (int c = 0; c < dvec; ++c) cols[j * dvec + c] = base + c * kWidth * step;
      }
      small_gemm<Kind>(MH, dvec, ntok, P + h * MH * kTileTokens, kTileTokens, cols, dvec, BS,
                       int64_t(D) * step, O + h * MH * D, D, true, &pf);
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

template <typename QT, typename KT>
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
  const KT* vp = reinterpret_cast<const KT*>(v_cache.data_ptr());
  QT* op = reinterpret_cast<QT*>(out.data_ptr());
  std::atomic<size_t> next{0};
  at::parallel_for(0, threads, 1, [&](int64_t, int64_t) {
    // Each thread claims its next item before finishing this one, to prefetch its first keys.
    size_t i = next.fetch_add(1);
    while (i < items.size()) {
      const size_t j = next.fetch_add(1);
      const Item* after = j < items.size() ? &items[j] : nullptr;
      attend<QT, KT>(L, items[i], after, qp, kp, vp, op, partials.get());
      i = j;
    }
  });
  if (!splits.empty()) {
    at::parallel_for(0, int64_t(splits.size()), 1, [&](int64_t begin, int64_t end) {
      for (int64_t i = begin; i < end; ++i) merge<QT>(L, splits[i], partials.get(), op);
    });
  }
}

template <typename QT>
void run_q(const Layout& L, int num_seqs, const at::Tensor& q, const at::Tensor& k_cache,
           const at::Tensor& v_cache, at::Tensor& out) {
  switch (k_cache.scalar_type()) {
    case at::kFloat: return run<QT, float>(L, num_seqs, q, k_cache, v_cache, out);
    case at::kBFloat16: return run<QT, bf16>(L, num_seqs, q, k_cache, v_cache, out);
    case at::kHalf: return run<QT, fp16>(L, num_seqs, q, k_cache, v_cache, out);
    default: TORCH_CHECK(false, "quill::paged_attention: KV cache dtype ", k_cache.scalar_type(), " is not supported");
  }
}

template <typename QT, typename KT>
std::string kind_name() {
  using Kind = typename KindFor<QT, KT>::type;
  if constexpr (std::is_same<Kind, FmaPairs>::value) return "fp32 FMA on bf16 row pairs";
#if defined(QUILL_AVX512)
  if constexpr (std::is_same<Kind, DotPairs>::value) return "bf16 dot products (vdpbf16ps)";
#endif
  if constexpr (std::is_same<KT, fp16>::value) return "fp32 FMA on fp16 (F16C)";
  return "fp32 FMA";
}

template <typename QT>
std::string kind_name_q(at::ScalarType kv) {
  switch (kv) {
    case at::kFloat: return kind_name<QT, float>();
    case at::kBFloat16: return kind_name<QT, bf16>();
    case at::kHalf: return kind_name<QT, fp16>();
    default: return "unsupported";
  }
}

}  // namespace

std::string attention_kernel(at::ScalarType q_dtype, at::ScalarType kv_dtype) {
  std::string name;
  switch (q_dtype) {
    case at::kFloat: name = kind_name_q<float>(kv_dtype); break;
    case at::kBFloat16: name = kind_name_q<bf16>(kv_dtype); break;
    case at::kHalf: name = kind_name_q<fp16>(kv_dtype); break;
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
