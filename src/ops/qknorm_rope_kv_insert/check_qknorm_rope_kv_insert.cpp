// The `m3rt check` rows of qknorm_rope_kv_insert.
// Shared helpers and the method (poisoned outputs; CPU reference on a GPU, fp64 oracle on the
// CPU): src/check/check_helpers.h.
#include <algorithm>
#include <cmath>
#include <string>
#include <vector>

#include "check/check_helpers.h"
#include "check/check_util.h"
#include "m3rt/ops.h"

namespace m3rt::detail {

namespace {

// fp64 Gemma RMSNorm of one 128-dim head, then partial NeoX RoPE, rounded once to bf16.
void oracle_norm_rope(const uint16_t* x, const uint16_t* w, const uint16_t* cs, int rotary_dim,
                      double eps, uint16_t* out) {
  double ss = 0;
  for (int d = 0; d < 128; ++d) ss += double(b2f(x[d])) * b2f(x[d]);
  const double inv = 1.0 / std::sqrt(ss / 128.0 + eps);
  double n[128];
  for (int d = 0; d < 128; ++d) n[d] = double(b2f(x[d])) * inv * (1.0 + b2f(w[d]));
  oracle_rope_f64(n, cs, rotary_dim, out);
}

// ------------------------------------------------------------------------------------------------
// qknorm_rope_kv_insert
struct QkShape {
  int nq, nkv, rot, bs;
  int64_t T;
  bool insert, fp8_cache, q_out, q_fp8;
  float q_scale;
  int nidx = 0;            // sparse row: index_q heads (plus one index_k); 0: dense row
  bool index_fp8 = false;  // fp8 index cache, e4m3 index_q_out
  // Claim counters (GPU): -2 none; -1 given, the library's rule; P >= 0 given, P% claimed
  // (M3RT_QK_CLAIM_PCT). With counters the row also checks that the call left them zero.
  int claim_pct = -2;
};

void check_qk_variant(CheckContext& c, const QkShape& s) {
  const int64_t max_pos = 4096, nb = (s.T + s.bs - 1) / s.bs + 2;
  const int iq0 = s.nq + 2 * s.nkv, ik0 = iq0 + s.nidx;  // first index_q head, the index_k head
  const int64_t W = (iq0 + (s.nidx > 0 ? s.nidx + 1 : 0)) * 128;
  const float eps = 1e-6f;
  // Sparse rows name both caches ("bf16-kv fp8-idx4 ..."), within the CLI's 44-column variant.
  const std::string idx =
      s.nidx == 0 ? "" : (s.index_fp8 ? " fp8-idx" : " bf16-idx") + std::to_string(s.nidx);
  c.variant = std::string(!s.insert     ? "no-insert"
                          : s.nidx > 0  ? (s.fp8_cache ? "fp8-kv" : "bf16-kv")
                          : s.fp8_cache ? "fp8-cache"
                                        : "bf16-cache") +
              idx + " nq" + std::to_string(s.nq) + " nkv" + std::to_string(s.nkv) + " rot" +
              std::to_string(s.rot) + " T" + std::to_string(s.T) + (s.q_out ? " +q_out" : "") +
              (s.q_fp8 ? " +q_fp8" : "") + CheckClaims::suffix(s.claim_pct);
  Tensor qkv = random_half({s.T, W}, DType::kBFloat16, c.rng, -4, 4);
  Tensor qw = random_half({128}, DType::kBFloat16, c.rng, -1, 1);
  Tensor kw = random_half({128}, DType::kBFloat16, c.rng, -1, 1);
  std::vector<int64_t> pos(static_cast<size_t>(s.T));
  for (auto& p : pos) p = c.rng.integer(0, max_pos - 1);
  pos[0] = max_pos - 1;
  Tensor positions = int64_vector(pos);
  Tensor slots = int64_vector(random_slots(s.T, nb * s.bs, 6, c.rng));
  Tensor table = rope_table(max_pos, s.rot);
  const float ksc = s.fp8_cache ? 0.6f : 1.f, vsc = s.fp8_cache ? 1.7f : 1.f;
  Tensor k_scale = scalar_f32(ksc), v_scale = scalar_f32(vsc);
  const DType cdt = s.fp8_cache ? DType::kUInt8 : DType::kBFloat16;
  const std::vector<int64_t> cshape = {nb, s.nkv, s.bs, 256};
  // Sparse rows: the index heads' weights and the index cache [nbi, 128, 128] with its own slots
  // (dense rows: empty index outputs).
  const int64_t nbi = s.nidx > 0 ? (s.T + 127) / 128 + 2 : 0;
  Tensor iqw, ikw, islots;
  if (s.nidx > 0) {
    iqw = random_half({128}, DType::kBFloat16, c.rng, -1, 1);
    ikw = random_half({128}, DType::kBFloat16, c.rng, -1, 1);
    islots = int64_vector(random_slots(s.T, nbi * 128, 5, c.rng));
  }
  const DType iq_dt = s.index_fp8 ? DType::kFloat8E4M3 : DType::kBFloat16;
  const DType icdt = s.index_fp8 ? DType::kUInt8 : DType::kBFloat16;
  const std::vector<int64_t> iq_shape = {s.T, int64_t(s.nidx) * 128}, icshape = {nbi, 128, 128};
  struct Out {
    Tensor qkv, q_out, q_fp8, cache, index_q, index_cache;
  };
  auto run = [&](Device dev) {
    Out o;
    Tensor x = on(qkv, dev), qwd = on(qw, dev), kwd = on(kw, dev), pd = on(positions, dev),
           td = on(table, dev), sd = on(slots, dev), ksd = on(k_scale, dev), vsd = on(v_scale, dev);
    Tensor q_out = poisoned({s.T, int64_t(s.nq) * 128}, DType::kBFloat16, dev);
    Tensor q_fp8 = poisoned({s.T, int64_t(s.nq) * 128}, DType::kFloat8E4M3, dev);
    Tensor cache = poisoned(cshape, cdt, dev);
    QknormRopeKvInsertArgs a{.qkv = x, .q_norm_weight = qwd, .k_norm_weight = kwd,
                             .cos_sin_cache = td, .positions = pd, .num_heads = s.nq,
                             .num_kv_heads = s.nkv, .rotary_dim = s.rot, .eps = eps};
    if (s.q_out) a.q_out = q_out;
    if (s.q_fp8) {
      a.q_fp8_out = q_fp8;
      a.q_fp8_scale = s.q_scale;
    }
    if (s.insert) {
      a.slot_mapping = sd;
      a.kv_cache = cache;
      a.kv_cache_dtype = s.fp8_cache ? KvCacheDtype::kFp8E4M3 : KvCacheDtype::kAuto;
      a.k_scale = ksd;
      a.v_scale = vsd;
    }
    Tensor index_q = poisoned(iq_shape, iq_dt, dev), index_cache = poisoned(icshape, icdt, dev);
    Tensor iqwd, ikwd, isd;
    if (s.nidx > 0) {
      iqwd = on(iqw, dev);
      ikwd = on(ikw, dev);
      isd = on(islots, dev);
      a.num_index_heads = s.nidx;
      a.index_q_norm_weight = iqwd;
      a.index_k_norm_weight = ikwd;
      a.index_q_out = index_q;
      a.index_slot_mapping = isd;
      a.index_cache = index_cache;
      a.index_cache_dtype = s.index_fp8 ? KvCacheDtype::kFp8E4M3 : KvCacheDtype::kBFloat16;
    }
    const CheckClaims claims(s.claim_pct, "M3RT_QK_CLAIM_PCT", dev);
    a.claim_counters = claims.view();
    qknorm_rope_kv_insert(a);
    if (dev == c.device) claims.add_rows(c);
    return Out{to_host(x), to_host(q_out), to_host(q_fp8), to_host(cache), to_host(index_q), to_host(index_cache)};
  };
  Out got = run(c.device), want;
  if (c.device.is_cuda()) {
    want = run(Device::cpu());
  } else {
    want = Out{qkv.to(Device::cpu()), poisoned({s.T, int64_t(s.nq) * 128}, DType::kBFloat16, Device::cpu()),
               poisoned({s.T, int64_t(s.nq) * 128}, DType::kFloat8E4M3, Device::cpu()),
               poisoned(cshape, cdt, Device::cpu()), poisoned(iq_shape, iq_dt, Device::cpu()),
               poisoned(icshape, icdt, Device::cpu())};
    const bool q_in_place = !s.q_out && !s.q_fp8;
    for (int64_t t = 0; t < s.T; ++t) {
      const uint16_t* row = qkv.ptr<uint16_t>() + t * W;
      uint16_t* wrow = want.qkv.ptr<uint16_t>() + t * W;
      const uint16_t* cs = table.ptr<uint16_t>() + pos[size_t(t)] * s.rot;
      uint16_t y[128];
      for (int h = 0; h < s.nq; ++h) {
        oracle_norm_rope(row + h * 128, qw.ptr<uint16_t>(), cs, s.rot, eps, y);
        for (int d = 0; d < 128; ++d) {
          const int64_t o = t * s.nq * 128 + h * 128 + d;
          if (s.q_out) want.q_out.ptr<uint16_t>()[o] = y[d];
          if (s.q_fp8) want.q_fp8.ptr<uint8_t>()[o] = float_to_e4m3(float(double(b2f(y[d])) / s.q_scale));
          if (q_in_place) wrow[h * 128 + d] = y[d];
        }
      }
      const int64_t slot = slots.ptr<int64_t>()[t];
      for (int h = 0; h < s.nkv; ++h) {
        oracle_norm_rope(row + (s.nq + h) * 128, kw.ptr<uint16_t>(), cs, s.rot, eps, y);
        std::copy(y, y + 128, wrow + (s.nq + h) * 128);
        if (!s.insert || slot < 0) continue;
        const int64_t e = cache_elem(want.cache, slot, h);
        oracle_store(want.cache.data(), s.fp8_cache, e, y, ksc);
        oracle_store(want.cache.data(), s.fp8_cache, e + 128, row + (s.nq + s.nkv + h) * 128, vsc);
      }
      if (s.nidx == 0) continue;
      // Sparse row: index_q only to index_q_out (bf16, or e4m3 of the bf16 value, unscaled);
      // index_k in place and at index slot * 128 (index_q in qkv stays as it was).
      for (int h = 0; h < s.nidx; ++h) {
        oracle_norm_rope(row + (iq0 + h) * 128, iqw.ptr<uint16_t>(), cs, s.rot, eps, y);
        for (int d = 0; d < 128; ++d) {
          const int64_t o = (t * s.nidx + h) * 128 + d;
          if (s.index_fp8) {
            want.index_q.ptr<uint8_t>()[o] = float_to_e4m3(b2f(y[d]));
          } else {
            want.index_q.ptr<uint16_t>()[o] = y[d];
          }
        }
      }
      oracle_norm_rope(row + ik0 * 128, ikw.ptr<uint16_t>(), cs, s.rot, eps, y);
      std::copy(y, y + 128, wrow + ik0 * 128);
      const int64_t islot = islots.ptr<int64_t>()[t];
      if (islot >= 0) oracle_store(want.index_cache.data(), s.index_fp8, islot * 128, y, 1.0);
    }
  }
  const int64_t qk = int64_t(s.nq + s.nkv) * 128;
  const double rope_abs = c.device.is_cuda() ? 0 : kRopeAbsTol;
  add_row(c, "qkv.qk", got.qkv.view().narrowed(1, 0, qk), want.qkv.view().narrowed(1, 0, qk),
          DType::kBFloat16, 1, rope_abs);
  add_row(c, "qkv.v", got.qkv.view().narrowed(1, qk, s.nkv * 128),
          want.qkv.view().narrowed(1, qk, s.nkv * 128), DType::kBFloat16, 0);
  if (s.q_out) add_row(c, "q_out", got.q_out, want.q_out, DType::kBFloat16, 1, rope_abs);
  if (s.q_fp8) {
    add_row(c, "q_fp8_out", got.q_fp8, want.q_fp8, DType::kFloat8E4M3, 1, rope_abs);
    if (s.q_out) {
      // Bitwise: the fp8 q is exactly scaled_fp8_quant of the bf16 q the same run produced.
      Tensor requant = Tensor::empty({s.T, int64_t(s.nq) * 128}, DType::kFloat8E4M3);
      for (int64_t i = 0; i < requant.numel(); ++i)
        requant.ptr<uint8_t>()[i] = float_to_e4m3(b2f(got.q_out.ptr<uint16_t>()[i]) * (1.f / s.q_scale));
      add_row(c, "q_fp8_out=quant(q_out)", got.q_fp8, requant, DType::kFloat8E4M3, 0);
    }
  }
  if (s.insert) {
    const DType code = s.fp8_cache ? DType::kFloat8E4M3 : DType::kBFloat16;
    add_row(c, "cache.K", got.cache.view().narrowed(3, 0, 128), want.cache.view().narrowed(3, 0, 128), code, 1,
            rope_abs);
    add_row(c, "cache.V", got.cache.view().narrowed(3, 128, 128), want.cache.view().narrowed(3, 128, 128), code, 0);
  }
  if (s.nidx > 0) {
    add_row(c, "qkv.index_q", got.qkv.view().narrowed(1, iq0 * 128, s.nidx * 128),
            want.qkv.view().narrowed(1, iq0 * 128, s.nidx * 128), DType::kBFloat16, 0);
    add_row(c, "qkv.index_k", got.qkv.view().narrowed(1, ik0 * 128, 128),
            want.qkv.view().narrowed(1, ik0 * 128, 128), DType::kBFloat16, 1, rope_abs);
    add_row(c, "index_q_out", got.index_q, want.index_q, iq_dt, 1, rope_abs);
    const DType icode = s.index_fp8 ? DType::kFloat8E4M3 : DType::kBFloat16;
    add_row(c, "index_cache", got.index_cache, want.index_cache, icode, 1, rope_abs);
    // Bitwise: the index cache rows are exactly the ik' the same run left in qkv (copied, or cast
    // to e4m3 unscaled); rows of index slots < 0 keep their poison.
    Tensor stored = poisoned(icshape, icdt, Device::cpu());
    for (int64_t t = 0; t < s.T; ++t) {
      const int64_t islot = islots.ptr<int64_t>()[t];
      const uint16_t* ik = got.qkv.ptr<uint16_t>() + t * W + ik0 * 128;
      if (islot >= 0) oracle_store(stored.data(), s.index_fp8, islot * 128, ik, 1.0);
    }
    add_row(c, "index_cache=qkv.index_k", got.index_cache, stored, icode, 0);
  }
}

}  // namespace

void check_qknorm_rope_kv_insert(CheckContext& c) {
  check_qk_variant(c, {8, 2, 64, 16, 37, false, false, false, false, 1.f});
  check_qk_variant(c, {64, 4, 64, 64, 29, true, false, true, false, 1.f});
  check_qk_variant(c, {16, 4, 32, 16, 41, true, true, true, true, 0.5f});
  check_qk_variant(c, {8, 1, 16, 128, 9, true, true, false, true, 0.37f});
  // MiniMax-M3 sparse rows: TP1 (bf16 caches), TP2 (fp8 caches, q and index_q in e4m3), and a
  // small one without the main insert (index heads right after v, no v items).
  check_qk_variant(c, {64, 4, 64, 128, 29, true, false, true, false, 1.f, 4, false});
  check_qk_variant(c, {32, 2, 64, 128, 41, true, true, false, true, 0.5f, 2, true});
  check_qk_variant(c, {8, 1, 16, 16, 37, false, false, false, false, 1.f, 1, false});
  // From 256 tokens the GPU runs the quad kernel (the rows above, the half-warp one): the draft
  // shape with q in place, fp8 with both q outputs at rotary 32, and two sparse rows.
  check_qk_variant(c, {64, 4, 64, 128, 300, true, false, false, false, 1.f});
  check_qk_variant(c, {16, 4, 32, 16, 263, true, true, true, true, 0.5f});
  check_qk_variant(c, {32, 2, 64, 128, 257, true, true, false, true, 0.5f, 2, true});
  check_qk_variant(c, {8, 1, 16, 16, 270, false, false, false, false, 1.f, 1, false});
  // Enough tokens that the quad kernel's warps walk 3-4 tokens each through their 3-stage pipeline
  // (the rows above take 1-2 steps); in place and with q to q_out (the drafter's call).
  check_qk_variant(c, {64, 4, 64, 128, 900, true, false, false, false, 1.f});
  check_qk_variant(c, {64, 4, 64, 128, 900, true, false, true, false, 1.f});
  // Run-time claims (claim_counters): the library's rule from 2048 tokens (bf16 cache, GPUs below
  // the H200's DRAM bandwidth an SM; the fp8 instance stays static and leaves the counters alone),
  // and claims forced at fewer tokens: every token, 30% of a sparse row's, half of a row without
  // insert.
  check_qk_variant(c, {64, 4, 64, 128, 2600, true, false, false, false, 1.f, 0, false, -1});
  check_qk_variant(c, {16, 4, 32, 16, 2100, true, true, false, true, 0.5f, 0, false, -1});
  check_qk_variant(c, {64, 4, 64, 128, 900, true, false, true, false, 1.f, 0, false, 100});
  check_qk_variant(c, {64, 4, 64, 128, 300, true, false, false, false, 1.f, 4, false, 30});
  check_qk_variant(c, {8, 1, 16, 16, 270, false, false, false, false, 1.f, 1, false, 50});
}

}  // namespace m3rt::detail
