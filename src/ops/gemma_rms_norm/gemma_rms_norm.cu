// gemma_rms_norm kernel: out = x * (1 / sqrt(mean(x^2) + eps)) * (1 + w) per row, fp32 math; the
// fused form first forms s = x + residual in fp32, writes residual = round(s) and norms s.
//
// Grid: 128-dim bf16 heads (the per-head QK/K norm, 16-byte aligned) take the per-head path of
// the fused kernels: a half-warp per head, 8 dims per lane, the canonical sum order, so the result
// equals theirs bit for bit. Wide rows (1024 < d <= 8192, d % 8 == 0, 16-byte aligned rows: the
// model's hidden rows) keep the row in registers: a 256-thread block per row, each thread loads
// its up to four 8-element pieces of x (and the residual) at once, so a row costs one memory
// round trip instead of a chain of dependent scalar loads (7 rows of 6144: 17 -> ~4 us).
// Other rows: a warp per row when d <= 1024 (8 rows per 256-thread block), else a 256-thread block per
// row. Two passes over the row (sum of squares, then scale and store); the second re-reads the
// inputs (from L2) instead of keeping the row, so any d works. Each thread handles elements
// i, i + threads, ... so a warp's accesses are coalesced; a thread reads and writes the same
// elements in both passes, which makes out == x (in place) safe.
// Reference: gemma_rms_norm_ref.cpp; checks: check_gemma_rms_norm.cpp (m3rt check),
// test_gemma_rms_norm.cpp.
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include "core/cuda_check.h"
#include "ops/common/head_math.cuh"
#include "ops/gemma_rms_norm/gemma_rms_norm.h"

namespace m3rt {
namespace {

constexpr int kThreads = 256;

// Row r of a [a, inner, d] view -> (r / inner, r % inner); 32-bit division when it fits.
__device__ __forceinline__ void split_row(int64_t r, int64_t inner, int64_t& a, int64_t& b) {
  if (inner == 1) {
    a = r, b = 0;
  } else if (r < (int64_t(1) << 32) && inner < (int64_t(1) << 32)) {
    const uint32_t q = uint32_t(r) / uint32_t(inner);
    a = q, b = r - int64_t(q) * inner;
  } else {
    a = r / inner, b = r % inner;
  }
}

__device__ __forceinline__ float to_f32(__nv_bfloat16 v) { return __bfloat162float(v); }
__device__ __forceinline__ float to_f32(__half v) { return __half2float(v); }
template <class T>
__device__ __forceinline__ T from_f32(float v);
template <>
__device__ __forceinline__ __nv_bfloat16 from_f32<__nv_bfloat16>(float v) {
  return __float2bfloat16_rn(v);
}
template <>
__device__ __forceinline__ __half from_f32<__half>(float v) {
  return __float2half_rn(v);
}

template <class T, int kThreadsPerRow>
__global__ void __launch_bounds__(kThreads) gemma_rms_norm_kernel(const __grid_constant__ GemmaRmsNormParams p) {
  constexpr int kRowsPerBlock = kThreads / kThreadsPerRow;
  const int64_t r = int64_t(blockIdx.x) * kRowsPerBlock + threadIdx.x / kThreadsPerRow;
  const int tid = threadIdx.x % kThreadsPerRow;
  __shared__ float warp_sums[kThreads / 32];
  const bool active = r < p.rows;  // block-per-row kernels have no inactive threads
  if (kThreadsPerRow == 32 && !active) return;
  int64_t a, b;
  split_row(r, p.inner, a, b);
  const T* x = static_cast<const T*>(p.x) + a * p.x_s0 + b * p.x_s1;
  T* out = static_cast<T*>(p.out) + a * p.out_s0 + b * p.out_s1;
  T* res = p.residual ? static_cast<T*>(p.residual) + a * p.res_s0 + b * p.res_s1 : nullptr;
  const T* w = static_cast<const T*>(p.weight);

  // phase 1: sum of squares of s = x (+ residual) in fp32.
  float ss = 0.f;
  for (int64_t i = tid; i < p.d; i += kThreadsPerRow) {
    float s = to_f32(x[i]);
    if (res) s = __fadd_rn(s, to_f32(res[i]));
    ss = __fadd_rn(ss, __fmul_rn(s, s));
  }
#pragma unroll
  for (int m = 16; m > 0; m >>= 1) ss = __fadd_rn(ss, __shfl_xor_sync(0xffffffffu, ss, m));
  if constexpr (kThreadsPerRow > 32) {
    if (tid % 32 == 0) warp_sums[tid / 32] = ss;
    __syncthreads();
    ss = 0.f;
#pragma unroll
    for (int k = 0; k < kThreadsPerRow / 32; ++k) ss = __fadd_rn(ss, warp_sums[k]);
  }
  const float inv_rms = __fdiv_rn(1.f, __fsqrt_rn(__fadd_rn(__fdiv_rn(ss, float(p.d)), p.eps)));

  // phase 2: recompute s, store the residual and the normed row.
  for (int64_t i = tid; i < p.d; i += kThreadsPerRow) {
    float s = to_f32(x[i]);
    if (res) {
      s = __fadd_rn(s, to_f32(res[i]));
      res[i] = from_f32<T>(s);
    }
    out[i] = from_f32<T>(__fmul_rn(__fmul_rn(s, inv_rms), __fadd_rn(1.f, to_f32(w[i]))));
  }
}

// Wide rows in registers: piece c (8 elements) of the row belongs to thread c % 256; a thread sums
// its pieces' squares in order, then the warps' sums are added in warp order.
constexpr int kVecMaxPieces = 4;  // d <= 256 * 8 * 4 = 8192

__device__ __forceinline__ void unpack8(const uint4& u, float* f, __nv_bfloat16) {
  const __nv_bfloat162* h = reinterpret_cast<const __nv_bfloat162*>(&u);
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const float2 v = __bfloat1622float2(h[i]);
    f[2 * i] = v.x, f[2 * i + 1] = v.y;
  }
}
__device__ __forceinline__ void unpack8(const uint4& u, float* f, __half) {
  const __half2* h = reinterpret_cast<const __half2*>(&u);
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const float2 v = __half22float2(h[i]);
    f[2 * i] = v.x, f[2 * i + 1] = v.y;
  }
}
template <class T>
__device__ __forceinline__ uint4 pack8(const float* f) {
  uint4 u;
  T* h = reinterpret_cast<T*>(&u);
#pragma unroll
  for (int i = 0; i < 8; ++i) h[i] = from_f32<T>(f[i]);
  return u;
}

template <class T, int kPieces>
__global__ void __launch_bounds__(kThreads) gemma_rms_norm_vec_kernel(const __grid_constant__ GemmaRmsNormParams p) {
  __shared__ float warp_sums[kThreads / 32];
  int64_t a, b;
  split_row(blockIdx.x, p.inner, a, b);
  const T* x = static_cast<const T*>(p.x) + a * p.x_s0 + b * p.x_s1;
  T* out = static_cast<T*>(p.out) + a * p.out_s0 + b * p.out_s1;
  T* res = p.residual ? static_cast<T*>(p.residual) + a * p.res_s0 + b * p.res_s1 : nullptr;
  const int pieces = int(p.d / 8);
  float s[kPieces][8];
  uint4 raw[kPieces], rraw[kPieces];
#pragma unroll
  for (int k = 0; k < kPieces; ++k) {
    const int c = threadIdx.x + k * kThreads;
    if (c < pieces) {
      raw[k] = reinterpret_cast<const uint4*>(x)[c];
      if (res) rraw[k] = reinterpret_cast<const uint4*>(res)[c];
    }
  }
  float ss = 0.f;
#pragma unroll
  for (int k = 0; k < kPieces; ++k) {
    const int c = threadIdx.x + k * kThreads;
    if (c >= pieces) continue;
    unpack8(raw[k], s[k], T());
    if (res) {
      float r[8];
      unpack8(rraw[k], r, T());
#pragma unroll
      for (int i = 0; i < 8; ++i) s[k][i] = __fadd_rn(s[k][i], r[i]);
    }
#pragma unroll
    for (int i = 0; i < 8; ++i) ss = __fadd_rn(ss, __fmul_rn(s[k][i], s[k][i]));
  }
#pragma unroll
  for (int m = 16; m > 0; m >>= 1) ss = __fadd_rn(ss, __shfl_xor_sync(0xffffffffu, ss, m));
  if (threadIdx.x % 32 == 0) warp_sums[threadIdx.x / 32] = ss;
  __syncthreads();
  ss = 0.f;
#pragma unroll
  for (int k = 0; k < kThreads / 32; ++k) ss = __fadd_rn(ss, warp_sums[k]);
  const float inv_rms = __fdiv_rn(1.f, __fsqrt_rn(__fadd_rn(__fdiv_rn(ss, float(p.d)), p.eps)));
#pragma unroll
  for (int k = 0; k < kPieces; ++k) {
    const int c = threadIdx.x + k * kThreads;
    if (c >= pieces) continue;
    float w[8], o[8];
    unpack8(reinterpret_cast<const uint4*>(p.weight)[c], w, T());
#pragma unroll
    for (int i = 0; i < 8; ++i) o[i] = __fmul_rn(__fmul_rn(s[k][i], inv_rms), __fadd_rn(1.f, w[i]));
    if (res) reinterpret_cast<uint4*>(res)[c] = pack8<T>(s[k]);
    reinterpret_cast<uint4*>(out)[c] = pack8<T>(o);
  }
}

bool vec_path_applies(const GemmaRmsNormParams& p) {
  auto aligned = [](const void* q) { return reinterpret_cast<uintptr_t>(q) % 16 == 0; };
  const bool strides = p.x_s0 % 8 == 0 && p.x_s1 % 8 == 0 && p.out_s0 % 8 == 0 && p.out_s1 % 8 == 0 &&
                       (!p.residual || (p.res_s0 % 8 == 0 && p.res_s1 % 8 == 0 && aligned(p.residual)));
  return p.d > 1024 && p.d <= kThreads * 8 * kVecMaxPieces && p.d % 8 == 0 && strides && aligned(p.x) &&
         aligned(p.out) && aligned(p.weight) && p.rows < (int64_t(1) << 31);
}

template <class T>
void launch_vec(const GemmaRmsNormParams& p, cudaStream_t stream) {
  const int pieces = int((p.d / 8 + kThreads - 1) / kThreads);
  const unsigned grid = unsigned(p.rows);
  switch (pieces) {
    case 1: gemma_rms_norm_vec_kernel<T, 1><<<grid, kThreads, 0, stream>>>(p); break;
    case 2: gemma_rms_norm_vec_kernel<T, 2><<<grid, kThreads, 0, stream>>>(p); break;
    case 3: gemma_rms_norm_vec_kernel<T, 3><<<grid, kThreads, 0, stream>>>(p); break;
    default: gemma_rms_norm_vec_kernel<T, 4><<<grid, kThreads, 0, stream>>>(p); break;
  }
  M3RT_LAUNCH_CHECK(stream, "gemma_rms_norm_vec_kernel");
}

// One 128-dim bf16 head per half-warp (head_math.cuh), the fused kernels' exact arithmetic.
__global__ void __launch_bounds__(kThreads) gemma_rms_norm_head_kernel(const __grid_constant__ GemmaRmsNormParams p) {
  using namespace kernels;
  const int64_t r = int64_t(blockIdx.x) * (kThreads / kLanesPerHead) + threadIdx.x / kLanesPerHead;
  if (r >= p.rows) return;
  const int lane = threadIdx.x % 32, j = lane % kLanesPerHead;
  const unsigned mask = lane < kLanesPerHead ? 0x0000ffffu : 0xffff0000u;
  int64_t a, b;
  split_row(r, p.inner, a, b);
  const auto* x = static_cast<const uint16_t*>(p.x) + a * p.x_s0 + b * p.x_s1 + j * kDimsPerLane;
  auto* out = static_cast<uint16_t*>(p.out) + a * p.out_s0 + b * p.out_s1 + j * kDimsPerLane;
  float v[8];
  unpack_bf16x8(*reinterpret_cast<const uint4*>(x), v);
  float w1[8];
  gemma_weight_lane(static_cast<const __nv_bfloat16*>(p.weight) + j * kDimsPerLane, w1);
  gemma_norm_head(v, w1, p.eps, mask);
  store16(out, pack_bf16x8(v));
}

bool head_path_applies(const GemmaRmsNormParams& p) {
  auto aligned = [](const void* q) { return reinterpret_cast<uintptr_t>(q) % 16 == 0; };
  return p.dtype == DType::kBFloat16 && p.d == 128 && !p.residual && aligned(p.x) &&
         aligned(p.out) && aligned(p.weight) && p.x_s0 % 8 == 0 && p.x_s1 % 8 == 0 &&
         p.out_s0 % 8 == 0 && p.out_s1 % 8 == 0;
}

template <class T>
void launch(const GemmaRmsNormParams& p, cudaStream_t stream) {
  if (p.d <= 1024) {
    const int64_t blocks = (p.rows + kThreads / 32 - 1) / (kThreads / 32);
    gemma_rms_norm_kernel<T, 32><<<unsigned(blocks), kThreads, 0, stream>>>(p);
  } else {
    gemma_rms_norm_kernel<T, kThreads><<<unsigned(p.rows), kThreads, 0, stream>>>(p);
  }
  M3RT_LAUNCH_CHECK(stream, "gemma_rms_norm_kernel");
}

}  // namespace

void gemma_rms_norm_launch(const GemmaRmsNormParams& p, CUstream_st* stream) {
  if (p.rows == 0) return;
  if (head_path_applies(p)) {
    const int64_t heads_per_block = kThreads / kernels::kLanesPerHead;
    gemma_rms_norm_head_kernel<<<unsigned((p.rows + heads_per_block - 1) / heads_per_block), kThreads, 0,
                                 stream>>>(p);
    M3RT_LAUNCH_CHECK(stream, "gemma_rms_norm_head_kernel");
  } else if (vec_path_applies(p)) {
    if (p.dtype == DType::kBFloat16) launch_vec<__nv_bfloat16>(p, stream);
    else launch_vec<__half>(p, stream);
  } else if (p.dtype == DType::kBFloat16) {
    launch<__nv_bfloat16>(p, stream);
  } else {
    launch<__half>(p, stream);
  }
}

}  // namespace m3rt
