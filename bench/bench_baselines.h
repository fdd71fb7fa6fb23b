// Unfused baselines the fused ops are timed against: the separate kernels an engine would run
// without them. Gemma norm and the cache insert are m3rt's own ops (gemma_rms_norm,
// reshape_and_cache); RoPE is the plain in-place kernel in bench_baselines.cu.
#pragma once

#include <cuda_bf16.h>
#include <cuda_runtime_api.h>

#include <cstdint>

namespace m3rt::bench {

// In-place partial NeoX RoPE on bf16 heads x[t, h, :] at base + t * stride_t + h * 128, fp32 math,
// one thread per rotated pair.
void rope_neox_inplace(__nv_bfloat16* base, int64_t stride_t, int64_t T, int H,
                       const int64_t* positions, const __nv_bfloat16* cos_sin, int rotary_dim,
                       cudaStream_t s);

}  // namespace m3rt::bench
