// A probe of MSA prefill tile shapes (docs/perf.md, msa_attention, session 33): does a tile whose
// rows all belong to one token beat the library's 64-row wgmma tile of 4 tokens x 16 heads, and
// how close is either to the page stream it has to move? Standalone (no m3rt library; the device
// helpers of src/ops/common), built as m3rt_prefill_tile_probe in CUDA builds with sm_90a code;
// run on an H100/H200: build/m3rt_prefill_tile_probe [8192 32768 ...].
//
// Workload: the bench's prefill row (src/ops/msa_attention/bench_msa_attention.cu): one request of
// L tokens, M3 TP1 (Hq 64, Hkv 4, head dim 128, page 128, topk 16), bf16 cache [pages, Hkv, 128,
// 256] (K | V per key row) behind a shuffled block table, every token's list the local block plus
// 15 distinct earlier blocks (all blocks while at most 16), independent per token and KV head.
// FLOPs as the bench counts them: 4 x 128 per (token, query head, visible key of a selected block).
//
// Kernels (grid: row groups of 8 tokens x KV heads, one CTA an SM; a producer warp streams the
// group's page union, in page order, in 64-key chunks through a ring of 6 stages by cp.async with a
// 16-byte XOR swizzle, completing on mbarriers; 8 consumer warps, warp w serving token w):
//  - stream: the consumers only wait and release each chunk: the page stream alone;
//  - stream L2: the same with page ids folded into 16 MiB (L2-resident): the L2 -> SM ceiling of
//    this access pattern;
//  - token tile: warp w computes, for each chunk its token selected, S^T = K Q^T (m16n8k16 MMAs,
//    M = 64 keys, N = 16 heads, K from ldmatrix, Q from shared memory), the online softmax over
//    the keys (a column max across the warp's lanes only: the warp holds all of a chunk's keys),
//    P^T moved into B fragments by movmatrix (no shared-memory round trip) as a bf16 value plus
//    its residue (the op's numerics) and O^T += V^T P^T (V^T by ldmatrix.trans; the value's and
//    the residue's MMAs into the same fragments); every MMA row is the token's. p16: P rounded
//    once (no residue MMAs).
// The token tile is checked against an fp64 evaluation on sampled (token, KV head) pairs: bf16
// outputs within 3 bf16 ulps relative or 8e-4 absolute (the op's GPU tolerance).
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <map>
#include <numeric>
#include <random>
#include <set>
#include <vector>

#include "ops/common/mma.cuh"
#include "ops/common/sm90.cuh"

#include "standalone_check.h"

namespace {

constexpr int kHq = 64, kHkv = 4, kG = kHq / kHkv, kDim = 128, kPage = 128, kTopk = 16;
constexpr int kGroupTokens = 8, kChunkKeys = 64, kStages = 6;
constexpr int kRowBytes = 512;                       // a cache key row: K (256 bytes) | V (256)
constexpr int kChunkBytes = kChunkKeys * kRowBytes;  // 32 KiB
constexpr int kQBytes = kGroupTokens * kG * kDim * 2;
constexpr int kSmem = 1024 + kStages * kChunkBytes + kQBytes;
constexpr int kThreads = (kGroupTokens + 1) * 32;  // 8 consumer warps + the producer
constexpr float kLog2e = 1.4426950408889634f;

enum class Mode { kStream, kTile, kTileP16 };

struct Args {
  const uint16_t* cache;  // [pages, Hkv, 128, 256] bf16
  const uint16_t* q;      // [T, Hq, 128]
  uint16_t* out;          // [T, Hq, 128]
  const int* offsets;     // [Hkv * groups + 1]: item kv_head * groups + group
  const int2* entries;    // {physical page, logical page | token mask << 16}
  int groups, tokens, fold;
  float scale_log2;
  unsigned* sink;
};

#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
using namespace m3rt::kernels;

// Byte offset of 16-byte piece `piece` (0-31: K 0-15, V 16-31) of key row `row` in a stage.
__device__ __forceinline__ uint32_t swz(int row, int piece) {
  return uint32_t(row * kRowBytes + ((piece ^ (row & 7)) << 4));
}
// A bf16 pair and the pair of its residues (x - bf16(x), rounded to bf16).
__device__ __forceinline__ void bf2_split(float a, float b, uint32_t& hi, uint32_t& lo) {
  const __nv_bfloat162 h = __floats2bfloat162_rn(a, b);
  hi = *reinterpret_cast<const uint32_t*>(&h);
  lo = bf16x2_bits(a - __low2float(h), b - __high2float(h));
}
#endif

template <Mode kMode>
__global__ void __launch_bounds__(kThreads, 1) probe_kernel(const __grid_constant__ Args a) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  extern __shared__ __align__(128) char smem_raw[];
  uint64_t* full = reinterpret_cast<uint64_t*>(smem_raw);  // barriers first, then (1024-aligned) the ring
  uint64_t* empty = full + kStages;
  char* ring = smem_raw + 1024 + ((1024u - (smem_u32(smem_raw + 1024) & 1023u)) & 1023u);
  char* q_s = ring + kStages * kChunkBytes;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int kv_head = blockIdx.y, group = blockIdx.x;
  const int item = kv_head * a.groups + group;
  const int begin = a.offsets[item], chunks = 2 * (a.offsets[item + 1] - begin);
  const int tok0 = group * kGroupTokens;
  if (threadIdx.x == 0) {
    for (int s = 0; s < kStages; ++s) mbar_init(&full[s], 32), mbar_init(&empty[s], kGroupTokens);
    fence_mbarrier_init();
  }
  if constexpr (kMode != Mode::kStream) {  // the group's queries: [token][head][128] swizzled like the rows
    for (int i = threadIdx.x; i < kGroupTokens * kG * 16; i += kThreads) {
      const int row = i / 16, piece = i % 16, t = tok0 + row / kG;
      const uint16_t* src = a.q + (int64_t(t) * kHq + kv_head * kG + row % kG) * kDim + piece * 8;
      cp_async_16z(q_s + row * 256 + ((piece ^ (row & 7)) << 4), src, t < a.tokens ? 16 : 0);
    }
    asm volatile("cp.async.commit_group;\ncp.async.wait_group 0;\n" ::: "memory");
  }
  __syncthreads();

  if (warp == kGroupTokens) {  // the producer: lane l copies piece l of every key row of a chunk
    for (int c = 0; c < chunks; ++c) {
      const int s = c % kStages;
      if (c >= kStages) mbar_wait(&empty[s], uint32_t(c / kStages - 1) & 1u);
      int page = a.entries[begin + c / 2].x;
      if (a.fold > 0) page %= a.fold;
      const char* src = reinterpret_cast<const char*>(a.cache) +
                        ((int64_t(page) * kHkv + kv_head) * kPage + (c & 1) * kChunkKeys) * kRowBytes + lane * 16;
      char* dst = ring + s * kChunkBytes;
#pragma unroll 8
      for (int r = 0; r < kChunkKeys; ++r) cp_async_16z(dst + swz(r, lane), src + r * kRowBytes, 16);
      asm volatile("cp.async.mbarrier.arrive.noinc.shared::cta.b64 [%0];\n" ::"r"(smem_u32(&full[s])) : "memory");
    }
    asm volatile("cp.async.wait_all;\n" ::: "memory");
    return;
  }

  const int t = tok0 + warp;
  const int pos = t;  // one request: token t sits at position t
  unsigned acc = 0;
  // Token state: O^T fragments [dim tile 8][head tile 2][4] (P's value and residue MMAs accumulate
  // into the same fragments), running max (log2 units) and partial sums for the thread's 4 heads
  // (head tile nt, column e).
  float o[8][2][4];
  float m[2][2], l[2][2];
#pragma unroll
  for (int i = 0; i < 8; ++i)
#pragma unroll
    for (int j = 0; j < 2; ++j) o[i][j][0] = o[i][j][1] = o[i][j][2] = o[i][j][3] = 0.f;
  m[0][0] = m[0][1] = m[1][0] = m[1][1] = -INFINITY;
  l[0][0] = l[0][1] = l[1][0] = l[1][1] = 0.f;
  const uint32_t q_base = smem_u32(q_s) + warp * kG * 256;

  for (int c = 0; c < chunks; ++c) {
    const int s = c % kStages;
    mbar_wait(&full[s], uint32_t(c / kStages) & 1u);
    const int2 e = a.entries[begin + c / 2];
    const int key0 = (e.y & 0xffff) * kPage + (c & 1) * kChunkKeys;
    const bool mine = t < a.tokens && ((e.y >> 16) >> warp & 1) && key0 <= pos;
    const uint32_t st = smem_u32(ring + s * kChunkBytes);
    if constexpr (kMode == Mode::kStream) {
      acc += *reinterpret_cast<const unsigned*>(ring + s * kChunkBytes + lane * 16);
    } else if (mine) {
      // S^T = K Q^T: [4 key tiles][2 head tiles][4]
      float sc[4][2][4];
#pragma unroll
      for (int i = 0; i < 4; ++i)
#pragma unroll
        for (int j = 0; j < 2; ++j) sc[i][j][0] = sc[i][j][1] = sc[i][j][2] = sc[i][j][3] = 0.f;
#pragma unroll
      for (int ks = 0; ks < 8; ++ks) {
        // Q B fragments: matrices (heads 0-7, dims +0), (heads 0-7, +8), (heads 8-15, +0), (8-15, +8)
        uint32_t qb[2][2];
        {
          const int mi = lane / 8, hr = (mi >> 1) * 8 + lane % 8, piece = ks * 2 + (mi & 1);
          ldsm_x4(q_base + hr * 256 + ((piece ^ (hr & 7)) << 4), qb[0][0], qb[0][1], qb[1][0], qb[1][1]);
        }
#pragma unroll
        for (int mt = 0; mt < 4; ++mt) {
          // K A fragment: (keys +0-7, dims +0), (keys +8-15, +0), (keys +0-7, +8), (keys +8-15, +8)
          const int mi = lane / 8, row = mt * 16 + (mi & 1) * 8 + lane % 8, piece = ks * 2 + (mi >> 1);
          uint32_t a0, a1, a2, a3;
          ldsm_x4(st + swz(row, piece), a0, a1, a2, a3);
          mma_16816<false>(sc[mt][0], a0, a1, a2, a3, qb[0][0], qb[0][1]);
          mma_16816<false>(sc[mt][1], a0, a1, a2, a3, qb[1][0], qb[1][1]);
        }
      }
      // Causal mask on the local page; scale to log2 units; the column (head) max over the chunk.
      const bool partial = key0 + kChunkKeys - 1 > pos;
      float mx[2][2] = {{-INFINITY, -INFINITY}, {-INFINITY, -INFINITY}};
#pragma unroll
      for (int mt = 0; mt < 4; ++mt)
#pragma unroll
        for (int nt = 0; nt < 2; ++nt)
#pragma unroll
          for (int r = 0; r < 4; ++r) {
            const int key = key0 + mt * 16 + lane / 4 + (r >= 2 ? 8 : 0);
            float v = sc[mt][nt][r] * a.scale_log2;
            if (partial && key > pos) v = -INFINITY;
            sc[mt][nt][r] = v;
            mx[nt][r & 1] = fmaxf(mx[nt][r & 1], v);
          }
      float alpha[2][2];
#pragma unroll
      for (int nt = 0; nt < 2; ++nt)
#pragma unroll
        for (int e2 = 0; e2 < 2; ++e2) {
          const float v = reduce_accumulator_column(mx[nt][e2], [](float x, float y) { return fmaxf(x, y); });
          const float mn = fmaxf(m[nt][e2], v);  // finite: the chunk has a visible key (key0 <= pos)
          alpha[nt][e2] = exp2f(m[nt][e2] - mn);
          m[nt][e2] = mn;
          l[nt][e2] *= alpha[nt][e2];
        }
#pragma unroll
      for (int i = 0; i < 8; ++i)
#pragma unroll
        for (int j = 0; j < 2; ++j) {
          o[i][j][0] *= alpha[j][0], o[i][j][1] *= alpha[j][1];
          o[i][j][2] *= alpha[j][0], o[i][j][3] *= alpha[j][1];
        }
      // O^T += V^T P^T, 16 keys a step; P^T's B fragments by movmatrix from the S^T accumulators.
#pragma unroll
      for (int ks = 0; ks < 4; ++ks) {
        uint32_t pb[4][2];  // [n tile: value heads 0-7, 8-15, residue 0-7, 8-15][keys +0-7, +8-15]
#pragma unroll
        for (int nt = 0; nt < 2; ++nt) {
          float p[4];
#pragma unroll
          for (int r = 0; r < 4; ++r) {
            p[r] = exp2f(sc[ks][nt][r] - m[nt][r & 1]);
            l[nt][r & 1] += p[r];
          }
          if constexpr (kMode == Mode::kTileP16) {
            pb[nt][0] = movmatrix_trans(bf16x2_bits(p[0], p[1]));
            pb[nt][1] = movmatrix_trans(bf16x2_bits(p[2], p[3]));
          } else {
            uint32_t h0, l0, h1, l1;
            bf2_split(p[0], p[1], h0, l0);
            bf2_split(p[2], p[3], h1, l1);
            pb[nt][0] = movmatrix_trans(h0), pb[nt][1] = movmatrix_trans(h1);
            pb[nt + 2][0] = movmatrix_trans(l0), pb[nt + 2][1] = movmatrix_trans(l1);
          }
        }
#pragma unroll
        for (int mt = 0; mt < 8; ++mt) {
          // V^T A fragment (trans): (keys +0-7, dims +0), (keys +0-7, dims +8), (keys +8-15, +0), (+8-15, +8)
          const int mi = lane / 8, row = ks * 16 + (mi >> 1) * 8 + lane % 8, piece = 16 + mt * 2 + (mi & 1);
          uint32_t a0, a1, a2, a3;
          ldsm_x4_trans(st + swz(row, piece), a0, a1, a2, a3);
          mma_16816<false>(o[mt][0], a0, a1, a2, a3, pb[0][0], pb[0][1]);
          mma_16816<false>(o[mt][1], a0, a1, a2, a3, pb[1][0], pb[1][1]);
          if constexpr (kMode != Mode::kTileP16) {
            mma_16816<false>(o[mt][0], a0, a1, a2, a3, pb[2][0], pb[2][1]);
            mma_16816<false>(o[mt][1], a0, a1, a2, a3, pb[3][0], pb[3][1]);
          }
        }
      }
    }
    __syncwarp();
    if (lane == 0) mbar_arrive(&empty[s]);
  }
  if constexpr (kMode == Mode::kStream) {
    if (acc == 0x9e3779b9u) *a.sink = acc;
  } else if (t < a.tokens) {
    // l over the warp's rows; O = (O^T)^T / l, written as bf16 through movmatrix:
    // thread (row lane/4, columns 2 (lane % 4) + {0, 1}) of an 8x8 block of O^T becomes the same
    // place in O's block: head 8 nt + lane / 4, dims 16 mt + 8 half + 2 (lane % 4) + {0, 1}.
    float inv[2][2];
#pragma unroll
    for (int nt = 0; nt < 2; ++nt)
#pragma unroll
      for (int e2 = 0; e2 < 2; ++e2) {
        const float v = reduce_accumulator_column(l[nt][e2], [](float x, float y) { return x + y; });
        inv[nt][e2] = v > 0.f ? 1.f / v : 0.f;
      }
    uint16_t* out = a.out + (int64_t(t) * kHq + kv_head * kG) * kDim;
#pragma unroll
    for (int mt = 0; mt < 8; ++mt)
#pragma unroll
      for (int nt = 0; nt < 2; ++nt)
#pragma unroll
        for (int half = 0; half < 2; ++half) {
          const float x0 = o[mt][nt][2 * half] * inv[nt][0], x1 = o[mt][nt][2 * half + 1] * inv[nt][1];
          const uint32_t y = movmatrix_trans(bf16x2_bits(x0, x1));
          const int head = nt * 8 + lane / 4, dim = mt * 16 + half * 8 + 2 * (lane % 4);
          *reinterpret_cast<uint32_t*>(out + head * kDim + dim) = y;
        }
  }
#endif
}

uint16_t to_bf16(float x) {  // round to nearest even (finite inputs)
  uint32_t u;
  std::memcpy(&u, &x, 4);
  u += 0x7fffu + ((u >> 16) & 1u);
  return uint16_t(u >> 16);
}
float from_bf16(uint16_t h) {
  const uint32_t u = uint32_t(h) << 16;
  float x;
  std::memcpy(&x, &u, 4);
  return x;
}

struct Problem {
  int L = 0, pages = 0, groups = 0;
  std::vector<uint16_t> cache, q;
  std::vector<int32_t> table;                      // logical -> physical page
  std::vector<std::vector<int32_t>> lists;         // [t * Hkv + h]: logical ids
  std::vector<int> offsets;
  std::vector<int2> entries;
  double flops = 0, union_pages = 0;
};

Problem make_problem(int L, std::mt19937_64& rng) {
  Problem p;
  p.L = L;
  p.pages = L / kPage;
  p.groups = (L + kGroupTokens - 1) / kGroupTokens;
  p.cache.resize(size_t(p.pages) * kHkv * kPage * 256);
  p.q.resize(size_t(L) * kHq * kDim);
  std::uniform_real_distribution<float> u(-1.f, 1.f);
  for (auto& x : p.cache) x = to_bf16(u(rng));
  for (auto& x : p.q) x = to_bf16(u(rng));
  p.table.resize(size_t(p.pages));
  std::iota(p.table.begin(), p.table.end(), 0);
  std::shuffle(p.table.begin(), p.table.end(), rng);
  p.lists.resize(size_t(L) * kHkv);
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
      p.lists[size_t(t) * kHkv + h].assign(pick.begin(), pick.end());
      for (int32_t id : pick) p.flops += double(std::min(kPage, t + 1 - id * kPage)) * kDim * 4 * kG;
    }
  std::map<int32_t, int> mask;  // a group's union: id -> the mask of its tokens that selected it
  for (int h = 0; h < kHkv; ++h)
    for (int g = 0; g < p.groups; ++g) {
      mask.clear();
      for (int w = 0; w < kGroupTokens && g * kGroupTokens + w < L; ++w)
        for (int32_t id : p.lists[size_t(g * kGroupTokens + w) * kHkv + h]) mask[id] |= 1 << w;
      p.offsets.push_back(int(p.entries.size()));
      for (const auto& [id, tokens] : mask) p.entries.push_back(make_int2(p.table[size_t(id)], id | (tokens << 16)));
    }
  p.offsets.push_back(int(p.entries.size()));
  p.union_pages = double(p.entries.size());
  return p;
}

// fp64 evaluation of one (token, KV head): the 16 heads' outputs.
void reference(const Problem& p, int t, int h, float scale, std::vector<double>& out) {
  out.assign(size_t(kG) * kDim, 0.0);
  const auto& ids = p.lists[size_t(t) * kHkv + h];
  for (int hq = 0; hq < kG; ++hq) {
    const uint16_t* qr = &p.q[(size_t(t) * kHq + h * kG + hq) * kDim];
    std::vector<double> s;
    std::vector<const uint16_t*> rows;
    for (int32_t id : ids)
      for (int k = 0; k < kPage && id * kPage + k <= t; ++k) {
        const uint16_t* row = &p.cache[((size_t(p.table[size_t(id)]) * kHkv + h) * kPage + k) * 256];
        double d = 0;
        for (int i = 0; i < kDim; ++i) d += double(from_bf16(qr[i])) * from_bf16(row[i]);
        s.push_back(d * scale);
        rows.push_back(row);
      }
    const double mx = *std::max_element(s.begin(), s.end());
    double sum = 0;
    for (double& x : s) sum += (x = std::exp(x - mx));
    for (size_t j = 0; j < s.size(); ++j)
      for (int i = 0; i < kDim; ++i) out[size_t(hq) * kDim + i] += s[j] / sum * from_bf16(rows[j][kDim + i]);
  }
}

template <Mode kMode>
float time_ms(const Args& a, dim3 grid) {
  auto fn = probe_kernel<kMode>;
  CK(cudaFuncSetAttribute(fn, cudaFuncAttributeMaxDynamicSharedMemorySize, kSmem + 1024));
  cudaEvent_t e0, e1;
  CK(cudaEventCreate(&e0));
  CK(cudaEventCreate(&e1));
  for (int i = 0; i < 2; ++i) fn<<<grid, kThreads, kSmem + 1024>>>(a);
  CK(cudaGetLastError());
  std::vector<float> ms;
  for (int rep = 0; rep < 5; ++rep) {
    CK(cudaEventRecord(e0));
    fn<<<grid, kThreads, kSmem + 1024>>>(a);
    CK(cudaEventRecord(e1));
    CK(cudaEventSynchronize(e1));
    float x = 0;
    CK(cudaEventElapsedTime(&x, e0, e1));
    ms.push_back(x);
  }
  CK(cudaGetLastError());
  CK(cudaEventDestroy(e0));
  CK(cudaEventDestroy(e1));
  std::sort(ms.begin(), ms.end());
  return ms[ms.size() / 2];
}

}  // namespace

int main(int argc, char** argv) {
  int dev = 0;
  cudaDeviceProp prop{};
  if (cudaGetDevice(&dev) != cudaSuccess || cudaGetDeviceProperties(&prop, dev) != cudaSuccess) {
    std::printf("m3rt_prefill_tile_probe: no CUDA device\n");
    return 1;
  }
  if (!m3rt::kernels::kBuiltForSm90a || prop.major != 9) {
    std::printf("m3rt_prefill_tile_probe: skipped: needs a Hopper GPU and a build with sm_90a code; this is %s "
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
  const float scale = 0.08838834764831845f;
  int failures = 0;
  for (int L : contexts) {
    if (L < kPage || L % kPage != 0 || L > 262144) {
      std::printf("context %d: not a multiple of 128 in 128..262144\n", L);
      return 1;
    }
    const Problem p = make_problem(L, rng);
    uint16_t *cache, *q, *out;
    int* offsets;
    int2* entries;
    unsigned* sink;
    CK(cudaMalloc(&cache, p.cache.size() * 2));
    CK(cudaMalloc(&q, p.q.size() * 2));
    CK(cudaMalloc(&out, p.q.size() * 2));
    CK(cudaMalloc(&offsets, p.offsets.size() * sizeof(int)));
    CK(cudaMalloc(&entries, p.entries.size() * sizeof(int2)));
    CK(cudaMalloc(&sink, 4));
    CK(cudaMemcpy(cache, p.cache.data(), p.cache.size() * 2, cudaMemcpyHostToDevice));
    CK(cudaMemcpy(q, p.q.data(), p.q.size() * 2, cudaMemcpyHostToDevice));
    CK(cudaMemcpy(offsets, p.offsets.data(), p.offsets.size() * sizeof(int), cudaMemcpyHostToDevice));
    CK(cudaMemcpy(entries, p.entries.data(), p.entries.size() * sizeof(int2), cudaMemcpyHostToDevice));
    Args a{cache, q, out, offsets, entries, p.groups, L, 0, scale * kLog2e, sink};
    const dim3 grid(unsigned(p.groups), kHkv);
    const double moved = p.union_pages * kPage * kRowBytes;
    auto row = [&](const char* name, float ms, const char* note) {
      std::printf("%-8d %-12s %10.3f %9.1f %12.0f  %s\n", L, name, ms, p.flops / (ms * 1e9), moved / (ms * 1e6), note);
    };
    char note[160];
    std::snprintf(note, sizeof note, "%.2f GB of union pages (%.2f tokens a page), %.3f TFLOP", moved / 1e9,
                  double(L) * kHkv * kTopk / std::max(p.union_pages, 1.0), p.flops / 1e12);
    row("stream", time_ms<Mode::kStream>(a, grid), note);
    a.fold = int((16 << 20) / (kHkv * kPage * kRowBytes));
    row("stream L2", time_ms<Mode::kStream>(a, grid), "page ids folded into 16 MiB: the L2 -> SM ceiling");
    a.fold = 0;
    for (Mode mode : {Mode::kTile, Mode::kTileP16}) {
      CK(cudaMemset(out, 0xff, p.q.size() * 2));  // NaN poison
      const float ms = mode == Mode::kTile ? time_ms<Mode::kTile>(a, grid) : time_ms<Mode::kTileP16>(a, grid);
      std::vector<uint16_t> got(p.q.size());
      CK(cudaMemcpy(got.data(), out, got.size() * 2, cudaMemcpyDeviceToHost));
      // Sampled pairs: the first tokens, the last, and random ones between.
      std::vector<int> toks = {0, 1, 7, 127, 128, 2047, 2048, L - 1};
      for (int i = 0; i < 24; ++i) toks.push_back(int(rng() % uint64_t(L)));
      double worst = 0;  // in units of the tolerance
      int bad = 0;
      std::vector<double> ref;
      for (int t : toks) {
        if (t < 0 || t >= L) continue;
        for (int h = 0; h < kHkv; ++h) {
          reference(p, t, h, scale, ref);
          for (int i = 0; i < kG * kDim; ++i) {
            const double g = from_bf16(got[(size_t(t) * kHq + h * kG) * kDim + size_t(i)]), r = ref[size_t(i)];
            const double tol = std::max(3.0 * std::fabs(r) / 256.0, 8e-4);
            const double err = std::isfinite(g) ? std::fabs(g - r) / tol : 1e30;
            worst = std::max(worst, err);
            bad += err > 1.0;
          }
        }
      }
      // The op's tolerance binds the default numerics; P rounded once is reported, not judged.
      const bool p16 = mode == Mode::kTileP16;
      std::snprintf(note, sizeof note, "%s; check %zu tokens x 4 KV heads: worst %.3f of tolerance, %d over%s",
                    p16 ? "P rounded once" : "P value + residue", toks.size(), worst, bad,
                    p16 ? " (not judged)" : bad == 0 ? ": PASS" : ": FAIL");
      failures += !p16 && bad != 0;
      row(p16 ? "token p16" : "token tile", ms, note);
    }
    CK(cudaFree(cache));
    CK(cudaFree(q));
    CK(cudaFree(out));
    CK(cudaFree(offsets));
    CK(cudaFree(entries));
    CK(cudaFree(sink));
  }
  return failures ? 1 : 0;
}
