// Tests of the lightning indexer's CPU path (LightningIndexer on Device::cpu() tensors):
//   - selections on random data against an independent fp64 brute force (scores in double from the
//     spec's formula, positions from the test's own request lengths, a full sort), through the set
//     comparison (indexer_compare.h) and exactly wherever the fp64 ranking is clear at the cut;
//   - exact selections where the answer is known by construction: short sequences, block edges,
//     forced blocks, ties, NaN and -inf scores, padded decode rows, topk 1 and 64; a shuffled block
//     table gives what the identity table gives;
//   - the reference's scores are the spec's fp32 sums, bit for bit; indexer_select_ref on
//     hand-made scores; the comparison catches each kind of wrong row;
//   - output rows past T and the padding of strided rows stay untouched (poisoned with 0x7F);
//   - validation: IndexerConfig, the call arguments, and inconsistent device-resident lengths and
//     page ids, which must throw before anything is written.
// Shared helpers: tests/test_util.h.
#include <numeric>

#include "m3rt/lightning_indexer.h"
#include "ops/lightning_indexer/indexer_compare.h"
#include "ops/lightning_indexer/lightning_indexer.h"
#include "test_util.h"

namespace {

using namespace m3rt;
using namespace m3rt_test;

constexpr int kBs = kIndexBlockSize;
// A 128-term fp32 dot is within gamma_128 < 129 * 2^-24 of sum |q k| of the exact one.
constexpr double kRelTol = 129 * 0x1p-24;
constexpr uint8_t kPoisonByte = 0x7F;  // 0x7F7F7F7F: no valid id (0xFF bytes would read -1)
constexpr int32_t kPoisonId = 0x7F7F7F7F;

// ---- problems -----------------------------------------------------------------------------------

// One indexer call: the description, then (build) its host inputs. Every request's keys at
// positions < seq_len are random; every other cache row is NaN (0xFF bytes), and block_table
// entries past a request's blocks hold garbage page ids.
struct Problem {
  bool fp8 = false;
  int H = 1;
  IndexerSelection sel{4, 0, 1};
  int dql = 0;                // decode_query_len; 0: prefill
  std::vector<int> seq_lens;
  std::vector<int> q_lens;    // prefill: query tokens of each request
  DType q_dtype = DType::kBFloat16;  // with fp8: kUInt8 or kFloat8E4M3

  Tensor q, cache, cu, lens, table;
  int64_t T = 0;
  int max_query_len = 0, width = 0;

  Problem& build(Rng& r, bool shuffle = true) {
    const int B = int(seq_lens.size());
    if (fp8 && q_dtype == DType::kBFloat16) q_dtype = DType::kUInt8;
    const std::vector<int32_t> c = query_offsets(B, dql, q_lens, max_query_len);
    T = c.back();
    int used = 0;
    width = 1;
    for (int len : seq_lens) {
      used += (len + kBs - 1) / kBs;
      width = std::max(width, (len + kBs - 1) / kBs + 1);
    }
    const int pages = used + 2;
    const std::vector<int32_t> perm = page_order(r, pages, shuffle);
    table = Tensor::empty({B, width}, DType::kInt32);
    const int32_t garbage[] = {-1, pages, INT32_MAX, pages + 7, INT32_MIN};
    int next = 0;
    for (int b = 0; b < B; ++b)
      for (int j = 0; j < width; ++j)
        table.ptr<int32_t>()[b * width + j] =
            j < (seq_lens[size_t(b)] + kBs - 1) / kBs ? perm[size_t(next++)] : garbage[(b + j) % 5];
    cache = filled({pages, kBs, 128}, fp8 ? DType::kUInt8 : DType::kBFloat16, 0xFF);
    for (int b = 0; b < B; ++b)
      for (int64_t n = 0; n < seq_lens[size_t(b)]; ++n)
        for (int d = 0; d < 128; ++d) set_key(b, n, d, value(r));
    q = Tensor::empty({T, H, 128}, q_dtype);
    for (int64_t i = 0; i < q.numel(); ++i) set(q, i, value(r));
    cu = Tensor::empty({B + 1}, DType::kInt32);
    std::copy(c.begin(), c.end(), cu.ptr<int32_t>());
    lens = Tensor::empty({B}, DType::kInt32);
    std::copy(seq_lens.begin(), seq_lens.end(), lens.ptr<int32_t>());
    return *this;
  }

  double value(Rng& r) const { return fp8 ? r.uni(-2, 2) : r.uni(-1, 1); }
  void set(Tensor& t, int64_t elem, double v) {
    if (fp8) t.ptr<uint8_t>()[elem] = float_to_e4m3(float(v));
    else t.ptr<uint16_t>()[elem] = float_to_bf16(float(v));
  }
  double get(const Tensor& t, int64_t elem) const {
    return fp8 ? e4m3_to_float(t.ptr<uint8_t>()[elem]) : bf16_to_float(t.ptr<uint16_t>()[elem]);
  }
  // Element 0 of the key at position n of request b.
  int64_t key_elem(int b, int64_t n) const {
    return (int64_t(table.ptr<int32_t>()[b * width + n / kBs]) * kBs + n % kBs) * 128;
  }
  void set_key(int b, int64_t n, int d, double v) { set(cache, key_elem(b, n) + d, v); }
  void set_q(int64_t t, int h, int d, double v) { set(q, (t * H + h) * 128 + d, v); }

  // Scores by construction: every token's q of head h is e_h (one-hot on dim h), and every key of
  // block j of request b holds v[j] in dim h, so head h scores block j exactly v[j].
  void set_block_scores(int b, int h, const std::vector<double>& v) {
    for (int64_t t = 0; t < T; ++t)
      for (int d = 0; d < 128; ++d) set_q(t, h, d, d == h ? 1.0 : 0.0);
    for (int64_t n = 0; n < seq_lens[size_t(b)]; ++n) set_key(b, n, h, v[size_t(n / kBs)]);
  }

  IndexerConfig config() const {
    IndexerConfig c;
    c.num_index_heads = H;
    c.select = sel;
    c.index_cache_dtype = fp8 ? KvCacheDtype::kFp8E4M3 : KvCacheDtype::kBFloat16;
    c.max_prefill_tokens = dql ? 0 : T;
    c.max_decode_seqs = dql ? int(seq_lens.size()) : 0;
    c.max_decode_query_len = std::max(dql, 1);
    c.max_blocks_per_seq = width;
    return c;
  }

  // The internal params of this call over the host tensors (for the comparison and the
  // reference's row scores).
  IndexerParams params() const {
    return indexer_call_params(config(), q, cache, lens, table, TensorView{}, cu, dql, max_query_len);
  }
};

// The op's output: [T + extra, H * topk + pad] int32, poisoned, written through a [T, H, topk]
// view with row stride H * topk + pad.
struct Output {
  Tensor buf;
  int64_t row_stride = 0;
  int topk = 0;
  std::vector<int32_t> list(int64_t t, int h) const {
    const int32_t* p = buf.ptr<int32_t>() + t * row_stride + h * topk;
    return {p, p + topk};
  }
};

// Runs LightningIndexer on the CPU; checks that the row padding and the rows past T stay poisoned.
Output run(const Problem& P, int64_t pad = 0, int64_t extra = 2) {
  const int K = P.sel.topk;
  Output o{filled({P.T + extra, P.H * K + pad}, DType::kInt32, kPoisonByte), P.H * K + pad, K};
  TensorView out = TensorView::contiguous(o.buf.data(), DType::kInt32, {P.T, P.H, K});
  out.stride[0] = o.row_stride;
  LightningIndexer indexer(P.config(), Device::cpu());
  if (P.dql) {
    indexer.decode({.index_q = P.q, .index_cache = P.cache, .seq_lens = P.lens, .block_table = P.table,
                    .decode_query_len = P.dql, .topk_out = out});
  } else {
    indexer.prefill({.index_q = P.q, .index_cache = P.cache, .cu_seqlens_q = P.cu, .seq_lens = P.lens,
                     .block_table = P.table, .max_query_len = P.max_query_len, .topk_out = out});
  }
  Mismatches mm;
  for (int64_t t = 0; t < P.T + extra; ++t)
    for (int64_t i = t < P.T ? P.H * K : 0; i < o.row_stride; ++i)
      if (o.buf.ptr<int32_t>()[t * o.row_stride + i] != kPoisonId)
        mm.add("untouched entry written: row " + std::to_string(t) + " column " + std::to_string(i));
  return o;
}

// ---- the fp64 brute force -----------------------------------------------------------------------

// The spec's scores (§3.2) in fp64 (detail::indexer_oracle_row_scores: products exact, sums in
// double, NaN dots skipped), and positions from the problem's own request lengths.
class Oracle {
 public:
  explicit Oracle(const Problem& P) : P_(P), scores_(detail::indexer_oracle_row_scores(P.params())) {}
  // Request and position of token t; false for a padded row.
  bool position(int64_t t, int* b, int64_t* pos) const {
    if (P_.dql) {
      *b = int(t / P_.dql);
      *pos = P_.seq_lens[size_t(*b)] - P_.dql + t % P_.dql;
    } else {
      int64_t first = 0;
      *b = 0;
      while (t >= first + P_.q_lens[size_t(*b)]) first += P_.q_lens[size_t((*b)++)];
      *pos = P_.seq_lens[size_t(*b)] - P_.q_lens[size_t(*b)] + (t - first);
    }
    return *pos >= 0;
  }
  int scores(int64_t t, int h, std::vector<double>& s) const { return scores_(t, h, s); }

 private:
  const Problem& P_;
  detail::IndexerRowScores scores_;
};

bool is_forced(int j, int nb, const IndexerSelection& sel) {
  return j < sel.init_blocks || j >= nb - sel.local_blocks;
}

// The selection by a full sort: forced blocks, then the rest by (score desc, NaN last, id asc).
std::vector<int32_t> oracle_select(const std::vector<double>& s, int nb, const IndexerSelection& sel) {
  std::vector<int32_t> out, rest;
  for (int j = 0; j < nb; ++j) (is_forced(j, nb, sel) ? out : rest).push_back(j);
  std::sort(rest.begin(), rest.end(), [&](int a, int b) {
    const double x = s[size_t(a)], y = s[size_t(b)];
    if (std::isnan(x) != std::isnan(y)) return std::isnan(y);
    if (!std::isnan(x) && x != y) return x > y;
    return a < b;
  });
  const size_t k = size_t(std::min(sel.topk, nb));
  for (size_t i = 0; out.size() < k; ++i) out.push_back(rest[i]);
  std::sort(out.begin(), out.end());
  out.resize(size_t(sel.topk), -1);
  return out;
}

// Checks every row against the brute force: as sets within the fp32 error bounds, and exactly
// where the fp64 scores leave a clear gap (> 0.01, far above the fp32 error of these values) between
// the last block taken and the first left out. Returns how many rows were checked exactly.
int64_t check_against_oracle(const Problem& P, const Output& o) {
  const Oracle oracle(P);
  const detail::IndexerCompareResult r = detail::compare_indexer_topk(
      P.params(), o.buf.ptr<int32_t>(), o.row_stride,
      [&](int64_t t, int h, std::vector<double>& s) { return oracle.scores(t, h, s); }, kRelTol);
  EXPECT_TRUE(r.pass()) << r.summary() << "\n" << r.first_failures;
  EXPECT_EQ(r.rows_checked, P.T * P.H);
  int64_t exact = 0;
  std::vector<double> s;
  for (int64_t t = 0; t < P.T; ++t)
    for (int h = 0; h < P.H; ++h) {
      const int nb = oracle.scores(t, h, s);
      const std::vector<int32_t> want = oracle_select(s, nb, P.sel);
      double lo = INFINITY, hi = -INFINITY;  // NaN as -inf
      for (int j = 0; j < nb; ++j) {
        const double v = std::isnan(s[size_t(j)]) ? -INFINITY : s[size_t(j)];
        const bool taken = std::find(want.begin(), want.end(), j) != want.end();
        if (taken && !is_forced(j, nb, P.sel)) lo = std::min(lo, v);
        if (!taken) hi = std::max(hi, v);
      }
      if (lo == INFINITY || hi == -INFINITY || lo - hi > 0.01) {
        ++exact;
        EXPECT_EQ(o.list(t, h), want) << "token " << t << " head " << h;
      }
    }
  return exact;
}

std::vector<int32_t> ids(std::initializer_list<int32_t> valid, int topk) {
  std::vector<int32_t> v(valid);
  v.resize(size_t(topk), -1);
  return v;
}
std::vector<int32_t> iota_ids(int n, int topk) {
  std::vector<int32_t> v(size_t(topk), -1);
  for (int j = 0; j < std::min(n, topk); ++j) v[size_t(j)] = j;
  return v;
}

// ---- selections on random data ------------------------------------------------------------------

TEST(IndexerCpu, FewerVisibleBlocksThanTopk) {
  Rng r(1);
  SEED_TRACE(r);
  Problem P{.H = 2, .sel = {16, 0, 1}, .dql = 4, .seq_lens = {300, 1000, 5}};
  P.build(r);
  const Output o = run(P);
  Oracle oracle(P);
  for (int64_t t = 0; t < P.T; ++t) {
    int b;
    int64_t pos;
    const bool has = oracle.position(t, &b, &pos);
    for (int h = 0; h < P.H; ++h)  // every visible block, ascending
      EXPECT_EQ(o.list(t, h), iota_ids(has ? int(pos / kBs) + 1 : 0, 16)) << "token " << t;
  }
  check_against_oracle(P, o);
}

TEST(IndexerCpu, ExactlyTopkBlocks) {
  Rng r(2);
  SEED_TRACE(r);
  // dql 2 rows at positions 2046, 2047 (16 blocks = topk: all of them), then 2047, 2048 (17).
  Problem P{.H = 2, .sel = {16, 0, 1}, .dql = 2, .seq_lens = {2048, 2049}};
  P.build(r);
  const Output o = run(P);
  for (int h = 0; h < 2; ++h) {
    EXPECT_EQ(o.list(0, h), iota_ids(16, 16));
    EXPECT_EQ(o.list(1, h), iota_ids(16, 16));
    EXPECT_EQ(o.list(2, h), iota_ids(16, 16));
    EXPECT_EQ(o.list(3, h).back(), 16) << "the local block is the last entry";
  }
  check_against_oracle(P, o);
}

TEST(IndexerCpu, OneBlock) {
  Rng r(3);
  SEED_TRACE(r);
  // A 100-token prefill and a single-token one: every token sees block 0 only.
  Problem P{.H = 2, .sel = {16, 0, 1}, .seq_lens = {100, 1}, .q_lens = {100, 1}};
  P.build(r);
  const Output o = run(P);
  for (int64_t t = 0; t < P.T; ++t)
    for (int h = 0; h < 2; ++h) EXPECT_EQ(o.list(t, h), ids({0}, 16)) << "token " << t;
  check_against_oracle(P, o);
}

TEST(IndexerCpu, PositionsAtBlockEdges) {
  // dql 2: rows at positions 127, 128 (seq_len 129) and 255, 256 (seq_len 257).
  for (int topk : {1, 2}) {
    Rng r(4);
    SEED_TRACE(r);
    Problem P{.H = 2, .sel = {topk, 0, 1}, .dql = 2, .seq_lens = {129, 257}};
    P.build(r);
    const Output o = run(P);
    const int64_t pos[] = {127, 128, 255, 256};
    for (int t = 0; t < 4; ++t)
      for (int h = 0; h < 2; ++h) {
        const int32_t local = int32_t(pos[t] / kBs);
        const std::vector<int32_t> want =
            topk == 1 ? ids({local}, 1) : local == 0 ? ids({0}, 2) : ids({local == 2 ? o.list(t, h)[0] : 0, local}, 2);
        EXPECT_EQ(o.list(t, h), want) << "position " << pos[t];
      }
    check_against_oracle(P, o);
    // The diagonal block at position 128 holds one visible key; at 256 as well.
    std::vector<float> s;
    const IndexerParams p = P.params();
    for (int t : {1, 3}) {
      ASSERT_EQ(indexer_row_scores_ref(p, t, 0, s), int(pos[t] / kBs) + 1);
      float dot = 0.f;
      for (int d = 0; d < 128; ++d)
        dot += float(P.get(P.q, (t * 2) * 128 + d)) * float(P.get(P.cache, P.key_elem(t / 2, pos[t]) + d));
      EXPECT_EQ(float_bits(s.back()), float_bits(dot)) << "position " << pos[t];
    }
  }
}

TEST(IndexerCpu, ForcedInitAndLocalBlocks) {
  // 10 visible blocks (position 1279), topk 4; forced blocks get the lowest scores, so only the
  // forcing can select them.
  for (int init : {0, 1, 2})
    for (int local : {1, 2}) {
      SCOPED_TRACE(tag({{"init", init}, {"local", local}}));
      Rng r(uint64_t(10 + init * 3 + local));
      Problem P{.H = 2, .sel = {4, init, local}, .dql = 1, .seq_lens = {1280}};
      P.build(r);
      const std::vector<double> v0 = {5, 1, 7, 3, 8, 2, 6, 4, 0.5, 9}, v1 = {1, 2, 3, 4, 5, 6, 7, 8, 9, 10};
      for (int h = 0; h < 2; ++h) {
        std::vector<double> v = h ? v1 : v0;
        for (int j = 0; j < 10; ++j)
          if (is_forced(j, 10, P.sel)) v[size_t(j)] = -10 - j;
        P.set_block_scores(0, h, v);
      }
      const Output o = run(P);
      // Head 0: the best non-forced blocks by v0 are 4 (8), 2 (7), 6 (6), 0 (5), 7 (4), ...
      const std::vector<std::vector<int32_t>> want0 = {
          {2, 4, 6, 9}, {2, 4, 8, 9}, {0, 2, 4, 9}, {0, 4, 8, 9}, {0, 1, 4, 9}, {0, 1, 8, 9}};
      // Head 1: the highest ids that are not forced.
      const std::vector<std::vector<int32_t>> want1 = {
          {6, 7, 8, 9}, {6, 7, 8, 9}, {0, 7, 8, 9}, {0, 7, 8, 9}, {0, 1, 8, 9}, {0, 1, 8, 9}};
      const size_t c = size_t(init * 2 + local - 1);
      EXPECT_EQ(o.list(0, 0), want0[c]);
      EXPECT_EQ(o.list(0, 1), want1[c]);
      check_against_oracle(P, o);
    }
  // Forced blocks overlapping: init 2 + local 2 on 3 visible blocks selects all three.
  Rng r(20);
  Problem P{.sel = {4, 2, 2}, .dql = 1, .seq_lens = {300}};
  P.build(r);
  EXPECT_EQ(run(P).list(0, 0), ids({0, 1, 2}, 4));
}

TEST(IndexerCpu, TiesGoToTheLowerBlock) {
  // Every block holds the same keys: equal scores, so the lowest ids win after the forced ones.
  for (int fp8 : {0, 1}) {
    Rng r(30);
    SEED_TRACE(r);
    Problem P{.fp8 = bool(fp8), .H = 2, .sel = {4, 0, 1}, .dql = 1, .seq_lens = {1280}};
    P.build(r);
    const int64_t row_bytes = 128 * (fp8 ? 1 : 2);
    for (int64_t n = kBs; n < 1280; ++n)
      std::memcpy(P.cache.ptr<uint8_t>() + P.key_elem(0, n) * (row_bytes / 128),
                  P.cache.ptr<uint8_t>() + P.key_elem(0, n % kBs) * (row_bytes / 128), size_t(row_bytes));
    EXPECT_EQ(run(P).list(0, 0), ids({0, 1, 2, 9}, 4));
    P.sel = {4, 1, 2};
    EXPECT_EQ(run(P).list(0, 1), ids({0, 1, 8, 9}, 4));
  }
  // Two blocks tie for the top score: topk 2 keeps the lower, topk 3 both.
  Rng r(31);
  Problem P{.sel = {2, 0, 1}, .dql = 1, .seq_lens = {1280}};
  P.build(r);
  P.set_block_scores(0, 0, {0.25, -1, 0.5, 2, 1, 0.75, 2, -0.5, 0, 1});
  EXPECT_EQ(run(P).list(0, 0), ids({3, 9}, 2));
  P.sel.topk = 3;
  EXPECT_EQ(run(P).list(0, 0), ids({3, 6, 9}, 3));
}

TEST(IndexerCpu, NanScoresRankLowest) {
  // One prefill request of 700 tokens, the last 50 new (positions 650..699: 6 visible blocks).
  // Head 0 scores by construction: block 0 and 4 NaN (every key NaN), block 1 -inf, block 2 0.5
  // (one finite key among NaN keys), block 3 1, block 5 (the diagonal) 3 up to position 650 and
  // NaN keys after it, which the token at 650 must not see.
  Rng r(40);
  SEED_TRACE(r);
  Problem P{.sel = {4, 0, 1}, .seq_lens = {700}, .q_lens = {50}};
  P.build(r);
  P.set_block_scores(0, 0, {NAN, -INFINITY, NAN, 1, NAN, 3});
  P.set_key(0, 2 * kBs + 17, 0, 0.5);
  for (int64_t n = 651; n < 700; ++n) P.set_key(0, n, 0, NAN);
  std::vector<float> s;
  ASSERT_EQ(indexer_row_scores_ref(P.params(), 0, 0, s), 6);
  EXPECT_TRUE(std::isnan(s[0]) && std::isnan(s[4])) << s[0] << " " << s[4];
  EXPECT_EQ(s[1], -INFINITY);
  EXPECT_EQ(s[2], 0.5f);
  EXPECT_EQ(s[3], 1.f);
  EXPECT_EQ(s[5], 3.f) << "keys past the token's position were read";
  const std::vector<std::vector<int32_t>> want = {
      ids({1, 2, 3, 5}, 4), ids({0, 1, 2, 3, 5}, 5), ids({0, 1, 2, 3, 4, 5}, 7)};
  for (int i = 0; i < 3; ++i) {
    P.sel.topk = int(want[size_t(i)].size());
    const Output o = run(P);
    for (int64_t t = 0; t < P.T; ++t) EXPECT_EQ(o.list(t, 0), want[size_t(i)]) << "token " << t;
    check_against_oracle(P, o);
  }
}

TEST(IndexerCpu, Fp8IndexCache) {
  for (DType qd : {DType::kUInt8, DType::kFloat8E4M3}) {
    Rng r(50 + uint64_t(qd));
    SEED_TRACE(r);
    Problem D{.fp8 = true, .H = 4, .sel = {8, 1, 1}, .dql = 3, .seq_lens = {1900, 700, 0},
              .q_dtype = qd};
    D.build(r);
    EXPECT_GT(check_against_oracle(D, run(D)), D.T * D.H / 2);
    Problem F{.fp8 = true, .H = 2, .sel = {4, 0, 2}, .seq_lens = {900, 1300}, .q_lens = {200, 60},
              .q_dtype = qd};
    F.build(r);
    EXPECT_GT(check_against_oracle(F, run(F)), F.T * F.H / 2);
  }
}

TEST(IndexerCpu, DecodeQueryLen1To32) {
  for (int dql = 1; dql <= 32; ++dql) {
    Rng r(uint64_t(100 + dql));
    SEED_TRACE(r);
    SCOPED_TRACE(tag({{"dql", dql}}));
    const int a = dql + int(r.g() % 900), b = 1 + int(r.g() % 1400);
    Problem P{.H = 2, .sel = {4, 1, 1}, .dql = dql, .seq_lens = {a, b}};
    P.build(r);
    check_against_oracle(P, run(P));
  }
}

TEST(IndexerCpu, PaddedDecodeRows) {
  // seq_len 0: every row -1; seq_len 3 < dql 8: rows 0..4 sit at negative positions (-1), rows
  // 5..7 at positions 0..2 see block 0.
  Rng r(60);
  SEED_TRACE(r);
  Problem P{.H = 2, .sel = {4, 0, 1}, .dql = 8, .seq_lens = {0, 3, 700}};
  P.build(r);
  const Output o = run(P);
  for (int h = 0; h < 2; ++h)
    for (int i = 0; i < 8; ++i) {
      EXPECT_EQ(o.list(i, h), ids({}, 4)) << "padded request, row " << i;
      EXPECT_EQ(o.list(8 + i, h), i < 5 ? ids({}, 4) : ids({0}, 4)) << "short request, row " << i;
    }
  check_against_oracle(P, o);
}

TEST(IndexerCpu, PrefillVarlenAndChunked) {
  // A full prefill, a chunked one (1460 tokens of context, 40 new), an empty request, a request
  // without new tokens, and a 520-token prefill.
  Rng r(70);
  SEED_TRACE(r);
  Problem P{.H = 2, .sel = {4, 0, 1}, .seq_lens = {130, 1500, 0, 600, 520}, .q_lens = {130, 40, 0, 0, 520}};
  P.build(r);
  const Output o = run(P);
  EXPECT_GT(check_against_oracle(P, o), P.T * P.H / 2);
  for (int h = 0; h < 2; ++h) {  // the chunked request's first token sits at position 1460
    EXPECT_EQ(o.list(130, h)[3], 11) << "local block of position 1460";
    EXPECT_EQ(o.list(130 + 39, h)[3], 11) << "local block of position 1499";
  }
}

TEST(IndexerCpu, ShuffledBlockTableMatchesIdentity) {
  for (int dql : {0, 5}) {
    Rng r1(80), r2(80);
    SEED_TRACE(r1);
    Problem A{.H = 2, .sel = {4, 1, 1}, .dql = dql, .seq_lens = {1000, 1700}, .q_lens = {90, 30}};
    Problem B = A;
    A.build(r1, false);
    B.build(r2, true);
    ASSERT_FALSE(same_bytes(A.table, B.table));
    const Output a = run(A), b = run(B);
    EXPECT_TRUE(same_bytes(a.buf, b.buf)) << "the physical page order changed the selection";
    check_against_oracle(B, b);
  }
}

TEST(IndexerCpu, Topk1And64) {
  {  // topk 1: the local block alone.
    Rng r(90);
    Problem P{.H = 2, .sel = {1, 0, 1}, .seq_lens = {300, 900}, .q_lens = {300, 20}};
    P.build(r);
    const Output o = run(P);
    Oracle oracle(P);
    for (int64_t t = 0; t < P.T; ++t) {
      int b;
      int64_t pos;
      ASSERT_TRUE(oracle.position(t, &b, &pos));
      EXPECT_EQ(o.list(t, 1), ids({int32_t(pos / kBs)}, 1)) << "token " << t;
    }
  }
  {  // topk 64 over 71 visible blocks (position 8999), init 2, local 2; and over 8.
    Rng r(91);
    SEED_TRACE(r);
    Problem P{.sel = {64, 2, 2}, .dql = 2, .seq_lens = {9000, 1000}};
    P.build(r);
    const Output o = run(P);
    check_against_oracle(P, o);
    for (int t : {0, 1}) {  // 64 valid ids: init 0, 1 first, local 69, 70 last
      const std::vector<int32_t> l = o.list(t, 0);
      EXPECT_TRUE(l[0] == 0 && l[1] == 1 && l[62] == 69 && l[63] == 70) << "token " << t;
    }
    EXPECT_EQ(o.list(2, 0), iota_ids(8, 64));
  }
}

TEST(IndexerCpu, StridedOutputAndRowsPastT) {
  // Rows 7 int32s apart beyond H * topk, 5 spare rows: run() checks both stay poisoned.
  Rng r(95);
  SEED_TRACE(r);
  Problem P{.H = 3, .sel = {4, 1, 1}, .seq_lens = {700, 200}, .q_lens = {30, 200}};
  P.build(r);
  check_against_oracle(P, run(P, 7, 5));
  Problem D{.H = 3, .sel = {4, 1, 1}, .dql = 3, .seq_lens = {700, 2}};
  D.build(r);
  check_against_oracle(D, run(D, 1, 3));
}

// ---- the reference's scores and selection -------------------------------------------------------

// indexer_row_scores_ref is the spec's arithmetic: per key an fp32 sum over d = 0..127 in order,
// the max over visible keys skipping NaN. Recomputed here independently, compared bit for bit.
TEST(IndexerRef, RowScoresAreTheSpecsFp32Sums) {
  for (int fp8 : {0, 1}) {
    Rng r(200 + uint64_t(fp8));
    SEED_TRACE(r);
    Problem P{.fp8 = bool(fp8), .H = 2, .sel = {4, 0, 1}, .seq_lens = {700, 300}, .q_lens = {40, 300}};
    P.build(r);
    for (int64_t n = 600; n < 610; ++n) P.set_key(0, n, 5, NAN);  // some NaN dots in block 4
    const IndexerParams p = P.params();
    const Oracle oracle(P);
    std::vector<float> qf(size_t(P.q.numel())), kf(size_t(P.cache.numel())), s;
    for (size_t i = 0; i < qf.size(); ++i) qf[i] = float(P.get(P.q, int64_t(i)));
    for (size_t i = 0; i < kf.size(); ++i) kf[i] = float(P.get(P.cache, int64_t(i)));
    int64_t mismatches = 0;
    for (int64_t t = 0; t < P.T; ++t)
      for (int h = 0; h < P.H; ++h) {
        int b;
        int64_t pos;
        ASSERT_TRUE(oracle.position(t, &b, &pos));
        const int nb = indexer_row_scores_ref(p, t, h, s);
        ASSERT_EQ(nb, int(pos / kBs) + 1);
        for (int j = 0; j < nb; ++j) {
          float best = NAN;
          for (int64_t n = int64_t(j) * kBs; n <= std::min(pos, int64_t(j) * kBs + kBs - 1); ++n) {
            const float *q = qf.data() + (t * P.H + h) * 128, *k = kf.data() + P.key_elem(b, n);
            float dot = 0.f;
            for (int d = 0; d < 128; ++d) dot += q[d] * k[d];
            if (!std::isnan(dot) && (std::isnan(best) || dot > best)) best = dot;
          }
          if (float_bits(best) != float_bits(s[size_t(j)]) && ++mismatches <= 5)
            ADD_FAILURE() << "token " << t << " head " << h << " block " << j << ": " << s[size_t(j)]
                          << " want " << best;
        }
      }
  }
}

TEST(IndexerRef, SelectFromScores) {
  auto select = [](std::vector<float> s, int topk, int init, int local) {
    std::vector<int32_t> out(size_t(topk), kPoisonId);
    indexer_select_ref(s.data(), int(s.size()), topk, init, local, out.data());
    return out;
  };
  const float n = NAN, inf = INFINITY;
  EXPECT_EQ(select({}, 3, 0, 1), ids({}, 3));
  EXPECT_EQ(select({1, 2}, 3, 0, 1), ids({0, 1}, 3));
  EXPECT_EQ(select({3, 1, 2, 0}, 2, 0, 1), ids({0, 3}, 2));
  EXPECT_EQ(select({1, 2, 2, 2, 0}, 3, 0, 1), ids({1, 2, 4}, 3));          // ties: lower id
  EXPECT_EQ(select({n, -inf, n, 0}, 2, 0, 1), ids({1, 3}, 2));             // -inf above NaN
  EXPECT_EQ(select({n, n, n, 0}, 3, 0, 1), ids({0, 1, 3}, 3));             // NaN ties: lower id
  EXPECT_EQ(select({0, 5, 4, 3, 9}, 3, 1, 1), ids({0, 1, 4}, 3));          // init forced
  EXPECT_EQ(select({0, 5, 4, 3, 9, -1}, 3, 1, 2), ids({0, 4, 5}, 3));      // local 2 forced
  EXPECT_EQ(select({-0.f, 0.f, 1}, 2, 0, 1), ids({0, 2}, 2));              // -0 == +0: a tie
  EXPECT_EQ(select({inf, 1, inf, 0}, 2, 0, 1), ids({0, 3}, 2));
}

// ---- the comparison -----------------------------------------------------------------------------

TEST(IndexerCompare, CatchesEachKindOfWrongRow) {
  Rng r(300);
  SEED_TRACE(r);
  Problem P{.H = 2, .sel = {4, 1, 1}, .dql = 2, .seq_lens = {1500, 0, 900}};
  P.build(r);
  const Output good = run(P);
  const Oracle oracle(P);
  auto compare = [&](const Output& o) {
    return detail::compare_indexer_topk(
        P.params(), o.buf.ptr<int32_t>(), o.row_stride,
        [&](int64_t t, int h, std::vector<double>& s) { return oracle.scores(t, h, s); }, kRelTol);
  };
  ASSERT_TRUE(compare(good).pass());
  // Token 1 head 1 (position 1499, 12 blocks); the best unselected and the worst block by score.
  std::vector<double> s;
  ASSERT_EQ(oracle.scores(1, 1, s), 12);
  const std::vector<int32_t> row = good.list(1, 1);
  int worst = -1;
  for (int j = 1; j < 11; ++j)
    if (std::find(row.begin(), row.end(), j) == row.end() && (worst < 0 || s[size_t(j)] < s[size_t(worst)]))
      worst = j;
  auto with_row = [&](std::vector<int32_t> v, int64_t t = 1, int h = 1) {
    Output o{clone(good.buf), good.row_stride, good.topk};
    std::copy(v.begin(), v.end(), o.buf.ptr<int32_t>() + t * o.row_stride + h * o.topk);
    return o;
  };
  std::vector<int32_t> swapped = {row[0], row[1], worst, row[3]};  // the 2nd best for the worst
  std::vector<int32_t> no_local = {row[0], row[1], row[2], worst};
  std::sort(swapped.begin(), swapped.end());
  std::sort(no_local.begin(), no_local.end());
  const struct {
    const char* what;
    Output o;
    const char* want;
  } cases[] = {
      {"lower-scored block", with_row(swapped), "token 1 head 1: selected"},
      {"local block missing", with_row(no_local), "forced block 11 missing"},
      {"descending", with_row({row[3], row[2], row[1], row[0]}), "entry 1"},
      {"too few", with_row({row[0], row[1], row[3], -1}), "entry 3 = -1"},
      {"poison", with_row({row[0], row[1], row[2], kPoisonId}), "entry 3 = 2139062143"},
      {"duplicate", with_row({row[0], row[1], row[1], row[3]}), "entry 2"},
      {"padded row", with_row({0, -1, -1, -1}, 2, 0), "token 2 head 0: entry 0 = 0"},
      {"past the visible blocks", with_row({0, 1, 2, 12}), "entry 3 = 12"},
  };
  for (const auto& c : cases) {
    SCOPED_TRACE(c.what);
    const detail::IndexerCompareResult res = compare(c.o);
    EXPECT_EQ(res.rows_failed, 1) << res.first_failures;
    EXPECT_THAT(res.first_failures, HasSubstr(c.want));
  }
  // A tie may go either way: equal scores leave no ranking error.
  Problem tie{.sel = {2, 0, 1}, .dql = 1, .seq_lens = {1280}};
  tie.build(r);
  tie.set_block_scores(0, 0, {0.25, -1, 0.5, 2, 1, 0.75, 2, -0.5, 0, 1});
  Output o = run(tie);
  ASSERT_EQ(o.list(0, 0), ids({3, 9}, 2));
  o.buf.ptr<int32_t>()[0] = 6;
  const Oracle t_oracle(tie);
  const detail::IndexerCompareResult res = detail::compare_indexer_topk(
      tie.params(), o.buf.ptr<int32_t>(), o.row_stride,
      [&](int64_t t, int h, std::vector<double>& sc) { return t_oracle.scores(t, h, sc); }, kRelTol);
  EXPECT_TRUE(res.pass()) << res.first_failures;
}

// ===================================== argument validation =====================================

TEST(IndexerConfigErrors, ValidateAndConstructor) {
  const struct {
    std::function<void(IndexerConfig&)> edit;
    const char* want;
  } cases[] = {
      {[](IndexerConfig& c) { c.num_index_heads = 0; }, "num_index_heads = 0: supported 1..16"},
      {[](IndexerConfig& c) { c.num_index_heads = 17; }, "num_index_heads = 17"},
      {[](IndexerConfig& c) { c.select.topk = 0; }, "select.topk = 0: supported 1..64"},
      {[](IndexerConfig& c) { c.select.topk = 65; }, "select.topk = 65"},
      {[](IndexerConfig& c) { c.select.init_blocks = -1; }, "select.init_blocks = -1: must be >= 0"},
      {[](IndexerConfig& c) { c.select.local_blocks = 0; }, "select.local_blocks = 0: must be >= 1"},
      {[](IndexerConfig& c) { c.select = {4, 3, 2}; }, "select.init_blocks + select.local_blocks = 5: must be <= topk = 4"},
      {[](IndexerConfig& c) { c.index_cache_dtype = KvCacheDtype::kFp8E5M2; }, "index_cache_dtype = fp8_e5m2"},
      {[](IndexerConfig& c) { c.index_cache_dtype = KvCacheDtype::kNvfp4; }, "index_cache_dtype = nvfp4"},
      {[](IndexerConfig& c) { c.max_prefill_tokens = -1; }, "max_prefill_tokens = -1"},
      {[](IndexerConfig& c) { c.max_decode_seqs = -2; }, "max_decode_seqs = -2"},
      {[](IndexerConfig& c) { c.max_decode_query_len = 0; }, "max_decode_query_len = 0: supported 1..32"},
      {[](IndexerConfig& c) { c.max_decode_query_len = 33; }, "max_decode_query_len = 33"},
      {[](IndexerConfig& c) { c.max_blocks_per_seq = 0; }, "max_blocks_per_seq = 0: must be >= 1"},
  };
  IndexerConfig ok;
  ok.max_blocks_per_seq = 8;
  EXPECT_EQ(LightningIndexer::validate(ok), "");
  EXPECT_NO_THROW({ LightningIndexer x(ok, Device::cpu()); });
  for (const auto& c : cases) {
    SCOPED_TRACE(c.want);
    IndexerConfig cfg = ok;
    c.edit(cfg);
    EXPECT_THAT(LightningIndexer::validate(cfg), HasSubstr(c.want));
    EXPECT_THAT(error_of([&] { LightningIndexer x(cfg, Device::cpu()); }),
                AllOf(StartsWith("lightning_indexer: unsupported IndexerConfig: "), HasSubstr(c.want)));
  }
}

void set_i32(const TensorView& v, std::initializer_list<int32_t> values) {
  std::copy(values.begin(), values.end(), v.ptr<int32_t>());
}

// A valid prefill: H 2, topk 4, requests of 2 and 4 tokens (seq_lens 2 and 300: 1 and 3 blocks)
// over a 4-page bf16 cache; max_prefill_tokens 8, max_blocks_per_seq 4.
struct PrefillCall : CallBase {
  IndexerConfig cfg;
  IndexerPrefillArgs a;
  PrefillCall() {
    cfg.num_index_heads = 2;
    cfg.select = {4, 0, 1};
    cfg.max_prefill_tokens = 8;
    cfg.max_blocks_per_seq = 4;
    a.index_q = make({6, 2, 128}, DType::kBFloat16);
    a.index_cache = make({4, 128, 128}, DType::kBFloat16);
    a.cu_seqlens_q = make({3}, DType::kInt32);
    set_i32(a.cu_seqlens_q, {0, 2, 6});
    a.seq_lens = make({2}, DType::kInt32);
    set_i32(a.seq_lens, {2, 300});
    a.block_table = make({2, 4}, DType::kInt32);
    set_i32(a.block_table, {3, -1, 99, -5, 0, 2, 1, 7});
    a.max_query_len = 4;
    a.topk_out = make({6, 2, 4}, DType::kInt32, kPoisonByte);
  }
  void call() { LightningIndexer(cfg, Device::cpu()).prefill(a); }
};

// A valid decode: H 2, topk 4, 3 requests x dql 2 (seq_lens 0, 1, 200); max_decode_seqs 3,
// max_decode_query_len 4.
struct DecodeCall : CallBase {
  IndexerConfig cfg;
  IndexerDecodeArgs a;
  DecodeCall() {
    cfg.num_index_heads = 2;
    cfg.select = {4, 0, 1};
    cfg.max_decode_seqs = 3;
    cfg.max_decode_query_len = 4;
    cfg.max_blocks_per_seq = 3;
    a.index_q = make({6, 2, 128}, DType::kBFloat16);
    a.index_cache = make({3, 128, 128}, DType::kBFloat16);
    a.seq_lens = make({3}, DType::kInt32);
    set_i32(a.seq_lens, {0, 1, 200});
    a.block_table = make({3, 3}, DType::kInt32);
    set_i32(a.block_table, {-1, -1, -1, 2, 9, 9, 0, 1, 9});
    a.decode_query_len = 2;
    a.topk_out = make({6, 2, 4}, DType::kInt32, kPoisonByte);
  }
  void call() { LightningIndexer(cfg, Device::cpu()).decode(a); }
};

TensorView on_cuda(TensorView v) {
  v.device = Device::cuda(0);
  return v;
}
TensorView strided(CallBase& c, const TensorView& v) {  // same shape, rows twice as far apart
  std::vector<int64_t> shape = v.sizes();
  shape[0] *= 2;
  TensorView w = c.make(shape, v.dtype);
  w.shape[0] = v.shape[0];
  w.stride[0] *= 2;
  return w;
}

TEST(IndexerArgs, BadPrefillArguments) {
  using C = PrefillCall;
  expect_bad_args<C>({
      {"index_q float32", [](C& c) { c.a.index_q = c.make({6, 2, 128}, DType::kFloat32); },
       {"lightning_indexer: index_q.dtype = float32", "supported: bfloat16"}},
      {"fp8 q with a bf16 cache", [](C& c) { c.a.index_q = c.make({6, 2, 128}, DType::kUInt8); },
       {"index_q.dtype = uint8"}},
      {"index_q heads", [](C& c) { c.a.index_q = c.make({6, 3, 128}, DType::kBFloat16); },
       {"index_q.shape = [6, 3, 128]", "expected [*, 2, 128]"}},
      {"index_q strided", [](C& c) { c.a.index_q = strided(c, c.a.index_q); }, {"index_q.strides"}},
      {"index_q on cuda", [](C& c) { c.a.index_q = on_cuda(c.a.index_q); },
       {"index_q.device = cuda:0", "must be on cpu"}},
      {"missing index_q", [](C& c) { c.a.index_q = TensorView{}; }, {"index_q = (none): is required"}},
      {"fp8 cache with a bf16 config", [](C& c) { c.a.index_cache = c.make({4, 128, 128}, DType::kUInt8); },
       {"index_cache.dtype = uint8", "supported: bfloat16"}},
      {"bf16 cache with an fp8 config",
       [](C& c) {
         c.cfg.index_cache_dtype = KvCacheDtype::kFp8E4M3;
         c.a.index_q = c.make({6, 2, 128}, DType::kFloat8E4M3);
       },
       {"index_cache.dtype = bfloat16", "supported: uint8"}},
      {"bf16 q with an fp8 config",
       [](C& c) {
         c.cfg.index_cache_dtype = KvCacheDtype::kFp8E4M3;
         c.a.index_cache = c.make({4, 128, 128}, DType::kUInt8);
       },
       {"index_q.dtype = bfloat16", "supported: float8_e4m3fn or uint8"}},
      {"cache page 64", [](C& c) { c.a.index_cache = c.make({8, 64, 128}, DType::kBFloat16); },
       {"index_cache.shape = [8, 64, 128]", "expected [*, 128, 128]"}},
      {"cache strided", [](C& c) { c.a.index_cache = strided(c, c.a.index_cache); }, {"index_cache.strides"}},
      {"seq_lens int64", [](C& c) { c.a.seq_lens = c.make({2}, DType::kInt64); }, {"seq_lens.dtype = int64"}},
      {"seq_lens 2-d", [](C& c) { c.a.seq_lens = c.make({2, 1}, DType::kInt32); },
       {"seq_lens.shape = [2, 1]", "expected [*]"}},
      {"block_table rows", [](C& c) { c.a.block_table = c.make({3, 4}, DType::kInt32); },
       {"block_table.shape = [3, 4]", "expected [2, *]"}},
      {"block_table too wide", [](C& c) { c.a.block_table = c.make({2, 5}, DType::kInt32); },
       {"block_table.shape = [2, 5]", "at most max_blocks_per_seq = 4"}},
      {"block_table column stride",
       [](C& c) {
         TensorView t = c.make({2, 8}, DType::kInt32);
         t.shape[1] = 4, t.stride[1] = 2;
         c.a.block_table = t;
       },
       {"block_table.strides", "stride 1"}},
      {"block_table int64", [](C& c) { c.a.block_table = c.make({2, 4}, DType::kInt64); },
       {"block_table.dtype = int64"}},
      {"topk_out int64", [](C& c) { c.a.topk_out = c.make({6, 2, 4}, DType::kInt64); },
       {"topk_out.dtype = int64", "supported: int32"}},
      {"topk_out width", [](C& c) { c.a.topk_out = c.make({6, 2, 8}, DType::kInt32); },
       {"topk_out.shape = [6, 2, 8]", "expected [*, 2, 4]"}},
      {"topk_out rows", [](C& c) { c.a.topk_out = c.make({5, 2, 4}, DType::kInt32); },
       {"topk_out.shape = [5, 2, 4]", "at least 6 rows"}},
      {"topk_out head stride",
       [](C& c) {
         TensorView t = c.make({6, 2, 8}, DType::kInt32);
         t.shape[2] = 4;
         c.a.topk_out = t;
       },
       {"topk_out.strides = (16, 8, 1)", "the last two dims must be contiguous"}},
      {"topk_out on cuda", [](C& c) { c.a.topk_out = on_cuda(c.a.topk_out); }, {"topk_out.device = cuda:0"}},
      {"too many tokens", [](C& c) { c.cfg.max_prefill_tokens = 5; },
       {"index_q.shape = [6, 2, 128]", "at most max_prefill_tokens = 5"}},
      {"missing cu_seqlens_q", [](C& c) { c.a.cu_seqlens_q = TensorView{}; },
       {"cu_seqlens_q = (none): is required"}},
      {"cu_seqlens_q length", [](C& c) { c.a.cu_seqlens_q = c.make({2}, DType::kInt32); },
       {"cu_seqlens_q.shape = [2]", "expected [3]"}},
      {"cu_seqlens_q int64", [](C& c) { c.a.cu_seqlens_q = c.make({3}, DType::kInt64); },
       {"cu_seqlens_q.dtype = int64"}},
      {"max_query_len past T", [](C& c) { c.a.max_query_len = 7; }, {"max_query_len = 7", "[0, T = 6]"}},
      {"max_query_len negative", [](C& c) { c.a.max_query_len = -1; }, {"max_query_len = -1"}},
  });
}

TEST(IndexerArgs, BadDecodeArguments) {
  using C = DecodeCall;
  expect_bad_args<C>({
      {"dql 0", [](C& c) { c.a.decode_query_len = 0; },
       {"decode_query_len = 0", "supported 1..max_decode_query_len = 4"}},
      {"dql past the config", [](C& c) { c.a.decode_query_len = 5; }, {"decode_query_len = 5"}},
      {"too many requests", [](C& c) { c.cfg.max_decode_seqs = 2; },
       {"seq_lens.shape = [3]", "at most max_decode_seqs = 2"}},
      {"rows != B * dql", [](C& c) { c.a.index_q = c.make({5, 2, 128}, DType::kBFloat16); },
       {"index_q.shape = [5, 2, 128]", "expected 6 rows"}},
      {"index_q strided", [](C& c) { c.a.index_q = strided(c, c.a.index_q); }, {"index_q.strides"}},
      {"cache dtype", [](C& c) { c.a.index_cache = c.make({3, 128, 128}, DType::kFloat16); },
       {"index_cache.dtype = float16"}},
      {"block_table too wide", [](C& c) { c.a.block_table = c.make({3, 4}, DType::kInt32); },
       {"block_table.shape = [3, 4]", "max_blocks_per_seq = 3"}},
      {"seq_lens strided", [](C& c) { c.a.seq_lens = strided(c, c.a.seq_lens); }, {"seq_lens.strides"}},
      {"topk_out rows", [](C& c) { c.a.topk_out = c.make({4, 2, 4}, DType::kInt32); },
       {"topk_out.shape = [4, 2, 4]", "at least 6 rows"}},
      {"seq_lens on cuda", [](C& c) { c.a.seq_lens = on_cuda(c.a.seq_lens); }, {"seq_lens.device = cuda:0"}},
  });
}

// ---- inconsistent device-resident lengths and page ids: throw, write nothing ------------------

TEST(IndexerOutOfRange, PrefillLengthsAndPages) {
  // Garbage in unused table entries (-1, 99, -5, 7) is fine: the unedited call runs.
  expect_edits_throw_untouched<PrefillCall>(
      {
        {[](PrefillCall& c) { set_i32(c.a.cu_seqlens_q, {1, 2, 6}); }, "cu_seqlens_q[0]", "1"},
        {[](PrefillCall& c) { set_i32(c.a.cu_seqlens_q, {0, 7, 6}); }, "cu_seqlens_q[2]", "6"},
        {[](PrefillCall& c) { set_i32(c.a.cu_seqlens_q, {0, 2, 5}); }, "cu_seqlens_q[2]", "5"},
        {[](PrefillCall& c) { c.a.max_query_len = 3; }, "cu_seqlens_q[2] - cu_seqlens_q[1]", "4"},
        {[](PrefillCall& c) { set_i32(c.a.seq_lens, {2, 3}); }, "seq_lens[1]", "3"},
        {[](PrefillCall& c) { set_i32(c.a.seq_lens, {2, -1}); }, "seq_lens[1]", "-1"},
        {[](PrefillCall& c) { set_i32(c.a.seq_lens, {2, 513}); }, "seq_lens[1]", "513"},
        {[](PrefillCall& c) { c.a.block_table.ptr<int32_t>()[6] = 4; }, "block_table[1][2]", "4"},
        {[](PrefillCall& c) { c.a.block_table.ptr<int32_t>()[5] = -1; }, "block_table[1][1]", "-1"},
      },
      [](PrefillCall& c) { return std::vector<TensorView>{c.a.topk_out}; });
}

TEST(IndexerOutOfRange, DecodeLengthsAndPages) {
  expect_edits_throw_untouched<DecodeCall>(
      {
        {[](DecodeCall& c) { set_i32(c.a.seq_lens, {0, 1, -3}); }, "seq_lens[2]", "-3"},
        {[](DecodeCall& c) { set_i32(c.a.seq_lens, {0, 1, 385}); }, "seq_lens[2]", "385"},
        {[](DecodeCall& c) { c.a.block_table.ptr<int32_t>()[7] = 3; }, "block_table[2][1]", "3"},
        {[](DecodeCall& c) { set_i32(c.a.seq_lens, {0, 129, 200}); }, "block_table[1][1]", "9"},
      },
      [](DecodeCall& c) { return std::vector<TensorView>{c.a.topk_out}; });
}

// Random lengths, query offsets and tables (each field kept valid half the time): the CPU path
// runs, or throws before writing anything; under scripts/sanitize.sh it also never reads or writes
// out of bounds.
TEST(IndexerOutOfRange, RandomIndicesRunOrThrowUntouched) {
  expect_runs_or_throws_untouched<PrefillCall>(
      400, 21,
      [](PrefillCall& c, std::mt19937_64& g) {
        if (coin(g)) wild_fill(c.a.cu_seqlens_q, g, 0, 6);
        if (coin(g)) wild_fill(c.a.seq_lens, g, 0, 520);
        if (coin(g)) wild_fill(c.a.block_table, g, 0, 3);
        if (coin(g)) c.a.max_query_len = int(g() % 7);
      },
      [](PrefillCall& c) { return std::vector<TensorView>{c.a.topk_out}; });
  expect_runs_or_throws_untouched<DecodeCall>(
      400, 22,
      [](DecodeCall& c, std::mt19937_64& g) {
        if (coin(g)) wild_fill(c.a.seq_lens, g, 0, 390);
        if (coin(g)) wild_fill(c.a.block_table, g, 0, 2);
      },
      [](DecodeCall& c) { return std::vector<TensorView>{c.a.topk_out}; });
}

}  // namespace
