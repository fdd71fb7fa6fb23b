// Access-pattern ceilings of the two paged-KV write ops on the GPU: copies with each op's exact
// reads and writes and no arithmetic, beside cudaMemcpyAsync (the copy ceiling `m3rt bench`
// reports) and plain contiguous copy kernels, so that an op's "% of the copy ceiling" can be read
// against what its layout allows at all. Standalone (no m3rt library), built as
// m3rt_access_ceiling in CUDA builds; run on the GPU machine: build/m3rt_access_ceiling.
//
//   T=1792 rows: qknorm_rope_kv_insert at the draft shape (nq 64, nkv 4): the qkv row read, q and k
//     written back, k and v into a block-128 cache by slot (shuffled blocks); CUDA-graph timed,
//     inputs rotated over 3 sets.
//   n=8192 / 32768 rows: dspark_context_kv_write at the M3.1 draft shape (5 layers, nkv 4, bf16):
//     all_kv read, every (layer, kv head) K/V row pair into its layer's cache by slot; stream
//     timed (20 back-to-back launches, median of 7), 3 input sets at n=8192.
//   memcpy: a device-to-device cudaMemcpyAsync of the same bytes; E / E2: grid-stride contiguous
//     copies (E2 with 4 loads in flight a thread); B: the writer's own structure (grid (pairs, runs),
//     half-warp per token, 3-stage cp.async) with stores only; C / D: token-major variants (a
//     block per token run, cp.async or direct loads); F / G: bulk copies (cp.async.bulk, sm_90)
//     through shared memory, contiguous / with 256-byte row stores; Q: the QK insert's structure;
//     Q q_out: q to a separate output (the drafter's call);
//     QB: the QK insert's bytes token-major by bulk copies (a whole qkv row in, q and k back as one
//     bulk store); E2 in place: the contiguous copy writing each word back where it was read.
//   once (the argument `once`, for compute-sanitizer): the T and n rows' launches, each once and
//     untimed, no engine probe.
//   engine (first, and alone with the argument `engine`): which engine runs cudaMemcpyAsync (a
//     stream copy and a graph copy node, beside a grid that holds every SM), and a sweep of
//     contiguous SM copies (E2: 1-8 loads in flight a thread, with and without the streaming
//     hints, 1-8 blocks an SM; "E3" in session 57's results file) against the memcpy at the
//     writer's n = 8192 / 32768 copy sizes.
// Results (H200, 2026-12-01) are in docs/perf.md: the writer's pattern tops out at 86-88% of the
// memcpy rate, a contiguous SM copy at 92-93%. (They were measured with the layers' cache pointers
// in an array indexed at run time, which put the kernels' parameters in local memory; the layers
// now share one allocation. Not re-measured there since.) H100 (session 57,
// bench/results/h100-s57-access-ceiling.txt, h100-s57-memcpy-engine.txt): the memcpy runs on a
// copy engine; at n = 8192 it moves 2852 GB/s, the best contiguous SM copy of the sweep 2756
// (91.4% of the bench's ~3015 GB/s ceiling), the writer's patterns 2491-2675 (82.6-88.7%); at
// n = 32768 the memcpy 3000, the best SM copies 2848-2849 (94.4-94.5%), the writer's patterns
// 2734-2806.
#include <cuda_runtime.h>
#include <cstdio>
#include <cstdint>
#include <vector>
#include <algorithm>
#include <random>
#include <string>
#include "standalone_check.h"
constexpr int L = 5, NKV = 4, P = L * NKV, ROW = P * 2 * 128;  // elements per token
__device__ __forceinline__ uint32_t su32(const void* p) { return uint32_t(__cvta_generic_to_shared(p)); }
__device__ __forceinline__ void cpa16(uint32_t s, const void* g) { asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(s), "l"(g)); }
__device__ __forceinline__ void cpa8(uint32_t s, const void* g) { asm volatile("cp.async.ca.shared.global [%0], [%1], 8;\n" ::"r"(s), "l"(g)); }
__device__ __forceinline__ void commit() { asm volatile("cp.async.commit_group;\n" ::); }
template <int N> __device__ __forceinline__ void waitg() { asm volatile("cp.async.wait_group %0;\n" ::"n"(N)); }
__device__ __forceinline__ void st16(void* g, uint4 v) { asm volatile("st.global.v4.b32 [%0], {%1,%2,%3,%4};\n" ::"l"(g), "r"(v.x), "r"(v.y), "r"(v.z), "r"(v.w) : "memory"); }
__device__ __forceinline__ void st16cs(void* g, uint4 v) { asm volatile("st.global.cs.v4.b32 [%0], {%1,%2,%3,%4};\n" ::"l"(g), "r"(v.x), "r"(v.y), "r"(v.z), "r"(v.w) : "memory"); }
struct Args { uint16_t* dst; const uint16_t* kv; uint16_t* cache0; int64_t layer_elems; const int64_t* slots; const int64_t* pos; int n; };
// Layer l's cache (the layers' caches lie in one allocation).
__device__ __forceinline__ uint16_t* layer_cache(const Args& a, int l) { return a.cache0 + l * a.layer_elems; }
__device__ __forceinline__ uint16_t* rowp(uint16_t* c, int64_t slot, int h) { return c + ((slot >> 7) * NKV + h) * 128 * 256 + (slot & 127) * 256; }

// B: the current kernel's pattern: grid (pairs, Y), half-warp per token, 3-stage cp.async.
struct StageB { uint4 rows[16][2][16]; int64_t idx[16][2]; };
template <bool CS>
__global__ void __launch_bounds__(256, 4) kB(Args a) {
  __shared__ StageB st[3];
  const int l = blockIdx.x / NKV, h = blockIdx.x % NKV, j = threadIdx.x % 16, tok = threadIdx.x / 16;
  const int step = gridDim.y * 16;
  int tp = blockIdx.y * 16 + tok;
  auto pref = [&](int s) {
    if (tp < a.n) {
      const uint16_t* src = a.kv + int64_t(tp) * ROW + (l * 2 * NKV + h) * 128 + j * 8;
      cpa16(su32(&st[s].rows[tok][0][j]), src);
      cpa16(su32(&st[s].rows[tok][1][j]), src + NKV * 128);
      if (j == 0) { cpa8(su32(&st[s].idx[tok][0]), a.slots + tp); cpa8(su32(&st[s].idx[tok][1]), a.pos + tp); }
    }
    commit(); tp += step;
  };
  pref(0); pref(1);
  int cur = 0;
  for (int t0 = blockIdx.y * 16; t0 < a.n; t0 += step, cur = (cur + 1) % 3) {
    pref((cur + 2) % 3);
    waitg<2>(); __syncwarp();
    if (t0 + tok < a.n) {
      uint16_t* r = rowp(layer_cache(a, l), st[cur].idx[tok][0], h) + j * 8;
      if (CS) { st16cs(r, st[cur].rows[tok][0][j]); st16cs(r + 128, st[cur].rows[tok][1][j]); }
      else { st16(r, st[cur].rows[tok][0][j]); st16(r + 128, st[cur].rows[tok][1][j]); }
    }
    __syncwarp();
  }
  waitg<0>();
}

// C: token-major: block = P half-warps (320 threads); a run is R consecutive tokens (contiguous
// R*10 KiB), 3 stages by cp.async; half-warp (l,h) writes its rows of the R tokens.
template <int R>
__global__ void __launch_bounds__(320) kC(Args a) {
  extern __shared__ uint4 smem[];  // [3][R][P*2*16] uint4 + idx
  constexpr int kStageU4 = R * P * 2 * 16;
  int64_t* idx = reinterpret_cast<int64_t*>(smem + 3 * kStageU4);  // [3][R][2]
  const int hw = threadIdx.x / 16, j = threadIdx.x % 16, l = hw / NKV, h = hw % NKV;
  const int step = gridDim.x * R;
  int tp = blockIdx.x * R;
  auto pref = [&](int s) {
    // R*P*2*16 uint4 pieces, 320 threads: each copies R*2 of them, contiguous over threads
#pragma unroll
    for (int i = 0; i < R * 2; ++i) {
      const int u = i * 320 + threadIdx.x;  // uint4 index within the run
      const int r = u / (P * 2 * 16);
      if (tp + r < a.n) cpa16(su32(smem + s * kStageU4 + u), a.kv + int64_t(tp) * ROW + int64_t(u) * 8);
    }
    if (threadIdx.x < R * 2) {
      const int r = threadIdx.x / 2;
      if (tp + r < a.n) cpa8(su32(idx + (s * R + r) * 2 + (threadIdx.x & 1)), ((threadIdx.x & 1) ? a.pos : a.slots) + tp + r);
    }
    commit(); tp += step;
  };
  pref(0); pref(1);
  int cur = 0;
  for (int t0 = blockIdx.x * R; t0 < a.n; t0 += step, cur = (cur + 1) % 3) {
    pref((cur + 2) % 3);
    waitg<2>(); __syncthreads();
#pragma unroll
    for (int r = 0; r < R; ++r) {
      if (t0 + r < a.n) {
        const uint4* base = smem + cur * kStageU4 + r * P * 2 * 16 + (l * 2 * NKV + h) * 16 + j;
        uint16_t* row = rowp(layer_cache(a, l), idx[(cur * R + r) * 2], h) + j * 8;
        st16(row, base[0]); st16(row + 128, base[NKV * 16]);
      }
    }
    __syncthreads();
  }
  waitg<0>();
}

// D: token-major, direct loads to registers, U tokens in flight per half-warp.
template <int U>
__global__ void __launch_bounds__(320) kD(Args a) {
  const int hw = threadIdx.x / 16, j = threadIdx.x % 16, l = hw / NKV, h = hw % NKV;
  const int stride = gridDim.x;
  const uint16_t* base = a.kv + (l * 2 * NKV + h) * 128 + j * 8;
  for (int t0 = blockIdx.x; t0 < a.n; t0 += stride * U) {
    uint4 k[U], v[U]; int64_t s[U];
#pragma unroll
    for (int u = 0; u < U; ++u) {
      const int t = t0 + u * stride;
      if (t < a.n) {
        k[u] = __ldcs(reinterpret_cast<const uint4*>(base + int64_t(t) * ROW));
        v[u] = __ldcs(reinterpret_cast<const uint4*>(base + int64_t(t) * ROW + NKV * 128));
        s[u] = __ldg(a.slots + t);
      }
    }
#pragma unroll
    for (int u = 0; u < U; ++u) {
      const int t = t0 + u * stride;
      if (t < a.n) { uint16_t* row = rowp(layer_cache(a, l), s[u], h) + j * 8; st16(row, k[u]); st16(row + 128, v[u]); }
    }
  }
}


// mbarrier / bulk helpers (sm_90: other targets trap; the main program runs them on Hopper only)
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ < 900
#define M3RT_SM90_ONLY(...) __trap()
#else
#define M3RT_SM90_ONLY(...) __VA_ARGS__
#endif
__device__ __forceinline__ void mbar_init(uint64_t* b, int c) { M3RT_SM90_ONLY(asm volatile("mbarrier.init.shared.b64 [%0], %1;\n" ::"r"(su32(b)), "r"(c))); }
__device__ __forceinline__ void mbar_expect(uint64_t* b, uint32_t bytes) { M3RT_SM90_ONLY(asm volatile("mbarrier.arrive.expect_tx.shared.b64 _, [%0], %1;\n" ::"r"(su32(b)), "r"(bytes) : "memory")); }
__device__ __forceinline__ void mbar_wait(uint64_t* b, uint32_t ph) {
  M3RT_SM90_ONLY(asm volatile("{\n .reg .pred p;\n W: mbarrier.try_wait.parity.shared.b64 p, [%0], %1;\n @!p bra W;\n}\n" ::"r"(su32(b)), "r"(ph) : "memory")); }
__device__ __forceinline__ void bulk_g2s(void* s, const void* g, uint32_t bytes, uint64_t* b) {
  M3RT_SM90_ONLY(asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];\n" ::"r"(su32(s)), "l"(g), "r"(bytes), "r"(su32(b)) : "memory")); }
__device__ __forceinline__ void bulk_s2g(void* g, const void* s, uint32_t bytes) {
  M3RT_SM90_ONLY(asm volatile("cp.async.bulk.global.shared::cta.bulk_group [%0], [%1], %2;\n" ::"l"(g), "r"(su32(s)), "r"(bytes) : "memory")); }
__device__ __forceinline__ void bulk_commit() { M3RT_SM90_ONLY(asm volatile("cp.async.bulk.commit_group;\n" ::: "memory")); }
template <int N> __device__ __forceinline__ void bulk_wait_read() { M3RT_SM90_ONLY(asm volatile("cp.async.bulk.wait_group.read %0;\n" ::"n"(N) : "memory")); }

// F: contiguous copy through shared memory by bulk copies: one thread per block; chunks of CH bytes,
// S stages.
template <int CH, int S>
__global__ void kF(const char* src, char* dst, int64_t bytes) {
  extern __shared__ __align__(128) char sm[];
  uint64_t* bar = reinterpret_cast<uint64_t*>(sm + S * CH);
  if (threadIdx.x != 0) return;
  for (int s = 0; s < S; ++s) mbar_init(bar + s, 1);
  M3RT_SM90_ONLY(asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory"));
  const int64_t nch = bytes / CH;
  int64_t c = blockIdx.x;
  const int64_t stride = gridDim.x;
  // prologue
  int issued = 0;
  for (int s = 0; s < S && c + s * stride < nch; ++s) { mbar_expect(bar + s, CH); bulk_g2s(sm + s * CH, src + (c + s * stride) * CH, CH, bar + s); ++issued; }
  int k = 0;
  for (int64_t i = c; i < nch; i += stride, ++k) {
    const int s = k % S; const uint32_t ph = (k / S) & 1;
    mbar_wait(bar + s, ph);
    bulk_s2g(dst + i * CH, sm + s * CH, CH); bulk_commit();
    const int64_t nxt = i + S * stride;
    if (nxt < nch) { bulk_wait_read<0>(); mbar_expect(bar + s, CH); bulk_g2s(sm + s * CH, src + nxt * CH, CH, bar + s); }
  }
  M3RT_SM90_ONLY(asm volatile("cp.async.bulk.wait_group 0;\n" ::: "memory"));
}
// E2: contiguous copy, U loads in flight per thread, with the streaming cache hints
// (ld.global.cs / st.global.cs) or (kHints false, the engine sweep) without.
template <int U, bool kHints = true>
__global__ void kE2(const uint4* src, uint4* dst, int64_t n16) {
  const int64_t stride = int64_t(gridDim.x) * blockDim.x;
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n16; i += stride * U) {
    uint4 v[U];
#pragma unroll
    for (int u = 0; u < U; ++u)
      if (i + u * stride < n16) v[u] = kHints ? __ldcs(src + i + u * stride) : src[i + u * stride];
#pragma unroll
    for (int u = 0; u < U; ++u)
      if (i + u * stride < n16) {
        if (kHints) __stcs(dst + i + u * stride, v[u]);
        else dst[i + u * stride] = v[u];
      }
  }
}
// G: writer pattern, token-major, bulk loads of R tokens (contiguous), 256-byte bulk stores per (token, pair, K/V).
template <int R, int S>
__global__ void __launch_bounds__(64) kG(Args a) {
  extern __shared__ __align__(128) char sm[];
  constexpr int TOK = ROW * 2;  // bytes per token
  uint64_t* bar = reinterpret_cast<uint64_t*>(sm + S * R * TOK);
  int64_t* idx = reinterpret_cast<int64_t*>(bar + 4);  // [S][R] slots
  const int step = gridDim.x * R;
  if (threadIdx.x == 0) { for (int s = 0; s < S; ++s) mbar_init(bar + s, 1); M3RT_SM90_ONLY(asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory")); }
  __syncthreads();
  auto issue = [&](int s, int t) {
    const int cnt = min(R, a.n - t);
    mbar_expect(bar + s, cnt * TOK + cnt * 8);
    bulk_g2s(sm + s * R * TOK, a.kv + int64_t(t) * ROW, cnt * TOK, bar + s);
    bulk_g2s(idx + s * R, a.slots + t, cnt * 8, bar + s);
  };
  if (threadIdx.x == 0) for (int s = 0; s < S; ++s) { const int t = blockIdx.x * R + s * step; if (t < a.n) issue(s, t); }
  int k = 0;
  for (int t0 = blockIdx.x * R; t0 < a.n; t0 += step, ++k) {
    const int s = k % S; const uint32_t ph = (k / S) & 1;
    mbar_wait(bar + s, ph);
    const int cnt = min(R, a.n - t0);
    // stores: items (r, pair, kv) = cnt*P*2, spread over the block's threads
    for (int it = threadIdx.x; it < cnt * P * 2; it += blockDim.x) {
      const int r = it / (P * 2), q = it % (P * 2), pr = q / 2, kv = q % 2, l = pr / NKV, h = pr % NKV;
      uint16_t* row = rowp(layer_cache(a, l), idx[s * R + r], h) + kv * 128;
      bulk_s2g(row, sm + s * R * TOK + r * TOK + ((l * 2 + kv) * NKV + h) * 256, 256);
    }
    bulk_commit();
    bulk_wait_read<0>();
    __syncthreads();
    if (threadIdx.x == 0) { const int t = t0 + S * step; if (t < a.n) issue(s, t); }
  }
  M3RT_SM90_ONLY(asm volatile("cp.async.bulk.wait_group 0;\n" ::: "memory"));
}


// Q: the QK-insert pattern (nq 64, nkv 4): items q(64) k(4) v(4); q,k written back in place, k,v to
// the cache; grid (9 runs of 8 items, token pairs), warp per item, half-warp per token, cp.async 3 stages.
constexpr int QNQ = 64, QROW = (QNQ + 2 * NKV) * 128;
struct QArgs { uint16_t* qkv; uint16_t* cache; const int64_t* slots; const int64_t* pos; int n; uint16_t* qout; };
struct QStage { uint4 rows[2][16]; int64_t idx[2][2]; };
// QOUT: q to a separate [n, 64 x 128] output instead of back into qkv (the drafter's call).
template <bool QOUT>
__global__ void __launch_bounds__(256, 4) kQ(QArgs a) {
  __shared__ QStage st[3][8];
  const int w = threadIdx.x / 32, item = blockIdx.x * 8 + w;
  if (item >= QNQ + 2 * NKV) return;
  const int j = threadIdx.x % 16, half = (threadIdx.x / 16) % 2;
  const int step = gridDim.y * 2;
  int tp = blockIdx.y * 2 + half;
  uint16_t* lane = a.qkv + item * 128 + j * 8;
  auto pref = [&](int s) {
    if (tp < a.n) {
      cpa16(su32(&st[s][w].rows[half][j]), lane + int64_t(tp) * QROW);
      if (j == 0) { cpa8(su32(&st[s][w].idx[half][0]), a.slots + tp); cpa8(su32(&st[s][w].idx[half][1]), a.pos + tp); }
    }
    commit(); tp += step;
  };
  pref(0); pref(1);
  int cur = 0;
  for (int t0 = blockIdx.y * 2; t0 < a.n; t0 += step, cur = (cur + 1) % 3) {
    pref((cur + 2) % 3);
    waitg<2>(); __syncwarp();
    const int t = t0 + half;
    const uint4 v = st[cur][w].rows[half][j];
    const int64_t slot = st[cur][w].idx[half][0];
    __syncwarp();
    if (t < a.n) {
      if (QOUT && item < QNQ) st16(a.qout + int64_t(t) * QNQ * 128 + item * 128 + j * 8, v);
      else if (item < QNQ + NKV) st16(lane + int64_t(t) * QROW, v);
      if (item >= QNQ) {
        const int h = item < QNQ + NKV ? item - QNQ : item - QNQ - NKV;
        st16(rowp(a.cache, slot, h) + (item >= QNQ + NKV ? 128 : 0) + j * 8, v);
      }
    }
  }
  waitg<0>();
}

// QB: the QK-insert pattern token-major through bulk copies: a block takes one token at a time
// (tokens blockIdx.x + k gridDim.x), thread 0 loads its whole qkv row (18 KiB) into one of S stages
// (its slot and position by 8-byte cp.async on the same mbarrier), then writes q and k back in
// place as one 17 KiB bulk store and the 4 k and 4 v rows into the cache as 256-byte bulk stores.
// kThreads > 32: every thread waits for the stage and the block meets at a barrier before the
// stores (the synchronization a kernel doing the math in between would need).
template <int S, int kThreads>
__global__ void __launch_bounds__(kThreads) kQB(QArgs a) {
  extern __shared__ __align__(128) char sm[];
  constexpr int RB = QROW * 2;  // bytes of a qkv row
  uint64_t* bar = reinterpret_cast<uint64_t*>(sm + S * RB);
  int64_t* idx = reinterpret_cast<int64_t*>(bar + S);  // [S][2]: slot, position
  if (threadIdx.x == 0) {
    for (int s = 0; s < S; ++s) mbar_init(bar + s, 2);
    M3RT_SM90_ONLY(asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory"));
  }
  __syncthreads();
  auto issue = [&](int s, int t) {
    mbar_expect(bar + s, RB);
    bulk_g2s(sm + s * RB, a.qkv + int64_t(t) * QROW, RB, bar + s);
    cpa8(su32(idx + 2 * s), a.slots + t);
    cpa8(su32(idx + 2 * s + 1), a.pos + t);
    M3RT_SM90_ONLY(asm volatile("cp.async.mbarrier.arrive.noinc.shared.b64 [%0];\n" ::"r"(su32(bar + s)) : "memory"));
  };
  const int step = gridDim.x;
  if (threadIdx.x == 0)
    for (int s = 0; s < S; ++s) { const int t = blockIdx.x + s * step; if (t < a.n) issue(s, t); }
  int k = 0;
  for (int t = blockIdx.x; t < a.n; t += step, ++k) {
    const int s = k % S;
    if (kThreads > 32 || threadIdx.x == 0) mbar_wait(bar + s, (k / S) & 1);
    if (kThreads > 32) __syncthreads();
    if (threadIdx.x == 0) {
      const char* st = sm + s * RB;
      bulk_s2g(a.qkv + int64_t(t) * QROW, st, (QNQ + NKV) * 256);
      const int64_t slot = idx[2 * s];
      for (int h = 0; h < NKV; ++h) {
        uint16_t* row = rowp(a.cache, slot, h);
        bulk_s2g(row, st + (QNQ + h) * 256, 256);
        bulk_s2g(row + 128, st + (QNQ + NKV + h) * 256, 256);
      }
      bulk_commit();
      // The previous token's stores have read their stage: refill it.
      if (k >= 1) {
        bulk_wait_read<1>();
        const int ps = (k - 1) % S, nt = t - step + S * step;
        if (nt < a.n) issue(ps, nt);
      }
    }
  }
  if (threadIdx.x == 0) M3RT_SM90_ONLY(asm volatile("cp.async.bulk.wait_group 0;\n" ::: "memory"));
}

// E: plain contiguous copy of the same bytes.
__global__ void kE(const uint4* src, uint4* dst, int64_t n16) {
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n16; i += int64_t(gridDim.x) * blockDim.x) dst[i] = __ldcs(src + i);
}

// Which engine runs a device-to-device cudaMemcpyAsync (the copy ceiling's copy): a grid that holds
// every SM (a block an SM with all of an SM's shared memory, so nothing else fits) spins for
// ~spin_us on one stream while the copy is issued on another. A copy run by the SMs cannot start
// before the spin ends (it ends at ~spin + alone); one run by a copy engine runs beside it (it
// ends at ~alone). The contiguous SM copy kernel E is the control. Stream copy and graph copy node.
__global__ void kSpin(long long cycles, int* sink) {
  extern __shared__ char s[];
  const long long t0 = clock64();
  while (clock64() - t0 < cycles) {
  }
  if (cycles < 0 && threadIdx.x == 0) *sink = s[0];  // never taken
}
void memcpy_engine_probe(int sms) {
  const size_t bytes = size_t(256) << 20;
  const double spin_us = 2000;
  int khz = 0, smem = 0;
  CK(cudaDeviceGetAttribute(&khz, cudaDevAttrClockRate, 0));
  CK(cudaDeviceGetAttribute(&smem, cudaDevAttrMaxSharedMemoryPerBlockOptin, 0));
  CK(cudaFuncSetAttribute(kSpin, cudaFuncAttributeMaxDynamicSharedMemorySize, smem));
  char *src, *dst; int* sink;
  CK(cudaMalloc(&src, bytes)); CK(cudaMalloc(&dst, bytes)); CK(cudaMalloc(&sink, 4));
  CK(cudaMemset(src, 1, bytes));
  cudaStream_t a, b; CK(cudaStreamCreateWithFlags(&a, cudaStreamNonBlocking)); CK(cudaStreamCreateWithFlags(&b, cudaStreamNonBlocking));
  cudaEvent_t e0, e1, e2;
  CK(cudaEventCreate(&e0)); CK(cudaEventCreate(&e1)); CK(cudaEventCreate(&e2));
  cudaGraph_t g; cudaGraphExec_t ge;
  CK(cudaStreamBeginCapture(b, cudaStreamCaptureModeGlobal));
  CK(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDeviceToDevice, b));
  CK(cudaStreamEndCapture(b, &g)); CK(cudaGraphInstantiate(&ge, g, 0));
  const char* names[3] = {"memcpy (stream)", "memcpy (graph node)", "SM copy kernel E (control)"};
  auto copy = [&](int k) {
    if (k == 0) CK(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDeviceToDevice, b));
    else if (k == 1) CK(cudaGraphLaunch(ge, b));
    else kE<<<sms * 8, 256, 0, b>>>(reinterpret_cast<const uint4*>(src), reinterpret_cast<uint4*>(dst), int64_t(bytes / 16));
  };
  const long long cycles = (long long)(spin_us * khz / 1000.0);
  for (int k = 0; k < 3; ++k) {
    for (int w = 0; w < 2; ++w) copy(k);
    CK(cudaStreamSynchronize(b));
    float alone = 0, end = 0, spin = 0;
    for (int rep = 0; rep < 3; ++rep) {  // the last round's numbers
      CK(cudaEventRecord(e0, b)); copy(k); CK(cudaEventRecord(e1, b)); CK(cudaEventSynchronize(e1));
      CK(cudaEventElapsedTime(&alone, e0, e1));
      CK(cudaEventRecord(e0, a));
      kSpin<<<sms, 1024, smem, a>>>(cycles, sink);
      CK(cudaEventRecord(e2, a));
      CK(cudaStreamWaitEvent(b, e0, 0));
      copy(k);
      CK(cudaEventRecord(e1, b));
      CK(cudaDeviceSynchronize());
      CK(cudaEventElapsedTime(&end, e0, e1)); CK(cudaEventElapsedTime(&spin, e0, e2));
    }
    printf("engine %-28s alone %8.1f us (%5.0f GB/s); beside a %4.0f us grid holding every SM: ends at %8.1f us -> %s\n",
           names[k], alone * 1e3, 2.0 * bytes / (alone * 1e3) / 1e3, spin * 1e3, end * 1e3,
           end * 1e3 < 0.5 * spin * 1e3 ? "ran beside it (copy engine)" : "waited for SMs");
  }
  CK(cudaGetLastError());
  CK(cudaGraphExecDestroy(ge)); CK(cudaGraphDestroy(g));
  CK(cudaEventDestroy(e0)); CK(cudaEventDestroy(e1)); CK(cudaEventDestroy(e2));
  CK(cudaFree(src)); CK(cudaFree(dst)); CK(cudaFree(sink));
  CK(cudaStreamDestroy(a)); CK(cudaStreamDestroy(b));
}

// Stream timing of the n rows and the engine sweep: µs a call, the median of 7 rounds of 20
// back-to-back calls launch(i % sets) (i the call's index in its round), after one untimed round.
template <class F>
float stream_us_per_call(F&& launch, int sets) {
  return median_ms([&] { for (int i = 0; i < 20; ++i) launch(i % sets); }, 1, 7) * 1000.f / 20;
}

// The best contiguous SM copy against cudaMemcpyAsync at the writer's n = 8192 / 32768 copy sizes
// (stream timed like the n rows: 20 launches back to back, median of 7, two source buffers).
void contiguous_sweep(int sms) {
  for (size_t bytes : {size_t(8192) * 5120 * 2, size_t(32768) * 5120 * 2}) {
    char *src[2], *dst;
    for (auto& x : src) { CK(cudaMalloc(&x, bytes)); CK(cudaMemset(x, 1, bytes)); }
    CK(cudaMalloc(&dst, bytes));
    auto timeit = [&](const char* name, auto&& launch) {
      const float us = stream_us_per_call([&](int i) { launch(src[i]); }, 2);
      printf("sweep %7.1f MB %-30s %8.2f us %7.0f GB/s\n", bytes / 1e6, name, us, 2.0 * bytes / us / 1e3);
    };
    timeit("memcpy", [&](char* s) { CK(cudaMemcpyAsync(dst, s, bytes, cudaMemcpyDeviceToDevice)); });
    const int64_t n16 = int64_t(bytes / 16);
    auto sweep = [&](auto Uc, auto Hc) {
      constexpr int U = decltype(Uc)::value;
      constexpr bool H = decltype(Hc)::value;
      for (int threads : {256, 1024})
        for (int bpsm : {1, 2, 4, 8}) {
          if (threads * bpsm > 2048 || (U >= 8 && threads > 256)) continue;
          char nm[64]; snprintf(nm, 64, "E2 U%d %s %dthr %d/SM", U, H ? "cs" : "plain", threads, bpsm);
          timeit(nm, [&](char* s) { kE2<U, H><<<sms * bpsm, threads>>>(reinterpret_cast<const uint4*>(s), reinterpret_cast<uint4*>(dst), n16); });
        }
    };
    sweep(std::integral_constant<int, 1>{}, std::true_type{});
    sweep(std::integral_constant<int, 2>{}, std::true_type{});
    sweep(std::integral_constant<int, 4>{}, std::true_type{});
    sweep(std::integral_constant<int, 8>{}, std::true_type{});
    sweep(std::integral_constant<int, 4>{}, std::false_type{});
    sweep(std::integral_constant<int, 8>{}, std::false_type{});
    for (auto x : src) CK(cudaFree(x));
    CK(cudaFree(dst));
  }
}

int main(int argc, char** argv) {
  const std::string mode = argc > 1 ? argv[1] : "";
  if (argc > 2 || (argc > 1 && mode != "engine" && mode != "once")) {
    std::printf("m3rt_access_ceiling: unsupported arguments (got %d, first '%s'); usage: m3rt_access_ceiling [engine|once]\n",
                argc - 1, mode.c_str());
    return 2;
  }
  int sms; CK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0));
  int major = 0; CK(cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, 0));
  const bool hopper = major >= 9;  // the bulk-copy rows (F, G)
  // `once` (for compute-sanitizer, under which one timed row takes minutes): each row's launch
  // runs once, untimed, and its row says "ran once".
  const bool once = mode == "once";
  if (!once) memcpy_engine_probe(sms);
  if (mode == "engine") {  // the engine probe and the contiguous sweep alone
    contiguous_sweep(sms);
    return 0;
  }

  {
    const int n = 1792, sets = 3, nb = (n + 127) / 128;
    std::vector<QArgs> qa(sets);
    std::mt19937 rng(2);
    char* mdst; char* msrc[3];
    const double bytes = double(n) * QROW * 2 + double(n) * (QNQ + NKV) * 256 + double(n) * 2 * NKV * 256 + n * 16.0;
    CK(cudaMalloc(&mdst, size_t(bytes)));
    for (int s = 0; s < sets; ++s) {
      QArgs& a = qa[s]; a.n = n;
      CK(cudaMalloc(&a.qkv, size_t(n) * QROW * 2)); CK(cudaMemset(a.qkv, 1, size_t(n) * QROW * 2));
      CK(cudaMalloc(&a.cache, size_t(nb) * NKV * 128 * 256 * 2));
      CK(cudaMalloc(&a.qout, size_t(n) * QNQ * 128 * 2));
      CK(cudaMalloc(&msrc[s], size_t(bytes)));
      std::vector<int> perm(nb); for (int i = 0; i < nb; ++i) perm[i] = i; std::shuffle(perm.begin(), perm.end(), rng);
      std::vector<int64_t> sl(n), ps(n); for (int t = 0; t < n; ++t) { sl[t] = int64_t(perm[t / 128]) * 128 + t % 128; ps[t] = t; }
      int64_t *ds, *dp; CK(cudaMalloc(&ds, n * 8)); CK(cudaMalloc(&dp, n * 8));
      CK(cudaMemcpy(ds, sl.data(), n * 8, cudaMemcpyHostToDevice)); CK(cudaMemcpy(dp, ps.data(), n * 8, cudaMemcpyHostToDevice));
      a.slots = ds; a.pos = dp;
    }
    cudaEvent_t e0, e1; CK(cudaEventCreate(&e0)); CK(cudaEventCreate(&e1));
    auto timeq = [&](const char* name, auto&& launch, double b) {
      cudaStream_t st; CK(cudaStreamCreate(&st));
      if (once) {
        launch(0, st); CK(cudaGetLastError()); CK(cudaStreamSynchronize(st)); CK(cudaStreamDestroy(st));
        printf("T=%5d %-30s ran once\n", n, name);
        return;
      }
      cudaGraph_t g; cudaGraphExec_t ge;
      CK(cudaStreamBeginCapture(st, cudaStreamCaptureModeGlobal));
      for (int i = 0; i < 20; ++i) launch(i % sets, st);
      CK(cudaStreamEndCapture(st, &g)); CK(cudaGraphInstantiate(&ge, g, 0));
      for (int w = 0; w < 3; ++w) cudaGraphLaunch(ge, st);
      std::vector<float> ts;
      for (int rep = 0; rep < 9; ++rep) {
        cudaEventRecord(e0, st); cudaGraphLaunch(ge, st); cudaEventRecord(e1, st); CK(cudaEventSynchronize(e1));
        float ms; CK(cudaEventElapsedTime(&ms, e0, e1)); ts.push_back(ms * 1000 / 20);
      }
      CK(cudaGetLastError());
      CK(cudaGraphExecDestroy(ge)); CK(cudaGraphDestroy(g)); CK(cudaStreamDestroy(st));
      std::sort(ts.begin(), ts.end());
      printf("T=%5d %-30s %8.2f us %7.0f GB/s (%.1f MB)\n", n, name, ts[4], b / ts[4] / 1e3, b / 1e6);
    };
    timeq("memcpy same bytes/2 (graph)", [&](int s, cudaStream_t st) { cudaMemcpyAsync(mdst, msrc[s], size_t(bytes / 2), cudaMemcpyDeviceToDevice, st); }, bytes);
    const double big = 2.0 * (1 << 30);
    char *bs, *bd; CK(cudaMalloc(&bs, size_t(big / 2))); CK(cudaMalloc(&bd, size_t(big / 2)));
    timeq("memcpy 1 GiB (graph)", [&](int, cudaStream_t st) { cudaMemcpyAsync(bd, bs, size_t(big / 2), cudaMemcpyDeviceToDevice, st); }, big);
    for (int ys : {58, 116, 896}) {
      char nm[64]; snprintf(nm, 64, "Q pattern y=%d (graph)", ys);
      timeq(nm, [&](int s, cudaStream_t st) { kQ<false><<<dim3(9, ys), 256, 0, st>>>(qa[s]); }, bytes);
    }
    for (int ys : {58, 896}) {
      char nm[64]; snprintf(nm, 64, "Q pattern q_out y=%d (graph)", ys);
      timeq(nm, [&](int s, cudaStream_t st) { kQ<true><<<dim3(9, ys), 256, 0, st>>>(qa[s]); }, bytes);
    }
    auto runQB = [&](auto Sc, auto Tc, int bpsm) {
      constexpr int S = decltype(Sc)::value, NT = decltype(Tc)::value;
      const size_t smb = size_t(S) * QROW * 2 + S * 8 + S * 16;
      CK(cudaFuncSetAttribute(kQB<S, NT>, cudaFuncAttributeMaxDynamicSharedMemorySize, int(smb)));
      char nm[64]; snprintf(nm, 64, "QB bulk x%d %dthr %d/SM (graph)", S, NT, bpsm);
      timeq(nm, [&](int s, cudaStream_t st) { kQB<S, NT><<<std::min(n, sms * bpsm), NT, smb, st>>>(qa[s]); }, bytes);
    };
    if (hopper) {
      runQB(std::integral_constant<int, 2>{}, std::integral_constant<int, 32>{}, 4);
      runQB(std::integral_constant<int, 3>{}, std::integral_constant<int, 32>{}, 2);
      runQB(std::integral_constant<int, 3>{}, std::integral_constant<int, 32>{}, 3);
      runQB(std::integral_constant<int, 3>{}, std::integral_constant<int, 32>{}, 4);
      runQB(std::integral_constant<int, 4>{}, std::integral_constant<int, 32>{}, 3);
      runQB(std::integral_constant<int, 6>{}, std::integral_constant<int, 32>{}, 2);
      runQB(std::integral_constant<int, 3>{}, std::integral_constant<int, 288>{}, 2);
      runQB(std::integral_constant<int, 4>{}, std::integral_constant<int, 288>{}, 2);
      runQB(std::integral_constant<int, 3>{}, std::integral_constant<int, 288>{}, 3);
      runQB(std::integral_constant<int, 3>{}, std::integral_constant<int, 288>{}, 4);
    }
    timeq("E2 U4 contiguous same bytes", [&](int s, cudaStream_t st) { kE2<4><<<sms * 4, 256, 0, st>>>(reinterpret_cast<const uint4*>(msrc[s]), reinterpret_cast<uint4*>(mdst), int64_t(bytes / 2) / 16); }, bytes);
    // The same contiguous copy with each word written back where it was read (the QK insert
    // writes q and k back in place).
    timeq("E2 U4 in place same bytes", [&](int s, cudaStream_t st) { kE2<4><<<sms * 4, 256, 0, st>>>(reinterpret_cast<const uint4*>(msrc[s]), reinterpret_cast<uint4*>(msrc[s]), int64_t(bytes / 2) / 16); }, bytes);
    CK(cudaEventDestroy(e0)); CK(cudaEventDestroy(e1));
    CK(cudaFree(bs)); CK(cudaFree(bd)); CK(cudaFree(mdst));
    for (int s = 0; s < sets; ++s) {
      const QArgs& a = qa[s];
      CK(cudaFree(msrc[s])); CK(cudaFree(a.qkv)); CK(cudaFree(a.cache)); CK(cudaFree(a.qout));
      CK(cudaFree(const_cast<int64_t*>(a.slots))); CK(cudaFree(const_cast<int64_t*>(a.pos)));
    }
  }
  for (int n : {8192, 32768}) {
    const int sets = n == 8192 ? 3 : 1;
    const int nb = n / 128;
    std::vector<Args> as(sets);
    std::mt19937 rng(1);
    for (int s = 0; s < sets; ++s) {
      Args& a = as[s]; a.n = n;
      uint16_t* kv; CK(cudaMalloc(&kv, size_t(n) * ROW * 2)); CK(cudaMemset(kv, 1, size_t(n) * ROW * 2)); a.kv = kv; CK(cudaMalloc(&a.dst, size_t(n) * ROW * 2));
      a.layer_elems = int64_t(nb) * NKV * 128 * 256;
      CK(cudaMalloc(&a.cache0, size_t(L) * a.layer_elems * 2));
      std::vector<int> perm(nb); for (int i = 0; i < nb; ++i) perm[i] = i; std::shuffle(perm.begin(), perm.end(), rng);
      std::vector<int64_t> sl(n), ps(n); for (int t = 0; t < n; ++t) { sl[t] = int64_t(perm[t / 128]) * 128 + t % 128; ps[t] = t; }
      int64_t *ds, *dp; CK(cudaMalloc(&ds, n * 8)); CK(cudaMalloc(&dp, n * 8));
      CK(cudaMemcpy(ds, sl.data(), n * 8, cudaMemcpyHostToDevice)); CK(cudaMemcpy(dp, ps.data(), n * 8, cudaMemcpyHostToDevice));
      a.slots = ds; a.pos = dp;
    }
    const double bytes = double(n) * ROW * 2 * 2 + n * 16.0;
    auto timeit = [&](const char* name, auto&& launch) {
      if (once) {
        launch(as[0]); CK(cudaGetLastError()); CK(cudaDeviceSynchronize());
        printf("n=%6d %-28s ran once\n", n, name);
        return;
      }
      const float us = stream_us_per_call([&](int i) { launch(as[i]); }, sets);
      printf("n=%6d %-28s %8.2f us %7.0f GB/s\n", n, name, us, bytes / us / 1e3);
    };
    timeit("memcpy", [&](Args& a) { cudaMemcpyAsync(a.dst, a.kv, size_t(n) * ROW * 2, cudaMemcpyDeviceToDevice); });
    for (int bpsm : {4, 8, 16}) {
      char nm[64]; snprintf(nm, 64, "E contiguous %d blk/SM", bpsm);
      timeit(nm, [&](Args& a) { kE<<<sms * bpsm, 256>>>(reinterpret_cast<const uint4*>(a.kv), reinterpret_cast<uint4*>(a.dst), int64_t(n) * ROW * 2 / 16); });
    }
    {
      const int ys = std::min(n / 16, sms * 4 / P);
      timeit("B pair-major (current)", [&](Args& a) { kB<false><<<dim3(P, ys), 256>>>(a); });
      timeit("B pair-major st.cs", [&](Args& a) { kB<true><<<dim3(P, ys), 256>>>(a); });
      const int ys2 = std::min(n / 16, sms * 8 / P);
      timeit("B pair-major 2 waves", [&](Args& a) { kB<false><<<dim3(P, ys2), 256>>>(a); });
    }
    auto runC = [&](auto Rc, int bpsm) {
      constexpr int R = decltype(Rc)::value;
      const size_t sm = 3 * size_t(R) * P * 2 * 16 * 16 + 3 * R * 16;
      CK(cudaFuncSetAttribute(kC<R>, cudaFuncAttributeMaxDynamicSharedMemorySize, int(sm)));
      char nm[64]; snprintf(nm, 64, "C token-major R%d %d/SM", R, bpsm);
      timeit(nm, [&](Args& a) { kC<R><<<std::min(n / R, sms * bpsm), 320, sm>>>(a); });
    };
    runC(std::integral_constant<int, 1>{}, 6);
    runC(std::integral_constant<int, 2>{}, 3);
    runC(std::integral_constant<int, 2>{}, 2);
    runC(std::integral_constant<int, 3>{}, 2);

    for (int bpsm : {4, 8}) {
      char nm[64]; snprintf(nm, 64, "E2 U4 %d blk/SM", bpsm);
      timeit(nm, [&](Args& a) { kE2<4><<<sms * bpsm, 256>>>(reinterpret_cast<const uint4*>(a.kv), reinterpret_cast<uint4*>(a.dst), int64_t(n) * ROW * 2 / 16); });
    }
    auto runF = [&](auto CHc, auto Sc, int bpsm) {
      constexpr int CH = decltype(CHc)::value, S = decltype(Sc)::value;
      const size_t sm = size_t(S) * CH + S * 8;
      CK(cudaFuncSetAttribute(kF<CH, S>, cudaFuncAttributeMaxDynamicSharedMemorySize, int(sm)));
      char nm[64]; snprintf(nm, 64, "F bulk %dKB x%d %d/SM", CH / 1024, S, bpsm);
      timeit(nm, [&](Args& a) { kF<CH, S><<<sms * bpsm, 32, sm>>>(reinterpret_cast<const char*>(a.kv), reinterpret_cast<char*>(a.dst), int64_t(n) * ROW * 2); });
    };
    if (hopper) runF(std::integral_constant<int, 16384>{}, std::integral_constant<int, 4>{}, 3);
    if (hopper) runF(std::integral_constant<int, 32768>{}, std::integral_constant<int, 3>{}, 2);
    if (hopper) runF(std::integral_constant<int, 8192>{}, std::integral_constant<int, 4>{}, 6);
    auto runG = [&](auto Rc, auto Sc, int bpsm) {
      constexpr int R = decltype(Rc)::value, S = decltype(Sc)::value;
      const size_t sm = size_t(S) * R * ROW * 2 + 32 + S * R * 8;
      CK(cudaFuncSetAttribute(kG<R, S>, cudaFuncAttributeMaxDynamicSharedMemorySize, int(sm)));
      char nm[64]; snprintf(nm, 64, "G bulk R%d x%d %d/SM", R, S, bpsm);
      timeit(nm, [&](Args& a) { kG<R, S><<<std::min(n / R, sms * bpsm), 64, sm>>>(a); });
    };
    if (hopper) runG(std::integral_constant<int, 2>{}, std::integral_constant<int, 3>{}, 3);
    if (hopper) runG(std::integral_constant<int, 4>{}, std::integral_constant<int, 2>{}, 2);
    if (hopper) runG(std::integral_constant<int, 2>{}, std::integral_constant<int, 4>{}, 2);
    timeit("D direct U2 6/SM", [&](Args& a) { kD<2><<<sms * 6, 320>>>(a); });
    timeit("D direct U4 6/SM", [&](Args& a) { kD<4><<<sms * 6, 320>>>(a); });
    timeit("D direct U4 3/SM", [&](Args& a) { kD<4><<<sms * 3, 320>>>(a); });
    for (const Args& a : as) {
      CK(cudaFree(const_cast<uint16_t*>(a.kv))); CK(cudaFree(a.dst)); CK(cudaFree(a.cache0));
      CK(cudaFree(const_cast<int64_t*>(a.slots))); CK(cudaFree(const_cast<int64_t*>(a.pos)));
    }
  }
  return 0;
}
