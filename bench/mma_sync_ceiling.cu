// The tensor-core ceiling of the MSA per-token tile's instruction mix (msa_token_tile_kernel), on
// the GPU: warp-level m16n8k16 MMAs (f16 or bf16 in, fp32 accumulate) issued from registers with no
// memory traffic, at a chosen number of warps an SM, with or without the e4m3 -> f16 conversions
// the e4m3 tile runs beside them (the tile's ratio: 256 `cvt.rn.f16x2.e4m3x2` to 192 MMAs a token
// and 64-key chunk, 4 : 3), and with the tile's P-residue pattern (two MMAs into one accumulator
// back to back). Reported as TFLOP/s of MMA work (2 * 16 * 8 * 16 a warp MMA), beside the rate at
// 32 warps an SM, so that the tile's rate (docs/perf.md, msa_attention) reads against what its
// nine warps (eight computing) can issue at all. Standalone (no m3rt library), built as
// m3rt_mma_sync_ceiling in CUDA builds; run on the GPU machine: build/m3rt_mma_sync_ceiling.
#include <cuda_runtime.h>
#include <cstdio>
#include <cstdint>
#include "ops/common/mma.cuh"
#include "standalone_check.h"

using m3rt::kernels::e4m3x4_to_f16x2x2;
using m3rt::kernels::mma_16816;

// Each warp: `iters` rounds of 12 MMAs into 12 accumulators (independent: kPairs = false; as 6
// value / residue pairs, the second of a pair right after the first: kPairs = true) and, with
// kCvt, 16 conversions whose results feed the next round's A operands (so they cannot be dropped).
template <bool kF16, bool kCvt, bool kPairs>
__global__ void mma_loop(int iters, float* out) {
  float acc[12][4] = {};
  uint32_t a[4] = {0x3c003c00u ^ threadIdx.x, 0x3c003c00u, 0x3c003c00u, 0x3c003c00u ^ blockIdx.x};
  const uint32_t b0 = 0x00010001u * (threadIdx.x & 7), b1 = 0x3c00u;
  uint32_t codes = 0x38383838u ^ threadIdx.x;
  for (int it = 0; it < iters; ++it) {
#pragma unroll
    for (int i = 0; i < 12; ++i) {
      mma_16816<kF16>(acc[kPairs ? i & ~1 : i], a[0], a[1], a[2], a[3], b0 ^ uint32_t(i), b1);  // pairs: i, i + 1
    }
    if constexpr (kCvt) {
#pragma unroll
      for (int j = 0; j < 8; ++j) {  // 16 conversions: 4 : 3 against 12 MMAs
        uint32_t lo, hi;
        e4m3x4_to_f16x2x2(codes, lo, hi);  // the library's conversion (sm_89+: two cvt instructions)
        a[j & 3] ^= lo ^ hi;
        codes += 0x01010101u;
      }
    }
  }
  float s = 0.f;
#pragma unroll
  for (int i = 0; i < 12; ++i) s += acc[i][0] + acc[i][1] + acc[i][2] + acc[i][3];
  if (s == 12345.f) out[blockIdx.x * blockDim.x + threadIdx.x] = s;  // keeps the loop
}

template <bool kF16, bool kCvt, bool kPairs>
double run(int warps, int sms, int iters) {
  float* out;
  CK(cudaMalloc(&out, size_t(sms) * 1024 * sizeof(float)));
  // One CTA a SM: a grid of one CTA per SM spreads one to each (the block scheduler's round robin
  // over idle SMs). A short launch warms up.
  const int ctas = sms;
  mma_loop<kF16, kCvt, kPairs><<<ctas, warps * 32>>>(iters / 10, out);
  const float ms = median_ms([&] { mma_loop<kF16, kCvt, kPairs><<<ctas, warps * 32>>>(iters, out); }, 0);
  CK(cudaFree(out));
  const double flops = double(ctas) * warps * iters * 12 * (2.0 * 16 * 8 * 16);
  return flops / (ms * 1e-3) / 1e12;
}

int main() {
  const cudaDeviceProp prop = current_device();
  const int sms = prop.multiProcessorCount;
  std::printf("%s, %d SMs; TFLOP/s of m16n8k16 MMA work, one CTA an SM (before sm_89 the conversion is\n"
              "the library's software fallback)\n",
              prop.name, sms);
  const int iters = 20000;
  // The five columns, listed once: heading and width, instance (its register count), timing.
  struct Variant {
    const char* name;
    int width;
    const void* kernel;
    double (*time)(int, int, int);
  };
  const Variant variants[] = {
      {"f16", 10, (const void*)mma_loop<true, false, false>, run<true, false, false>},
      {"bf16", 10, (const void*)mma_loop<false, false, false>, run<false, false, false>},
      {"f16+cvt 4:3", 12, (const void*)mma_loop<true, true, false>, run<true, true, false>},
      {"f16 pairs", 12, (const void*)mma_loop<true, false, true>, run<true, false, true>},
      {"f16 pairs+cvt", 12, (const void*)mma_loop<true, true, true>, run<true, true, true>}};
  std::printf("%-6s", "warps");
  for (const Variant& v : variants) std::printf(" %*s", v.width, v.name);
  std::printf("\n");
  // A warp count whose registers exceed the SM's file cannot launch (session 39: 24 warps did not):
  // the row stops there.
  int regs = 0;
  for (const Variant& v : variants) {
    cudaFuncAttributes attr;
    CK(cudaFuncGetAttributes(&attr, v.kernel));
    regs = attr.numRegs > regs ? attr.numRegs : regs;
  }
  for (int w : {4, 8, 9, 12, 16, 24, 32}) {
    if (w * 32 * regs > prop.regsPerMultiprocessor || w * 32 > prop.maxThreadsPerBlock) {
      std::printf("%-6d (%d registers a thread: more than the SM holds at this many warps)\n", w, regs);
      break;
    }
    std::printf("%-6d", w);
    for (const Variant& v : variants) std::printf(" %*.0f", v.width, v.time(w, sms, iters));
    std::printf("\n");
  }
  return 0;
}
