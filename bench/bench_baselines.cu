// The unfused RoPE baseline kernel (bench_baselines.h).
#include "bench_baselines.h"

namespace m3rt::bench {

// In-place partial NeoX RoPE on bf16 heads: x[t, h, :] at base + t * stride_t + h * 128, fp32
// math, one thread per rotated pair.
namespace {
__global__ void rope_neox_inplace_kernel(__nv_bfloat16* base, int64_t stride_t, int64_t T, int H,
                                         const int64_t* positions, const __nv_bfloat16* cos_sin,
                                         int rotary_dim) {
  const int half = rotary_dim / 2;
  const int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i >= T * H * half) return;
  const int d = int(i % half);
  const int h = int((i / half) % H);
  const int64_t t = i / (int64_t(half) * H);
  __nv_bfloat16* x = base + t * stride_t + h * 128;
  const __nv_bfloat16* row = cos_sin + positions[t] * rotary_dim;
  const float c = __bfloat162float(row[d]), s = __bfloat162float(row[half + d]);
  const float a = __bfloat162float(x[d]), b = __bfloat162float(x[d + half]);
  x[d] = __float2bfloat16_rn(a * c - b * s);
  x[d + half] = __float2bfloat16_rn(b * c + a * s);
}
}  // namespace

void rope_neox_inplace(__nv_bfloat16* base, int64_t stride_t, int64_t T, int H,
                              const int64_t* positions, const __nv_bfloat16* cos_sin, int rotary_dim,
                              cudaStream_t s) {
  const int64_t n = T * H * (rotary_dim / 2);
  rope_neox_inplace_kernel<<<unsigned((n + 255) / 256), 256, 0, s>>>(base, stride_t, T, H, positions,
                                                                     cos_sin, rotary_dim);
}

}  // namespace m3rt::bench
