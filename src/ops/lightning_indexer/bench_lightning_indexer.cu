// Benchmark of the lightning indexer at M3's TP1 shape (4 index heads, dim 128, topk 16, init 0,
// local 1), bf16 and fp8 index caches.
//
// Decode (dql 1), batch 1/8/32/128, every request at context 32K or 128K: bytes = the index-K rows
// the requests must read (batch x context x 128 x 1 or 2 bytes); q, the block table and the top-k
// output are < 0.1% and not counted. Reported against the copy ceiling measured in the run.
// Inputs rotate over sets (disjoint pages of one cache) larger than 3x L2; graph replays. Batch 1
// and 8 also run with enable_pdl (the graph's calls as programmatic dependents of each other).
// Prefill, one request of 8K and 32K new tokens: effective FLOPs = the causal QK^T over the 4 heads
// (sum over tokens of (position + 1) x 128 x 2 x 4); the row's TFLOP/s and % are the scoring
// kernel's (timed alone) against the bf16 GEMM rate measured in the run; `us` is the whole call
// (scoring + selection), and the note gives the selection's share and the call's TFLOP/s. The
// portable mma.sync scoring kernel (what non-Hopper GPUs run) is timed as a baseline.
#include <cuda_runtime.h>

#include <algorithm>
#include <numeric>
#include <random>

#include "bench.h"
#include "core/cuda_check.h"
#include "m3rt/lightning_indexer.h"
#include "ops/lightning_indexer/lightning_indexer.h"

namespace m3rt::bench {

namespace {

__global__ void fill_e4m3_kernel(uint8_t* p, int64_t n, uint64_t seed) {
  for (int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; i < n; i += int64_t(gridDim.x) * blockDim.x) {
    uint64_t z = seed + 0x9e3779b97f4a7c15ull * uint64_t(i + 1);  // splitmix64
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    z ^= z >> 31;
    // Magnitudes 2^-4 .. 2^3 (exponent field 3..10), random sign and mantissa; never NaN.
    const uint8_t mant = uint8_t(z & 7u), exp = uint8_t(3 + (z >> 3) % 8), sign = uint8_t((z >> 8) & 1u);
    p[i] = uint8_t(sign << 7 | exp << 3 | mant);
  }
}

void fill_index_values(const Tensor& t, bool fp8, uint64_t seed) {
  if (fp8) {
    fill_e4m3_kernel<<<1024, 256>>>(t.ptr<uint8_t>(), t.numel(), seed);
    M3RT_LAUNCH_CHECK(nullptr, "fill_e4m3_kernel");
  } else {
    fill_uniform_bf16(t.data(), t.numel(), seed, -2.f, 2.f);
  }
}

Tensor int32_on_gpu(const std::vector<int32_t>& v, std::vector<int64_t> shape) {
  Tensor h = Tensor::empty(shape, DType::kInt32);
  std::copy(v.begin(), v.end(), h.ptr<int32_t>());
  return h.to(Device::cuda());
}

constexpr int kHeads = 4, kTopk = 16;

// M3's indexer (4 heads, topk 16, init 0, local 1) sized for one benchmark shape.
IndexerConfig m3_config(bool fp8, int64_t max_prefill_tokens, int max_decode_seqs, int max_blocks) {
  IndexerConfig cfg;
  cfg.num_index_heads = kHeads;
  cfg.select.topk = kTopk;
  cfg.index_cache_dtype = fp8 ? KvCacheDtype::kFp8E4M3 : KvCacheDtype::kAuto;
  cfg.max_prefill_tokens = max_prefill_tokens;
  cfg.max_decode_seqs = max_decode_seqs;
  cfg.max_blocks_per_seq = max_blocks;
  return cfg;
}

}  // namespace

std::vector<BenchRow> bench_lightning_indexer(BenchEnv& env) {
  std::vector<BenchRow> rows;
  std::mt19937_64 rng(7);
  const DType code = DType::kUInt8;
  // ---- decode ----
  const std::vector<int> batches = env.quick ? std::vector<int>{8} : std::vector<int>{1, 8, 32, 128};
  for (bool fp8 : {false, true}) {
    for (int ctx : {32768, 131072}) {
      for (int B : batches) {
        const int pages = ctx / kIndexBlockSize;
        const double bytes = double(B) * ctx * 128 * (fp8 ? 1 : 2);
        const int sets = sets_beyond_l2(bytes, 16);
        const int64_t num_pages = int64_t(sets) * B * pages;
        Tensor cache = Tensor::empty({num_pages, 128, 128}, fp8 ? code : DType::kBFloat16, Device::cuda());
        fill_index_values(cache, fp8, 31);
        std::vector<int32_t> ids(static_cast<size_t>(num_pages));
        std::iota(ids.begin(), ids.end(), 0);
        std::shuffle(ids.begin(), ids.end(), rng);
        std::vector<Tensor> tables(sets), qs(sets);
        for (int s = 0; s < sets; ++s) {
          tables[s] = int32_on_gpu({ids.begin() + int64_t(s) * B * pages, ids.begin() + int64_t(s + 1) * B * pages},
                                   {B, pages});
          qs[s] = Tensor::empty({B, kHeads, 128}, fp8 ? code : DType::kBFloat16, Device::cuda());
          fill_index_values(qs[s], fp8, 100 + s);
        }
        Tensor seq_lens = int32_on_gpu(std::vector<int32_t>(size_t(B), ctx), {B});
        Tensor out = Tensor::empty({B, kHeads, kTopk}, DType::kInt32, Device::cuda());
        LightningIndexer indexer(m3_config(fp8, 0, B, pages), Device::cuda());
        bool pdl = false;
        auto call = [&](int s, CUstream_st* st) {
          IndexerDecodeArgs a{.index_q = qs[s], .index_cache = cache, .seq_lens = seq_lens,
                              .block_table = tables[s], .decode_query_len = 1, .topk_out = out,
                              .enable_pdl = pdl};
          indexer.decode(a, st);
        };
        BenchRow r;
        r.op = "lightning_indexer";
        r.variant = std::string("decode ") + (fp8 ? "fp8" : "bf16") + " B" + std::to_string(B) + " ctx" +
                    std::to_string(ctx / 1024) + "K";
        r.us = time_us(call, sets, true, env);
        indexer_force_portable(true);  // the portable decode kernel (non-Hopper GPUs), as a baseline
        r.ratios.push_back({"vs portable", time_us(call, sets, true, env) / r.us});
        indexer_force_portable(false);
        r.bytes = bytes;
        r.gbps = bytes / (r.us * 1e3);
        r.pct_ceiling = 100.0 * r.gbps / env.copy_gbps;
        r.note = "selection fused" + host_cost_note(call, sets, 64);
        rows.push_back(r);
        // Read floors of the same bytes in the same harness: the decode kernel's own page stream
        // (grid, pages, stages) with nothing else, and a contiguous read of as many bytes.
        Tensor sink = Tensor::empty({1}, DType::kInt32, Device::cuda());
        const IndexerParams fp = indexer_call_params(m3_config(fp8, 0, B, pages), qs[0], cache, seq_lens, tables[0],
                                                     out, TensorView{}, 1, 0);
        auto floor_call = [&](int s, CUstream_st* st) {
          IndexerParams p = fp;
          p.block_table = tables[s].ptr<int32_t>();
          indexer_decode_read_floor_launch(p, reinterpret_cast<unsigned*>(sink.data()), st);
        };
        if (indexer_decode_read_floor_launch(fp, reinterpret_cast<unsigned*>(sink.data()), nullptr))
          rows.push_back(floor_row(r, " read floor", time_us(floor_call, sets, true, env),
                                   "the decode kernel's page stream alone: same grid, pages and stages; no scoring "
                                   "or selection",
                                   env));
        rows.push_back(floor_row(r, " contiguous read", time_contiguous_read_us(cache.data(), bytes, sets, env),
                                 kContiguousReadNote, env));
        if (B <= 8) {  // where a call's fixed costs show: back-to-back calls launched with PDL
          pdl = true;
          BenchRow q = r;
          q.variant += " pdl";
          q.us = time_us(call, sets, true, env);
          q.ratios = {{"vs without pdl", r.us / q.us}};
          q.gbps = bytes / (q.us * 1e3);
          q.pct_ceiling = 100.0 * q.gbps / env.copy_gbps;
          q.note += "; back-to-back calls with enable_pdl";
          rows.push_back(q);
        }
      }
    }
  }
  // ---- prefill ----
  if (env.gemm_tflops == 0) env.gemm_tflops = measure_gemm_tflops();
  for (bool fp8 : {false, true}) {
    for (int L : env.quick ? std::vector<int>{8192} : std::vector<int>{8192, 32768}) {
      const int pages = L / kIndexBlockSize;
      Tensor cache = Tensor::empty({pages, 128, 128}, fp8 ? code : DType::kBFloat16, Device::cuda());
      fill_index_values(cache, fp8, 41);
      std::vector<int32_t> ids(static_cast<size_t>(pages));
      std::iota(ids.begin(), ids.end(), 0);
      std::shuffle(ids.begin(), ids.end(), rng);
      Tensor table = int32_on_gpu(ids, {1, pages});
      Tensor q = Tensor::empty({L, kHeads, 128}, fp8 ? code : DType::kBFloat16, Device::cuda());
      fill_index_values(q, fp8, 43);
      Tensor cu = int32_on_gpu({0, L}, {2});
      Tensor seq_lens = int32_on_gpu({L}, {1});
      Tensor out = Tensor::empty({L, kHeads, kTopk}, DType::kInt32, Device::cuda());
      const IndexerConfig cfg = m3_config(fp8, L, 0, pages);
      LightningIndexer indexer(cfg, Device::cuda());
      const IndexerPrefillArgs a{.index_q = q, .index_cache = cache, .cu_seqlens_q = cu, .seq_lens = seq_lens,
                                 .block_table = table, .max_query_len = L, .topk_out = out};
      auto call = [&](int, CUstream_st* st) { indexer.prefill(a, st); };
      // The selection alone, on scores the scoring kernel left in a scratch of our own.
      Tensor scores = Tensor::empty({L, kHeads, pages}, DType::kFloat32, Device::cuda());
      IndexerParams sp = indexer_call_params(cfg, q, cache, seq_lens, table, out, cu, 0, L);
      sp.scores = scores.ptr<float>();
      indexer_prefill_score_launch(sp, nullptr);  // real scores for the selection to rank
      M3RT_CUDA_CHECK(cudaDeviceSynchronize());
      auto select = [&](int, CUstream_st* st) { indexer_prefill_select_launch(sp, st); };
      auto score = [&](int, CUstream_st* st) { indexer_prefill_score_launch(sp, st); };
      BenchRow r;
      r.op = "lightning_indexer";
      r.variant = std::string("prefill ") + (fp8 ? "fp8" : "bf16") + " " + std::to_string(L / 1024) + "K";
      r.us = time_us(call, 1, true, env, 3);
      const double score_us = time_us(score, 1, true, env, 3);
      const double select_us = time_us(select, 1, true, env, 3);
      indexer_force_portable(true);  // the portable mma.sync scoring kernel, as a baseline
      const double portable_us = time_us(score, 1, true, env, 3);
      indexer_force_portable(false);
      r.ratios.push_back({"scoring vs mma.sync kernel", portable_us / score_us});
      const double flops = double(kHeads) * 128 * 2 * (double(L) * (L + 1) / 2);
      // The acceptance metric: effective TFLOP/s of the scoring kernel against the GEMM rate.
      r.tflops = flops / (score_us * 1e6);
      r.ceiling = "gemm";
      r.pct_ceiling = 100.0 * r.tflops / env.gemm_tflops;
      r.bytes = double(L) * 128 * (fp8 ? 1 : 2) * (1 + kHeads);
      r.gbps = r.bytes / (r.us * 1e3);
      char note[200];
      std::snprintf(note, sizeof(note),
                    "scoring %.1f us = %.0f TFLOP/s (bf16 GEMM %.0f); selection %.1f us = %.0f%% of the call; "
                    "call %.0f TFLOP/s",
                    score_us, r.tflops, env.gemm_tflops, select_us, 100.0 * select_us / r.us, flops / (r.us * 1e6));
      r.note = note;
      rows.push_back(r);
    }
  }
  return rows;
}

}  // namespace m3rt::bench
