// Tests of qknorm_rope_kv_insert: the CPU path against an fp64 oracle (in place, q_out, fp8 q,
// bf16/fp8 cache insert, padded qkv rows); the fp8 q equals e4m3(bf16(q) * (1/scale)); MiniMax-M3
// sparse rows (index_q to index_q_out only, index_k in place and into the index cache, skipped for
// index slot < 0, bf16 or unscaled e4m3 with saturation); argument validation (bad arguments, the
// index arguments, out-of-range slot, index slot or position that must throw before anything is
// written); the run-time claims' rule (ops/common/claims_rule.h), shared with the context writer.
// Shared helpers: tests/test_util.h.
#include "ops/common/claims_rule.h"
#include "test_util.h"

namespace {

using namespace m3rt;
using namespace m3rt_test;

// ---- qknorm_rope_kv_insert ----------------------------------------------------------------------

// The arguments every qknorm_rope_kv_insert call needs (no outputs, no insert).
QknormRopeKvInsertArgs qk_args(const TensorView& qkv, const Tensor& qw, const Tensor& kw, const Tensor& table,
                               const Tensor& pos, int nq, int nkv, int R) {
  return {.qkv = qkv, .q_norm_weight = qw, .k_norm_weight = kw, .cos_sin_cache = table, .positions = pos,
          .num_heads = nq, .num_kv_heads = nkv, .rotary_dim = R, .eps = kEps};
}

// Cache rows hold exactly the k' and v left in the qkv rows `buf` (bf16), or e4m3(k' / 0.37) and
// e4m3(v / 2.5) (fp8: the tests' scales).
void check_kv_rows(Mismatches& mm, const Tensor& cache, const std::vector<int64_t>& slots, const Tensor& buf,
                   int64_t row, int nq, int nkv, bool fp8) {
  check_cache(mm, cache, slots, [&](const uint8_t* crow, int64_t t, int h) {
    const uint16_t* k = buf.ptr<uint16_t>() + t * row + (nq + h) * 128;
    const uint16_t* v = buf.ptr<uint16_t>() + t * row + (nq + nkv + h) * 128;
    const uint16_t* c16 = reinterpret_cast<const uint16_t*>(crow);
    for (int d = 0; d < 128; ++d) {
      const bool ok = !fp8 ? c16[d] == k[d] && c16[128 + d] == v[d]
                           : crow[d] == float_to_e4m3(bf16_to_float(k[d]) / 0.37f) &&
                                 crow[128 + d] == float_to_e4m3(bf16_to_float(v[d]) / 2.5f);
      if (!ok) mm.add("cache row of token/head/dim " + at({t, h, d}));
    }
  });
}

TEST(QknormRopeKvInsertCpu, MatchesOracle) {
  // insert: 0 none, 1 bf16 cache, 2 fp8 cache (k_scale 0.37, v_scale 2.5); pad: qkv row padding.
  const struct { int T, nq, nkv, R, bs, insert; bool q_out, q_fp8; float q_scale; int64_t pad; } cases[] = {
      {0, 2, 1, 64, 16, 1, false, false, 1, 0},       {1, 2, 1, 16, 16, 0, false, false, 1, 0},
      {7, 4, 2, 32, 64, 1, true, false, 1, 0},        {64, 8, 4, 64, 16, 2, true, true, 0.5f, 0},
      {513, 2, 1, 64, 128, 2, false, true, 0.37f, 8}, {7, 2, 2, 64, 16, 1, false, false, 1, 24},
      {33, 4, 4, 16, 64, 2, false, false, 1, 0}};
  for (const auto& c : cases) {
    Rng r(uint64_t(400 + c.T * 3 + c.R));
    SEED_TRACE(r);
    SCOPED_TRACE(tag({{"T", c.T}, {"nq", c.nq}, {"nkv", c.nkv}, {"R", c.R}, {"insert", c.insert}}));
    const int64_t W = int64_t(c.nq + 2 * c.nkv) * 128, row = W + c.pad, v0 = (c.nq + c.nkv) * 128;
    Tensor buf = rand16({std::max(c.T, 1), row}, r, -10, 10);
    for (int64_t t = 0; t < c.T; ++t)  // V in the narrower range
      for (int64_t i = v0; i < W; ++i) buf.ptr<uint16_t>()[t * row + i] = float_to_bf16(r.uni(-2, 2));
    const Tensor orig = clone(buf);
    Tensor qw = rand16({128}, r, -1, 1), kw = rand16({128}, r, -1, 1), table = rope_table(c.R);
    const int64_t nb = c.T / c.bs + 2;
    const std::vector<int64_t> pos = make_positions(r, c.T), slots = make_slots(r, c.T, nb * c.bs);
    Tensor q_out = poisoned({c.T, c.nq * 128}, DType::kBFloat16),
           q8 = poisoned({c.T, c.nq * 128}, DType::kUInt8);
    Tensor cache = poisoned({nb, c.nkv, c.bs, 256}, c.insert == 2 ? DType::kUInt8 : DType::kBFloat16);
    Tensor pos_t = i64s(pos), slot_t = i64s(slots), ks = f32(0.37f), vs = f32(2.5f);
    TensorView qkv = TensorView::contiguous(buf.data(), DType::kBFloat16, {c.T, W});
    qkv.stride[0] = row;
    QknormRopeKvInsertArgs a = qk_args(qkv, qw, kw, table, pos_t, c.nq, c.nkv, c.R);
    if (c.q_out) a.q_out = q_out;
    if (c.q_fp8) a.q_fp8_out = q8, a.q_fp8_scale = c.q_scale;
    if (c.insert) a.kv_cache = cache, a.slot_mapping = slot_t, a.k_scale = ks, a.v_scale = vs;
    a.kv_cache_dtype = c.insert == 2 ? KvCacheDtype::kFp8E4M3 : KvCacheDtype::kBFloat16;
    a.enable_pdl = c.T % 2 == 1;  // GPU launch options: the CPU path ignores them
    Tensor claims = poisoned({kClaimCounterInts}, DType::kInt32);
    if (c.T % 3 == 1) a.claim_counters = claims;
    qknorm_rope_kv_insert(a);

    Mismatches mm;
    const bool q_in_place = !c.q_out && !c.q_fp8;
    double x[128], n[128], y[128], term[128], wq[128], wk[128];
    load_head(qw.ptr<uint16_t>(), wq);
    load_head(kw.ptr<uint16_t>(), wk);
    for (int64_t t = 0; t < c.T; ++t) {
      const uint16_t *in = orig.ptr<uint16_t>() + t * row, *res = buf.ptr<uint16_t>() + t * row;
      for (int h = 0; h < c.nq + c.nkv; ++h) {
        const bool is_q = h < c.nq;
        load_head(in + h * 128, x);
        gemma_norm64(x, is_q ? wq : wk, 128, n);  // fp32 throughout: no intermediate rounding
        rope64(n, table.ptr<uint16_t>() + pos[t] * c.R, c.R, y, term);
        for (int d = 0; d < 128; ++d) {
          const int64_t qo = (t * c.nq + h) * 128 + d;
          const uint16_t got = res[h * 128 + d];
          if ((!is_q || q_in_place) && !near16(DType::kBFloat16, got, y[d], term[d]))
            mm.add("qkv" + at({t, h, d}) + " want " + std::to_string(y[d]));
          if (is_q && !q_in_place && got != in[h * 128 + d]) mm.add("qkv q changed" + at({t, h, d}));
          if (is_q && c.q_out && !near16(DType::kBFloat16, q_out.ptr<uint16_t>()[qo], y[d], term[d]))
            mm.add("q_out" + at({t, h, d}));
          if (is_q && c.q_fp8 && dist_e4m3(q8.ptr<uint8_t>()[qo], e4m3_of(y[d] / double(c.q_scale))) > 1)
            mm.add("q_fp8_out" + at({t, h, d}));
        }
      }
      if (!std::equal(in + v0, in + row, res + v0))
        mm.add("v or row padding changed, token " + std::to_string(t));
    }
    // Cache rows hold exactly the k' left in qkv (bf16) or e4m3(k' / k_scale); V likewise.
    if (c.insert)
      check_kv_rows(mm, cache, slots, buf, row, c.nq, c.nkv, c.insert == 2);
  }
}

// q_fp8_out is exactly e4m3(float(bf16(q')) * (1/scale)), with or without q_out.
TEST(QknormRopeKvInsertCpu, Fp8QEqualsScaledQuantOfQOut) {
  for (float scale : {0.5f, 0.37f}) {
    Rng r(500 + uint64_t(scale * 100));
    SEED_TRACE(r);
    const int T = 7, nq = 4, nkv = 2, R = 64, W = (nq + 2 * nkv) * 128;
    Tensor qkv = rand16({T, W}, r, -10, 10), qw = rand16({128}, r, -1, 1), kw = rand16({128}, r, -1, 1);
    Tensor table = rope_table(R), pos = i64s(make_positions(r, T));
    const Tensor orig = clone(qkv);
    Tensor q_out = poisoned({T, nq * 128}, DType::kBFloat16), q8 = poisoned({T, nq * 128}, DType::kUInt8);
    QknormRopeKvInsertArgs a = qk_args(qkv, qw, kw, table, pos, nq, nkv, R);
    a.q_out = q_out;
    a.q_fp8_out = q8;
    a.q_fp8_scale = scale;
    qknorm_rope_kv_insert(a);
    const float inv = 1.0f / scale;
    for (int64_t i = 0; i < q8.numel(); ++i)
      ASSERT_EQ(q8.ptr<uint8_t>()[i], float_to_e4m3(bf16_to_float(q_out.ptr<uint16_t>()[i]) * inv))
          << "element " << i << " scale " << scale;
    for (int64_t t = 0; t < T; ++t) {  // q (q_out was given) and v unchanged in qkv
      const uint16_t *now = qkv.ptr<uint16_t>() + t * W, *was = orig.ptr<uint16_t>() + t * W;
      const int v0 = (nq + nkv) * 128;
      EXPECT_TRUE(std::equal(was, was + nq * 128, now) && std::equal(was + v0, was + W, now + v0))
          << "q or v changed in qkv, token " << t;
    }
    // q_fp8_out without q_out: q is emitted only in fp8 (same codes); qkv's q stays unchanged.
    Tensor qkv2 = clone(orig), q8b = poisoned({T, nq * 128}, DType::kUInt8);
    a.qkv = qkv2;
    a.q_out = TensorView{};
    a.q_fp8_out = q8b;
    qknorm_rope_kv_insert(a);
    EXPECT_TRUE(same_bytes(q8b, q8)) << "fp8-only q differs from the q_out + q_fp8_out run";
    EXPECT_TRUE(same_bytes(qkv2, qkv)) << "qkv (unchanged q, same k', v) differs between the runs";
  }
}

// ---- sparse (MiniMax-M3 MSA) rows ---------------------------------------------------------------

// Every row of a poisoned index cache [nb, 128, 128]: rows no index slot targets must still be all
// 0xFF; the others go to check(row, token).
template <class F>
void check_index_cache(Mismatches& mm, const Tensor& cache, const std::vector<int64_t>& slots, const F& check) {
  const int64_t rows = cache.numel() / 128, row_bytes = 128 * dtype_size(cache.view().dtype);
  std::map<int64_t, int64_t> token_of;
  for (size_t t = 0; t < slots.size(); ++t)
    if (slots[t] >= 0) token_of[slots[t]] = int64_t(t);
  for (int64_t r = 0; r < rows; ++r) {
    const uint8_t* row = cache.ptr<uint8_t>() + r * row_bytes;
    auto it = token_of.find(r);
    if (it != token_of.end()) {
      check(row, it->second);
    } else if (!all_ff(row, size_t(row_bytes))) {
      mm.add("untargeted index cache row " + std::to_string(r) + " was written");
    }
  }
}

// The sparse-row arguments added to a call.
void add_index_args(QknormRopeKvInsertArgs& a, int nidx, const Tensor& iqw, const Tensor& ikw,
                    const Tensor& iq_out, const Tensor& islots, const Tensor& icache, bool fp8) {
  a.num_index_heads = nidx;
  a.index_q_norm_weight = iqw;
  a.index_k_norm_weight = ikw;
  a.index_q_out = iq_out;
  a.index_slot_mapping = islots;
  a.index_cache = icache;
  a.index_cache_dtype = fp8 ? KvCacheDtype::kFp8E4M3 : KvCacheDtype::kAuto;
}

TEST(QknormRopeKvInsertCpu, SparseMatchesOracle) {
  // insert: 0 none, 1 bf16 main cache, 2 fp8 main cache (k_scale 0.37, v_scale 2.5); ifp8: fp8
  // index cache and e4m3 index_q_out; pad: qkv row padding.
  const struct { int T, nq, nkv, nidx, R, bs, insert; bool ifp8, q_out; int64_t pad; } cases[] = {
      {0, 2, 1, 1, 64, 16, 1, false, false, 0},    {1, 2, 1, 1, 16, 16, 0, false, false, 0},
      {9, 8, 1, 1, 16, 128, 0, true, false, 8},    {37, 16, 4, 4, 64, 128, 1, false, true, 0},
      {130, 4, 2, 2, 32, 64, 2, true, false, 16},  {7, 64, 4, 4, 64, 128, 1, false, true, 0},
      {5, 2, 1, 16, 64, 16, 0, false, false, 0},   {33, 8, 2, 2, 64, 16, 2, false, true, 0}};
  for (const auto& c : cases) {
    Rng r(uint64_t(700 + c.T * 3 + c.R + c.nidx));
    SEED_TRACE(r);
    SCOPED_TRACE(tag({{"T", c.T}, {"nq", c.nq}, {"nkv", c.nkv}, {"nidx", c.nidx}, {"R", c.R},
                      {"insert", c.insert}, {"ifp8", c.ifp8}}));
    const int iq0 = c.nq + 2 * c.nkv, ik0 = iq0 + c.nidx;  // first index_q head, the index_k head
    const int64_t W = int64_t(ik0 + 1) * 128, row = W + c.pad, v0 = (c.nq + c.nkv) * 128;
    Tensor buf = rand16({std::max(c.T, 1), row}, r, -10, 10);
    for (int64_t t = 0; t < c.T; ++t)  // V in the narrower range
      for (int64_t i = v0; i < iq0 * 128; ++i) buf.ptr<uint16_t>()[t * row + i] = float_to_bf16(r.uni(-2, 2));
    const Tensor orig = clone(buf);
    Tensor qw = rand16({128}, r, -1, 1), kw = rand16({128}, r, -1, 1), table = rope_table(c.R);
    Tensor iqw = rand16({128}, r, -1, 1), ikw = rand16({128}, r, -1, 1);
    const int64_t nb = c.T / c.bs + 2, nbi = c.T / 128 + 2;
    const std::vector<int64_t> pos = make_positions(r, c.T), slots = make_slots(r, c.T, nb * c.bs),
                               islots = make_slots(r, c.T, nbi * 128);
    Tensor q_out = poisoned({c.T, c.nq * 128}, DType::kBFloat16);
    Tensor cache = poisoned({nb, c.nkv, c.bs, 256}, c.insert == 2 ? DType::kUInt8 : DType::kBFloat16);
    Tensor iq_out = poisoned({c.T, c.nidx * 128}, c.ifp8 ? DType::kUInt8 : DType::kBFloat16);
    Tensor icache = poisoned({nbi, 128, 128}, c.ifp8 ? DType::kUInt8 : DType::kBFloat16);
    Tensor pos_t = i64s(pos), slot_t = i64s(slots), islot_t = i64s(islots), ks = f32(0.37f), vs = f32(2.5f);
    TensorView qkv = TensorView::contiguous(buf.data(), DType::kBFloat16, {c.T, W});
    qkv.stride[0] = row;
    QknormRopeKvInsertArgs a = qk_args(qkv, qw, kw, table, pos_t, c.nq, c.nkv, c.R);
    if (c.q_out) a.q_out = q_out;
    if (c.insert) a.kv_cache = cache, a.slot_mapping = slot_t, a.k_scale = ks, a.v_scale = vs;
    a.kv_cache_dtype = c.insert == 2 ? KvCacheDtype::kFp8E4M3 : KvCacheDtype::kBFloat16;
    add_index_args(a, c.nidx, iqw, ikw, iq_out, islot_t, icache, c.ifp8);
    qknorm_rope_kv_insert(a);

    Mismatches mm;
    double x[128], n[128], y[128], term[128], w[4][128];  // w: q, k, index_q, index_k weights
    const Tensor* weights[4] = {&qw, &kw, &iqw, &ikw};
    for (int i = 0; i < 4; ++i) load_head(weights[i]->ptr<uint16_t>(), w[i]);
    for (int64_t t = 0; t < c.T; ++t) {
      const uint16_t *in = orig.ptr<uint16_t>() + t * row, *res = buf.ptr<uint16_t>() + t * row;
      for (int h = 0; h <= ik0; ++h) {
        if (h >= c.nq + c.nkv && h < iq0) continue;  // v
        const int kind = h < c.nq ? 0 : h < iq0 ? 1 : h < ik0 ? 2 : 3;  // q, k, index_q, index_k
        load_head(in + h * 128, x);
        gemma_norm64(x, w[kind], 128, n);  // fp32 throughout: no intermediate rounding
        rope64(n, table.ptr<uint16_t>() + pos[t] * c.R, c.R, y, term);
        for (int d = 0; d < 128; ++d) {
          const uint16_t got = res[h * 128 + d];
          const bool in_place = kind == 1 || kind == 3 || (kind == 0 && !c.q_out);
          if (in_place && !near16(DType::kBFloat16, got, y[d], term[d]))
            mm.add("qkv" + at({t, h, d}) + " want " + std::to_string(y[d]));
          if (!in_place && got != in[h * 128 + d]) mm.add("qkv q or index_q changed" + at({t, h, d}));
          if (kind == 0 && c.q_out &&
              !near16(DType::kBFloat16, q_out.ptr<uint16_t>()[(t * c.nq + h) * 128 + d], y[d], term[d]))
            mm.add("q_out" + at({t, h, d}));
          if (kind != 2) continue;
          const int64_t o = (t * c.nidx + h - iq0) * 128 + d;
          const bool bad = c.ifp8 ? dist_e4m3(iq_out.ptr<uint8_t>()[o], e4m3_of(y[d])) > 1
                                  : !near16(DType::kBFloat16, iq_out.ptr<uint16_t>()[o], y[d], term[d]);
          if (bad) mm.add("index_q_out" + at({t, h - iq0, d}) + " want " + std::to_string(y[d]));
        }
      }
      if (!std::equal(in + v0, in + iq0 * 128, res + v0) || !std::equal(in + W, in + row, res + W))
        mm.add("v or row padding changed, token " + std::to_string(t));
    }
    // Index cache rows hold exactly the ik' left in qkv (bf16) or e4m3(ik'), unscaled; rows of
    // index slots < 0 and untargeted rows keep their poison.
    check_index_cache(mm, icache, islots, [&](const uint8_t* crow, int64_t t) {
      const uint16_t* ik = buf.ptr<uint16_t>() + t * row + ik0 * 128;
      const uint16_t* c16 = reinterpret_cast<const uint16_t*>(crow);
      for (int d = 0; d < 128; ++d)
        if (c.ifp8 ? crow[d] != float_to_e4m3(bf16_to_float(ik[d])) : c16[d] != ik[d])
          mm.add("index cache row of token/dim " + at({t, d}));
    });
    // The main insert is independent of the index insert: K/V rows as in the dense case.
    if (c.insert)
      check_kv_rows(mm, cache, slots, buf, row, c.nq, c.nkv, c.insert == 2);
  }
}

// The fp8 index path is exactly the unscaled e4m3 cast of the bf16 path's values (index_q_out and
// index cache rows), saturating to +-448; qkv ends the same in both.
TEST(QknormRopeKvInsertCpu, Fp8IndexEqualsCastOfBf16Index) {
  Rng r(800);
  SEED_TRACE(r);
  const int T = 9, nq = 4, nkv = 1, nidx = 2, R = 32, iq0 = nq + 2 * nkv, W = (iq0 + nidx + 1) * 128;
  Tensor qkv = rand16({T, W}, r, -10, 10), qw = rand16({128}, r, -1, 1), kw = rand16({128}, r, -1, 1);
  Tensor iqw = rand16({128}, r, -1, 1), ikw = rand16({128}, r, -1, 1);
  // Saturation: index_q head 0 of tokens 0 and 1 and index_k of token 2 are one pass-through dim
  // (+-8 at d = 100), normed to +-sqrt(128), times 1 + w = 61: about +-690, beyond 448.
  iqw.ptr<uint16_t>()[100] = ikw.ptr<uint16_t>()[100] = float_to_bf16(60.f);
  for (int t = 0; t < 3; ++t) {
    uint16_t* head = qkv.ptr<uint16_t>() + t * W + (t < 2 ? iq0 : iq0 + nidx) * 128;
    std::fill(head, head + 128, uint16_t(0));
    head[100] = float_to_bf16(t == 1 ? -8.f : 8.f);
  }
  Tensor table = rope_table(R), pos = i64s(make_positions(r, T));
  const std::vector<int64_t> islots = {3, -1, 200, 17, -1, 0, 255, 128, 64};  // 2 blocks
  Tensor islot_t = i64s(islots);
  const Tensor orig = clone(qkv);
  Tensor iq16 = poisoned({T, nidx * 128}, DType::kBFloat16), ic16 = poisoned({2, 128, 128}, DType::kBFloat16);
  QknormRopeKvInsertArgs a = qk_args(qkv, qw, kw, table, pos, nq, nkv, R);
  add_index_args(a, nidx, iqw, ikw, iq16, islot_t, ic16, false);
  qknorm_rope_kv_insert(a);
  Tensor qkv8 = clone(orig), iq8 = poisoned({T, nidx * 128}, DType::kFloat8E4M3),
         ic8 = poisoned({2, 128, 128}, DType::kUInt8);
  a.qkv = qkv8;
  add_index_args(a, nidx, iqw, ikw, iq8, islot_t, ic8, true);
  qknorm_rope_kv_insert(a);
  EXPECT_TRUE(same_bytes(qkv8, qkv)) << "qkv differs between the bf16 and fp8 index runs";
  for (int64_t i = 0; i < iq8.numel(); ++i)
    ASSERT_EQ(iq8.ptr<uint8_t>()[i], float_to_e4m3(bf16_to_float(iq16.ptr<uint16_t>()[i])))
        << "index_q_out element " << i;
  Mismatches mm;
  check_index_cache(mm, ic8, islots, [&](const uint8_t* crow, int64_t t) {
    const uint16_t* bf = ic16.ptr<uint16_t>() + islots[size_t(t)] * 128;
    for (int d = 0; d < 128; ++d)
      if (crow[d] != float_to_e4m3(bf16_to_float(bf[d]))) mm.add("index cache row of token/dim " + at({t, d}));
  });
  // The saturated values: 0x7E is +448, 0xFE -448.
  EXPECT_GT(bf16_to_float(iq16.ptr<uint16_t>()[100]), 448.f);
  EXPECT_EQ(iq8.ptr<uint8_t>()[100], 0x7E);
  EXPECT_EQ(iq8.ptr<uint8_t>()[nidx * 128 + 100], 0xFE);
  EXPECT_EQ(ic8.ptr<uint8_t>()[islots[2] * 128 + 100], 0x7E);
}

// The run-time claims' rule the QK insert's and the context writer's launchers share
// (ops/common/claims_rule.h): which unit a launch claims from.
TEST(ClaimRule, FirstClaimedUnit) {
  using m3rt::kernels::first_claimed_unit;
  // The QK insert's rule: 15% of the tokens from 2048 (T = 2600: tokens 2210..2599 claimed).
  EXPECT_EQ(first_claimed_unit(true, true, 2600, 9, -1, true, 15), 2210);
  EXPECT_EQ(first_claimed_unit(true, true, 1792, 9, -1, false, 15), 1792);  // below the threshold
  EXPECT_EQ(first_claimed_unit(false, true, 2600, 9, -1, true, 15), 2600);  // no counters
  EXPECT_EQ(first_claimed_unit(true, false, 2600, 9, -1, true, 15), 2600);  // fp8: never
  // The writer's: token pairs (n = 8200: 4100 pairs, 3485..4099 claimed).
  EXPECT_EQ(first_claimed_unit(true, true, 4100, 20, -1, true, 15), 3485);
  // A forced share (M3RT_*_CLAIM_PCT) at any size, capped at 100%; 0 claims none.
  EXPECT_EQ(first_claimed_unit(true, true, 151, 6, 15, false, 15), 129);
  EXPECT_EQ(first_claimed_unit(true, true, 300, 6, 250, false, 15), 0);
  EXPECT_EQ(first_claimed_unit(true, true, 3000, 6, 0, true, 15), 3000);
  // More grid columns than the buffer's counters serve (2 a column): the static split.
  EXPECT_EQ(first_claimed_unit(true, true, 2600, m3rt::kClaimCounterInts / 2, -1, true, 15), 2210);
  EXPECT_EQ(first_claimed_unit(true, true, 2600, m3rt::kClaimCounterInts / 2 + 1, -1, true, 15), 2600);
}

// ---- argument validation ------------------------------------------------------------------------

// The dense part of the validation calls: T 3, nq 2, nkv 1, rotary 64, max_pos 16, a qkv row of
// `heads` 128-dim heads.
void dense_args(CallBase& c, m3rt::QknormRopeKvInsertArgs& a, int heads) {
  a.qkv = c.make({3, heads * 128}, DType::kBFloat16);
  a.q_norm_weight = c.make({128}, DType::kBFloat16);
  a.k_norm_weight = c.make({128}, DType::kBFloat16);
  a.cos_sin_cache = c.make({16, 64}, DType::kBFloat16);
  a.positions = c.make({3}, DType::kInt64);
  a.num_heads = 2;
  a.num_kv_heads = 1;
  a.rotary_dim = 64;
}

struct QkCall : CallBase {  // T 3, nq 2, nkv 1, rotary 64, max_pos 16
  m3rt::QknormRopeKvInsertArgs a;
  QkCall() {
    dense_args(*this, a, 4);
    a.q_fp8_out = make({3, 256}, DType::kUInt8);
    a.kv_cache = make({2, 1, 16, 256}, DType::kUInt8);
    a.kv_cache_dtype = KvCacheDtype::kFp8E4M3;
    a.slot_mapping = make({3}, DType::kInt64, 0xff);
    a.k_scale = make({1}, DType::kFloat32);
    a.v_scale = make({1}, DType::kFloat32);
  }
  void call() { m3rt::qknorm_rope_kv_insert(a); }
};

TEST(QknormRopeArgs, BadArguments) {
  using C = QkCall;
  std::vector<BadArg<C>> cases = {
      {"slot_mapping without kv_cache", [](C& c) { c.a.kv_cache = TensorView{}; },
       {"qknorm_rope_kv_insert: slot_mapping = int64[3] on cpu", "without kv_cache"}},
      {"qkv width", [](C& c) { c.a.num_kv_heads = 2; },
       {"qkv.shape = [3, 512]", "expected [*, 768]"}},
      {"num_heads 0", [](C& c) { c.a.num_heads = 0; }, {"num_heads = 0"}},
      {"rotary_dim 48", [](C& c) { c.a.rotary_dim = 48; }, {"rotary_dim = 48"}},
      {"q_out shape", [](C& c) { c.a.q_out = c.make({3, 128}, DType::kBFloat16); },
       {"q_out.shape = [3, 128]", "expected [3, 256]"}},
      {"q_fp8_out dtype", [](C& c) { c.a.q_fp8_out = c.make({3, 256}, DType::kBFloat16); },
       {"q_fp8_out.dtype = bfloat16"}},
      {"missing v_scale", [](C& c) { c.a.v_scale = TensorView{}; },
       {"v_scale = (none): is required"}},
      {"cache heads", [](C& c) { c.a.kv_cache = c.make({2, 2, 16, 256}, DType::kUInt8); },
       {"kv_cache.shape = [2, 2, 16, 256]", "expected [*, 1, *, 256]"}},
      {"positions int32", [](C& c) { c.a.positions = c.make({3}, DType::kInt32); },
       {"positions.dtype = int32"}},
      {"claim_counters int64", [](C& c) { c.a.claim_counters = c.make({256}, DType::kInt64); },
       {"claim_counters.dtype = int64", "supported: int32"}},
      {"claim_counters too few", [](C& c) { c.a.claim_counters = c.make({255}, DType::kInt32); },
       {"claim_counters = int32[255] on cpu", "at least kClaimCounterInts = 256"}},
  };
  for (float s : {0.0f, -0.5f, NAN, INFINITY})
    cases.push_back({"q_fp8_scale", [s](C& c) { c.a.q_fp8_scale = s; },
                     {"q_fp8_scale = ", "must be finite and > 0"}});
  expect_bad_args<C>(cases);
}

// A valid sparse call: T 3, nq 2, nkv 1, Hidx 2, rotary 64, bf16 index cache of 2 blocks, index
// slots all -1 (0xff bytes), no main insert.
struct QkSparseCall : CallBase {
  m3rt::QknormRopeKvInsertArgs a;
  QkSparseCall() {
    dense_args(*this, a, 7);
    a.num_index_heads = 2;
    a.index_q_norm_weight = make({128}, DType::kBFloat16);
    a.index_k_norm_weight = make({128}, DType::kBFloat16);
    a.index_q_out = make({3, 256}, DType::kBFloat16);
    a.index_slot_mapping = make({3}, DType::kInt64, 0xff);
    a.index_cache = make({2, 128, 128}, DType::kBFloat16);
  }
  void call() { m3rt::qknorm_rope_kv_insert(a); }
  void fp8_index() {
    a.index_cache = make({2, 128, 128}, DType::kUInt8);
    a.index_cache_dtype = KvCacheDtype::kFp8E4M3;
    a.index_q_out = make({3, 256}, DType::kFloat8E4M3);
  }
};

TEST(QknormRopeArgs, BadSparseArguments) {
  using C = QkSparseCall;
  std::vector<BadArg<C>> cases = {
      {"qkv width (Hidx 1)", [](C& c) { c.a.num_index_heads = 1; },
       {"qkv.shape = [3, 896]", "expected [*, 768]"}},
      {"qkv width (dense)", [](C& c) { c.a.qkv = c.make({3, 6 * 128}, DType::kBFloat16); },
       {"qkv.shape = [3, 768]", "expected [*, 896]"}},
      {"Hidx 17", [](C& c) { c.a.num_index_heads = 17; },
       {"num_index_heads = 17", "supported: 0 (dense row) or 1..16"}},
      {"Hidx -1", [](C& c) { c.a.num_index_heads = -1; }, {"num_index_heads = -1", "1..16"}},
      {"missing index_q_out", [](C& c) { c.a.index_q_out = TensorView{}; },
       {"index_q_out = (none): is required"}},
      {"index_q_out shape", [](C& c) { c.a.index_q_out = c.make({3, 128}, DType::kBFloat16); },
       {"index_q_out.shape = [3, 128]", "expected [3, 256]"}},
      {"index_q_out e4m3 with a bf16 index cache",
       [](C& c) { c.a.index_q_out = c.make({3, 256}, DType::kUInt8); },
       {"index_q_out.dtype = uint8", "supported: bfloat16"}},
      {"index_q_out bf16 with an fp8 index cache",
       [](C& c) {
         c.fp8_index();
         c.a.index_q_out = c.make({3, 256}, DType::kBFloat16);
       },
       {"index_q_out.dtype = bfloat16", "supported: float8_e4m3fn or uint8"}},
      {"index_cache dtype", [](C& c) { c.a.index_cache = c.make({2, 128, 128}, DType::kUInt8); },
       {"index_cache.dtype = uint8", "supported: bfloat16"}},
      {"index_cache bf16 for fp8",
       [](C& c) {
         c.fp8_index();
         c.a.index_cache = c.make({2, 128, 128}, DType::kBFloat16);
       },
       {"index_cache.dtype = bfloat16", "supported: uint8"}},
      {"index_cache_dtype e5m2", [](C& c) { c.a.index_cache_dtype = KvCacheDtype::kFp8E5M2; },
       {"index_cache_dtype = fp8_e5m2", "supported: auto/bfloat16 or fp8/fp8_e4m3"}},
      {"index_cache block size 64", [](C& c) { c.a.index_cache = c.make({4, 64, 128}, DType::kBFloat16); },
       {"index_cache.shape = [4, 64, 128]", "block size (dim 1) must be 128"}},
      {"index_cache dim 2", [](C& c) { c.a.index_cache = c.make({2, 128, 256}, DType::kBFloat16); },
       {"index_cache.shape = [2, 128, 256]", "expected [*, *, 128]"}},
      {"index_cache 4-D", [](C& c) { c.a.index_cache = c.make({2, 1, 128, 128}, DType::kBFloat16); },
       {"index_cache.shape = [2, 1, 128, 128]"}},
      {"missing index_cache", [](C& c) { c.a.index_cache = TensorView{}; },
       {"index_cache = (none): is required"}},
      {"missing index_slot_mapping", [](C& c) { c.a.index_slot_mapping = TensorView{}; },
       {"index_slot_mapping = (none): is required"}},
      {"index_slot_mapping int32", [](C& c) { c.a.index_slot_mapping = c.make({3}, DType::kInt32); },
       {"index_slot_mapping.dtype = int32"}},
      {"index_slot_mapping length", [](C& c) { c.a.index_slot_mapping = c.make({4}, DType::kInt64); },
       {"index_slot_mapping.shape = [4]", "expected [3]"}},
      {"missing index_q_norm_weight", [](C& c) { c.a.index_q_norm_weight = TensorView{}; },
       {"index_q_norm_weight = (none): is required"}},
      {"index_k_norm_weight shape", [](C& c) { c.a.index_k_norm_weight = c.make({64}, DType::kBFloat16); },
       {"index_k_norm_weight.shape = [64]", "expected [128]"}},
      {"index_q_norm_weight dtype", [](C& c) { c.a.index_q_norm_weight = c.make({128}, DType::kFloat16); },
       {"index_q_norm_weight.dtype = float16"}},
  };
  expect_bad_args<C>(cases);
  C fp8;  // the fp8 variant of the valid call is valid too
  fp8.fp8_index();
  EXPECT_NO_THROW(fp8.call());
}

// Index arguments on a dense row (num_index_heads 0) are refused, each by name.
TEST(QknormRopeArgs, IndexArgumentsWithoutIndexHeads) {
  using C = QkCall;
  const std::vector<BadArg<C>> cases = {
      {"index_q_out", [](C& c) { c.a.index_q_out = c.make({3, 128}, DType::kBFloat16); },
       {"index_q_out = bfloat16[3, 128] on cpu", "given without num_index_heads > 0"}},
      {"index_cache", [](C& c) { c.a.index_cache = c.make({2, 128, 128}, DType::kBFloat16); },
       {"index_cache = bfloat16[2, 128, 128] on cpu", "given without num_index_heads > 0"}},
      {"index_slot_mapping", [](C& c) { c.a.index_slot_mapping = c.make({3}, DType::kInt64); },
       {"index_slot_mapping = int64[3] on cpu", "given without num_index_heads > 0"}},
      {"index_q_norm_weight", [](C& c) { c.a.index_q_norm_weight = c.make({128}, DType::kBFloat16); },
       {"index_q_norm_weight = bfloat16[128] on cpu", "given without num_index_heads > 0"}},
      {"index_k_norm_weight", [](C& c) { c.a.index_k_norm_weight = c.make({128}, DType::kBFloat16); },
       {"index_k_norm_weight = bfloat16[128] on cpu", "given without num_index_heads > 0"}},
  };
  expect_bad_args<C>(cases);
}

TEST(OutOfRange, QknormIndexSlot) {
  // index slot 256 >= 2 blocks x 128: throws naming it; qkv, both caches and outputs untouched.
  QkSparseCall c;
  c.a.qkv = c.make({3, 7 * 128}, DType::kBFloat16, 0x3f);
  c.a.q_out = c.make({3, 256}, DType::kBFloat16, 0xff);
  c.a.index_q_out = c.make({3, 256}, DType::kBFloat16, 0xff);
  c.a.index_cache = c.make({2, 128, 128}, DType::kBFloat16, 0xff);
  c.a.kv_cache = c.make({2, 1, 16, 256}, DType::kBFloat16, 0xff);
  c.a.slot_mapping = c.make({3}, DType::kInt64);
  set_i64(c.a.slot_mapping, {0, 1, 2});
  set_i64(c.a.index_slot_mapping, {0, 255, 256});
  expect_throws_and_untouched(c, {c.a.qkv, c.a.q_out, c.a.index_q_out, c.a.index_cache, c.a.kv_cache},
                              "index_slot_mapping[2]", "256");
}

TEST(OutOfRange, QknormSlotAndPosition) {
  for (bool bad_slot : {true, false}) {  // slot 32 >= 2 blocks x 16, or position 16 >= max_pos 16
    QkCall c;
    c.a.qkv = c.make({3, 512}, DType::kBFloat16, 0x3f);
    c.a.kv_cache = c.make({2, 1, 16, 256}, DType::kUInt8, 0xff);
    set_i64(c.a.slot_mapping, {0, 1, bad_slot ? 32 : 2});
    set_i64(c.a.positions, {0, 15, bad_slot ? 3 : 16});
    expect_throws_and_untouched(c, {c.a.qkv, c.a.kv_cache, c.a.q_fp8_out},
                                bad_slot ? "slot_mapping[2]" : "positions[2]", bad_slot ? "32" : "16");
  }
}

// Random positions and slots (dense rows with an fp8 insert; sparse rows with the index insert):
// the CPU path runs, or throws before writing anything; under scripts/sanitize.sh it also never
// reads or writes out of bounds.
TEST(OutOfRange, QknormRandomIndicesRunOrThrowUntouched) {
  expect_runs_or_throws_untouched<QkCall>(
      300, 31,
      [](QkCall& c, std::mt19937_64& g) {
        wild_fill(c.a.positions, g, 0, 15);
        wild_fill(c.a.slot_mapping, g, -1, 31);
      },
      [](QkCall& c) { return std::vector<TensorView>{c.a.qkv, c.a.q_fp8_out, c.a.kv_cache}; });
  expect_runs_or_throws_untouched<QkSparseCall>(
      300, 32,
      [](QkSparseCall& c, std::mt19937_64& g) {
        if (coin(g)) c.fp8_index();
        wild_fill(c.a.positions, g, 0, 15);
        wild_fill(c.a.index_slot_mapping, g, -1, 255);
      },
      [](QkSparseCall& c) { return std::vector<TensorView>{c.a.qkv, c.a.index_q_out, c.a.index_cache}; });
}

}  // namespace
