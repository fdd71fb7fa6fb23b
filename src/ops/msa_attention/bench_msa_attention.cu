// Benchmark of MSA sparse attention at M3's TP1 shape (Hq 64, Hkv 4, head dim 128, page 128,
// topk 16), bf16 and fp8 KV caches.
//
// Top-k lists as the indexer writes them: the local block plus 15 distinct earlier blocks (every
// visible block when there are at most 16), ascending. Verify (dql 8) lists share most of their
// pages: each row takes its request's base list with two random substitutions, plus its own local
// block. Prefill runs twice: independent random lists per token (the worst case for page reuse),
// and "shared8" — runs of 8 consecutive tokens sharing their first token's list the same way
// (adjacent queries select mostly the same blocks). Bytes per call = the unique (request, KV head, page) slices selected (each page slice is
// 128 x 256 x 1 or 2 bytes) + q + out; decode is reported against the copy ceiling measured in the
// run. Prefill FLOPs = 4 x 128 per (token, query head, visible key of a selected block) (QK^T and
// PV), against the bf16 GEMM rate measured in the run. Inputs rotate over sets larger than 3x L2
// (disjoint page ranges of one cache); graph replays. Decode notes the plan's splits; batch 32 and
// prefill 8K also time the first (CUDA-core) kernel as a baseline. Verify and prefill rows are
// also timed with P rounded once ("p16": p_residue false), against the default in the same run.
// Prefill and verify rows run the per-token tile (msa_token_tile_kernel; verify where its grid is
// unsplit) and are also timed on msa_sparse_kernel's wgmma tile (M3RT_MSA_TOKEN_TILE=0), whose loops
// the other ratios time.
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <numeric>
#include <optional>
#include <random>
#include <set>
#include <string>

#include "bench.h"
#include "core/cuda_check.h"
#include "m3rt/msa_attention.h"
#include "ops/msa_attention/msa_attention.h"

namespace m3rt::bench {

namespace {

constexpr int kHq = 64, kHkv = 4, kTopk = 16, kPageTokens = 128;

// A list for a row that sees nb blocks: the local block, then distinct earlier blocks; ascending.
std::vector<int32_t> indexer_like_list(std::mt19937_64& rng, int nb) {
  std::vector<int32_t> ids;
  if (nb <= kTopk) {
    for (int j = 0; j < nb; ++j) ids.push_back(j);
  } else {
    std::set<int32_t> pick{nb - 1};
    while (int(pick.size()) < kTopk) pick.insert(int32_t(rng() % uint64_t(nb - 1)));
    ids.assign(pick.begin(), pick.end());
  }
  ids.resize(kTopk, -1);
  return ids;
}

struct Batch {
  Tensor cache, q, out, lens, table, topk, cu;  // topk: token-major [T, Hkv, K]
  TensorView topk_view;                         // [Hkv, T, K]
  double unique_slices = 0;                     // (request, KV head, page) slices selected
  double flops = 0;
};

// `sets` batches over disjoint page ranges of one cache of `pages_per_set * sets` pages.
// A row's list that shares most of `base`: base's ids below the row's local block, two of them
// replaced by random earlier blocks, then the local block.
std::vector<int32_t> shared_list(std::mt19937_64& rng, const std::vector<int32_t>& base, int row_nb) {
  std::set<int32_t> pick;
  for (int32_t id : base)
    if (id >= 0 && id < row_nb - 1) pick.insert(id);
  for (int k = 0; k < 2 && !pick.empty(); ++k) pick.erase(std::next(pick.begin(), long(rng() % pick.size())));
  while (int(pick.size()) < kTopk - 1) pick.insert(int32_t(rng() % uint64_t(row_nb - 1)));
  pick.insert(row_nb - 1);
  std::vector<int32_t> ids(pick.begin(), pick.end());
  ids.resize(kTopk, -1);
  return ids;
}

// `sets` batches over disjoint page ranges of one cache of `pages_per_set * sets` pages. Decode
// (dql 1): indexer-like lists; verify (dql > 1): the rows share their request's list
// (shared_list); prefill (dql 0, q_len tokens): independent lists, or with share > 1 runs of
// `share` consecutive tokens sharing the list of the run's first token.
std::vector<Batch> make_sets(std::mt19937_64& rng, bool fp8, int B, int ctx, int dql, int q_len, int sets,
                             int share = 0) {
  const int nb = ctx / kPageTokens;
  const int64_t pages_per_set = int64_t(B) * nb;
  const int rows_per_req = dql ? dql : q_len;
  const int64_t T = int64_t(B) * rows_per_req;
  Tensor cache = Tensor::empty({pages_per_set * sets, kHkv, kPageTokens, 256}, fp8 ? DType::kUInt8 : DType::kBFloat16,
                               Device::cuda());
  if (fp8) {
    M3RT_CUDA_CHECK(cudaMemset(cache.data(), 0x3a, size_t(cache.nbytes())));  // e4m3 1.25: finite, not zero
  } else {
    fill_uniform_bf16(cache.data(), cache.numel(), 17, -1.f, 1.f);
  }
  std::vector<Batch> out(static_cast<size_t>(sets));
  for (int s = 0; s < sets; ++s) {
    Batch& bt = out[size_t(s)];
    bt.cache = cache;
    std::vector<int32_t> perm(static_cast<size_t>(pages_per_set));
    std::iota(perm.begin(), perm.end(), int32_t(pages_per_set * s));
    std::shuffle(perm.begin(), perm.end(), rng);
    Tensor table = Tensor::empty({B, nb}, DType::kInt32), topk = Tensor::empty({T, kHkv, kTopk}, DType::kInt32);
    std::copy(perm.begin(), perm.end(), table.ptr<int32_t>());
    for (int b = 0; b < B; ++b)
      for (int g = 0; g < kHkv; ++g) {
        std::set<int32_t> unique;
        std::vector<int32_t> base = indexer_like_list(rng, nb);
        for (int r = 0; r < rows_per_req; ++r) {
          const int64_t pos = int64_t(ctx) - rows_per_req + r;
          const int row_nb = int(pos / kPageTokens) + 1;
          if (dql == 0 && share > 1 && r % share == 0) base = indexer_like_list(rng, row_nb);
          const bool shared = (dql > 1 || (dql == 0 && share > 1)) && row_nb > kTopk;
          const std::vector<int32_t> ids = shared ? shared_list(rng, base, row_nb) : indexer_like_list(rng, row_nb);
          const int64_t t = int64_t(b) * rows_per_req + r;
          std::copy(ids.begin(), ids.end(), topk.ptr<int32_t>() + (t * kHkv + g) * kTopk);
          for (int32_t id : ids) {
            if (id < 0) continue;
            unique.insert(id);
            const int64_t keys = std::min<int64_t>(kPageTokens, pos + 1 - int64_t(id) * kPageTokens);
            bt.flops += double(keys) * 128 * 4 * (kHq / kHkv);
          }
        }
        bt.unique_slices += double(unique.size());
      }
    bt.table = table.to(Device::cuda());
    bt.topk = topk.to(Device::cuda());
    bt.topk_view = bt.topk.view();
    bt.topk_view.shape[0] = kHkv, bt.topk_view.shape[1] = T;
    bt.topk_view.stride[0] = kTopk, bt.topk_view.stride[1] = int64_t(kHkv) * kTopk;
    Tensor lens = Tensor::empty({B}, DType::kInt32), cu = Tensor::empty({B + 1}, DType::kInt32);
    for (int b = 0; b < B; ++b) lens.ptr<int32_t>()[b] = ctx;
    for (int b = 0; b <= B; ++b) cu.ptr<int32_t>()[b] = b * rows_per_req;
    bt.lens = lens.to(Device::cuda());
    bt.cu = cu.to(Device::cuda());
    bt.q = Tensor::empty({T, kHq, 128}, DType::kBFloat16, Device::cuda());
    fill_uniform_bf16(bt.q.data(), bt.q.numel(), 50 + uint64_t(s), -1.f, 1.f);
    bt.out = Tensor::empty({T, kHq, 128}, DType::kBFloat16, Device::cuda());
  }
  return out;
}

using detail::ScopedEnv;  // the plan's tuning knobs (M3RT_MSA_*) for a scope

}  // namespace

std::vector<BenchRow> bench_msa_attention(BenchEnv& env) {
  std::vector<BenchRow> rows;
  std::mt19937_64 rng(5);
  const float scale = 0.08838834764831845f;  // 1 / sqrt(128)
  Tensor ks = Tensor::empty({1}, DType::kFloat32), vs = Tensor::empty({1}, DType::kFloat32);
  *ks.ptr<float>() = 1.f;
  *vs.ptr<float>() = 1.f;
  const Tensor ksd = ks.to(Device::cuda()), vsd = vs.to(Device::cuda());
  struct Case {
    int B, ctx, dql;
    int seed = -1;  // >= 0: the top-k lists drawn from this seed's own stream
  };
  auto plan_splits = [](const Case& c, bool fp8) {
    return msa_decode_splits(c.B, c.dql, kHq, kHkv, kTopk, c.ctx / kPageTokens, fp8);
  };
  std::vector<Case> decode_cases;
  // M3RT_BENCH_MSA_DECODE_ONLY=1 (tuning): dql-1 decode at 32K, no ratios, no verify or prefill;
  // there M3RT_BENCH_MSA_BATCHES (e.g. "32,64,96") replaces the batch sizes 1, 32, 128.
  const bool decode_only = env_set("M3RT_BENCH_MSA_DECODE_ONLY");
  std::vector<int> batches = env.quick ? std::vector<int>{1, 32} : std::vector<int>{1, 32, 128};
  if (decode_only) {
    if (std::vector<int> list = env_int_list("M3RT_BENCH_MSA_BATCHES", 1, 4096, "batch sizes"); !list.empty())
      batches = list;
  }
  for (int ctx : env.quick || decode_only ? std::vector<int>{32768} : std::vector<int>{32768, 131072})
    for (int B : batches) decode_cases.push_back({B, ctx, 1});
  if (!decode_only) decode_cases.push_back({32, 32768, 8});  // verify
  // M3RT_BENCH_MSA_VERIFY_SEEDS (e.g. "1,2,3"; investigation): the verify case alone, once for each
  // seed with its top-k lists drawn from that seed's stream (the usual row draws them where the
  // earlier cases left one stream, so the quick and the full bench time different lists), and the
  // default timed again after the row's ratios ("first / again": the order's effect). With
  // M3RT_BENCH_MSA_VERIFY_AFTER_ALL=1 the seeds' rows come after every usual decode and verify row
  // instead of alone (the same lists, after the run's history: its 128K batches come and go).
  const std::vector<int> verify_seeds = env_int_list("M3RT_BENCH_MSA_VERIFY_SEEDS", 0, 1 << 30, "seeds");
  if (!verify_seeds.empty()) {
    if (!env_set("M3RT_BENCH_MSA_VERIFY_AFTER_ALL")) decode_cases.clear();
    for (int seed : verify_seeds) decode_cases.push_back({32, 32768, 8, seed});
  }
  // M3RT_BENCH_MSA_PREFILL_ONLY="L:share" (profiling): the prefill rows of one context (L K tokens)
  // and one share (0: independent lists) alone, no decode, verify, ratios or drafter blocks (with
  // M3RT_BENCH_MSA_DECODE_ONLY as well, the decode rows alone).
  int only_l = 0, only_share = -1;
  if (const char* only = std::getenv("M3RT_BENCH_MSA_PREFILL_ONLY"); only && *only) {
    if (std::sscanf(only, "%d:%d", &only_l, &only_share) != 2 || only_l < 1 || only_l > 1024 || only_share < 0 ||
        only_share > 64)
      throw Error(std::string("M3RT_BENCH_MSA_PREFILL_ONLY: '") + only +
                  "' is not 'L:share' (context in K tokens, 1..1024; tokens a shared list, 0..64)");
    decode_cases.clear();
  }
  for (bool fp8 : {false, true}) {
    const KvCacheDtype kd = fp8 ? KvCacheDtype::kFp8E4M3 : KvCacheDtype::kAuto;
    for (const Case& c : decode_cases) {
      const int nb = c.ctx / kPageTokens;
      const double slice_bytes = double(kPageTokens) * 256 * (fp8 ? 1 : 2);
      const double per_token_io = double(kHq) * 128 * 2 * 2;  // q in, out
      const double est = double(c.B) * kHkv * kTopk * slice_bytes;
      const int sets = sets_beyond_l2(est, 8);
      if (c.seed >= 0) rng.seed(uint64_t(c.seed));
      std::vector<Batch> batch = make_sets(rng, fp8, c.B, c.ctx, c.dql, 0, sets);
      MsaDecodePlan plan({c.B, c.dql, kHq, kHkv, kTopk, nb, kd}, Device::cuda());
      auto call_with = [&](MsaDecodePlan& plan_to_run, bool pdl = false, bool p_residue = true) {
        return [&, pl = &plan_to_run, pdl, p_residue](int s, CUstream_st* st) {
          const Batch& bt = batch[size_t(s)];
          pl->run({.q = bt.q, .cache = {bt.cache, kd, ksd, vsd}, .topk = bt.topk_view, .seq_lens = bt.lens,
                   .block_table = bt.table, .softmax_scale = scale, .out = bt.out, .p_residue = p_residue,
                   .enable_pdl = pdl},
                  st);
        };
      };
      // The same calls with one argument changed, timed in the same run, against `base`.
      auto derived_row = [&](const BenchRow& base, const char* suffix, bool pdl, bool p_residue, const char* note,
                             const char* vs) {
        BenchRow q = base;
        q.variant += suffix;
        q.us = time_us(call_with(plan, pdl, p_residue), sets, true, env);
        q.gbps = q.bytes / (q.us * 1e3);
        q.pct_ceiling = 100.0 * q.gbps / env.copy_gbps;
        q.note += note;
        q.ratios = {{vs, base.us / q.us}};
        return q;
      };
      // dql 1 at batch <= 32: the same calls launched with PDL (each call's launch and CTA start-up
      // overlap the previous call's tail, as they would the indexer's in a decode step).
      auto pdl_row = [&](const BenchRow& base) {
        return derived_row(base, " pdl", true, true, "; back-to-back calls with enable_pdl", "vs without pdl");
      };
      const bool with_pdl = c.dql == 1 && c.B <= 32;
      const auto call = call_with(plan);
      BenchRow r;
      r.op = "msa_attention";
      r.variant = std::string(c.dql > 1 ? "verify dql8 " : "decode ") + (fp8 ? "fp8" : "bf16") + " B" +
                  std::to_string(c.B) + " ctx" + std::to_string(c.ctx / 1024) + "K" +
                  (c.seed >= 0 ? " seed " + std::to_string(c.seed) : "");
      r.us = time_us(call, sets, true, env);
      r.bytes = batch[0].unique_slices * slice_bytes + double(c.B) * c.dql * per_token_io;
      r.gbps = r.bytes / (r.us * 1e3);
      r.pct_ceiling = 100.0 * r.gbps / env.copy_gbps;
      const int splits = plan_splits(c, fp8);
      const MsaDecodeMixed mixed = msa_decode_mixed(c.B, c.dql, kHkv, kTopk, nb, fp8, splits);
      r.note = mixed.whole > 0 ? std::to_string(mixed.whole) + " whole pairs, the rest in " +
                                     std::to_string(mixed.pieces) + " pieces"
                               : std::to_string(splits) + " splits";
      r.note += host_cost_note(call, sets, 64);
      if (mixed.whole > 0) {  // the split grid, same run
        const ScopedEnv split_grid("M3RT_MSA_MIXED", "0");
        MsaDecodePlan alt({c.B, c.dql, kHq, kHkv, kTopk, nb, kd}, Device::cuda());
        const double split_us = time_us(call_with(alt), sets, true, env);
        char b[64];
        std::snprintf(b, sizeof b, "; split grid (%d splits) %.2f us", splits, split_us);
        r.note += b;
        r.ratios.push_back({"vs split grid", split_us / r.us});
      }
      // Read floors of the same bytes in the same harness (dql 1 on the split grid): the kernel's own
      // page stream (grid, chunks, stages) with nothing else, and a contiguous read of as many bytes.
      auto floor_rows = [&]() {
        if (c.dql != 1 || mixed.whole > 0) return;
        const Tensor sink = Tensor::empty({1}, DType::kInt32, Device::cuda());
        std::vector<MsaParams> fps;
        for (const Batch& bt : batch) {
          MsaParams fp = msa_call_params(bt.q, {bt.cache, kd, ksd, vsd}, bt.topk_view, TensorView{}, bt.lens,
                                         bt.table, 1, 0, scale, MsaMask{}, bt.out);
          fp.num_splits = splits;
          fps.push_back(fp);
        }
        unsigned* sk = reinterpret_cast<unsigned*>(sink.data());
        if (msa_decode1_read_floor_launch(fps[0], sk, nullptr))
          rows.push_back(floor_row(
              r, " read floor",
              time_us([&](int s, CUstream_st* st) { msa_decode1_read_floor_launch(fps[size_t(s)], sk, st); }, sets,
                      true, env),
              "the dql-1 kernel's page stream alone: same grid, chunks and stages; no queries, softmax, merge or output",
              env));
        rows.push_back(floor_row(r, " contiguous read", time_contiguous_read_us(batch[0].cache.data(), r.bytes, sets, env),
                                 kContiguousReadNote, env));
      };
      if (decode_only) {
        rows.push_back(r);
        floor_rows();
        if (with_pdl) rows.push_back(pdl_row(r));
        continue;
      }
      if (c.B == 1 && c.ctx == 32768 && !env.quick) {  // batch 1: the split merge in global memory, same run
        const ScopedEnv global_merge("M3RT_MSA_CLUSTER", "0");
        MsaDecodePlan alt({c.B, c.dql, kHq, kHkv, kTopk, nb, kd}, Device::cuda());
        char b[64];
        std::snprintf(b, sizeof b, "; global merge %.2f us", time_us(call_with(alt), sets, true, env));
        r.note += b;
      }
      rows.push_back(r);
      if (c.dql == 1) {  // the general kernel msa_decode1_kernel replaced for dql 1, same run
        const ScopedEnv general("M3RT_MSA_DECODE1", "0");
        MsaDecodePlan alt({c.B, c.dql, kHq, kHkv, kTopk, nb, kd}, Device::cuda());
        rows.back().ratios.push_back({"vs general kernel", time_us(call_with(alt), sets, true, env) / r.us});
      }
      // Verify: the per-token tile (unsplit grids) against msa_sparse_kernel's 128-row tile, whose
      // loops the ratios after it time.
      std::optional<ScopedEnv> tt_off;
      if (c.dql > 1) {
        tt_off.emplace("M3RT_MSA_TOKEN_TILE", "0");
        MsaDecodePlan alt({c.B, c.dql, kHq, kHkv, kTopk, nb, kd}, Device::cuda());
        rows.back().ratios.push_back({"vs 128-row wgmma tile", time_us(call_with(alt), sets, true, env) / r.us});
      }
      if (c.dql > 1) {  // the mma.sync loop the wgmma one replaced on Hopper, same run
        const ScopedEnv mma_sync("M3RT_MSA_WGMMA", "0");
        MsaDecodePlan alt({c.B, c.dql, kHq, kHkv, kTopk, nb, kd}, Device::cuda());
        rows.back().ratios.push_back({"vs mma.sync loop", time_us(call_with(alt), sets, true, env) / r.us});
      }
      if (c.dql > 1 && fp8) {  // e4m3: the chunks converted by the row warps (no producer warpgroup), same run
        const ScopedEnv row_warps("M3RT_MSA_WS", "0");
        MsaDecodePlan alt({c.B, c.dql, kHq, kHkv, kTopk, nb, kd}, Device::cuda());
        rows.back().ratios.push_back({"vs row-warp conversion", time_us(call_with(alt), sets, true, env) / r.us});
      }
      if (c.B == 32 && !env.quick) {  // the first (CUDA-core) kernel, timed in the same run
        msa_force_baseline(true);
        rows.back().ratios.push_back({"vs baseline kernel", time_us(call, sets, true, env) / r.us});
        msa_force_baseline(false);
      }
      tt_off.reset();
      if (c.seed >= 0) rows.back().ratios.push_back({"first / again", r.us / time_us(call, sets, true, env)});
      floor_rows();
      if (with_pdl) rows.push_back(pdl_row(r));
      if (c.dql > 1)  // P rounded once (MsaDecodeArgs::p_residue false)
        rows.push_back(derived_row(r, " p16", false, false, "; P rounded once (p_residue false)", "vs p_residue"));
    }
  }
  if (decode_only || !verify_seeds.empty()) return rows;
  if (env.gemm_tflops == 0) env.gemm_tflops = measure_gemm_tflops();
  for (bool fp8 : {false, true}) {
    const KvCacheDtype kd = fp8 ? KvCacheDtype::kFp8E4M3 : KvCacheDtype::kAuto;
    for (int L : only_l      ? std::vector<int>{only_l * 1024}
                 : env.quick ? std::vector<int>{8192}
                             : std::vector<int>{8192, 32768})
    for (int share : only_l ? std::vector<int>{only_share} : std::vector<int>{0, 8}) {
      std::vector<Batch> batch = make_sets(rng, fp8, 1, L, 0, L, 1, share);
      const Batch& bt = batch[0];
      const MsaPrefillArgs a{.q = bt.q, .cache = {bt.cache, kd, ksd, vsd}, .topk = bt.topk_view,
                             .cu_seqlens_q = bt.cu, .seq_lens = bt.lens, .block_table = bt.table,
                             .max_query_len = L, .softmax_scale = scale, .out = bt.out};
      auto call = [&](int, CUstream_st* st) { msa_prefill(a, st); };
      BenchRow r;
      r.op = "msa_attention";
      r.variant = std::string("prefill ") + (fp8 ? "fp8" : "bf16") + " " + std::to_string(L / 1024) + "K" +
                  (share ? " shared" + std::to_string(share) : "");
      r.us = time_us(call, 1, true, env, 3);
      r.tflops = bt.flops / (r.us * 1e6);
      r.ceiling = "gemm";
      r.pct_ceiling = 100.0 * r.tflops / env.gemm_tflops;
      r.bytes = bt.unique_slices * double(kPageTokens) * 256 * (fp8 ? 1 : 2);
      r.gbps = r.bytes / (r.us * 1e3);
      r.note = std::to_string(int(r.tflops)) + " TFLOP/s effective" + host_cost_note(call, 1, 8);
      rows.push_back(r);
      if (only_l) continue;
      std::optional<ScopedEnv> tt_off;  // the ratios below are of msa_sparse_kernel's loops
      {  // group 16: the per-token tile against msa_sparse_kernel's 64-row wgmma tile
        tt_off.emplace("M3RT_MSA_TOKEN_TILE", "0");
        rows.back().ratios.push_back({"vs 64-row wgmma tile", time_us(call, 1, true, env, 3) / r.us});
      }
      {  // the mma.sync loop the wgmma one replaced on Hopper, same run
        const ScopedEnv mma_sync("M3RT_MSA_WGMMA", "0");
        rows.back().ratios.push_back({"vs mma.sync loop", time_us(call, 1, true, env, 3) / r.us});
      }
      if (fp8) {  // e4m3: the chunks converted by the row warps (no producer warpgroup), same run
        const ScopedEnv row_warps("M3RT_MSA_WS", "0");
        rows.back().ratios.push_back({"vs row-warp conversion", time_us(call, 1, true, env, 3) / r.us});
      }
      if (L == 8192 && share == 0 && !env.quick) {
        msa_force_baseline(true);
        rows.back().ratios.push_back({"vs baseline kernel", time_us(call, 1, true, env, 3) / r.us});
        msa_force_baseline(false);
      }
      tt_off.reset();
      {  // P rounded once (MsaPrefillArgs::p_residue false), same run
        MsaPrefillArgs a16 = a;
        a16.p_residue = false;
        BenchRow q = r;
        q.variant += " p16";
        q.us = time_us([&](int, CUstream_st* st) { msa_prefill(a16, st); }, 1, true, env, 3);
        q.tflops = bt.flops / (q.us * 1e6);
        q.pct_ceiling = 100.0 * q.tflops / env.gemm_tflops;
        q.gbps = q.bytes / (q.us * 1e3);
        q.note = std::to_string(int(q.tflops)) + " TFLOP/s effective; P rounded once (p_residue false)";
        q.ratios = {{"vs p_residue", r.us / q.us}};
        rows.push_back(q);
      }
    }
  }
  return rows;
}

// The drafter's attention (src/model: the draft block of 7 tokens attends non-causally to its
// request's context in a 4096-key window, every block of the window listed, topk 64): B requests of
// 8192 cached tokens + the block, Hq 64 / Hkv 4 (112-row groups), bf16 cache. Rows: the plan's
// default (cluster merge), the global-memory merge (M3RT_MSA_CLUSTER=0) and 8 splits
// (M3RT_MSA_SPLITS) and the mma.sync loop instead of wgmma (M3RT_MSA_WGMMA=0), each a graph replay
// with inputs rotated beyond L2.
std::vector<BenchRow> bench_msa_attention_draft(BenchEnv& env) {
  // tuning runs of the dql-1 decode, profiling runs of one prefill row, the verify rows over seeds
  if (env_set("M3RT_BENCH_MSA_DECODE_ONLY") || env_set("M3RT_BENCH_MSA_PREFILL_ONLY") ||
      env_set("M3RT_BENCH_MSA_VERIFY_SEEDS"))
    return {};
  constexpr int N = 7, K = kMsaMaxTopk, window = 4096, ctx = 8192;
  const int seq = ctx + N, first = (ctx - window + 1) / kPageTokens, last = (seq - 1) / kPageTokens;
  const int nb = last + 1, span = last - first + 1;
  const float scale = 0.08838834764831845f;
  const Tensor ks = Tensor::empty({1}, DType::kFloat32, Device::cuda()), vs = ks;
  std::mt19937_64 rng(11);
  std::vector<BenchRow> rows;
  for (int B : env.quick ? std::vector<int>{1} : std::vector<int>{1, 8}) {
    const int64_t T = int64_t(B) * N;
    const double slice = double(kPageTokens) * 256 * 2, bytes = double(B) * kHkv * span * slice + double(T) * kHq * 512;
    const int sets = sets_beyond_l2(bytes, 16);
    struct Set {
      Tensor cache, q, out, lens, table, topk;
      TensorView topk_view;
    };
    std::vector<Set> sv(static_cast<size_t>(sets));
    for (Set& st : sv) {
      st.cache = Tensor::empty({int64_t(B) * nb, kHkv, kPageTokens, 256}, DType::kBFloat16, Device::cuda());
      fill_uniform_bf16(st.cache.data(), st.cache.numel(), rng(), -1.f, 1.f);
      st.q = Tensor::empty({T, kHq, 128}, DType::kBFloat16, Device::cuda());
      fill_uniform_bf16(st.q.data(), st.q.numel(), rng(), -1.f, 1.f);
      st.out = Tensor::empty({T, kHq, 128}, DType::kBFloat16, Device::cuda());
      Tensor lens = Tensor::empty({B}, DType::kInt32), table = Tensor::empty({B, nb}, DType::kInt32),
             topk = Tensor::empty({kHkv, T, K}, DType::kInt32);
      std::vector<int32_t> perm(size_t(B) * nb);
      std::iota(perm.begin(), perm.end(), 0);
      std::shuffle(perm.begin(), perm.end(), rng);
      std::copy(perm.begin(), perm.end(), table.ptr<int32_t>());
      for (int b = 0; b < B; ++b) lens.ptr<int32_t>()[b] = seq;
      for (int64_t i = 0; i < topk.numel(); ++i) topk.ptr<int32_t>()[i] = int(i % K) < span ? first + int(i % K) : -1;
      st.lens = lens.to(Device::cuda()), st.table = table.to(Device::cuda()), st.topk = topk.to(Device::cuda());
      st.topk_view = st.topk.view();
    }
    const MsaMask mask{.causal = false, .window_left = window};
    struct Variant {
      const char* name;
      const char* splits;   // M3RT_MSA_SPLITS, nullptr: the plan's default
      const char* cluster;  // M3RT_MSA_CLUSTER "0": the global-memory merge
      const char* wgmma;    // M3RT_MSA_WGMMA "0": the mma.sync loop
    };
    for (const Variant& v : {Variant{"default", nullptr, nullptr, nullptr}, Variant{"global merge", nullptr, "0", nullptr},
                             Variant{"splits 8", "8", nullptr, nullptr}, Variant{"mma.sync", nullptr, nullptr, "0"}}) {
      if (env.quick && std::string(v.name) != "default") continue;
      const ScopedEnv splits_env("M3RT_MSA_SPLITS", v.splits), cluster_env("M3RT_MSA_CLUSTER", v.cluster),
          wgmma_env("M3RT_MSA_WGMMA", v.wgmma);
      MsaDecodePlan plan({B, N, kHq, kHkv, K, nb, KvCacheDtype::kAuto}, Device::cuda());
      const int splits = msa_decode_splits(B, N, kHq, kHkv, K, nb, false);
      auto call = [&](int s, CUstream_st* stream) {
        const Set& st = sv[size_t(s)];
        plan.run({.q = st.q, .cache = {st.cache, KvCacheDtype::kAuto, ks, vs}, .topk = st.topk_view,
                  .seq_lens = st.lens, .block_table = st.table, .softmax_scale = scale, .mask = mask, .out = st.out},
                 stream);
      };
      BenchRow r;
      r.op = "msa_attention_draft";
      r.variant = "draft block B" + std::to_string(B) + " ctx8K win4096 " + v.name;
      r.us = time_us(call, sets, true, env);
      r.bytes = bytes;
      r.gbps = bytes / (r.us * 1e3);
      r.pct_ceiling = 100.0 * r.gbps / env.copy_gbps;
      r.note = std::to_string(splits) + " splits, " + std::to_string(span) + " pages per (request, KV head)";
      rows.push_back(r);
    }
  }
  return rows;
}

}  // namespace m3rt::bench
