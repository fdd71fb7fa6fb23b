// Benchmark of the DSpark context-K/V writer at the M3.1 draft shape (5 layers, nkv 4, block 128,
// rotary 64), bf16 and fp8 caches, against the unfused path (per layer: gemma_rms_norm of K into a
// temp, in-place RoPE, reshape_and_cache: 15 launches) timed in the same run.
//
// Bytes per call (the floor): all_kv read (n*L*2*nkv*128*2) + caches written (n*L*2*nkv*128 * 2 or
// 1) + positions and slots (n*16). Inputs rotate over sets larger than 3x L2; each set writes its
// own slots, laid out as an engine's: consecutive tokens fill a block, blocks in shuffled order.
// Times are per call inside a CUDA graph of 20 calls (median of 25 replays); each row is timed
// again with enable_pdl (" pdl": every call a programmatic dependent of the one before). Every call
// passes claim_counters (the fast configuration; the rule: bf16 claims from 8192 tokens, 16384 on
// GPUs with the H200's DRAM bandwidth an SM, fp8 from 32768 in the half-warp kernel, the quad
// kernel never by default), and the rows from 8192 tokens are timed without them too ("vs static":
// 1.00 where the call does not claim).
#include <cuda_runtime.h>

#include <algorithm>
#include <random>

#include "bench.h"
#include "bench_baselines.h"
#include "core/cuda_check.h"
#include "m3rt/ops.h"

namespace m3rt::bench {

std::vector<BenchRow> bench_dspark_context_kv(const BenchEnv& env) {
  constexpr int L = 5, nkv = 4, bs = 128, rot = 64;
  constexpr int64_t max_pos = 1 << 17;
  constexpr float eps = 1e-6f;
  std::vector<BenchRow> rows;
  std::mt19937_64 rng(1234);
  Tensor table = Tensor::empty({max_pos, rot}, DType::kBFloat16, Device::cuda());
  fill_uniform_bf16(table.data(), table.numel(), 7, -1.f, 1.f);
  Tensor w = Tensor::empty({L, 128}, DType::kBFloat16, Device::cuda());
  fill_uniform_bf16(w.data(), w.numel(), 8, -0.5f, 0.5f);
  Tensor claims = Tensor::empty({kClaimCounterInts}, DType::kInt32, Device::cuda());
  claims.fill_bytes(0);
  M3RT_CUDA_CHECK(cudaDeviceSynchronize());  // the memset (legacy stream) lands before any use
  std::vector<int64_t> sizes = env.quick ? std::vector<int64_t>{7, 8192}
                                         : std::vector<int64_t>{1, 7, 64, 512, 8192, 32768};
  // M3RT_BENCH_WRITER_TOKENS (e.g. "8192,16384,32768"; investigation): only these num_ctx.
  if (const std::vector<int> n_list = env_int_list("M3RT_BENCH_WRITER_TOKENS", 1, 1 << 20, "token counts");
      !n_list.empty())
    sizes.assign(n_list.begin(), n_list.end());
  for (bool fp8 : {false, true}) {
    for (int64_t n : sizes) {
      const double row_elems = double(n) * L * 2 * nkv * 128;
      const double bytes = row_elems * 2 + row_elems * (fp8 ? 1 : 2) + double(n) * 16;
      const int sets = sets_beyond_l2(bytes);
      // Inputs per set; slots disjoint across sets, so the caches see fresh lines too.
      const IndexSets idx = make_index_sets(sets, n, bs, max_pos, rng);
      const std::vector<Tensor>& pos = idx.positions;
      const std::vector<Tensor>& slots = idx.slots;
      const int64_t nb = idx.num_blocks;
      std::vector<Tensor> kv(sets);
      for (int s = 0; s < sets; ++s) {
        kv[s] = Tensor::empty({n, L, 2, nkv, 128}, DType::kBFloat16, Device::cuda());
        fill_uniform_bf16(kv[s].data(), kv[s].numel(), 100 + s, -2.f, 2.f);
      }
      const DType cdt = fp8 ? DType::kUInt8 : DType::kBFloat16;
      const KvCacheDtype kd = fp8 ? KvCacheDtype::kFp8E4M3 : KvCacheDtype::kAuto;
      std::vector<Tensor> caches, ks, vs;
      std::vector<DsparkDraftLayerKv> layers;
      for (int l = 0; l < L; ++l) {
        caches.push_back(Tensor::empty({nb, nkv, bs, 256}, cdt, Device::cuda()));
        Tensor k = Tensor::empty({1}, DType::kFloat32), v = Tensor::empty({1}, DType::kFloat32);
        *k.ptr<float>() = 0.5f + 0.1f * l;
        *v.ptr<float>() = 1.5f - 0.1f * l;
        ks.push_back(k.to(Device::cuda()));
        vs.push_back(v.to(Device::cuda()));
        layers.push_back({caches.back(), kd, ks.back(), vs.back()});
      }
      DsparkContextKvWriter writer(layers);
      auto args = [&](int s, bool pdl = false) {
        return DsparkContextKvArgs{.all_kv = kv[s], .k_norm_weight = w, .eps = eps,
                                   .positions = pos[s], .cos_sin_cache = table, .rotary_dim = rot,
                                   .slot_mapping = slots[s], .enable_pdl = pdl, .claim_counters = claims};
      };
      const double fused_us = time_us([&](int s, CUstream_st* st) { writer(args(s), st); }, sets, true, env);
      const double eager_us = time_us([&](int s, CUstream_st* st) { writer(args(s), st); }, sets, false, env);

      // The unfused path: three separate ops per layer.
      Tensor tmp = Tensor::empty({n, nkv, 128}, DType::kBFloat16, Device::cuda());
      auto unfused = [&](int s, CUstream_st* st) {
        for (int l = 0; l < L; ++l) {
          TensorView k = kv[s].view(), v = kv[s].view();
          for (TensorView* x : {&k, &v}) {
            x->ndim = 3;
            x->shape[0] = n, x->shape[1] = nkv, x->shape[2] = 128;
            x->stride[0] = int64_t(L) * 2 * nkv * 128, x->stride[1] = 128, x->stride[2] = 1;
          }
          k.data = kv[s].ptr<uint16_t>() + (int64_t(l) * 2 + 0) * nkv * 128;
          v.data = kv[s].ptr<uint16_t>() + (int64_t(l) * 2 + 1) * nkv * 128;
          const TensorView wl = w.view().narrowed(0, l, 1).reshaped({128});
          gemma_rms_norm(tmp, k, wl, eps, st);
          rope_neox_inplace(tmp.ptr<__nv_bfloat16>(), nkv * 128, n, nkv, pos[s].ptr<int64_t>(),
                            table.ptr<__nv_bfloat16>(), rot, st);
          M3RT_LAUNCH_CHECK(st, "rope_neox_inplace_kernel");
          reshape_and_cache(tmp, v, caches[l], slots[s], kd, ks[l], vs[l], st);
        }
      };
      const double unfused_us = time_us(unfused, sets, true, env);

      BenchRow r;
      r.op = "dspark_context_kv_write";
      r.variant = std::string(fp8 ? "fp8" : "bf16") + " L5 nkv4 bs128 rot64 n" + std::to_string(n);
      r.us = fused_us;
      r.bytes = bytes;
      r.gbps = bytes / (fused_us * 1e3);
      r.pct_ceiling = 100.0 * r.gbps / env.copy_gbps;
      r.ratios = {{"vs unfused", unfused_us / fused_us}};
      if (n >= 8192) {  // the claims' range: the same calls without claim_counters
        const double static_us = time_us(
            [&](int s, CUstream_st* st) {
              DsparkContextKvArgs a = args(s);
              a.claim_counters = TensorView{};
              writer(a, st);
            },
            sets, true, env);
        r.ratios.push_back({"vs static", static_us / fused_us});
      }
      char note[96];
      std::snprintf(note, sizeof(note), "unfused %.2f us; eager %.2f us; %d sets", unfused_us, eager_us, sets);
      r.note = note + host_cost_note([&](int s, CUstream_st* st) { writer(args(s), st); }, sets, 64);
      rows.push_back(r);
      // The same calls as programmatic dependents of each other (enable_pdl).
      const double pdl_us = time_us([&](int s, CUstream_st* st) { writer(args(s, true), st); }, sets, true, env);
      rows.push_back(pdl_row(r, pdl_us, env));
    }
  }
  return rows;
}

}  // namespace m3rt::bench
