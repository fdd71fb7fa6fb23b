// Tests of MSA sparse attention's CPU path (m3rt::msa_prefill and MsaDecodePlan::run on
// Device::cpu() tensors):
//   - every output against the independent fp64 oracle (msa_oracle.h: the visible keys enumerated
//     one by one, the softmax in double): out within 1 bf16 ulp of the oracle rounded once (or 1e-6
//     absolute), lse within 1e-5 relative (|got - want| / max(|want|, 1)); rows with no visible key
//     exactly out +0 and lse -inf;
//   - the named cases: short and partial pages, padded decode rows, -1 holes, repeats, ids past the
//     visible blocks (pointing at NaN pages), shuffled tables, strided top-k views, dql 1..32, GQA
//     groups 1..16, bf16 and fp8 caches with scales, the non-causal and window masks, varlen and
//     chunked prefill, lse optional;
//   - out and lse are views into larger buffers poisoned with NaN: every row is written, the padding
//     and the rows past T are not;
//   - validation: the call arguments, MsaDecodeShape, plan mismatches, and inconsistent
//     device-resident lengths and page ids, which must throw before anything is written.
// Shared helpers: tests/test_util.h.
#include <numeric>

#include "m3rt/msa_attention.h"
#include "ops/msa_attention/msa_attention.h"
#include "ops/msa_attention/msa_oracle.h"
#include "test_util.h"

namespace {

using namespace m3rt;
using namespace m3rt_test;

constexpr int kBs = kMsaPageSize;
constexpr double kLseRelTol = 1e-5;
constexpr double kOutAbsTol = 1e-6;

// ---- problems -----------------------------------------------------------------------------------

// One call: the description, then (build) its host inputs. Keys at positions < seq_len of every
// request are random (drawn in logical order, so a shuffled and an identity table hold the same
// keys); every other cache row is NaN (0xFF), including whole spare pages. block_table columns
// past a request's blocks point at spare (NaN) pages. Top-k lists are made like the indexer's:
// unique ascending ids of visible blocks with the local block last, then -1.
struct Problem {
  bool fp8 = false;
  int Hq = 2, Hkv = 1, K = 4;
  int dql = 0;                // decode_query_len; 0: prefill
  std::vector<int> seq_lens;
  std::vector<int> q_lens;    // prefill: query tokens of each request
  MsaMask mask{};
  float ks = 1.f, vs = 1.f;
  float scale = 0.25f;
  bool shuffle = true;
  int topk_pad = 0;           // extra entries per token row of the token-major top-k buffer
  bool head_major = false;    // a contiguous [Hkv, T, K] top-k buffer instead

  Tensor q, cache, cu, lens, table, k_scale, v_scale, topk_buf;
  TensorView topk;            // [Hkv, T, K]
  int64_t T = 0;
  int max_query_len = 0, width = 0, pages = 0;

  Problem& build(Rng& r) {
    const int B = int(seq_lens.size());
    const std::vector<int32_t> c = query_offsets(B, dql, q_lens, max_query_len);
    T = c.back();
    int used = 0;
    width = 1;
    for (int len : seq_lens) {
      used += blocks(len);
      width = std::max(width, blocks(len) + 3);
    }
    pages = used + 2;
    const std::vector<int32_t> perm = page_order(r, pages, shuffle);
    table = Tensor::empty({B, width}, DType::kInt32);
    int next = 0;
    for (int b = 0; b < B; ++b)
      for (int j = 0; j < width; ++j)
        table.ptr<int32_t>()[b * width + j] =
            j < blocks(seq_lens[size_t(b)]) ? perm[size_t(next++)] : perm[size_t(used + (b + j) % 2)];
    cache = filled({pages, Hkv, kBs, 256}, fp8 ? DType::kUInt8 : DType::kBFloat16, 0xFF);
    for (int b = 0; b < B; ++b)
      for (int64_t n = 0; n < seq_lens[size_t(b)]; ++n)
        for (int g = 0; g < Hkv; ++g)
          for (int d = 0; d < 256; ++d) set_kv(b, n, g, d, fp8 ? r.uni(-2, 2) : r.uni(-1, 1));
    q = rand16({T, Hq, 128}, r, -1, 1);
    cu = Tensor::empty({B + 1}, DType::kInt32);
    std::copy(c.begin(), c.end(), cu.ptr<int32_t>());
    lens = Tensor::empty({B}, DType::kInt32);
    std::copy(seq_lens.begin(), seq_lens.end(), lens.ptr<int32_t>());
    k_scale = f32(ks);
    v_scale = f32(vs);
    if (head_major) {
      topk_buf = filled({Hkv, T, K}, DType::kInt32, 0xFF);
      topk = topk_buf;
    } else {
      topk_buf = filled({T, Hkv * (K + topk_pad)}, DType::kInt32, 0xFF);
      topk = TensorView::contiguous(topk_buf.data(), DType::kInt32, {Hkv, T, K});
      topk.stride[0] = K + topk_pad;
      topk.stride[1] = int64_t(Hkv) * (K + topk_pad);
    }
    for (int64_t t = 0; t < T; ++t)
      for (int g = 0; g < Hkv; ++g) {
        const int nb = visible_blocks(t);
        std::vector<int32_t> ids;
        if (nb > 0) {
          std::vector<int32_t> rest(static_cast<size_t>(nb - 1));
          std::iota(rest.begin(), rest.end(), 0);
          std::shuffle(rest.begin(), rest.end(), r.g);
          rest.resize(size_t(std::min(K, nb) - 1));
          std::sort(rest.begin(), rest.end());
          ids = rest;
          ids.push_back(nb - 1);
        }
        set_list(t, g, ids);
      }
    return *this;
  }

  static int blocks(int64_t len) { return int((len + kBs - 1) / kBs); }
  // Request and position of token t (the test's own bookkeeping).
  void position(int64_t t, int* b, int64_t* pos) const {
    if (dql) {
      *b = int(t / dql);
      *pos = seq_lens[size_t(*b)] - dql + t % dql;
      return;
    }
    int64_t first = 0;
    *b = 0;
    while (t >= first + q_lens[size_t(*b)]) first += q_lens[size_t((*b)++)];
    *pos = seq_lens[size_t(*b)] - q_lens[size_t(*b)] + (t - first);
  }
  int visible_blocks(int64_t t) const {
    int b = 0;
    int64_t pos = 0;
    position(t, &b, &pos);
    const int64_t hi = mask.causal ? std::min<int64_t>(pos + 1, seq_lens[size_t(b)]) : seq_lens[size_t(b)];
    return hi > 0 ? blocks(hi) : 0;
  }
  // Element d of the K|V row of the key at position n of request b, head g.
  int64_t kv_elem(int b, int64_t n, int g, int d) const {
    const int64_t page = table.ptr<int32_t>()[b * width + n / kBs];
    return ((page * Hkv + g) * kBs + n % kBs) * 256 + d;
  }
  void set_kv(int b, int64_t n, int g, int d, double v) {
    if (fp8) cache.ptr<uint8_t>()[kv_elem(b, n, g, d)] = float_to_e4m3(float(v));
    else cache.ptr<uint16_t>()[kv_elem(b, n, g, d)] = float_to_bf16(float(v));
  }
  // Sets the top-k list of (t, g): `ids`, then -1.
  void set_list(int64_t t, int g, std::vector<int32_t> ids) {
    ids.resize(size_t(K), -1);
    int32_t* row = topk.ptr<int32_t>() + g * topk.stride[0] + t * topk.stride[1];
    for (int i = 0; i < K; ++i) row[i] = ids[size_t(i)];
  }
  std::vector<int32_t> list(int64_t t, int g) const {
    std::vector<int32_t> v;
    for (int i = 0; i < K; ++i) v.push_back(topk.ptr<int32_t>()[g * topk.stride[0] + t * topk.stride[1] + i]);
    return v;
  }
  MsaKvCache kv() const {
    return {cache, fp8 ? KvCacheDtype::kFp8E4M3 : KvCacheDtype::kBFloat16, k_scale, v_scale};
  }
  detail::MsaOracle oracle() const {
    const TensorView cu_view = dql ? TensorView{} : cu.view();
    return detail::msa_oracle(msa_call_params(q, kv(), topk, cu_view, lens, table, dql, 0, scale, mask));
  }
};

// The op's outputs: out is [T, Hq, 128] in a [T + 2, Hq * 128 + 64] buffer, lse [T, Hq] in a
// [T + 2, Hq + 3] buffer, both poisoned with NaN (0xFF).
struct Output {
  Tensor out_buf, lse_buf;
  int64_t out_row = 0, lse_row = 0;
  int Hq = 0;
  bool has_lse = true;
  uint16_t out(int64_t t, int h, int d) const { return out_buf.ptr<uint16_t>()[t * out_row + h * 128 + d]; }
  float lse(int64_t t, int h) const { return lse_buf.ptr<float>()[t * lse_row + h]; }
};

// Runs the op on the CPU; checks that the padding and the rows past T stay poisoned.
Output run(const Problem& P, bool with_lse = true) {
  Output o;
  o.Hq = P.Hq;
  o.has_lse = with_lse;
  o.out_row = int64_t(P.Hq) * 128 + 64;
  o.lse_row = P.Hq + 3;
  o.out_buf = poisoned({P.T + 2, o.out_row}, DType::kBFloat16);
  o.lse_buf = poisoned({P.T + 2, o.lse_row}, DType::kFloat32);
  TensorView out = TensorView::contiguous(o.out_buf.data(), DType::kBFloat16, {P.T, P.Hq, 128});
  out.stride[0] = o.out_row;
  TensorView lse;
  if (with_lse) {
    lse = TensorView::contiguous(o.lse_buf.data(), DType::kFloat32, {P.T, P.Hq});
    lse.stride[0] = o.lse_row;
  }
  if (P.dql) {
    MsaDecodePlan plan({.batch = int(P.seq_lens.size()), .decode_query_len = P.dql, .num_heads = P.Hq,
                        .num_kv_heads = P.Hkv, .topk = P.K, .max_blocks = P.width,
                        .kv_cache_dtype = P.kv().kv_cache_dtype},
                       Device::cpu());
    plan.run({.q = P.q, .cache = P.kv(), .topk = P.topk, .seq_lens = P.lens, .block_table = P.table,
              .softmax_scale = P.scale, .mask = P.mask, .out = out, .lse = lse});
  } else {
    msa_prefill({.q = P.q, .cache = P.kv(), .topk = P.topk, .cu_seqlens_q = P.cu, .seq_lens = P.lens,
                 .block_table = P.table, .max_query_len = P.max_query_len, .softmax_scale = P.scale,
                 .mask = P.mask, .out = out, .lse = lse});
  }
  Mismatches mm;
  for (int64_t t = 0; t < P.T + 2; ++t) {
    for (int64_t i = t < P.T ? int64_t(P.Hq) * 128 : 0; i < o.out_row; ++i)
      if (o.out_buf.ptr<uint16_t>()[t * o.out_row + i] != 0xFFFF) mm.add("out padding written " + at({t, i}));
    for (int64_t i = t < P.T && with_lse ? P.Hq : 0; i < o.lse_row; ++i)
      if (!all_ff(o.lse_buf.ptr<float>() + t * o.lse_row + i, 4)) mm.add("lse padding written " + at({t, i}));
  }
  return o;
}

// Every row against the oracle; returns how many rows had no visible key.
int64_t expect_matches(const Problem& P, const Output& o, const detail::MsaOracle& want) {
  Mismatches mm;
  int64_t empty = 0;
  for (int64_t t = 0; t < P.T; ++t)
    for (int h = 0; h < P.Hq; ++h) {
      if (want.keys_at(t, h) == 0) {
        ++empty;
        for (int d = 0; d < 128; ++d)
          if (o.out(t, h, d) != 0) mm.add("empty row out " + at({t, h, d}) + " not +0");
        if (o.has_lse && o.lse(t, h) != -INFINITY) mm.add("empty row lse " + at({t, h}) + " not -inf");
        continue;
      }
      for (int d = 0; d < 128; ++d) {
        const double x = want.out_at(t, h, d);
        const uint16_t got = o.out(t, h, d);
        if (dist16(DType::kBFloat16, got, detail::msa_oracle_bf16(x)) > 1 &&
            !(std::fabs(bf16_to_float(got) - x) <= kOutAbsTol))
          mm.add("out " + at({t, h, d}) + " got " + std::to_string(bf16_to_float(got)) + " want " +
                 std::to_string(x));
      }
      if (o.has_lse) {
        const double w = want.lse_at(t, h), g = o.lse(t, h);
        if (!(std::fabs(g - w) <= kLseRelTol * std::max(std::fabs(w), 1.0)))
          mm.add("lse " + at({t, h}) + " got " + std::to_string(g) + " want " + std::to_string(w));
      }
    }
  return empty;
}

// Runs P and checks it against the oracle; returns the output.
Output run_and_check(const Problem& P, int64_t* empty_rows = nullptr) {
  const Output o = run(P);
  const int64_t e = expect_matches(P, o, P.oracle());
  if (empty_rows) *empty_rows = e;
  return o;
}

bool same_out(const Problem& P, const Output& a, const Output& b) {
  for (int64_t t = 0; t < P.T; ++t)
    for (int h = 0; h < P.Hq; ++h) {
      const float la = a.lse(t, h), lb = b.lse(t, h);
      if (std::memcmp(&la, &lb, sizeof(float)) != 0) return false;
      for (int d = 0; d < 128; ++d)
        if (a.out(t, h, d) != b.out(t, h, d)) return false;
    }
  return true;
}

// ---- lengths, pages, padding --------------------------------------------------------------------

TEST(MsaPrefill, ShortContextAndPartialLastPage) {
  Rng r(1);
  SEED_TRACE(r);
  // seq_len < 128 (one partial page); 200 and 385: the last page partly past seq_len (NaN rows).
  const std::vector<std::pair<int, int>> lens = {{100, 100}, {100, 30}, {200, 70}, {385, 20}};
  for (const auto& [len, ql] : lens) {
    SCOPED_TRACE(tag({{"seq_len", len}, {"q_len", ql}}));
    Problem P{.Hq = 2, .Hkv = 1, .K = 4, .seq_lens = {len}, .q_lens = {ql}};
    run_and_check(P.build(r));
  }
}

TEST(MsaPrefill, VarlenChunkedRequests) {
  Rng r(2);
  SEED_TRACE(r);
  // A full prefill, a chunked one (seq_len > query length), a request without query tokens, one
  // just past a block edge.
  Problem P{.Hq = 4, .Hkv = 2, .K = 4, .seq_lens = {200, 700, 500, 129}, .q_lens = {200, 24, 0, 129}};
  run_and_check(P.build(r));
}

TEST(MsaDecode, SeqLenZeroAndShorterThanDql) {
  Rng r(3);
  SEED_TRACE(r);
  // Request 0 pads (seq_len 0): out 0, lse -inf. Request 1 (seq_len 5 < dql 8): causal rows 0..2
  // sit at p < 0 and see no key; non-causal rows see all 5 keys.
  for (bool causal : {true, false}) {
    SCOPED_TRACE(causal ? "causal" : "non-causal");
    Problem P{.Hq = 2, .Hkv = 1, .K = 4, .dql = 8, .seq_lens = {0, 5, 300}, .mask = {.causal = causal}};
    P.build(r);
    int64_t empty = 0;
    run_and_check(P, &empty);
    EXPECT_EQ(empty, (causal ? 8 + 3 : 8) * P.Hq);
  }
}

// ---- the top-k lists ----------------------------------------------------------------------------

TEST(MsaTopk, MinusOneInsideThePrefix) {
  Rng r(4);
  SEED_TRACE(r);
  Problem P{.Hq = 2, .Hkv = 1, .K = 6, .dql = 2, .seq_lens = {900}};
  P.build(r);
  P.set_list(0, 0, {2, -1, 0, -1, 5, 6});
  P.set_list(1, 0, {-1, -1, 3, 7});
  run_and_check(P);
  // -1 holes select exactly what the list without them selects.
  const Output with_holes = run(P);
  P.set_list(0, 0, {2, 0, 5, 6});
  P.set_list(1, 0, {3, 7});
  EXPECT_TRUE(same_out(P, with_holes, run(P)));
}

TEST(MsaTopk, RepeatedIdsCountOnce) {
  Rng r(5);
  SEED_TRACE(r);
  Problem P{.Hq = 4, .Hkv = 2, .K = 6, .dql = 1, .seq_lens = {1000, 300}};
  P.build(r);
  P.set_list(0, 0, {1, 1, 7, 1, 7, 3});
  P.set_list(0, 1, {7, 7, 7, 7, 7, 7});
  P.set_list(1, 1, {2, 0, 2, -1, 0, 2});
  run_and_check(P);  // the oracle selects the set of ids
  const Output dup = run(P);
  P.set_list(0, 0, {1, 7, 3});
  P.set_list(0, 1, {7});
  P.set_list(1, 1, {2, 0});
  EXPECT_TRUE(same_out(P, dup, run(P)));
}

TEST(MsaTopk, IdsPastTheVisibleBlocksAreSkipped) {
  Rng r(6);
  SEED_TRACE(r);
  // Decode: block_table columns past a request's blocks point at NaN pages; reading one would
  // poison the row. Prefill: early tokens of a chunk list blocks only later tokens see.
  Problem D{.Hq = 2, .Hkv = 1, .K = 5, .dql = 2, .seq_lens = {300, 100}};
  D.build(r);
  ASSERT_EQ(D.blocks(300), 3);
  D.set_list(0, 0, {0, 3, 2, 4});            // row 0: p 298, 3 visible blocks
  D.set_list(1, 0, {5, 1, INT32_MAX, 2});
  D.set_list(2, 0, {1, 0, 2});               // p 98: only block 0 visible
  D.set_list(3, 0, {3, 0, -7, INT32_MIN});
  run_and_check(D);
  Problem P{.Hq = 2, .Hkv = 1, .K = 4, .seq_lens = {600}, .q_lens = {400}};
  P.build(r);
  P.set_list(0, 0, {0, 1, 4, 3});            // p 200: blocks 0, 1 visible; 3, 4 skipped
  P.set_list(30, 0, {4, 2, 1});              // p 230
  const Output o = run_and_check(P);
  P.set_list(0, 0, {0, 1});
  P.set_list(30, 0, {1});
  EXPECT_TRUE(same_out(P, o, run(P)));
}

TEST(MsaTopk, ShuffledTableMatchesIdentity) {
  Rng r(7), r2(7);
  SEED_TRACE(r);
  Problem a{.Hq = 2, .Hkv = 2, .K = 4, .dql = 4, .seq_lens = {700, 33, 260}};
  Problem b = a;
  b.shuffle = false;
  a.build(r);
  b.build(r2);
  EXPECT_FALSE(same_bytes(a.table, b.table));
  EXPECT_TRUE(same_out(a, run_and_check(a), run_and_check(b)));
}

TEST(MsaTopk, StridedViews) {
  // The token-major [T, Hkv, K] buffer viewed as [Hkv, T, K], the same with padded token rows, and
  // a contiguous head-major buffer: the same lists give the same output.
  std::vector<Output> outs;
  for (const auto& [pad, hm] : std::vector<std::pair<int, bool>>{{0, false}, {3, false}, {0, true}}) {
    Rng r(8);
    SEED_TRACE(r);
    SCOPED_TRACE(tag({{"pad", pad}, {"head_major", hm}}));
    Problem P{.Hq = 4, .Hkv = 2, .K = 5, .seq_lens = {520, 140}, .q_lens = {12, 9}, .topk_pad = pad,
              .head_major = hm};
    P.build(r);
    outs.push_back(run_and_check(P));
    if (outs.size() > 1) {
      EXPECT_TRUE(same_out(P, outs[0], outs.back()));
    }
  }
}

// ---- shapes, dtypes, masks ----------------------------------------------------------------------

TEST(MsaDecode, QueryLens) {
  for (int dql : {1, 2, 4, 8, 32}) {
    Rng r(10 + uint64_t(dql));
    SEED_TRACE(r);
    SCOPED_TRACE(tag({{"dql", dql}}));
    Problem P{.Hq = 2, .Hkv = 1, .K = 3, .dql = dql, .seq_lens = {20, 0, 300}};
    run_and_check(P.build(r));
  }
}

TEST(MsaAttention, GqaGroups) {
  for (const auto& [hq, hkv] : std::vector<std::pair<int, int>>{{2, 2}, {4, 2}, {4, 1}, {16, 2}, {16, 1}}) {
    Rng r(20 + uint64_t(hq * 4 + hkv));
    SEED_TRACE(r);
    SCOPED_TRACE(tag({{"Hq", hq}, {"Hkv", hkv}}));
    Problem P{.Hq = hq, .Hkv = hkv, .K = 3, .dql = 2, .seq_lens = {400, 90}};
    run_and_check(P.build(r));
  }
}

TEST(MsaAttention, Fp8CacheWithScales) {
  for (const auto& [ks, vs] : std::vector<std::pair<float, float>>{{1.f, 1.f}, {0.7f, 1.3f}, {2.5f, 0.05f}}) {
    Rng r(30);
    SEED_TRACE(r);
    SCOPED_TRACE("k_scale " + std::to_string(ks) + " v_scale " + std::to_string(vs));
    Problem D{.fp8 = true, .Hq = 4, .Hkv = 2, .K = 4, .dql = 4, .seq_lens = {500, 60}, .ks = ks, .vs = vs};
    run_and_check(D.build(r));
    Problem P{.fp8 = true, .Hq = 2, .Hkv = 1, .K = 4, .seq_lens = {300}, .q_lens = {20}, .ks = ks, .vs = vs};
    run_and_check(P.build(r));
  }
}

TEST(MsaMask, NonCausal) {
  Rng r(40);
  SEED_TRACE(r);
  // Every row of a request sees every selected key < seq_len, including keys after its position.
  Problem P{.Hq = 2, .Hkv = 1, .K = 4, .seq_lens = {300, 140}, .q_lens = {7, 140}, .mask = {.causal = false}};
  P.build(r);
  const Output o = run_and_check(P);
  Problem C = P;
  C.mask.causal = true;
  EXPECT_FALSE(same_out(P, o, run(C)));  // row 0 of request 1 differs (p 0 vs all 140 keys)
  Problem D{.Hq = 2, .Hkv = 1, .K = 4, .dql = 8, .seq_lens = {260, 3}, .mask = {.causal = false}};
  run_and_check(D.build(r));
}

TEST(MsaMask, Window) {
  // window 50 (< a block), 200 (across block edges), 1 (the key itself); causal and non-causal.
  for (int w : {1, 50, 200})
    for (bool causal : {true, false}) {
      Rng r(50 + uint64_t(w));
      SEED_TRACE(r);
      SCOPED_TRACE(tag({{"window", w}, {"causal", causal}}));
      const MsaMask m{.causal = causal, .window_left = w};
      Problem D{.Hq = 2, .Hkv = 1, .K = 4, .dql = 4, .seq_lens = {520, 2, 140}, .mask = m};
      run_and_check(D.build(r));
      Problem P{.Hq = 2, .Hkv = 1, .K = 4, .seq_lens = {400}, .q_lens = {30}, .mask = m};
      run_and_check(P.build(r));
    }
  // A row whose selected blocks all lie before its window sees no key: out 0, lse -inf.
  Rng r(59);
  Problem P{.Hq = 2, .Hkv = 1, .K = 2, .dql = 1, .seq_lens = {400}, .mask = {.window_left = 50}};
  P.build(r);
  P.set_list(0, 0, {0, 1});  // p 399: window [350, 400) is in block 2
  int64_t empty = 0;
  run_and_check(P, &empty);
  EXPECT_EQ(empty, 2);
}

TEST(MsaAttention, LseOptional) {
  Rng r(60);
  SEED_TRACE(r);
  Problem P{.Hq = 2, .Hkv = 1, .K = 4, .dql = 2, .seq_lens = {300, 0}};
  P.build(r);
  const Output with = run(P), without = run(P, false);  // run(): the lse buffer stays all NaN
  expect_matches(P, without, P.oracle());
  for (int64_t t = 0; t < P.T; ++t)
    for (int h = 0; h < P.Hq; ++h)
      for (int d = 0; d < 128; ++d) ASSERT_EQ(with.out(t, h, d), without.out(t, h, d));
}

TEST(MsaOracle, AbsOutIsTheMeanOfAbsV) {
  // abs_out = sum_n p_n |v_n| / sum_n p_n (the scale of P's rounding, used by the GPU check's p16
  // rows): at least |out| everywhere; equal to out where every visible V value is >= 0 (dim 0
  // here), to -out where every one is <= 0 (dim 1), and to c where they are +-c (dim 2, signs
  // alternating by key: out near 0).
  Rng r(40);
  SEED_TRACE(r);
  for (bool fp8 : {false, true}) {
    SCOPED_TRACE(fp8 ? "fp8" : "bf16");
    Problem P{.fp8 = fp8, .Hq = 4, .Hkv = 2, .K = 4, .seq_lens = {300, 90}, .q_lens = {40, 90}};
    P.build(r);
    for (int b = 0; b < 2; ++b)
      for (int64_t n = 0; n < P.seq_lens[size_t(b)]; ++n)
        for (int g = 0; g < P.Hkv; ++g) {
          P.set_kv(b, n, g, 128 + 0, 0.25 + 0.01 * double(n % 7));
          P.set_kv(b, n, g, 128 + 1, -0.5 - 0.02 * double(n % 5));
          P.set_kv(b, n, g, 128 + 2, n % 2 ? 0.75 : -0.75);
        }
    const detail::MsaOracle o = P.oracle();
    int64_t rows = 0;
    for (int64_t t = 0; t < P.T; ++t)
      for (int h = 0; h < P.Hq; ++h) {
        if (o.keys_at(t, h) == 0) continue;
        ++rows;
        const size_t i = size_t((t * P.Hq + h) * 128);
        EXPECT_DOUBLE_EQ(o.abs_out[i], o.out[i]) << at({t, h, 0});
        EXPECT_DOUBLE_EQ(o.abs_out[i + 1], -o.out[i + 1]) << at({t, h, 1});
        EXPECT_NEAR(o.abs_out[i + 2], 0.75, 1e-12) << at({t, h, 2});
        for (int d = 3; d < 128; ++d)
          ASSERT_GE(o.abs_out[i + size_t(d)], std::fabs(o.out[i + size_t(d)]) * (1 - 1e-15)) << at({t, h, d});
      }
    EXPECT_EQ(rows, P.T * P.Hq);
  }
}

TEST(MsaOracle, RoundsOnce) {
  // 1 + 2^-8 + 2^-30: float rounds it to 1 + 2^-8 (a bf16 midpoint); once-rounding goes up.
  EXPECT_EQ(detail::msa_oracle_bf16(1.0 + 0x1p-8 + 0x1p-30), 0x3F81);
  EXPECT_EQ(detail::msa_oracle_bf16(1.0 + 0x1p-8), 0x3F80);           // a tie: the even code
  EXPECT_EQ(detail::msa_oracle_bf16(-(1.0 + 0x1p-8 + 0x1p-30)), 0xBF81);
  EXPECT_EQ(detail::msa_oracle_bf16(0.0), 0x0000);
}

// ===================================== argument validation =====================================

void set_i32(const TensorView& v, std::initializer_list<int32_t> values) {
  std::copy(values.begin(), values.end(), v.ptr<int32_t>());
}

// A valid prefill: Hq 4, Hkv 2, topk 4, requests of 2 and 3 tokens (seq_lens 2 and 300: 1 and 3
// blocks) over a 4-page bf16 cache, max_blocks 4. Lists pick blocks 0 (request 0) and 0..2.
struct PrefillCall : CallBase {
  MsaPrefillArgs a;
  PrefillCall() {
    a.q = make({5, 4, 128}, DType::kBFloat16);
    a.cache = {make({4, 2, 128, 256}, DType::kBFloat16), KvCacheDtype::kBFloat16, {}, {}};
    a.topk = make({2, 5, 4}, DType::kInt32);
    for (int i = 0; i < 10; ++i)
      set_row(i, i % 5 < 2 ? std::vector<int32_t>{0, -1, -1, -1} : std::vector<int32_t>{0, 1, 2, -1});
    a.cu_seqlens_q = make({3}, DType::kInt32);
    set_i32(a.cu_seqlens_q, {0, 2, 5});
    a.seq_lens = make({2}, DType::kInt32);
    set_i32(a.seq_lens, {2, 300});
    a.block_table = make({2, 4}, DType::kInt32);
    set_i32(a.block_table, {3, -1, 99, -5, 0, 2, 1, 7});
    a.max_query_len = 3;
    a.softmax_scale = 0.125f;
    a.out = make({5, 4, 128}, DType::kBFloat16, 0xFF);
    a.lse = make({5, 4}, DType::kFloat32, 0xFF);
  }
  void set_row(int row, const std::vector<int32_t>& ids) {  // row = g * T + t
    std::copy(ids.begin(), ids.end(), a.topk.ptr<int32_t>() + row * 4);
  }
  void call() { msa_prefill(a); }
};

// A valid decode: Hq 2, Hkv 1, topk 2, 3 requests x dql 2 (seq_lens 0, 1, 200), fp8 cache with
// scales, max_blocks 3.
struct DecodeCall : CallBase {
  MsaDecodeShape shape{.batch = 3, .decode_query_len = 2, .num_heads = 2, .num_kv_heads = 1, .topk = 2,
                       .max_blocks = 3, .kv_cache_dtype = KvCacheDtype::kFp8E4M3};
  MsaDecodeArgs a;
  DecodeCall() {
    a.q = make({6, 2, 128}, DType::kBFloat16);
    a.cache = {make({3, 1, 128, 256}, DType::kUInt8), KvCacheDtype::kFp8E4M3, make({1}, DType::kFloat32),
               make({1}, DType::kFloat32)};
    a.topk = make({1, 6, 2}, DType::kInt32);
    set_i32(a.topk, {-1, -1, 0, -1, 0, -1, 0, 1, 0, 1, 1, 0});
    a.seq_lens = make({3}, DType::kInt32);
    set_i32(a.seq_lens, {0, 1, 200});
    a.block_table = make({3, 3}, DType::kInt32);
    set_i32(a.block_table, {-1, -1, -1, 2, 9, 9, 0, 1, 9});
    a.softmax_scale = 0.125f;
    a.out = make({6, 2, 128}, DType::kBFloat16, 0xFF);
    a.lse = make({6, 2}, DType::kFloat32, 0xFF);
  }
  void call() { MsaDecodePlan(shape, Device::cpu()).run(a); }
};

TensorView on_cuda(TensorView v) {
  v.device = Device::cuda(0);
  return v;
}

TEST(MsaArgs, BadPrefillArguments) {
  using C = PrefillCall;
  expect_bad_args<C>({
      {"q float32", [](C& c) { c.a.q = c.make({5, 4, 128}, DType::kFloat32); },
       {"msa_attention: q.dtype = float32", "supported: bfloat16"}},
      {"q head dim", [](C& c) { c.a.q = c.make({5, 4, 64}, DType::kBFloat16); }, {"q.shape = [5, 4, 64]"}},
      {"missing q", [](C& c) { c.a.q = TensorView{}; }, {"q = (none): is required"}},
      {"out on cuda", [](C& c) { c.a.out = on_cuda(c.a.out); }, {"out.device = cuda:0", "must be on cpu"}},
      {"cache dtype", [](C& c) { c.a.cache.kv_cache = c.make({4, 2, 128, 256}, DType::kFloat16); },
       {"kv_cache.dtype = float16"}},
      {"cache e5m2", [](C& c) { c.a.cache.kv_cache_dtype = KvCacheDtype::kFp8E5M2; }, {"kv_cache_dtype = fp8_e5m2"}},
      {"block size 64", [](C& c) { c.a.cache.kv_cache = c.make({8, 2, 64, 256}, DType::kBFloat16); },
       {"kv_cache.shape = [8, 2, 64, 256]", "MSA layers use block size 128"}},
      {"group size 3", [](C& c) {
         c.a.q = c.make({5, 6, 128}, DType::kBFloat16);
         c.a.out = c.make({5, 6, 128}, DType::kBFloat16);
         c.a.lse = c.make({5, 6}, DType::kFloat32);
       },
       {"q.shape = [5, 6, 128]", "Hq / Hkv, Hkv = 2) must be 1, 2, 4, 8 or 16"}},
      {"fp8 without scales",
       [](C& c) {
         c.a.cache = {c.make({4, 2, 128, 256}, DType::kUInt8), KvCacheDtype::kFp8E4M3, {}, {}};
       },
       {"cache.k_scale = (none): is required"}},
      {"fp8 v_scale shape",
       [](C& c) {
         c.a.cache = {c.make({4, 2, 128, 256}, DType::kUInt8), KvCacheDtype::kFp8E4M3,
                      c.make({1}, DType::kFloat32), c.make({2}, DType::kFloat32)};
       },
       {"cache.v_scale.shape = [2]", "expected one fp32 value"}},
      {"topk 0", [](C& c) { c.a.topk = c.make({2, 5, 0}, DType::kInt32); }, {"topk.shape = [2, 5, 0]", "1..64"}},
      {"topk 65", [](C& c) { c.a.topk = c.make({2, 5, 65}, DType::kInt32, 0xFF); }, {"topk.shape = [2, 5, 65]", "1..64"}},
      {"topk int64", [](C& c) { c.a.topk = c.make({2, 5, 4}, DType::kInt64); }, {"topk.dtype = int64"}},
      {"topk heads", [](C& c) { c.a.topk = c.make({1, 5, 4}, DType::kInt32); }, {"topk.shape = [1, 5, 4]"}},
      {"softmax_scale 0", [](C& c) { c.a.softmax_scale = 0; }, {"softmax_scale = 0", "finite and > 0"}},
      {"softmax_scale NaN", [](C& c) { c.a.softmax_scale = NAN; }, {"softmax_scale = nan", "finite and > 0"}},
      {"window < 0", [](C& c) { c.a.mask.window_left = -1; }, {"mask.window_left = -1", "must be >= 0"}},
      {"seq_lens int64", [](C& c) { c.a.seq_lens = c.make({2}, DType::kInt64); }, {"seq_lens.dtype = int64"}},
      {"block_table rows", [](C& c) { c.a.block_table = c.make({3, 4}, DType::kInt32); },
       {"block_table.shape = [3, 4]", "expected [2, *]"}},
      {"out shape", [](C& c) { c.a.out = c.make({5, 2, 128}, DType::kBFloat16); }, {"out.shape = [5, 2, 128]"}},
      {"out float32", [](C& c) { c.a.out = c.make({5, 4, 128}, DType::kFloat32); }, {"out.dtype = float32"}},
      {"lse bf16", [](C& c) { c.a.lse = c.make({5, 4}, DType::kBFloat16); }, {"lse.dtype = bfloat16"}},
      {"lse shape", [](C& c) { c.a.lse = c.make({5, 2}, DType::kFloat32); }, {"lse.shape = [5, 2]"}},
      {"missing cu_seqlens_q", [](C& c) { c.a.cu_seqlens_q = TensorView{}; }, {"cu_seqlens_q = (none): is required"}},
      {"cu_seqlens_q length", [](C& c) { c.a.cu_seqlens_q = c.make({2}, DType::kInt32); },
       {"cu_seqlens_q.shape = [2]", "expected [3]"}},
      {"max_query_len past T", [](C& c) { c.a.max_query_len = 6; }, {"max_query_len = 6", "[0, T = 5]"}},
      {"no requests",
       [](C& c) {
         c.a.seq_lens = c.make({0}, DType::kInt32);
         c.a.block_table = c.make({0, 4}, DType::kInt32);
         c.a.cu_seqlens_q = c.make({1}, DType::kInt32);
       },
       {"seq_lens.shape = [0]", "no requests for 5 query tokens"}},
  });
}

TEST(MsaArgs, BadDecodeArguments) {
  using C = DecodeCall;
  expect_bad_args<C>({
      {"plan batch", [](C& c) { c.shape.batch = 2; }, {"seq_lens.shape = [3]", "the plan was built for batch 2"}},
      {"plan dql", [](C& c) { c.shape.decode_query_len = 3; }, {"q.shape = [6, 2, 128]", "9 rows"}},
      {"plan heads", [](C& c) { c.shape.num_heads = 4; }, {"q.shape = [6, 2, 128] with Hkv 1", "Hq 4, Hkv 1"}},
      {"plan kv heads", [](C& c) { c.shape.num_kv_heads = 2; }, {"with Hkv 1", "Hq 2, Hkv 2"}},
      {"plan topk", [](C& c) { c.shape.topk = 4; }, {"topk.shape = [1, 6, 2]", "topk 4"}},
      {"plan max_blocks", [](C& c) { c.shape.max_blocks = 4; }, {"block_table.shape = [3, 3]", "max_blocks 4"}},
      {"plan dtype", [](C& c) { c.shape.kv_cache_dtype = KvCacheDtype::kBFloat16; },
       {"cache.kv_cache_dtype = fp8_e4m3", "the plan was built for bfloat16"}},
      {"fp8 without scales", [](C& c) { c.a.cache.v_scale = TensorView{}; }, {"cache.v_scale = (none): is required"}},
      {"scale on cuda", [](C& c) { c.a.cache.k_scale = on_cuda(c.a.cache.k_scale); }, {"cache.k_scale.device = cuda:0"}},
      {"seq_lens strided",
       [](C& c) {
         TensorView t = c.make({6}, DType::kInt32);
         t.shape[0] = 3, t.stride[0] = 2;
         c.a.seq_lens = t;
       },
       {"seq_lens.strides"}},
  });
}

// The dql-1 bf16 split rule of GPUs with less DRAM bandwidth an SM than the H200 (the H100 sweep's
// best counts, session 49): powers of two, at most one CTA an SM, 16-CTA clusters on at most half.
TEST(MsaDecodeSplits, Bf16LeanRule) {
  const struct {
    int64_t pairs;
    int cap, sms, want;
  } cases[] = {
      {4, 16, 132, 16}, {8, 16, 132, 8},  {12, 16, 132, 8}, {16, 16, 132, 8}, {24, 16, 132, 4},
      {32, 16, 132, 4}, {40, 16, 132, 2}, {64, 16, 132, 2}, {66, 16, 132, 2}, {67, 16, 132, 1},
      {80, 16, 132, 1}, {500, 16, 132, 1}, {4, 6, 132, 4},  {4, 1, 132, 1},  {2, 16, 132, 16},
      {4, 16, 114, 8},  {0, 16, 132, 1},  {4, 0, 132, 1},  {4, 16, 0, 1},
  };
  for (const auto& c : cases)
    EXPECT_EQ(msa_decode1_bf16_lean_splits(c.pairs, c.cap, c.sms), c.want)
        << "pairs " << c.pairs << " cap " << c.cap << " sms " << c.sms;
}

TEST(MsaDecodeShapeErrors, ValidateAndConstructor) {
  const struct {
    std::function<void(MsaDecodeShape&)> edit;
    const char* want;
  } cases[] = {
      {[](MsaDecodeShape& s) { s.batch = -1; }, "batch = -1: must be >= 0"},
      {[](MsaDecodeShape& s) { s.decode_query_len = 0; }, "decode_query_len = 0: supported 1..32"},
      {[](MsaDecodeShape& s) { s.decode_query_len = 33; }, "decode_query_len = 33"},
      {[](MsaDecodeShape& s) { s.num_heads = 6; }, "num_heads = 6, num_kv_heads = 2: Hq / Hkv must be 1, 2, 4, 8 or 16"},
      {[](MsaDecodeShape& s) { s.num_heads = 64; }, "num_heads = 64, num_kv_heads = 2"},
      {[](MsaDecodeShape& s) { s.num_kv_heads = 0; }, "num_kv_heads = 0"},
      {[](MsaDecodeShape& s) { s.topk = 0; }, "topk = 0: supported 1..64"},
      {[](MsaDecodeShape& s) { s.topk = 65; }, "topk = 65"},
      {[](MsaDecodeShape& s) { s.max_blocks = 0; }, "max_blocks = 0: must be >= 1"},
      {[](MsaDecodeShape& s) { s.kv_cache_dtype = KvCacheDtype::kFp8E5M2; }, "kv_cache_dtype = fp8_e5m2"},
  };
  const MsaDecodeShape ok{.batch = 2, .decode_query_len = 8, .num_heads = 8, .num_kv_heads = 2, .topk = 16,
                          .max_blocks = 4};
  EXPECT_EQ(MsaDecodePlan::validate(ok), "");
  EXPECT_NO_THROW({ MsaDecodePlan x(ok, Device::cpu()); });
  for (const auto& c : cases) {
    SCOPED_TRACE(c.want);
    MsaDecodeShape s = ok;
    c.edit(s);
    EXPECT_THAT(MsaDecodePlan::validate(s), HasSubstr(c.want));
    EXPECT_THAT(error_of([&] { MsaDecodePlan x(s, Device::cpu()); }),
                AllOf(StartsWith("msa_attention: unsupported MsaDecodeShape: "), HasSubstr(c.want)));
  }
}

// ---- inconsistent device-resident lengths and page ids: throw, write nothing ------------------

TEST(MsaOutOfRange, PrefillLengthsAndPages) {
  // Garbage in unused table entries (-1, 99, -5, 7) is fine: the unedited call runs.
  expect_edits_throw_untouched<PrefillCall>(
      {
        {[](PrefillCall& c) { set_i32(c.a.cu_seqlens_q, {1, 2, 5}); }, "cu_seqlens_q[0]", "1"},
        {[](PrefillCall& c) { set_i32(c.a.cu_seqlens_q, {0, 6, 5}); }, "cu_seqlens_q[2]", "5"},
        {[](PrefillCall& c) { set_i32(c.a.cu_seqlens_q, {0, 2, 4}); }, "cu_seqlens_q[2]", "4"},
        {[](PrefillCall& c) { c.a.max_query_len = 2; }, "cu_seqlens_q[2] - cu_seqlens_q[1]", "3"},
        {[](PrefillCall& c) { set_i32(c.a.seq_lens, {2, 2}); }, "seq_lens[1]", "2"},
        {[](PrefillCall& c) { set_i32(c.a.seq_lens, {2, 513}); }, "seq_lens[1]", "513"},
        {[](PrefillCall& c) { c.a.block_table.ptr<int32_t>()[6] = 4; }, "block_table[1][2]", "4"},
        {[](PrefillCall& c) { c.a.block_table.ptr<int32_t>()[5] = -1; }, "block_table[1][1]", "-1"},
        // An entry only the top-k of one row selects (request 0's column 1 becomes visible with
        // seq_len 200; row 1 of head 1 selects it).
        {[](PrefillCall& c) {
           set_i32(c.a.seq_lens, {200, 300});
           c.set_row(5 + 1, {1, -1, -1, -1});
         },
         "block_table[0][1]", "-1"},
      },
      [](PrefillCall& c) { return std::vector<TensorView>{c.a.out, c.a.lse}; });
}

TEST(MsaOutOfRange, DecodeLengthsAndPages) {
  expect_edits_throw_untouched<DecodeCall>(
      {
        {[](DecodeCall& c) { set_i32(c.a.seq_lens, {0, 1, -3}); }, "seq_lens[2]", "-3"},
        {[](DecodeCall& c) { set_i32(c.a.seq_lens, {0, 1, 385}); }, "seq_lens[2]", "385"},
        {[](DecodeCall& c) { c.a.block_table.ptr<int32_t>()[7] = 3; }, "block_table[2][1]", "3"},
        {[](DecodeCall& c) {
           set_i32(c.a.seq_lens, {0, 129, 200});
           c.a.topk.ptr<int32_t>()[2 * 2] = 1;  // row 2 (request 1, p 127): block 1 is not visible
           c.a.topk.ptr<int32_t>()[3 * 2 + 1] = 1;  // row 3 (p 128) selects it: page 9
         },
         "block_table[1][1]", "9"},
      },
      [](DecodeCall& c) { return std::vector<TensorView>{c.a.out, c.a.lse}; });
}

TEST(MsaOutOfRange, SkippedEntriesAreNeverChecked) {
  // A page id out of range behind -1, an id past the visible blocks or a repeat is fine.
  DecodeCall c;
  // Rows 0-2 see no block; row 3 (p 0) lists id 1, past its one visible block, whose entry is 9.
  set_i32(c.a.topk, {-1, 2, 0, 1, 0, 0, 1, 1, 0, 1, 1, 0});
  EXPECT_NO_THROW(c.call());
}

// Random lengths, query offsets, tables and top-k ids (each field kept valid half the time): the
// CPU path runs, or throws before writing anything; under scripts/sanitize.sh it also never reads
// or writes out of bounds.
TEST(MsaOutOfRange, RandomIndicesRunOrThrowUntouched) {
  expect_runs_or_throws_untouched<PrefillCall>(
      400, 11,
      [](PrefillCall& c, std::mt19937_64& g) {
        if (coin(g)) wild_fill(c.a.cu_seqlens_q, g, 0, 5);
        if (coin(g)) wild_fill(c.a.seq_lens, g, 0, 520);
        if (coin(g)) wild_fill(c.a.block_table, g, 0, 3);
        if (coin(g)) c.a.max_query_len = int(g() % 6);
        wild_fill(c.a.topk, g, -1, 4);
      },
      [](PrefillCall& c) { return std::vector<TensorView>{c.a.out, c.a.lse}; });
  expect_runs_or_throws_untouched<DecodeCall>(
      400, 12,
      [](DecodeCall& c, std::mt19937_64& g) {
        if (coin(g)) wild_fill(c.a.seq_lens, g, 0, 390);
        if (coin(g)) wild_fill(c.a.block_table, g, 0, 2);
        wild_fill(c.a.topk, g, -1, 3);
      },
      [](DecodeCall& c) { return std::vector<TensorView>{c.a.out, c.a.lse}; });
}

}  // namespace
