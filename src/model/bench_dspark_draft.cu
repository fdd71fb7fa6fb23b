// Benchmark of the DSpark drafter on the GPU at the real M3.1 draft dimensions with random weights
// (5 layers, hidden 6144, 64/4 heads of 128, FFN 12288, vocab 200064, Markov rank 256, block 7,
// 5 target layers, confidence head with Markov input, window 4096), bf16 weights and KV cache.
//
// Draft step (R = 1, 8, 64 requests, each with 8192 cached context tokens; greedy): one call =
// input copies + the step's CUDA graph replay + output copy, timed with events around the call
// (median of the repeats). The floor is reading every weight the step needs once at the copy
// ceiling measured in the same run: the 5 layers, the final norm and LM head, W2 once per Markov
// step (7x; DsparkModel::draft_weight_bytes). The per-stage split comes from the events inside the
// graph. The same model built with use_graphs = false is the eager baseline. Larger batches are
// bound by more than the weights: the note also gives the step's bound, its GEMMs at the larger of
// reading the weights and their FLOPs at the measured GEMM rate, plus the K/V pages it attends.
// Context precompute (8 rows: one verify; 8192 rows: a prefill chunk): fc, hidden norm, the K/V
// GEMM of every layer and the fused cache write, eager. 8 rows are bound by reading fc and the K/V
// weights (copy ceiling); 8192 rows by their GEMM FLOPs (the cuBLAS GEMM rate measured in the run).
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdio>
#include <functional>
#include <memory>
#include <random>
#include <string>

#include "bench.h"
#include "core/cuda_check.h"
#include "m3rt/dspark_checkpoint.h"
#include "m3rt/dspark_model.h"

namespace m3rt::bench {

namespace {

double median_of(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v.empty() ? 0 : v[v.size() / 2];
}

}  // namespace

std::vector<BenchRow> bench_dspark_draft(BenchEnv& env) {
  const DsparkConfig c = m31_dspark_config(DsparkQuant::kBFloat16);
  constexpr int64_t kContext = 8192, kMaxBatch = 64;
  const int64_t N = c.block_size, pages = (kContext + N + 127) / 128;
  const int max_b = env.quick ? 1 : int(kMaxBatch);
  const DsparkModelOptions opt{.num_cache_blocks = int(max_b * pages), .device = Device::cuda(), .max_batch = max_b,
                               .max_blocks_per_request = int(pages)};
  DsparkModel model(c, opt, 2026);
  std::unique_ptr<DsparkModel> eager;
  if (!env.quick) {
    DsparkModelOptions e = opt;
    e.use_graphs = false;
    eager = std::make_unique<DsparkModel>(c, e, 2026);
  }
  // The cached context: random K/V (what precompute would have written).
  for (DsparkModel* m : {&model, eager.get()})
    if (m)
      for (int l = 0; l < c.num_layers; ++l) fill_uniform_bf16(m->kv_cache(l).data(), m->kv_cache(l).numel(), 50 + l, -1.f, 1.f);
  M3RT_CUDA_CHECK(cudaDeviceSynchronize());
  cudaStream_t s;
  M3RT_CUDA_CHECK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
  cudaEvent_t e0, e1;
  M3RT_CUDA_CHECK(cudaEventCreate(&e0));
  M3RT_CUDA_CHECK(cudaEventCreate(&e1));
  const int repeats = env.quick ? 5 : 20;
  auto time_call = [&](const std::function<void()>& call, DsparkModel* m, DsparkModel::Timings* stages) {
    call();  // warm-up (captures the graph on first use)
    M3RT_CUDA_CHECK(cudaStreamSynchronize(s));
    std::vector<double> us, bb, lm, hd;
    for (int r = 0; r < repeats; ++r) {
      M3RT_CUDA_CHECK(cudaEventRecord(e0, s));
      call();
      M3RT_CUDA_CHECK(cudaEventRecord(e1, s));
      M3RT_CUDA_CHECK(cudaEventSynchronize(e1));
      float ms = 0;
      M3RT_CUDA_CHECK(cudaEventElapsedTime(&ms, e0, e1));
      us.push_back(ms * 1e3);
      if (stages) {
        const DsparkModel::Timings& t = m->last_timings();
        bb.push_back(t.backbone_ms * 1e3), lm.push_back(t.lm_head_ms * 1e3), hd.push_back(t.heads_ms * 1e3);
      }
    }
    if (stages) stages->backbone_ms = median_of(bb), stages->lm_head_ms = median_of(lm), stages->heads_ms = median_of(hd);
    return median_of(us);
  };
  std::vector<BenchRow> rows;
  std::mt19937_64 rng(99);
  const double floor_bytes = double(model.draft_weight_bytes());
  const double floor_us = floor_bytes / (env.copy_gbps * 1e3);
  const std::vector<int64_t> batches = env.quick ? std::vector<int64_t>{1} : std::vector<int64_t>{1, 8, 64};
  for (int64_t R : batches) {
    Tensor anchors = Tensor::empty({R}, DType::kInt32), apos = Tensor::empty({R}, DType::kInt64),
           bslots = Tensor::empty({R, N}, DType::kInt64), table = Tensor::empty({R, pages}, DType::kInt32),
           temps = Tensor::empty({R}, DType::kFloat32), seeds = Tensor::empty({R}, DType::kInt64);
    for (int64_t r = 0; r < R; ++r) {
      anchors.ptr<int32_t>()[r] = int32_t(rng() % uint64_t(c.vocab_size));
      apos.ptr<int64_t>()[r] = kContext;
      temps.ptr<float>()[r] = 0.f;
      seeds.ptr<int64_t>()[r] = r;
      for (int64_t b = 0; b < pages; ++b) table.ptr<int32_t>()[r * pages + b] = int32_t(r * pages + b);
      for (int64_t j = 0; j < N; ++j) bslots.ptr<int64_t>()[r * N + j] = (r * pages + (kContext + j) / 128) * 128 + (kContext + j) % 128;
    }
    const Device d = Device::cuda();
    Tensor tokens = Tensor::empty({R, N}, DType::kInt32, d), conf = Tensor::empty({R, N}, DType::kFloat32, d);
    const Tensor anchors_d = anchors.to(d), apos_d = apos.to(d), bslots_d = bslots.to(d), table_d = table.to(d),
                 temps_d = temps.to(d), seeds_d = seeds.to(d);  // alive while `args` views them
    const DsparkDraftArgs args{.anchor_tokens = anchors_d, .anchor_positions = apos_d, .block_slots = bslots_d,
                               .block_table = table_d, .temperatures = temps_d, .seeds = seeds_d,
                               .draft_tokens = tokens, .confidence = conf};
    DsparkModel::Timings st;
    const double us = time_call([&] { model.draft(args, s); }, &model, &st);
    model.check_input_errors();
    BenchRow row;
    row.op = "dspark_draft";
    row.variant = "step R=" + std::to_string(R) + " ctx8K bf16 graph";
    row.us = us;
    row.bytes = floor_bytes;
    row.gbps = floor_bytes / (us * 1e3);
    row.pct_ceiling = 100.0 * floor_us / us;
    if (eager) {
      const double eus = time_call([&] { eager->draft(args, s); }, nullptr, nullptr);
      eager->check_input_errors();
      row.ratios.push_back({"vs eager", eus / us});
    }
    // The step's bound at this batch: its GEMMs at the larger of the weight read and their FLOPs at
    // the measured GEMM rate, plus the K/V pages the block attends (33 per request, layer and KV
    // head at 8K context with window 4096) at the copy ceiling.
    if (env.gemm_tflops == 0) env.gemm_tflops = measure_gemm_tflops();
    // Every weight once per block row, except W2: once per request and Markov step (N steps).
    const double w2_params = double(c.vocab_size) * c.markov_rank;
    const double gemm_flops = 2.0 * double(R * N) * (floor_bytes / 2 - double(N - 1) * w2_params);
    const int64_t kv_pages = (kContext + N - 1) / 128 - (kContext - c.sliding_window + 1) / 128 + 1;
    const double kv_bytes = double(R) * c.num_layers * kv_pages * c.num_kv_heads * 128.0 * 256 * 2;
    const double bound_us = std::max(floor_us, gemm_flops / (env.gemm_tflops * 1e6)) + kv_bytes / (env.copy_gbps * 1e3);
    char note[320];
    std::snprintf(note, sizeof note,
                  "%.2fx the weight floor %.0f us, %.2fx the bound %.0f us (GEMM FLOPs or weights + K/V reads); "
                  "layers %.0f, LM head %.0f, Markov+conf %.0f us",
                  us / floor_us, floor_us, us / bound_us, bound_us, st.backbone_ms, st.lm_head_ms, st.heads_ms);
    row.note = note;
    rows.push_back(row);
  }
  // Context precompute.
  if (env.gemm_tflops == 0) env.gemm_tflops = measure_gemm_tflops();
  const int64_t H = c.hidden_size, nt = int64_t(c.target_layer_ids.size()), KV = int64_t(c.num_layers) * 2 * c.num_kv_heads * 128;
  for (int64_t T : {int64_t(8), int64_t(8192)}) {
    if (T > int64_t(max_b) * pages * 128) continue;
    Tensor hidden = Tensor::empty({T, nt * H}, DType::kBFloat16, Device::cuda());
    fill_uniform_bf16(hidden.data(), hidden.numel(), 77, -1.f, 1.f);
    Tensor pos = Tensor::empty({T}, DType::kInt64), slots = Tensor::empty({T}, DType::kInt64);
    for (int64_t t = 0; t < T; ++t) pos.ptr<int64_t>()[t] = t, slots.ptr<int64_t>()[t] = t;
    const Tensor pos_d = pos.to(Device::cuda()), slots_d = slots.to(Device::cuda());
    const double us = time_call([&] { model.precompute_context(hidden, pos_d, slots_d, s); }, nullptr, nullptr);
    const double weights = double(H) * nt * H * 2 + double(KV) * H * 2;
    const double bytes = weights + double(T) * nt * H * 2 + double(T) * KV * 2;
    const double flops = 2.0 * double(T) * (double(H) * nt * H + double(KV) * H);
    BenchRow row;
    row.op = "dspark_draft";
    row.variant = "precompute " + std::to_string(T) + " rows";
    row.us = us;
    row.bytes = bytes;
    row.gbps = bytes / (us * 1e3);
    row.tflops = flops / (us * 1e6);
    const bool compute = flops / (env.gemm_tflops * 1e6) > bytes / (env.copy_gbps * 1e3);
    row.ceiling = compute ? "gemm" : "copy";
    row.pct_ceiling = compute ? 100.0 * row.tflops / env.gemm_tflops : 100.0 * row.gbps / env.copy_gbps;
    row.note = compute ? "fc + K/V GEMMs: FLOP-bound" : "reads fc and the K/V weights: bandwidth-bound";
    rows.push_back(row);
  }
  cudaEventDestroy(e0);
  cudaEventDestroy(e1);
  cudaStreamDestroy(s);
  return rows;
}

}  // namespace m3rt::bench
