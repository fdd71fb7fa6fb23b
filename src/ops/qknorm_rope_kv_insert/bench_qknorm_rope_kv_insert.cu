// Benchmark of qknorm_rope_kv_insert at the drafter's shape (nq 64, nkv 4, rotary 64, bf16 qkv,
// insert into a block-128 cache), T = 7, 56, 448, 1792, against the unfused path (gemma_rms_norm of
// q and of k in place, in-place RoPE of q and k, reshape_and_cache: 5 launches) in the same run.
//
// Bytes per call: the qkv row read (T*W*2), k written back (T*nkv*128*2), q written back as bf16 or
// only as fp8 (T*nq*128 * 2 or 1), the cache rows written (T*nkv*256 * 2 or 1), positions and
// slots (T*16). Inputs rotate over sets larger than 3x L2. Times are per call inside a 20-call graph.
#include <cuda_runtime.h>

#include <algorithm>
#include <random>

#include "bench.h"
#include "bench_baselines.h"
#include "core/cuda_check.h"
#include "m3rt/ops.h"

namespace m3rt::bench {

std::vector<BenchRow> bench_qknorm_rope_kv_insert(const BenchEnv& env) {
  constexpr int nq = 64, nkv = 4, rot = 64, bs = 128;
  constexpr int64_t W = (nq + 2 * nkv) * 128, max_pos = 1 << 17;
  constexpr float eps = 1e-6f;
  std::vector<BenchRow> rows;
  std::mt19937_64 rng(99);
  Tensor table = Tensor::empty({max_pos, rot}, DType::kBFloat16, Device::cuda());
  fill_uniform_bf16(table.data(), table.numel(), 3, -1.f, 1.f);
  Tensor qw = Tensor::empty({128}, DType::kBFloat16, Device::cuda());
  Tensor kw = Tensor::empty({128}, DType::kBFloat16, Device::cuda());
  fill_uniform_bf16(qw.data(), 128, 4, -0.5f, 0.5f);
  fill_uniform_bf16(kw.data(), 128, 5, -0.5f, 0.5f);
  Tensor ks = Tensor::empty({1}, DType::kFloat32), vs = Tensor::empty({1}, DType::kFloat32);
  *ks.ptr<float>() = 0.5f;
  *vs.ptr<float>() = 1.25f;
  Tensor ksd = ks.to(Device::cuda()), vsd = vs.to(Device::cuda());
  struct Variant {
    bool fp8;
    int64_t T;
  };
  std::vector<Variant> variants;
  for (int64_t T : env.quick ? std::vector<int64_t>{56, 1792} : std::vector<int64_t>{7, 56, 448, 1792})
    variants.push_back({false, T});
  variants.push_back({true, 1792});
  for (const Variant& var : variants) {
    const int64_t T = var.T;
    // read q, k, v; write k back, q back (bf16) or q as fp8; write the cache rows; indices.
    const double bytes = double(T) * W * 2 + double(T) * nkv * 128 * 2 +
                         double(T) * nq * 128 * (var.fp8 ? 1 : 2) +
                         double(T) * nkv * 256 * (var.fp8 ? 1 : 2) + double(T) * 16;
    const int sets = sets_beyond_l2(bytes);
    const IndexSets idx = make_index_sets(sets, T, bs, max_pos, rng);
    const std::vector<Tensor>& pos = idx.positions;
    const std::vector<Tensor>& slots = idx.slots;
    const int64_t nb = idx.num_blocks;
    std::vector<Tensor> qkv(sets), qf8(sets);
    for (int s = 0; s < sets; ++s) {
      qkv[s] = Tensor::empty({T, W}, DType::kBFloat16, Device::cuda());
      fill_uniform_bf16(qkv[s].data(), qkv[s].numel(), 200 + s, -2.f, 2.f);
      if (var.fp8) qf8[s] = Tensor::empty({T, nq * 128}, DType::kFloat8E4M3, Device::cuda());
    }
    const KvCacheDtype kd = var.fp8 ? KvCacheDtype::kFp8E4M3 : KvCacheDtype::kAuto;
    Tensor cache = Tensor::empty({nb, nkv, bs, 256}, var.fp8 ? DType::kUInt8 : DType::kBFloat16, Device::cuda());
    auto fused = [&](int s, CUstream_st* st) {
      QknormRopeKvInsertArgs a{.qkv = qkv[s], .q_norm_weight = qw, .k_norm_weight = kw,
                               .cos_sin_cache = table, .positions = pos[s], .num_heads = nq,
                               .num_kv_heads = nkv, .rotary_dim = rot, .eps = eps,
                               .slot_mapping = slots[s], .kv_cache = cache, .kv_cache_dtype = kd,
                               .k_scale = ksd, .v_scale = vsd};
      if (var.fp8) {  // q only in fp8 (for an fp8 attention kernel); k still back in place
        a.q_fp8_out = qf8[s];
        a.q_fp8_scale = 0.5f;
      }
      qknorm_rope_kv_insert(a, st);
    };
    const double fused_us = time_us(fused, sets, true, env);
    const double eager_us = time_us(fused, sets, false, env);
    auto heads = [&](const Tensor& x, int first, int count) {
      TensorView v = x.view();
      v.ndim = 3;
      v.shape[0] = T, v.shape[1] = count, v.shape[2] = 128;
      v.stride[0] = W, v.stride[1] = 128, v.stride[2] = 1;
      v.data = x.ptr<uint16_t>() + first * 128;
      return v;
    };
    auto unfused = [&](int s, CUstream_st* st) {
      const TensorView q = heads(qkv[s], 0, nq), k = heads(qkv[s], nq, nkv), v = heads(qkv[s], nq + nkv, nkv);
      gemma_rms_norm(q, q, qw, eps, st);
      gemma_rms_norm(k, k, kw, eps, st);
      rope_neox_inplace(qkv[s].ptr<__nv_bfloat16>(), W, T, nq + nkv, pos[s].ptr<int64_t>(),
                        table.ptr<__nv_bfloat16>(), rot, st);
      M3RT_LAUNCH_CHECK(st, "rope_neox_inplace_kernel");
      reshape_and_cache(k, v, cache, slots[s], kd, ksd, vsd, st);
    };
    const double unfused_us = var.fp8 ? 0 : time_us(unfused, sets, true, env);
    BenchRow r;
    r.op = "qknorm_rope_kv_insert";
    r.variant = std::string(var.fp8 ? "fp8-cache+q_fp8" : "bf16-cache") + " nq64 nkv4 T" + std::to_string(T);
    r.us = fused_us;
    r.bytes = bytes;
    r.gbps = bytes / (fused_us * 1e3);
    r.pct_ceiling = 100.0 * r.gbps / env.copy_gbps;
    if (!var.fp8) r.ratios = {{"vs unfused", unfused_us / fused_us}};
    char note[96];
    if (var.fp8) {
      std::snprintf(note, sizeof(note), "eager %.2f us; %d sets", eager_us, sets);
    } else {
      std::snprintf(note, sizeof(note), "unfused %.2f us; eager %.2f us; %d sets", unfused_us, eager_us, sets);
    }
    r.note = note;
    rows.push_back(r);
  }
  return rows;
}

}  // namespace m3rt::bench
