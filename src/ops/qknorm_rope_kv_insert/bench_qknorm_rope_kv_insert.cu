// Benchmark of qknorm_rope_kv_insert at the drafter's shape (nq 64, nkv 4, rotary 64, bf16 qkv,
// insert into a block-128 cache), T = 7, 56, 448, 1792, against the unfused path (gemma_rms_norm of
// q and of k in place, in-place RoPE of q and k, reshape_and_cache: 5 launches) in the same run;
// and at MiniMax-M3's sparse-layer shape (the same plus 4 index_q heads and one index_k head, index
// insert into a [nb, 128, 128] cache, bf16 or fp8 like the main cache), with no unfused baseline.
// q goes back into qkv in place, except in the `q_out` row (T = 1792, dense, bf16 cache): the call
// the drafter makes (src/model/dspark_model.cpp), q to a separate contiguous [T, nq x 128] output.
//
// Bytes per call: the qkv row read (T*W*2, W including the index heads), k written back
// (T*nkv*128*2), q written back (or to q_out) as bf16 or only as fp8 (T*nq*128 * 2 or 1), the cache rows written
// (T*nkv*256 * 2 or 1), positions and slots (T*16); sparse rows add index_q_out written
// (T*Hidx*128 * 2 or 1), index_k written back (T*128*2), the index cache rows written (T*128 * 2
// or 1) and index slots (T*8). Inputs rotate over sets larger than 3x L2. Times are per call inside
// a 20-call graph. The dense rows are timed again with enable_pdl (" pdl": each call launched as a
// programmatic dependent of the one before it, as it would follow the qkv projection). Every call
// passes claim_counters (the fast configuration; the rule claims from 2048 tokens below the H200's
// DRAM bandwidth an SM, never on the H200): the dense bf16 T = 8192 row (not in --quick) and any
// row from 2048 tokens is timed without them too ("vs static").
#include <cuda_runtime.h>

#include <algorithm>
#include <random>

#include "bench.h"
#include "bench_baselines.h"
#include "core/cuda_check.h"
#include "m3rt/ops.h"

namespace m3rt::bench {

std::vector<BenchRow> bench_qknorm_rope_kv_insert(const BenchEnv& env) {
  constexpr int nq = 64, nkv = 4, nidx = 4, rot = 64, bs = 128;
  constexpr int64_t max_pos = 1 << 17;
  constexpr float eps = 1e-6f;
  std::vector<BenchRow> rows;
  std::mt19937_64 rng(99);
  Tensor table = Tensor::empty({max_pos, rot}, DType::kBFloat16, Device::cuda());
  fill_uniform_bf16(table.data(), table.numel(), 3, -1.f, 1.f);
  Tensor qw = Tensor::empty({128}, DType::kBFloat16, Device::cuda());
  Tensor kw = Tensor::empty({128}, DType::kBFloat16, Device::cuda());
  fill_uniform_bf16(qw.data(), 128, 4, -0.5f, 0.5f);
  fill_uniform_bf16(kw.data(), 128, 5, -0.5f, 0.5f);
  Tensor iqw = Tensor::empty({128}, DType::kBFloat16, Device::cuda());
  Tensor ikw = Tensor::empty({128}, DType::kBFloat16, Device::cuda());
  fill_uniform_bf16(iqw.data(), 128, 6, -0.5f, 0.5f);
  fill_uniform_bf16(ikw.data(), 128, 7, -0.5f, 0.5f);
  Tensor ks = Tensor::empty({1}, DType::kFloat32), vs = Tensor::empty({1}, DType::kFloat32);
  *ks.ptr<float>() = 0.5f;
  *vs.ptr<float>() = 1.25f;
  Tensor ksd = ks.to(Device::cuda()), vsd = vs.to(Device::cuda());
  Tensor claims = Tensor::empty({kClaimCounterInts}, DType::kInt32, Device::cuda());
  claims.fill_bytes(0);
  M3RT_CUDA_CHECK(cudaDeviceSynchronize());  // the memset (legacy stream) lands before any use
  struct Variant {
    bool fp8;  // fp8 main cache (and index cache), q only as e4m3
    int64_t T;
    bool sparse;  // MiniMax-M3 sparse row: index heads and index insert
    bool q_out = false;  // q to a separate output (the drafter's call) instead of back into qkv
  };
  std::vector<Variant> variants;
  // M3RT_BENCH_QK_TOKENS (e.g. "1752,1792"; investigation): only the dense bf16 rows (q in place),
  // once for each token count (with M3RT_BENCH_QK_FP8=1 the fp8-cache rows, q as e4m3, instead);
  // the quad kernel's one-wave grid walks ceil(T / token lanes) steps.
  if (const std::vector<int> tokens = env_int_list("M3RT_BENCH_QK_TOKENS", 1, 1 << 20, "token counts");
      !tokens.empty()) {
    const bool fp8 = detail::env_int("M3RT_BENCH_QK_FP8", 0) != 0;  // investigation: those rows with fp8 caches
    for (int T : tokens) variants.push_back({fp8, T, false});
  } else {
    for (bool sparse : {false, true}) {
      for (int64_t T : env.quick ? std::vector<int64_t>{56, 1792} : std::vector<int64_t>{7, 56, 448, 1792})
        variants.push_back({false, T, sparse});
      if (!sparse && !env.quick) variants.push_back({false, 8192, false});
      if (!sparse) variants.push_back({false, 1792, false, true});
      variants.push_back({true, 1792, sparse});
    }
  }
  for (const Variant& var : variants) {
    const int64_t T = var.T;
    const int h_idx = var.sparse ? nidx : 0;
    const int64_t W = (nq + 2 * nkv + (var.sparse ? nidx + 1 : 0)) * 128;
    const int e = var.fp8 ? 1 : 2;  // bytes per cache (and fp8 q) element
    // read q, k, v (and index_q, index_k); write k back, q back (bf16) or q as fp8; write the cache
    // rows; indices. Sparse: write index_q_out, index_k back, the index cache rows; index slots.
    double bytes = double(T) * W * 2 + double(T) * nkv * 128 * 2 + double(T) * nq * 128 * e +
                   double(T) * nkv * 256 * e + double(T) * 16;
    if (var.sparse) {
      bytes += double(T) * h_idx * 128 * e + double(T) * 128 * 2 + double(T) * 128 * e + double(T) * 8;
    }
    const int sets = sets_beyond_l2(bytes);
    const IndexSets idx = make_index_sets(sets, T, bs, max_pos, rng);
    // The index cache has its own slots (and block order); its positions go unused.
    const IndexSets index_idx = var.sparse ? make_index_sets(sets, T, 128, max_pos, rng) : IndexSets{};
    const std::vector<Tensor>& pos = idx.positions;
    const std::vector<Tensor>& slots = idx.slots;
    const int64_t nb = idx.num_blocks;
    std::vector<Tensor> qkv(sets), qf8(sets), iq_out(sets), q_out(sets);
    for (int s = 0; s < sets; ++s) {
      qkv[s] = Tensor::empty({T, W}, DType::kBFloat16, Device::cuda());
      fill_uniform_bf16(qkv[s].data(), qkv[s].numel(), 200 + s, -2.f, 2.f);
      if (var.fp8) qf8[s] = Tensor::empty({T, nq * 128}, DType::kFloat8E4M3, Device::cuda());
      if (var.q_out) q_out[s] = Tensor::empty({T, nq * 128}, DType::kBFloat16, Device::cuda());
      const DType iq_dt = var.fp8 ? DType::kFloat8E4M3 : DType::kBFloat16;  // like the index cache
      if (var.sparse) iq_out[s] = Tensor::empty({T, h_idx * 128}, iq_dt, Device::cuda());
    }
    const KvCacheDtype kd = var.fp8 ? KvCacheDtype::kFp8E4M3 : KvCacheDtype::kAuto;
    Tensor cache = Tensor::empty({nb, nkv, bs, 256}, var.fp8 ? DType::kUInt8 : DType::kBFloat16, Device::cuda());
    Tensor index_cache;
    if (var.sparse) {
      index_cache = Tensor::empty({index_idx.num_blocks, 128, 128}, var.fp8 ? DType::kUInt8 : DType::kBFloat16,
                                  Device::cuda());
    }
    auto fused_with = [&](bool pdl, bool claim = true) {
      return [&, pdl, claim](int s, CUstream_st* st) {
        QknormRopeKvInsertArgs a{.qkv = qkv[s], .q_norm_weight = qw, .k_norm_weight = kw,
                                 .cos_sin_cache = table, .positions = pos[s], .num_heads = nq,
                                 .num_kv_heads = nkv, .rotary_dim = rot, .eps = eps,
                                 .slot_mapping = slots[s], .kv_cache = cache, .kv_cache_dtype = kd,
                                 .k_scale = ksd, .v_scale = vsd};
        if (var.q_out) a.q_out = q_out[s];
        if (var.fp8) {  // q only in fp8 (for an fp8 attention kernel); k still back in place
          a.q_fp8_out = qf8[s];
          a.q_fp8_scale = 0.5f;
        }
        if (var.sparse) {  // index_q only to index_q_out; index cache bf16 or fp8 like the main one
          a.num_index_heads = h_idx;
          a.index_q_norm_weight = iqw;
          a.index_k_norm_weight = ikw;
          a.index_q_out = iq_out[s];
          a.index_slot_mapping = index_idx.slots[s];
          a.index_cache = index_cache;
          a.index_cache_dtype = kd;
        }
        a.enable_pdl = pdl;
        if (claim) a.claim_counters = claims;
        qknorm_rope_kv_insert(a, st);
      };
    };
    const auto fused = fused_with(false);
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
    const bool baseline = !var.fp8 && !var.sparse && !var.q_out;  // the unfused path: dense bf16, q in place
    const double unfused_us = baseline ? time_us(unfused, sets, true, env) : 0;
    BenchRow r;
    r.op = "qknorm_rope_kv_insert";
    // Sparse rows: nq 64, nkv 4 too (the bench table's variant column has 34 characters).
    r.variant = std::string(var.fp8 ? "fp8-cache+q_fp8" : "bf16-cache") +
                (var.sparse ? " sparse nidx4" : " nq64 nkv4") + " T" + std::to_string(T) + (var.q_out ? " q_out" : "");
    r.us = fused_us;
    r.bytes = bytes;
    r.gbps = bytes / (fused_us * 1e3);
    r.pct_ceiling = 100.0 * r.gbps / env.copy_gbps;
    if (baseline) r.ratios = {{"vs unfused", unfused_us / fused_us}};
    if (T >= 2048) r.ratios.push_back({"vs static", time_us(fused_with(false, false), sets, true, env) / fused_us});
    char note[96];
    if (!baseline) {
      std::snprintf(note, sizeof(note), "eager %.2f us; %d sets", eager_us, sets);
    } else {
      std::snprintf(note, sizeof(note), "unfused %.2f us; eager %.2f us; %d sets", unfused_us, eager_us, sets);
    }
    r.note = note + host_cost_note(fused, sets, 64);
    rows.push_back(r);
    // The dense calls again as programmatic dependents of each other (enable_pdl).
    if (!var.sparse) rows.push_back(pdl_row(r, time_us(fused_with(true), sets, true, env), env));
  }
  return rows;
}

}  // namespace m3rt::bench
