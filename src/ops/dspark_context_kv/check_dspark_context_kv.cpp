// The `m3rt check` rows of dspark_context_kv_write (the DSpark context-K/V writer).
// Shared helpers and the method (poisoned outputs; CPU reference on a GPU, fp64 oracle on the
// CPU): src/check/check_helpers.h.
#include <string>
#include <vector>

#include "check/check_helpers.h"
#include "check/check_util.h"
#include "core/scoped_env.h"
#include "m3rt/ops.h"

namespace m3rt::detail {

namespace {

// ------------------------------------------------------------------------------------------------
// dspark_context_kv_write
struct WriterShape {
  bool fp8;
  int L, nkv, bs, rot;
  int64_t n;
  bool force_quad = false;  // the GPU run takes the quad kernel whatever the size and the GPU
  int claim_pct = -2;       // claim counters: CheckClaims
};

void check_writer_variant(CheckContext& c, const WriterShape& s) {
  const int64_t max_pos = 4096, nb = (s.n + s.bs - 1) / s.bs + 3;
  const float eps = 1e-6f;
  c.variant = std::string(s.fp8 ? "fp8" : "bf16") + " L" + std::to_string(s.L) + " nkv" +
              std::to_string(s.nkv) + " bs" + std::to_string(s.bs) + " rot" + std::to_string(s.rot) +
              " n" + std::to_string(s.n) + (s.force_quad ? " quad" : "") + CheckClaims::suffix(s.claim_pct);
  Tensor all_kv = random_half({s.n, s.L, 2, s.nkv, 128}, DType::kBFloat16, c.rng, -3, 3);
  Tensor w = random_half({s.L, 128}, DType::kBFloat16, c.rng, -1, 1);
  std::vector<int64_t> pos(static_cast<size_t>(s.n));
  for (auto& p : pos) p = c.rng.integer(0, max_pos - 1);
  if (s.n > 1) pos[1] = max_pos - 1;
  Tensor positions = int64_vector(pos);
  Tensor slots = int64_vector(random_slots(s.n, nb * s.bs, 7, c.rng));
  Tensor table = rope_table(max_pos, s.rot);
  std::vector<Tensor> ks, vs;
  for (int l = 0; l < s.L; ++l) {
    ks.push_back(scalar_f32(s.fp8 ? c.rng.uniform(0.25f, 4.f) : 1.f));
    vs.push_back(scalar_f32(s.fp8 ? c.rng.uniform(0.25f, 4.f) : 1.f));
  }
  const DType cdt = s.fp8 ? DType::kUInt8 : DType::kBFloat16;
  const std::vector<int64_t> cshape = {nb, s.nkv, s.bs, 256};
  auto run = [&](Device dev) {
    std::vector<Tensor> caches, kd, vd;
    std::vector<DsparkDraftLayerKv> layers;
    for (int l = 0; l < s.L; ++l) {  // separate allocations per layer, like an engine's
      caches.push_back(poisoned(cshape, cdt, dev));
      kd.push_back(on(ks[l], dev));
      vd.push_back(on(vs[l], dev));
      layers.push_back({caches.back(), s.fp8 ? KvCacheDtype::kFp8E4M3 : KvCacheDtype::kAuto,
                        kd.back(), vd.back()});
    }
    DsparkContextKvWriter writer(layers);
    Tensor kv = on(all_kv, dev), wd = on(w, dev), pd = on(positions, dev), sd = on(slots, dev),
           td = on(table, dev);
    const ScopedEnv quad("M3RT_WRITER_QUAD_MIN", s.force_quad && dev.is_cuda() ? "1" : nullptr);
    const CheckClaims claims(s.claim_pct, "M3RT_WRITER_CLAIM_PCT", dev);
    writer({.all_kv = kv, .k_norm_weight = wd, .eps = eps, .positions = pd, .cos_sin_cache = td,
            .rotary_dim = s.rot, .slot_mapping = sd, .claim_counters = claims.view()});
    if (dev == c.device) claims.add_rows(c);
    std::vector<Tensor> out;
    for (auto& cache : caches) out.push_back(to_host(cache));
    return out;
  };
  std::vector<Tensor> got = run(c.device), want;
  if (c.device.is_cuda()) {
    want = run(Device::cpu());
  } else {
    // The spec's unfused path: K normed by the CPU gemma_rms_norm op (itself checked against
    // fp64) and materialized in bf16, then rotated in fp64 and rounded; V copied.
    Tensor kn = Tensor::empty({s.n, s.L, s.nkv, 128}, DType::kBFloat16);
    for (int l = 0; l < s.L; ++l) {
      TensorView k = all_kv.view(), o = kn.view();
      k.ndim = o.ndim = 3;
      k.shape[0] = o.shape[0] = s.n, k.shape[1] = o.shape[1] = s.nkv, k.shape[2] = o.shape[2] = 128;
      k.stride[0] = int64_t(s.L) * 2 * s.nkv * 128, k.stride[1] = 128, k.stride[2] = 1;
      o.stride[0] = int64_t(s.L) * s.nkv * 128, o.stride[1] = 128, o.stride[2] = 1;
      k.data = all_kv.ptr<uint16_t>() + int64_t(l) * 2 * s.nkv * 128;
      o.data = kn.ptr<uint16_t>() + int64_t(l) * s.nkv * 128;
      gemma_rms_norm(o, k, w.view().narrowed(0, l, 1).reshaped({128}), eps);
    }
    for (int l = 0; l < s.L; ++l) want.push_back(poisoned(cshape, cdt, Device::cpu()));
    for (int64_t t = 0; t < s.n; ++t) {
      const int64_t slot = slots.ptr<int64_t>()[t];
      if (slot < 0) continue;
      const uint16_t* cs = table.ptr<uint16_t>() + pos[size_t(t)] * s.rot;
      for (int l = 0; l < s.L; ++l)
        for (int h = 0; h < s.nkv; ++h) {
          const uint16_t* k = kn.ptr<uint16_t>() + ((t * s.L + l) * s.nkv + h) * 128;
          const uint16_t* v = all_kv.ptr<uint16_t>() + (((t * s.L + l) * 2 + 1) * s.nkv + h) * 128;
          uint16_t kr[128];
          oracle_rope(k, cs, s.rot, kr);
          const int64_t e = cache_elem(want[l], slot, h);
          oracle_store(want[l].data(), s.fp8, e, kr, *ks[l].ptr<float>());
          oracle_store(want[l].data(), s.fp8, e + 128, v, *vs[l].ptr<float>());
        }
    }
  }
  const DType code = s.fp8 ? DType::kFloat8E4M3 : DType::kBFloat16;
  const double rope_abs = c.device.is_cuda() ? 0 : kRopeAbsTol;
  for (int l = 0; l < s.L; ++l) {
    const std::string layer = "layer" + std::to_string(l);
    add_row(c, layer + ".K", got[l].view().narrowed(3, 0, 128), want[l].view().narrowed(3, 0, 128), code, 1,
            rope_abs);
    add_row(c, layer + ".V", got[l].view().narrowed(3, 128, 128), want[l].view().narrowed(3, 128, 128), code, 0);
  }
}

}  // namespace

void check_dspark_context_kv_write(CheckContext& c) {
  check_writer_variant(c, {false, 5, 4, 128, 64, 513});
  check_writer_variant(c, {true, 5, 4, 128, 64, 513});
  check_writer_variant(c, {false, 1, 1, 16, 16, 7});
  check_writer_variant(c, {true, 2, 2, 64, 32, 65});
  // Rotary 16 / 32 and a partial group of (layer, kv head) pairs (6 = 4 + 2) at n >= 256.
  check_writer_variant(c, {false, 1, 1, 16, 16, 300});
  check_writer_variant(c, {true, 2, 2, 64, 32, 290});
  check_writer_variant(c, {false, 3, 2, 64, 64, 301});
  // fp8 from 16384 tokens runs the quad kernel on GPUs with the H200's DRAM bandwidth an SM (the
  // half-warp kernel on others): a full and a partial group of pairs, many steps; and the quad
  // kernel forced on any GPU (M3RT_WRITER_QUAD_MIN), also at rotary 16 and 32.
  check_writer_variant(c, {true, 2, 2, 64, 64, 16400});
  check_writer_variant(c, {true, 1, 1, 16, 16, 16390});
  check_writer_variant(c, {true, 2, 2, 64, 64, 4100, true});
  check_writer_variant(c, {true, 3, 1, 16, 16, 1290, true});
  check_writer_variant(c, {true, 1, 2, 128, 32, 777, true});
  // Run-time claims (claim_counters) in the half-warp kernel, bf16 caches, 4 token pairs a claim:
  // the library's rule (from 8192 tokens, 16384 on GPUs with the H200's DRAM bandwidth an SM), every
  // pair claimed at an odd count (the last pair one token), 15% of 151 pairs (a last claim of 2
  // pairs); fp8 at 30%, and by the rule from 32768 tokens (in the half-warp kernel; on GPUs with the
  // H200's DRAM bandwidth an SM the quad kernel, which does not claim there by the rule).
  check_writer_variant(c, {false, 2, 2, 64, 64, 16400, false, -1});
  check_writer_variant(c, {false, 5, 4, 128, 64, 4101, false, 100});
  check_writer_variant(c, {true, 2, 2, 64, 32, 2999, false, 30});
  check_writer_variant(c, {true, 1, 2, 64, 64, 32800, false, -1});
  check_writer_variant(c, {false, 3, 2, 64, 16, 301, false, 15});
  // Claims in the quad kernel (forced here), a unit a claim: by the rule from 16384 tokens (GPUs
  // below the H200's DRAM bandwidth an SM; none on others), every unit claimed with a partial group
  // of pairs (3) and an odd count, 30% at rotary 16.
  check_writer_variant(c, {true, 2, 2, 64, 64, 16400, true, -1});
  check_writer_variant(c, {true, 3, 1, 64, 64, 4101, true, 100});
  check_writer_variant(c, {true, 2, 2, 16, 16, 1290, true, 30});
}

}  // namespace m3rt::detail
