// reshape_and_cache kernel: one layer's K/V rows into its paged cache by slot.
//
//   key, value [T, nkv, 128] bf16 (token/head strides in elements, multiples of 8)
//   cache      [num_blocks, nkv, bs, 256] bf16 or e4m3 (uint8): K at [..., :128], V at [..., 128:]
//
// Grid: (token runs, kv heads), one warp per (token, kv head); lanes 0..15 carry K, 16..31 V, 8 dims each, so a warp
// writes one contiguous cache row. slot < 0 or >= num_slots: nothing is written.
// Reference: reshape_and_cache_ref.cpp; checks: check_reshape_and_cache.cpp (m3rt check),
// test_reshape_and_cache.cpp.
#include "core/cuda_check.h"
#include "ops/common/head_math.cuh"
#include "ops/reshape_and_cache/reshape_and_cache.h"

namespace m3rt {
namespace {

constexpr int kThreads = 256;
constexpr int kWarpsPerBlock = kThreads / 32;

template <bool kFp8>
__global__ void __launch_bounds__(kThreads)
    reshape_and_cache_kernel(const __grid_constant__ ReshapeAndCacheParams p) {
  using namespace kernels;
  // blockIdx.y: the kv head; blockIdx.x: a run of kWarpsPerBlock tokens.
  const int64_t t = int64_t(blockIdx.x) * kWarpsPerBlock + threadIdx.x / 32;
  if (t >= p.num_tokens) return;
  const int lane = threadIdx.x % 32, side = lane / kLanesPerHead, j = lane % kLanesPerHead;
  const int h = int(blockIdx.y);
  const uint16_t* src = side == 0 ? p.key + t * p.stride_key_t + h * p.stride_key_h
                                  : p.value + t * p.stride_value_t + h * p.stride_value_h;
  const uint4 raw = __ldcs(reinterpret_cast<const uint4*>(src + j * kDimsPerLane));
  const int64_t slot = __ldg(p.slots + t);
  if (slot < 0 || slot >= p.num_slots) return;
  const int64_t row = cache_row_offset(slot, p.block_size_log2, p.stride_cache_block,
                                       p.stride_cache_head, h);
  E4m3Quantizer quant;
  if constexpr (kFp8) quant = E4m3Quantizer(__ldg(side == 0 ? p.k_scale : p.v_scale));
  store_cache_copy<kFp8>(p.cache, row + side * 128 + j * kDimsPerLane, raw, quant);
}

}  // namespace

void reshape_and_cache_launch(const ReshapeAndCacheParams& p, CUstream_st* stream) {
  if (p.num_tokens == 0) return;
  const dim3 grid(unsigned((p.num_tokens + kWarpsPerBlock - 1) / kWarpsPerBlock), unsigned(p.num_kv_heads));
  if (p.fp8) {
    reshape_and_cache_kernel<true><<<grid, kThreads, 0, stream>>>(p);
  } else {
    reshape_and_cache_kernel<false><<<grid, kThreads, 0, stream>>>(p);
  }
  M3RT_LAUNCH_CHECK(stream, "reshape_and_cache_kernel");
}

}  // namespace m3rt
