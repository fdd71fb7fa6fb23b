// Tests of qknorm_rope_kv_insert: the CPU path against an fp64 oracle (in place, q_out, fp8 q,
// bf16/fp8 cache insert, padded qkv rows); the fp8 q equals e4m3(bf16(q) * (1/scale)); argument
// validation (bad arguments, out-of-range slot or position that must throw before anything is
// written).
// Shared helpers: tests/test_util.h.
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
      check_cache(mm, cache, slots, [&](const uint8_t* crow, int64_t t, int h) {
        const uint16_t* k = buf.ptr<uint16_t>() + t * row + (c.nq + h) * 128;
        const uint16_t* v = buf.ptr<uint16_t>() + t * row + (c.nq + c.nkv + h) * 128;
        const uint16_t* c16 = reinterpret_cast<const uint16_t*>(crow);
        for (int d = 0; d < 128; ++d) {
          const bool ok = c.insert == 1 ? c16[d] == k[d] && c16[128 + d] == v[d]
                                        : crow[d] == float_to_e4m3(bf16_to_float(k[d]) / 0.37f) &&
                                              crow[128 + d] == float_to_e4m3(bf16_to_float(v[d]) / 2.5f);
          if (!ok) mm.add("cache row of token/head/dim " + at({t, h, d}));
        }
      });
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

// ---- argument validation ------------------------------------------------------------------------

struct QkCall : CallBase {  // T 3, nq 2, nkv 1, rotary 64, max_pos 16
  m3rt::QknormRopeKvInsertArgs a;
  QkCall() {
    a.qkv = make({3, 4 * 128}, DType::kBFloat16);
    a.q_norm_weight = make({128}, DType::kBFloat16);
    a.k_norm_weight = make({128}, DType::kBFloat16);
    a.cos_sin_cache = make({16, 64}, DType::kBFloat16);
    a.positions = make({3}, DType::kInt64);
    a.num_heads = 2;
    a.num_kv_heads = 1;
    a.rotary_dim = 64;
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
  };
  for (float s : {0.0f, -0.5f, NAN, INFINITY})
    cases.push_back({"q_fp8_scale", [s](C& c) { c.a.q_fp8_scale = s; },
                     {"q_fp8_scale = ", "must be finite and > 0"}});
  expect_bad_args<C>(cases);
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

}  // namespace
