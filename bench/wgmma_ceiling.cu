// The tensor-core rate of a keys-as-M warpgroup loop, on the GPU: wgmma m64nNk16 (f16 in, fp32
// accumulate) with A in registers and B read from shared memory by descriptor, at N = 16, 32, 64
// and 128 for the same work a round (64 rows x 128 columns x 128 dims), at 1 and 2 warpgroups an
// SM. It is the design input for an MSA prefill tile that puts a chunk's 64 keys on M (A = the
// chunk's K, or V^T, converted once into registers) and one token's 16 query heads on N (B = the
// token's queries, or P^T), so that a page is converted once and computed once for every token that
// selected it, with no MMA row spent on a token that did not (docs/perf.md, msa_attention, "Session
// 38"). Each round (a chunk's Q K^T for every token) issues 128 / N groups of eight k-steps (one
// group a 16-head token at N = 16), each committed on its own, and waits for all at its end. The A
// registers change every round: "plain" refreshes them by an add (no conversion); "cvt" converts
// them from e4m3 codes (32 `cvt.rn.f16x2.e4m3x2` a thread for one 64 x 128 operand) once a round
// (a page shared by every token) or once every 32 columns (two tokens a page), alternating two
// register sets; "P" rewrites a group's B region before its MMAs (N bytes a thread, the async-proxy
// fence and a warpgroup barrier: P^T stored for P V). ptxas serializes none of these wgmmas at two
// warpgroups' register budget (at three, the double-buffered variants were serialized); every
// k-step accumulates, so that none is dead (ptxas drops a wgmma whose result is overwritten unread:
// session 39), and the N = 16 "P+cvt/32col" instance spills 56 bytes (its rate is a lower bound).
// Reported as TFLOP/s of MMA work, beside m3rt_mma_sync_ceiling's warp-level rates. Standalone
// (no m3rt library), built as m3rt_wgmma_ceiling in CUDA builds with sm_90a code.
#include <cuda_runtime.h>

#include <cstdint>
#include <cstdio>

#include "ops/common/sm90.cuh"
#include "standalone_check.h"

namespace k = m3rt::kernels;

constexpr int kMaxWg = 2, kDims = 128, kCols = 128;  // a round: 64 rows x kCols columns x kDims

// One CTA an SM of `blockDim.x / 128` warpgroups. B: kCols rows of 128 f16 dims in the K-major
// 128-byte-swizzled layout (32 KiB), group g's N rows at g * N * 256 bytes (dims 0-63, then 64-127
// N * 128 bytes further); one image shared by the warpgroups, or with kWriteB two a warpgroup
// (rounds alternate them, so a rewrite never meets the MMAs of the round before).
constexpr int kImage = kCols * kDims * 2;
template <int N, int kCvtCols, bool kCvt, bool kWriteB>
__global__ void __launch_bounds__(kMaxWg * 128, 1) wg_loop(int rounds, float* out) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  constexpr int kGroups = kCols / N, kConvs = kCvtCols > 0 ? kCols / kCvtCols : 0;  // conversions a round
  extern __shared__ __align__(1024) char smem_raw[];
  char* smem = smem_raw + ((1024u - (k::smem_u32(smem_raw) & 1023u)) & 1023u);
  const int tid = threadIdx.x, wg = tid / 128, t = tid % 128;
  const int images = kWriteB ? 2 * (blockDim.x / 128) : 1;
  for (int i = tid; i < images * kImage / 4; i += blockDim.x)
    reinterpret_cast<uint32_t*>(smem)[i] = 0x2c002c00u ^ uint32_t(i & 0x00ff00ffu);  // small f16 pairs
  k::fence_proxy_async();
  __syncthreads();
  char* bw = smem + (kWriteB ? 2 * wg * kImage : 0);
  const uint32_t b_base = k::smem_u32(bw);
  float acc[kGroups][N / 2];
#pragma unroll
  for (int g = 0; g < kGroups; ++g)
#pragma unroll
    for (int j = 0; j < N / 2; ++j) acc[g][j] = 0.f;
  uint32_t a[2][8][4];  // two register sets of A (the m64 x 128-dim operand), converted alternately
#pragma unroll
  for (int s = 0; s < 8; ++s)
#pragma unroll
    for (int r = 0; r < 4; ++r) a[0][s][r] = a[1][s][r] = 0x3c003c00u ^ uint32_t(t + s + r);
  uint32_t codes = 0x30303030u ^ uint32_t(t);  // a conversion's 16 code registers: codes + j * 0x00010101
  // Rounds in pairs, so that the register set and the B image of every group are compile-time
  // (an even count of conversions a pair).
  for (int r = 0; r < rounds; r += 2) {
#pragma unroll
    for (int rr = 0; rr < 2; ++rr) {
#pragma unroll
      for (int g = 0; g < kGroups; ++g) {
        // The register set the group reads: the one the latest conversion wrote.
        const int conv = kConvs > 0 ? rr * kConvs + (g * N) / (kCvtCols > 0 ? kCvtCols : 1) : 0;
        const int cur = conv & 1;
        if constexpr (kConvs > 0) {
          if ((g * N) % kCvtCols == 0) {
            // The groups that read this set (those of the conversion before the previous one) have
            // completed: the previous conversion's kCvtCols / N groups may still be pending. (Once a
            // round, the round before has completed at its end.)
            if constexpr (kConvs > 1) k::wgmma_wait<kCvtCols / N>();
#pragma unroll
            for (int j = 0; j < 16; ++j) {
              uint32_t lo = codes + uint32_t(j) * 0x00010101u, hi;
              if constexpr (kCvt) k::e4m3x4_to_f16x2x2(lo, lo, hi);
              else lo &= 0x3bff3bffu, hi = lo ^ 0x00100010u;  // A refreshed by an add and a mask: finite f16
              a[cur][j / 2][(j % 2) * 2] = lo, a[cur][j / 2][(j % 2) * 2 + 1] = hi;
            }
            codes += 0x01010101u;
          }
        }
        const uint32_t bg = b_base + uint32_t((kWriteB ? rr * kImage : 0) + g * N * kDims * 2);
        if constexpr (kWriteB) {
          // This image was last read by the round before, which completed at its end.
          char* dst = bw + rr * kImage + g * N * kDims * 2;
#pragma unroll
          for (int q = 0; q < N / 16; ++q)  // N bytes a thread, N * 128 in all: a 64-key P^T of N heads
            *reinterpret_cast<uint4*>(dst + (q * 128 + t) * 16) = make_uint4(r, g, q, t);
          k::fence_proxy_async();
          k::named_bar_sync(1 + wg, 128);
        }
        k::wgmma_fence();
        // Every k-step accumulates: with the first overwriting (as the kernels' first step does),
        // the round before's MMAs of this group were dead and ptxas dropped 7 of every 16
        // (session 39: the first run's rates were 16/9 too high).
        k::wgmma_k128<N, true, true>(acc[g], a[cur], bg, uint32_t(N * 128));
        k::wgmma_commit();
      }
      k::wgmma_wait<0>();  // a round's scores complete (a chunk's softmax would read them now)
    }
  }
  k::wgmma_wait<0>();
  float s = 0.f;
#pragma unroll
  for (int g = 0; g < kGroups; ++g)
#pragma unroll
    for (int j = 0; j < N / 2; ++j) s += acc[g][j];
  if (s == 12345.f) out[blockIdx.x * blockDim.x + tid] = s;  // keeps the loop
#endif
}

template <int N, int kCvtCols, bool kCvt, bool kWriteB>
double run(int wgs, int sms, int rounds) {
  float* out;
  CK(cudaMalloc(&out, size_t(sms) * kMaxWg * 128 * sizeof(float)));
  const int smem = kImage * (kWriteB ? 2 * wgs : 1) + 1024;
  CK(cudaFuncSetAttribute(wg_loop<N, kCvtCols, kCvt, kWriteB>, cudaFuncAttributeMaxDynamicSharedMemorySize, smem));
  wg_loop<N, kCvtCols, kCvt, kWriteB><<<sms, wgs * 128, smem>>>(rounds / 10, out);  // a short warm-up
  const float ms =
      median_ms([&] { wg_loop<N, kCvtCols, kCvt, kWriteB><<<sms, wgs * 128, smem>>>(rounds, out); }, 0);
  CK(cudaFree(out));
  const double flops = double(sms) * wgs * rounds * (2.0 * 64 * kCols * kDims);
  return flops / (ms * 1e-3) / 1e12;
}

template <int N>
void row(int wgs, int sms, int rounds) {
  std::printf("%-4d %-4d %9.0f %12.0f %12.0f %10.0f %14.0f\n", N, wgs, run<N, kCols, false, false>(wgs, sms, rounds),
              run<N, kCols, true, false>(wgs, sms, rounds), N <= 32 ? run<N, 32, true, false>(wgs, sms, rounds) : 0.0,
              run<N, kCols, false, true>(wgs, sms, rounds), N <= 32 ? run<N, 32, true, true>(wgs, sms, rounds) : 0.0);
}

int main() {
  const cudaDeviceProp prop = current_device();
  const int sms = prop.multiProcessorCount;
  if (prop.major != 9 || !m3rt::kernels::kBuiltForSm90a) {
    std::printf("wgmma_ceiling: needs a compute capability 9.x GPU and an sm_90a build (%s is %d.%d); skipped\n",
                prop.name, prop.major, prop.minor);
    return 0;
  }
  std::printf("%s, %d SMs; TFLOP/s of wgmma m64nNk16 work (f16, A in registers, B by descriptor), one CTA an\n"
              "SM; a round is 64 x %d x %d in %d/N groups; cvt: the A registers converted from e4m3 once a\n"
              "round / every 32 columns; P: each group's B region rewritten before its MMAs (fence, barrier)\n",
              prop.name, sms, kCols, kDims, kCols);
  std::printf("%-4s %-4s %9s %12s %12s %10s %14s\n", "N", "wgs", "plain", "cvt/round", "cvt/32col", "P", "P+cvt/32col");
  const int rounds = 4000;
  for (int wgs = 1; wgs <= kMaxWg; ++wgs) {
    row<16>(wgs, sms, rounds);
    row<32>(wgs, sms, rounds);
    row<64>(wgs, sms, rounds);
    row<128>(wgs, sms, rounds);
  }
  return 0;
}
