// swiglu_oai kernel: out[t, i] = g * sigmoid(alpha * g) * (u + beta) with g = min(gate, limit) and
// u = clamp(up, -limit, limit), from gate_up [T, 2I] = [gate | up]; fp32 math, one rounding.
// Grid-stride over T*I elements, one element per thread step (coalesced); expf is CUDA's
// full-precision exp (<= 2 ulp), so results can differ from the reference by one output ulp.
// Reference: swiglu_oai_ref.cpp; checks: check_swiglu_oai.cpp (m3rt check), test_swiglu_oai.cpp.
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include "core/cuda_check.h"
#include "ops/swiglu_oai/swiglu_oai.h"

namespace m3rt {
namespace {

constexpr int kThreads = 256;

__device__ __forceinline__ float to_f32(__nv_bfloat16 v) { return __bfloat162float(v); }
__device__ __forceinline__ float to_f32(__half v) { return __half2float(v); }
__device__ __forceinline__ void store(__nv_bfloat16* p, float v) { *p = __float2bfloat16_rn(v); }
__device__ __forceinline__ void store(__half* p, float v) { *p = __float2half_rn(v); }

template <class T>
__global__ void __launch_bounds__(kThreads) swiglu_oai_kernel(const __grid_constant__ SwigluOaiKernelParams p) {
  const T* in = static_cast<const T*>(p.gate_up);
  T* out = static_cast<T*>(p.out);
  const int64_t n = p.rows * p.inner;
  for (int64_t e = int64_t(blockIdx.x) * kThreads + threadIdx.x; e < n;
       e += int64_t(gridDim.x) * kThreads) {
    const int64_t r = e / p.inner, i = e % p.inner;
    const float g = fminf(to_f32(in[r * p.in_s0 + i]), p.limit);
    const float u = fminf(fmaxf(to_f32(in[r * p.in_s0 + p.inner + i]), -p.limit), p.limit);
    const float sig = __fdiv_rn(1.f, __fadd_rn(1.f, expf(-__fmul_rn(p.alpha, g))));
    store(out + r * p.out_s0 + i, __fmul_rn(__fmul_rn(g, sig), __fadd_rn(u, p.beta)));
  }
}

}  // namespace

void swiglu_oai_launch(const SwigluOaiKernelParams& p, CUstream_st* stream) {
  const int64_t n = p.rows * p.inner;
  if (n == 0) return;
  const int64_t blocks = std::min<int64_t>((n + kThreads - 1) / kThreads, 65536);
  if (p.dtype == DType::kBFloat16) {
    swiglu_oai_kernel<__nv_bfloat16><<<unsigned(blocks), kThreads, 0, stream>>>(p);
  } else {
    swiglu_oai_kernel<__half><<<unsigned(blocks), kThreads, 0, stream>>>(p);
  }
  M3RT_LAUNCH_CHECK(stream, "swiglu_oai_kernel");
}

}  // namespace m3rt
