// A probe of MSA prefill's page stream (docs/perf.md, msa_attention, sessions 33 and 35): how fast
// can a row group's page union move through a CTA at all, with no math? It is the ceiling every
// prefill tile that streams each group's union pages works under (the library's tiles are timed by
// `m3rt bench`). Standalone (no m3rt library; the device helpers of src/ops/common), built as
// m3rt_prefill_stream_probe in CUDA builds with sm_90a code; run on an H100/H200:
// build/m3rt_prefill_stream_probe [8192 32768 ...].
//
// Workload: the bench's prefill row (src/ops/msa_attention/bench_msa_attention.cu): one request of
// L tokens, M3 TP1 (Hq 64, Hkv 4, head dim 128, page 128, topk 16), bf16 cache [pages, Hkv, 128,
// 256] (K | V per key row) behind a shuffled block table, every token's list the local block plus
// 15 distinct earlier blocks (all blocks while at most 16), independent per token and KV head.
// FLOPs as the bench counts them: 4 x 128 per (token, query head, visible key of a selected block),
// so a row reads as the TFLOP/s a tile would reach if it ran at the stream's speed.
//
// Kernel (grid: row groups of 8 tokens x KV heads, one CTA an SM): a producer warp streams the
// group's page union, in page order, in 64-key chunks through a ring of 6 stages by cp.async with a
// 16-byte XOR swizzle, completing on mbarriers; 8 consumer warps (one a token, as the library's
// token tile) only wait for each chunk and release it. Rows: "stream" (the pages from HBM and L2 as
// they fall) and "stream L2" (page ids folded into 16 MiB: the L2 -> SM ceiling of the pattern).
// (Sessions 33-35 also ran a per-token tile here; it became the library's token tile,
// msa_token_tile_kernel.cuh, and was dropped from the probe in session 38.)
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <numeric>
#include <random>
#include <set>
#include <vector>

#include "ops/common/mma.cuh"
#include "ops/common/sm90.cuh"

#include "standalone_check.h"

namespace {

constexpr int kHkv = 4, kG = 16, kDim = 128, kPage = 128, kTopk = 16;
constexpr int kGroupTokens = 8, kChunkKeys = 64, kStages = 6;
constexpr int kRowBytes = 512;                       // a cache key row: K (256 bytes) | V (256)
constexpr int kChunkBytes = kChunkKeys * kRowBytes;  // 32 KiB
constexpr int kSmem = 1024 + kStages * kChunkBytes;
constexpr int kThreads = (kGroupTokens + 1) * 32;  // 8 consumer warps + the producer

struct Args {
  const uint16_t* cache;  // [pages, Hkv, 128, 256] bf16
  const int* offsets;     // [Hkv * groups + 1]: item kv_head * groups + group
  const int* entries;     // the union's physical pages
  int groups, fold;
  unsigned* sink;
};

__global__ void __launch_bounds__(kThreads, 1) stream_kernel(const __grid_constant__ Args a) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  using namespace m3rt::kernels;
  extern __shared__ __align__(128) char smem_raw[];
  uint64_t* full = reinterpret_cast<uint64_t*>(smem_raw);  // barriers first, then (1024-aligned) the ring
  uint64_t* empty = full + kStages;
  char* ring = smem_raw + 1024 + ((1024u - (smem_u32(smem_raw + 1024) & 1023u)) & 1023u);
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int kv_head = blockIdx.y, item = kv_head * a.groups + blockIdx.x;
  const int begin = a.offsets[item], chunks = 2 * (a.offsets[item + 1] - begin);
  if (threadIdx.x == 0) {
    for (int s = 0; s < kStages; ++s) mbar_init(&full[s], 32), mbar_init(&empty[s], kGroupTokens);
    fence_mbarrier_init();
  }
  __syncthreads();
  if (warp == kGroupTokens) {  // the producer: lane l copies piece l of every key row of a chunk
    for (int c = 0; c < chunks; ++c) {
      const int s = c % kStages;
      if (c >= kStages) mbar_wait(&empty[s], uint32_t(c / kStages - 1) & 1u);
      int page = a.entries[begin + c / 2];
      if (a.fold > 0) page %= a.fold;
      const char* src = reinterpret_cast<const char*>(a.cache) +
                        ((int64_t(page) * kHkv + kv_head) * kPage + (c & 1) * kChunkKeys) * kRowBytes + lane * 16;
      char* dst = ring + s * kChunkBytes;
#pragma unroll 8
      for (int r = 0; r < kChunkKeys; ++r)  // 16-byte piece q of key row r at q ^ (r % 8)
        cp_async_16z(dst + r * kRowBytes + ((lane ^ (r & 7)) << 4), src + r * kRowBytes, 16);
      asm volatile("cp.async.mbarrier.arrive.noinc.shared::cta.b64 [%0];\n" ::"r"(smem_u32(&full[s])) : "memory");
    }
    asm volatile("cp.async.wait_all;\n" ::: "memory");
    return;
  }
  unsigned acc = 0;  // one word of every chunk read, so that the wait is for landed bytes
  for (int c = 0; c < chunks; ++c) {
    const int s = c % kStages;
    mbar_wait(&full[s], uint32_t(c / kStages) & 1u);
    acc += *reinterpret_cast<const unsigned*>(ring + s * kChunkBytes + lane * 16);
    __syncwarp();
    if (lane == 0) mbar_arrive(&empty[s]);
  }
  if (acc == 0x9e3779b9u) *a.sink = acc;
#endif
}

struct Problem {
  int pages = 0, groups = 0;
  std::vector<int> offsets, entries;
  double flops = 0, union_pages = 0;
};

Problem make_problem(int L, std::mt19937_64& rng) {
  Problem p;
  p.pages = L / kPage;
  p.groups = (L + kGroupTokens - 1) / kGroupTokens;
  std::vector<int32_t> table(size_t(p.pages));  // logical -> physical page
  std::iota(table.begin(), table.end(), 0);
  std::shuffle(table.begin(), table.end(), rng);
  std::vector<std::vector<int32_t>> lists(size_t(L) * kHkv);  // [t * Hkv + h]: logical ids
  for (int t = 0; t < L; ++t)
    for (int h = 0; h < kHkv; ++h) {
      const int nb = t / kPage + 1;
      std::set<int32_t> pick;
      if (nb <= kTopk) {
        for (int j = 0; j < nb; ++j) pick.insert(j);
      } else {
        pick.insert(nb - 1);
        while (int(pick.size()) < kTopk) pick.insert(int32_t(rng() % uint64_t(nb - 1)));
      }
      lists[size_t(t) * kHkv + h].assign(pick.begin(), pick.end());
      for (int32_t id : pick) p.flops += double(std::min(kPage, t + 1 - id * kPage)) * kDim * 4 * kG;
    }
  std::set<int32_t> uni;  // a group's union, in page order
  for (int h = 0; h < kHkv; ++h)
    for (int g = 0; g < p.groups; ++g) {
      uni.clear();
      for (int w = 0; w < kGroupTokens && g * kGroupTokens + w < L; ++w)
        for (int32_t id : lists[size_t(g * kGroupTokens + w) * kHkv + h]) uni.insert(id);
      p.offsets.push_back(int(p.entries.size()));
      for (int32_t id : uni) p.entries.push_back(table[size_t(id)]);
    }
  p.offsets.push_back(int(p.entries.size()));
  p.union_pages = double(p.entries.size());
  return p;
}

float time_ms(const Args& a, dim3 grid) {
  CK(cudaFuncSetAttribute(stream_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, kSmem + 1024));
  return median_ms([&] { stream_kernel<<<grid, kThreads, kSmem + 1024>>>(a); }, 2);
}

}  // namespace

int main(int argc, char** argv) {
  const cudaDeviceProp prop = current_device();
  if (!m3rt::kernels::kBuiltForSm90a || prop.major != 9) {
    std::printf("m3rt_prefill_stream_probe: skipped: needs a Hopper GPU and a build with sm_90a code; this is %s "
                "(sm_%d%d)%s\n",
                prop.name, prop.major, prop.minor, m3rt::kernels::kBuiltForSm90a ? "" : ", a build without sm_90a");
    return 0;  // nothing to measure here, not a failure (scripts/gpu-check.sh runs it on any GPU)
  }
  std::vector<int> contexts;
  for (int i = 1; i < argc; ++i) contexts.push_back(std::atoi(argv[i]));
  if (contexts.empty()) contexts = {8192, 32768};
  std::printf("%s, %d SMs; Hq 64, Hkv 4, topk 16, bf16 cache, independent lists, row groups of 8 tokens\n", prop.name,
              prop.multiProcessorCount);
  std::printf("%-8s %-12s %10s %9s %12s  %s\n", "context", "kernel", "ms", "TFLOP/s", "stream GB/s", "note");
  std::mt19937_64 rng(33);
  for (int L : contexts) {
    if (L < kPage || L % kPage != 0 || L > 262144) {
      std::printf("context %d: not a multiple of 128 in 128..262144\n", L);
      return 1;
    }
    const Problem p = make_problem(L, rng);
    uint16_t* cache;
    int *offsets, *entries;
    unsigned* sink;
    const size_t cache_bytes = size_t(p.pages) * kHkv * kPage * kRowBytes;
    CK(cudaMalloc(&cache, cache_bytes));
    CK(cudaMemset(cache, 0, cache_bytes));
    CK(cudaMalloc(&offsets, p.offsets.size() * sizeof(int)));
    CK(cudaMalloc(&entries, p.entries.size() * sizeof(int)));
    CK(cudaMalloc(&sink, 4));
    CK(cudaMemcpy(offsets, p.offsets.data(), p.offsets.size() * sizeof(int), cudaMemcpyHostToDevice));
    CK(cudaMemcpy(entries, p.entries.data(), p.entries.size() * sizeof(int), cudaMemcpyHostToDevice));
    Args a{cache, offsets, entries, p.groups, 0, sink};
    const dim3 grid(unsigned(p.groups), kHkv);
    const double moved = p.union_pages * kPage * kRowBytes;
    auto row = [&](const char* name, float ms, const char* note) {
      std::printf("%-8d %-12s %10.3f %9.1f %12.0f  %s\n", L, name, ms, p.flops / (ms * 1e9), moved / (ms * 1e6), note);
    };
    char note[160];
    std::snprintf(note, sizeof note, "%.2f GB of union pages (%.2f tokens a page), %.3f TFLOP", moved / 1e9,
                  double(L) * kHkv * kTopk / std::max(p.union_pages, 1.0), p.flops / 1e12);
    row("stream", time_ms(a, grid), note);
    a.fold = int((16 << 20) / (kHkv * kPage * kRowBytes));
    row("stream L2", time_ms(a, grid), "page ids folded into 16 MiB: the L2 -> SM ceiling");
    CK(cudaFree(cache));
    CK(cudaFree(offsets));
    CK(cudaFree(entries));
    CK(cudaFree(sink));
  }
  return 0;
}
