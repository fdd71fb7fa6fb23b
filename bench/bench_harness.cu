// The shared benchmark harness (bench.h): copy ceiling, graph-replay timing, the bench registry.
#include <cuda_bf16.h>
#include <cublas_v2.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <vector>

#include "bench.h"
#include "core/cuda_check.h"
#include "core/validate.h"
#include "m3rt/error.h"

namespace m3rt::bench {

namespace {
double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

// Median microseconds of `op(i)` (the i-th run) on the legacy stream over 10 timed runs after 2
// warm-ups, each timed alone with events (for the ceilings: one large operation per run).
double median_single_us(const std::function<void(int)>& op) {
  cudaEvent_t e0, e1;
  M3RT_CUDA_CHECK(cudaEventCreate(&e0));
  M3RT_CUDA_CHECK(cudaEventCreate(&e1));
  std::vector<double> us;
  for (int i = 0; i < 12; ++i) {
    M3RT_CUDA_CHECK(cudaEventRecord(e0));
    op(i);
    M3RT_CUDA_CHECK(cudaEventRecord(e1));
    M3RT_CUDA_CHECK(cudaEventSynchronize(e1));
    float ms = 0;
    M3RT_CUDA_CHECK(cudaEventElapsedTime(&ms, e0, e1));
    if (i >= 2) us.push_back(ms * 1e3);
  }
  cudaEventDestroy(e0);
  cudaEventDestroy(e1);
  return median(us);
}
}  // namespace

double measure_copy_ceiling_gbps() {
  const size_t bytes = size_t(2) << 30;  // 2 GiB each way, far beyond L2
  void *a = nullptr, *b = nullptr;
  M3RT_CUDA_CHECK(cudaMalloc(&a, bytes));
  M3RT_CUDA_CHECK(cudaMalloc(&b, bytes));
  M3RT_CUDA_CHECK(cudaMemset(a, 0x3c, bytes));  // not zeros
  const double us = median_single_us([&](int i) {
    M3RT_CUDA_CHECK(cudaMemcpyAsync(i % 2 ? a : b, i % 2 ? b : a, bytes, cudaMemcpyDeviceToDevice));
  });
  cudaFree(a);
  cudaFree(b);
  return 2.0 * double(bytes) / (us * 1e3);  // bytes per us / 1e3 = GB/s
}

double measure_gemm_tflops() {
  constexpr int n = 8192;
  const size_t bytes = size_t(n) * n * 2;
  void *a = nullptr, *b = nullptr, *c = nullptr;
  M3RT_CUDA_CHECK(cudaMalloc(&a, bytes));
  M3RT_CUDA_CHECK(cudaMalloc(&b, bytes));
  M3RT_CUDA_CHECK(cudaMalloc(&c, bytes));
  fill_uniform_bf16(a, int64_t(n) * n, 11, -1.f, 1.f);
  fill_uniform_bf16(b, int64_t(n) * n, 12, -1.f, 1.f);
  cublasHandle_t h;
  if (cublasCreate(&h) != CUBLAS_STATUS_SUCCESS) throw Error("bench: cublasCreate failed");
  const float one = 1.f, zero = 0.f;
  const double us = median_single_us([&](int) {
    if (cublasGemmEx(h, CUBLAS_OP_T, CUBLAS_OP_N, n, n, n, &one, a, CUDA_R_16BF, n, b, CUDA_R_16BF, n,
                     &zero, c, CUDA_R_16BF, n, CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT) != CUBLAS_STATUS_SUCCESS)
      throw Error("bench: cublasGemmEx failed");
  });
  cublasDestroy(h);
  cudaFree(a);
  cudaFree(b);
  cudaFree(c);
  return 2.0 * double(n) * n * n / (us * 1e6);
}

double time_us(const std::function<void(int, CUstream_st*)>& call, int num_sets, bool graph,
               const BenchEnv& env, int calls_per_graph) {
  cudaStream_t s;
  M3RT_CUDA_CHECK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
  cudaEvent_t e0, e1;
  M3RT_CUDA_CHECK(cudaEventCreate(&e0));
  M3RT_CUDA_CHECK(cudaEventCreate(&e1));
  const int repeats = env.quick ? 5 : 25;
  int set = 0;
  std::vector<double> samples;
  if (graph) {
    cudaGraph_t g;
    cudaGraphExec_t ge;
    M3RT_CUDA_CHECK(cudaStreamBeginCapture(s, cudaStreamCaptureModeThreadLocal));
    for (int i = 0; i < calls_per_graph; ++i) call(set++ % num_sets, s);
    M3RT_CUDA_CHECK(cudaStreamEndCapture(s, &g));
    M3RT_CUDA_CHECK(cudaGraphInstantiate(&ge, g, 0));
    for (int i = 0; i < 3; ++i) M3RT_CUDA_CHECK(cudaGraphLaunch(ge, s));
    for (int r = 0; r < repeats; ++r) {
      M3RT_CUDA_CHECK(cudaEventRecord(e0, s));
      M3RT_CUDA_CHECK(cudaGraphLaunch(ge, s));
      M3RT_CUDA_CHECK(cudaEventRecord(e1, s));
      M3RT_CUDA_CHECK(cudaEventSynchronize(e1));
      float ms = 0;
      M3RT_CUDA_CHECK(cudaEventElapsedTime(&ms, e0, e1));
      samples.push_back(ms * 1e3 / calls_per_graph);
    }
    cudaGraphExecDestroy(ge);
    cudaGraphDestroy(g);
  } else {
    for (int i = 0; i < 3; ++i) call(set++ % num_sets, s);
    for (int r = 0; r < repeats; ++r) {
      M3RT_CUDA_CHECK(cudaEventRecord(e0, s));
      for (int i = 0; i < calls_per_graph; ++i) call(set++ % num_sets, s);
      M3RT_CUDA_CHECK(cudaEventRecord(e1, s));
      M3RT_CUDA_CHECK(cudaEventSynchronize(e1));
      float ms = 0;
      M3RT_CUDA_CHECK(cudaEventElapsedTime(&ms, e0, e1));
      samples.push_back(ms * 1e3 / calls_per_graph);
    }
  }
  M3RT_CUDA_CHECK(cudaStreamSynchronize(s));
  cudaEventDestroy(e0);
  cudaEventDestroy(e1);
  cudaStreamDestroy(s);
  return median(samples);
}

namespace {
__global__ void empty_kernel() {}
}  // namespace

double host_us_per_call(const std::function<void(int, CUstream_st*)>& call, int num_sets, int calls) {
  cudaStream_t s;
  M3RT_CUDA_CHECK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
  for (int i = 0; i < num_sets; ++i) call(i, s);  // first calls: plans' caches, lazy module loading
  std::vector<double> samples;
  int set = 0;
  for (int r = 0; r < 7; ++r) {
    M3RT_CUDA_CHECK(cudaStreamSynchronize(s));
    const auto t0 = std::chrono::steady_clock::now();
    for (int i = 0; i < calls; ++i) call(set++ % num_sets, s);
    const auto t1 = std::chrono::steady_clock::now();
    samples.push_back(std::chrono::duration<double, std::micro>(t1 - t0).count() / calls);
  }
  M3RT_CUDA_CHECK(cudaStreamSynchronize(s));
  M3RT_CUDA_CHECK(cudaGetLastError());
  cudaStreamDestroy(s);
  return median(samples);
}

double host_us_empty_launch() {
  static const double us = host_us_per_call([](int, CUstream_st* st) { empty_kernel<<<1, 32, 0, st>>>(); }, 1, 64);
  return us;
}

std::string host_cost_note(const std::function<void(int, CUstream_st*)>& call, int num_sets, int calls) {
  const double us = host_us_per_call(call, num_sets, calls), floor = host_us_empty_launch();
  char b[96];
  std::snprintf(b, sizeof b, "; host %.2f us a call (an empty kernel's launch %.2f)", us, floor);
  return b;
}

namespace {
__global__ void fill_uniform_bf16_kernel(__nv_bfloat16* p, int64_t n, uint64_t seed, float lo, float hi) {
  for (int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; i < n; i += int64_t(gridDim.x) * blockDim.x) {
    uint64_t z = seed + 0x9e3779b97f4a7c15ull * uint64_t(i + 1);  // splitmix64
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    z ^= z >> 31;
    const float u = float(z >> 40) * (1.f / 16777216.f);
    p[i] = __float2bfloat16_rn(lo + (hi - lo) * u);
  }
}
}  // namespace

void fill_uniform_bf16(void* p, int64_t n, uint64_t seed, float lo, float hi) {
  fill_uniform_bf16_kernel<<<1024, 256>>>(static_cast<__nv_bfloat16*>(p), n, seed, lo, hi);
  M3RT_LAUNCH_CHECK(nullptr, "fill_uniform_bf16_kernel");
}

IndexSets make_index_sets(int sets, int64_t n, int block_size, int64_t max_pos, std::mt19937_64& rng) {
  IndexSets out;
  out.num_blocks = (int64_t(sets) * n + block_size - 1) / block_size;
  std::vector<int64_t> blocks(static_cast<size_t>(out.num_blocks));
  for (int64_t b = 0; b < out.num_blocks; ++b) blocks[size_t(b)] = b;
  std::shuffle(blocks.begin(), blocks.end(), rng);
  for (int s = 0; s < sets; ++s) {
    Tensor pos = Tensor::empty({n}, DType::kInt64), slot = Tensor::empty({n}, DType::kInt64);
    for (int64_t t = 0; t < n; ++t) {
      const int64_t k = int64_t(s) * n + t;  // the k-th token overall fills blocks in order
      pos.ptr<int64_t>()[t] = int64_t(rng() % uint64_t(max_pos));
      slot.ptr<int64_t>()[t] = blocks[size_t(k / block_size)] * block_size + k % block_size;
    }
    out.positions.push_back(pos.to(Device::cuda()));
    out.slots.push_back(slot.to(Device::cuda()));
  }
  return out;
}

namespace {
// `sink` is written only in a case that does not arise (so the loads stay).
__global__ void __launch_bounds__(256) stream_read_kernel(const uint4* src, int64_t n16, unsigned* sink) {
  const int64_t stride = int64_t(gridDim.x) * blockDim.x;
  int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  unsigned acc = 0;
  for (; i + 3 * stride < n16; i += 4 * stride) {
    uint4 v[4];
#pragma unroll
    for (int k = 0; k < 4; ++k) v[k] = __ldcs(src + i + k * stride);
#pragma unroll
    for (int k = 0; k < 4; ++k) acc ^= v[k].x ^ v[k].y ^ v[k].z ^ v[k].w;
  }
  for (; i < n16; i += stride) {
    const uint4 v = __ldcs(src + i);
    acc ^= v.x ^ v.y ^ v.z ^ v.w;
  }
  if (acc == 0x9e3779b9u) *sink = acc;
}
}  // namespace

double time_contiguous_read_us(const void* buf, double bytes, int num_sets, const BenchEnv& env) {
  const Tensor sink = Tensor::empty({1}, DType::kInt32, Device::cuda());
  const int64_t n16 = int64_t(bytes) / 16;
  auto call = [&](int s, CUstream_st* st) {
    stream_read_kernel<<<detail::multiprocessor_count() * 8, 256, 0, st>>>(
        static_cast<const uint4*>(buf) + s * n16, n16, reinterpret_cast<unsigned*>(sink.data()));
    M3RT_LAUNCH_CHECK(st, "stream_read_kernel");
  };
  return time_us(call, num_sets, true, env);
}

BenchRow floor_row(const BenchRow& call, const char* suffix, double us, const char* note, const BenchEnv& env) {
  BenchRow f = call;
  f.variant += suffix;
  f.us = us;
  f.gbps = call.bytes / (us * 1e3);
  f.pct_ceiling = 100.0 * f.gbps / env.copy_gbps;
  f.ratios = {{"floor / call", us / call.us}};
  f.note = note;
  return f;
}

BenchRow pdl_row(const BenchRow& call, double us, const BenchEnv& env) {
  BenchRow q = floor_row(call, " pdl", us, "back-to-back calls with enable_pdl", env);
  q.ratios = {{"vs without pdl", call.us / us}};
  return q;
}

int sets_beyond_l2(double bytes_per_set, int max_sets) {
  int l2 = 0;
  M3RT_CUDA_CHECK(cudaDeviceGetAttribute(&l2, cudaDevAttrL2CacheSize, 0));
  const double want = 3.0 * double(l2);
  return std::clamp(int(want / std::max(bytes_per_set, 1.0)) + 1, 1, max_sets);
}

bool env_set(const char* name) {
  const char* v = std::getenv(name);
  return v && *v;
}

std::vector<int> env_int_list(const char* name, long lo, long hi, const char* what) {
  std::vector<int> out;
  const char* list = std::getenv(name);
  for (const char* at = list ? list : ""; *at;) {
    char* end = nullptr;
    const long v = std::strtol(at, &end, 10);
    if (end == at || v < lo || v > hi || (*end != ',' && *end != '\0'))
      throw Error(std::string(name) + ": '" + list + "' is not a list of " + what + " in " + std::to_string(lo) +
                  ".." + std::to_string(hi));
    out.push_back(int(v));
    at = *end == ',' ? end + 1 : end;
  }
  return out;
}

namespace {
struct BenchEntry {
  const char* op;
  std::vector<BenchRow> (*fn)(BenchEnv&);
};
// Table order is the order of `m3rt bench`'s rows.
constexpr BenchEntry kBenches[] = {
    {"dspark_context_kv_write", [](BenchEnv& env) { return bench_dspark_context_kv(env); }},
    {"qknorm_rope_kv_insert", [](BenchEnv& env) { return bench_qknorm_rope_kv_insert(env); }},
    {"lightning_indexer", bench_lightning_indexer},
    {"msa_attention", bench_msa_attention},
    {"msa_attention_draft", bench_msa_attention_draft},
    {"dspark_draft", bench_dspark_draft},
};
}  // namespace

std::vector<std::string> bench_op_names() {
  std::vector<std::string> names;
  for (const BenchEntry& e : kBenches) names.emplace_back(e.op);
  return names;
}

std::vector<BenchRow> run_benches(BenchEnv& env, const std::string& filter) {
  detail::require_filter_matches("bench", filter, bench_op_names());
  std::vector<BenchRow> rows;
  for (const BenchEntry& e : kBenches) {
    if (std::string(e.op).find(filter) == std::string::npos) continue;
    auto r = e.fn(env);
    rows.insert(rows.end(), r.begin(), r.end());
  }
  return rows;
}

}  // namespace m3rt::bench
