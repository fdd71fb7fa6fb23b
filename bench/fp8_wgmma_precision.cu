// How exactly Hopper's tensor cores sum e4m3 products: one warpgroup computes a 64 x 128 tile of
// dot products over 128 dims (the lightning indexer's score shape: 64 query rows x one page of
// 128 keys) with wgmma m64n128k32 on e4m3 operands, and, from the same values converted exactly
// to f16, with m64n128k16 (what the indexer's prefill kernel does today). Every result is compared
// with the exact dot (double) relative to sum_d |q_d k_d|, the bound the indexer's GPU check
// scales its tolerance (2^-12) by. Standalone (no m3rt library; the device helpers of
// src/ops/common/sm90.cuh and mma.cuh); built as m3rt_fp8_wgmma_precision
// in CUDA builds with sm_90a code; run on an H100/H200: build/m3rt_fp8_wgmma_precision.
// Data: e4m3 values of uniform(-2, 2) (the indexer check's), of N(0, 1), and of a wide dynamic range
// (sign x 2^uniform(-8, 8)), each rounded to the nearest e4m3 code. Results (H200, 2026-12-01) in
// docs/perf.md (lightning_indexer, session 13): e4m3 k32 sums err up to 2.5e-4 / 3.4e-4 / 1.3e-3 of
// sum |q_d k_d|, the f16 path 0 / 0 / 5e-7.
#include <cuda_fp8.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <random>
#include <vector>

#include "ops/common/sm90.cuh"

#include "standalone_check.h"

namespace {

constexpr int kRows = 64, kKeys = 128, kDim = 128;

#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
using namespace m3rt::kernels;
#define REGS64                                                                                                       \
  "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, " \
  "%24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, "   \
  "%46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63}"
#define ACC64                                                                                                         \
  "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]),      \
      "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]),        \
      "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]),       \
      "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]), "+f"(d[32]),       \
      "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]), "+f"(d[40]),       \
      "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]), "+f"(d[48]),       \
      "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]), "+f"(d[56]),       \
      "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63])
#endif

// One CTA (a warpgroup) per tile: A [64 rows][128 dims] and B [128 keys][128 dims] as e4m3 codes,
// row-major in global memory; out [64][128] fp32 (row, key). kFp8: e4m3 wgmma k32 on the codes;
// else the codes converted to f16 (exact) and f16 wgmma k16. Both operands from shared memory,
// K-major with the 128-byte swizzle (16-byte chunk q of row r at q ^ (r % 8) in its 128-byte row of
// a region; f16 rows span two regions of 64 dims).
template <bool kFp8>
__global__ void __launch_bounds__(128) tile_kernel(const uint8_t* a_codes, const uint8_t* b_codes, float* out) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  constexpr int kElem = kFp8 ? 1 : 2;
  constexpr int kABytes = kRows * kDim * kElem, kBBytes = kKeys * kDim * kElem;
  __shared__ __align__(1024) uint8_t sa[kABytes];
  __shared__ __align__(1024) uint8_t sb[kBBytes];
  const uint8_t* ga = a_codes + size_t(blockIdx.x) * kRows * kDim;
  const uint8_t* gb = b_codes + size_t(blockIdx.x) * kKeys * kDim;
  const int tid = threadIdx.x;
  // 8 codes -> 8 values (e4m3: as they are; f16: 16 bytes) per step; chunk = 16 bytes of the image.
  auto put = [&](uint8_t* s, int rows, const uint8_t* g) {
    for (int idx = tid; idx < rows * kDim / 8; idx += 128) {
      const int r = idx / (kDim / 8), d0 = (idx % (kDim / 8)) * 8;  // dims d0 .. d0 + 7
      const uint2 v = *reinterpret_cast<const uint2*>(g + r * kDim + d0);
      const int byte = d0 * kElem, region = byte / 128, q = (byte % 128) / 16, half = byte % 16;
      uint8_t* row = s + region * rows * 128 + r * 128 + ((q ^ (r & 7)) * 16) + half;
      if constexpr (kFp8) {
        *reinterpret_cast<uint2*>(row) = v;
      } else {
        const uint32_t w[2] = {v.x, v.y};
        uint32_t h[4];
        for (int e = 0; e < 4; ++e) h[e] = e4m3x2_to_f16x2((w[e / 2] >> (16 * (e % 2))) & 0xffffu);
        *reinterpret_cast<uint4*>(row) = make_uint4(h[0], h[1], h[2], h[3]);
      }
    }
  };
  put(sa, kRows, ga);
  put(sb, kKeys, gb);
  fence_proxy_async();
  __syncthreads();
  float d[64];
  for (int i = 0; i < 64; ++i) d[i] = 0.f;
  const uint32_t a0 = uint32_t(__cvta_generic_to_shared(sa)), b0 = uint32_t(__cvta_generic_to_shared(sb));
  wgmma_fence();
  constexpr int kSteps = kFp8 ? kDim / 32 : kDim / 16;
#pragma unroll
  for (int s = 0; s < kSteps; ++s) {
    // Step s: 32 bytes of every row (k32 e4m3 or k16 f16), in region s / 4.
    const uint64_t da = sw128_desc(a0 + (s / 4) * (kRows * 128) + (s % 4) * 32);
    const uint64_t db = sw128_desc(b0 + (s / 4) * (kKeys * 128) + (s % 4) * 32);
    if constexpr (kFp8)
      asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %66, 0;\n"
                   "wgmma.mma_async.sync.aligned.m64n128k32.f32.e4m3.e4m3 " REGS64 ", %64, %65, p, 1, 1;\n}\n"
                   : ACC64
                   : "l"(da), "l"(db), "r"(1));
    else
      asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %66, 0;\n"
                   "wgmma.mma_async.sync.aligned.m64n128k16.f32.f16.f16 " REGS64 ", %64, %65, p, 1, 1, 0, 0;\n}\n"
                   : ACC64
                   : "l"(da), "l"(db), "r"(1));
  }
  wgmma_commit();
  wgmma_wait_all();
  // d[4 i + e]: row 16 w + g + 8 (e / 2), key 8 i + 2 c + (e % 2).
  const int w = tid / 32, g = (tid % 32) / 4, c = tid % 4;
  float* o = out + size_t(blockIdx.x) * kRows * kKeys;
  for (int i = 0; i < 16; ++i)
    for (int e = 0; e < 4; ++e) o[(16 * w + g + 8 * (e / 2)) * kKeys + 8 * i + 2 * c + (e % 2)] = d[4 * i + e];
#else
  if (threadIdx.x == 0 && blockIdx.x == 0) printf("tile_kernel: needs sm_90a code (an H100/H200 build)\n");
#endif
}

double e4m3_value(uint8_t code) {
  const int s = code >> 7, e = (code >> 3) & 15, m = code & 7;
  if (e == 15 && m == 7) return NAN;
  const double v = e == 0 ? std::ldexp(m / 8.0, -6) : std::ldexp(1.0 + m / 8.0, e - 7);
  return s ? -v : v;
}

// The e4m3 code nearest to x (ties: either; the data only needs to be e4m3 values); `sorted`:
// the finite codes' (value, code) in increasing value.
uint8_t nearest_code(double x, const std::vector<std::pair<double, int>>& sorted) {
  auto it = std::lower_bound(sorted.begin(), sorted.end(), std::make_pair(x, -1));
  if (it == sorted.end()) return uint8_t(sorted.back().second);
  if (it != sorted.begin() && std::fabs(std::prev(it)->first - x) < std::fabs(it->first - x)) --it;
  return uint8_t(it->second);
}

}  // namespace

int main() {
  const cudaDeviceProp prop = current_device();
  if (prop.major != 9) {
    std::printf("needs a Hopper GPU (found %s, sm_%d%d)\n", prop.name, prop.major, prop.minor);
    return 0;
  }
  std::vector<double> table(256);
  std::vector<std::pair<double, int>> sorted;
  for (int c = 0; c < 256; ++c) {
    table[size_t(c)] = e4m3_value(uint8_t(c));
    if (!std::isnan(table[size_t(c)])) sorted.push_back({table[size_t(c)], c});
  }
  std::sort(sorted.begin(), sorted.end());
  constexpr int kTiles = 512;
  const size_t na = size_t(kTiles) * kRows * kDim, nb = size_t(kTiles) * kKeys * kDim;
  const size_t no = size_t(kTiles) * kRows * kKeys;
  uint8_t *da = nullptr, *db = nullptr;
  float* dout = nullptr;
  CK(cudaMalloc(&da, na));
  CK(cudaMalloc(&db, nb));
  CK(cudaMalloc(&dout, no * sizeof(float)));
  std::printf("%s: e4m3 dot products over 128 dims, %d tiles of 64 x 128 (%zu dots); error relative to "
              "sum |q_d k_d|\n",
              prop.name, kTiles, no);
  std::printf("%-16s %-10s %12s %12s %12s %12s %12s\n", "data", "path", "max", "p99.99", "mean", "> 2^-13",
              "> 2^-12");
  std::mt19937_64 rng(12345);
  for (int dist = 0; dist < 3; ++dist) {
    const char* name = dist == 0 ? "uniform(-2,2)" : dist == 1 ? "normal(0,1)" : "2^uniform(-8,8)";
    std::uniform_real_distribution<double> uni(-2, 2), ex(-8, 8);
    std::normal_distribution<double> nrm(0, 1);
    auto draw = [&] {
      if (dist == 0) return uni(rng);
      if (dist == 1) return nrm(rng);
      return (rng() & 1 ? -1.0 : 1.0) * std::exp2(ex(rng));
    };
    std::vector<uint8_t> a(na), b(nb);
    for (auto& x : a) x = nearest_code(draw(), sorted);
    for (auto& x : b) x = nearest_code(draw(), sorted);
    // The exact dots (every partial sum of these products is exact in double) and their bounds.
    std::vector<double> exact(no), bound(no);
    for (int t = 0; t < kTiles; ++t)
      for (int r = 0; r < kRows; ++r)
        for (int k = 0; k < kKeys; ++k) {
          double x = 0, y = 0;
          for (int dd = 0; dd < kDim; ++dd) {
            const double p =
                table[a[(size_t(t) * kRows + r) * kDim + dd]] * table[b[(size_t(t) * kKeys + k) * kDim + dd]];
            x += p;
            y += std::fabs(p);
          }
          exact[(size_t(t) * kRows + r) * kKeys + k] = x;
          bound[(size_t(t) * kRows + r) * kKeys + k] = y;
        }
    CK(cudaMemcpy(da, a.data(), na, cudaMemcpyHostToDevice));
    CK(cudaMemcpy(db, b.data(), nb, cudaMemcpyHostToDevice));
    for (int path = 0; path < 2; ++path) {
      CK(cudaMemset(dout, 0xFF, no * sizeof(float)));  // NaN: every result must be written
      if (path == 0)
        tile_kernel<true><<<kTiles, 128>>>(da, db, dout);
      else
        tile_kernel<false><<<kTiles, 128>>>(da, db, dout);
      CK(cudaGetLastError());
      CK(cudaDeviceSynchronize());
      std::vector<float> out(no);
      CK(cudaMemcpy(out.data(), dout, no * sizeof(float), cudaMemcpyDeviceToHost));
      std::vector<double> rel;
      rel.reserve(no);
      size_t over13 = 0, over12 = 0, bad = 0;
      double sum = 0;
      for (size_t i = 0; i < no; ++i) {
        const double got = out[i];
        if (std::isnan(got)) {
          ++bad;
          continue;
        }
        const double e = bound[i] > 0 ? std::fabs(got - exact[i]) / bound[i] : 0;
        rel.push_back(e);
        sum += e;
        over13 += e > 0x1p-13;
        over12 += e > 0x1p-12;
      }
      std::sort(rel.begin(), rel.end());
      const double mx = rel.empty() ? 0 : rel.back();
      const double p9999 = rel.empty() ? 0 : rel[size_t(0.9999 * double(rel.size() - 1))];
      std::printf("%-16s %-10s %12.3e %12.3e %12.3e %12zu %12zu%s\n", name, path == 0 ? "e4m3 k32" : "f16 k16", mx,
                  p9999, rel.empty() ? 0 : sum / double(rel.size()), over13, over12,
                  bad ? "  (NaN results: not written)" : "");
    }
  }
  std::printf("(2^-13 = %.3e, 2^-12 = %.3e, 2^-24 = %.3e)\n", 0x1p-13, 0x1p-12, 0x1p-24);
  CK(cudaFree(da));
  CK(cudaFree(db));
  CK(cudaFree(dout));
  return 0;
}
