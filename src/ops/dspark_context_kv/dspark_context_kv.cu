// dspark_context_kv kernel: every draft layer's context K/V into its paged cache, one launch.
//
//   all_kv  [num_ctx, L, 2, nkv, 128] bf16 (token stride given; the rest contiguous)
//   cache_l [num_blocks, nkv, bs, 256] bf16 or e4m3 (uint8), at cache0 + cache_offsets[l]
//   K: bf16(rope(bf16(gemma_norm(k; w_l)), pos)) -> bf16 or e4m3(k / k_scale_l);  V: copy / e4m3
//
// Grid: (layer x kv head, token runs of 16). A half-warp owns one token of one (layer, kv head),
// 8 dims per lane: it reads the K and V rows (256 bytes each) and writes one contiguous 512-byte
// (bf16) or 256-byte (fp8) cache row; every lane works on K and on V. Measured on an H200
// (docs/perf.md): one token per half-warp beat two or four (more registers, fewer resident warps),
// and (layer, head) as the fastest grid dim keeps the running blocks on whole all_kv rows. Rows
// with slot < 0 (padding), slot >= num_slots or a position outside the RoPE table are not written.
// Reference: dspark_context_kv_ref.cpp; checks: src/check/check_cases.cpp, tests/test_ops_cpu.cpp,
// tests/test_gpu.cu (graphs); bench: bench_dspark_context_kv.cu.
#include <algorithm>

#include "core/cuda_check.h"
#include "ops/common/head_math.cuh"
#include "ops/dspark_context_kv/dspark_context_kv.h"

namespace m3rt {
namespace {

constexpr int kThreads = 256;
// Resident blocks of 256 per SM: 6 (48 warps) caps registers at 40, which the bf16 kernel fits
// without spills; the fp8 one needs 5 (51 registers). The kernel is latency-bound, so resident
// warps matter (8 blocks, 32 registers, spills).
template <bool kFp8>
constexpr int kMinBlocksPerSm = kFp8 ? 5 : 6;
constexpr int kTokensPerBlock = kThreads / kernels::kLanesPerHead;  // one token per half-warp
constexpr unsigned kMaxGridY = 65535;

template <int kRotaryDim, bool kFp8>
__global__ void __launch_bounds__(kThreads, kMinBlocksPerSm<kFp8>)
    dspark_context_kv_kernel(const __grid_constant__ DsparkContextKvParams p) {
  using namespace kernels;
  // blockIdx.x: one (layer, kv head) pair, fastest, so the blocks running together read whole
  // all_kv rows; blockIdx.y: a run of 16 tokens (grid-stride past 65535 runs). No 64-bit divisions.
  const int l = int(blockIdx.x) / p.num_kv_heads;
  const int h = int(blockIdx.x) - l * p.num_kv_heads;
  const int j = threadIdx.x % kLanesPerHead;
  const uint16_t* k_src = p.all_kv + (int64_t(l) * 2 * p.num_kv_heads + h) * 128 + j * kDimsPerLane;
  const uint16_t* v_src = k_src + int64_t(p.num_kv_heads) * 128;
  const int64_t elem_size = kFp8 ? 1 : 2;
  void* cache = static_cast<char*>(p.cache0) + p.tables.cache_offsets[l] * elem_size;
  const auto* w_lane = reinterpret_cast<const __nv_bfloat16*>(p.k_norm_weight) + l * 128 + j * kDimsPerLane;
  const auto* table = reinterpret_cast<const __nv_bfloat16*>(p.cos_sin);

  // The loop bound is block-uniform and nothing below branches around the shuffles, so each warp
  // stays converged and shuffles with the full mask (xor distances < 16 stay in each half).
  for (int64_t run = blockIdx.y; run * kTokensPerBlock < p.num_ctx; run += gridDim.y) {
    const int64_t t_raw = run * kTokensPerBlock + threadIdx.x / kLanesPerHead;
    const int64_t t = t_raw < p.num_ctx ? t_raw : p.num_ctx - 1;  // past the end: loads stay in bounds
    // phase 1: the K and V rows and the token's indices, issued together.
    const uint4 k_raw = __ldcs(reinterpret_cast<const uint4*>(k_src + t * p.stride_all_kv_t));  // read once
    const uint4 v_raw = __ldcs(reinterpret_cast<const uint4*>(v_src + t * p.stride_all_kv_t));
    const int64_t slot = __ldg(p.slots + t);
    const int64_t pos = __ldg(p.positions + t);
    // Padding (slot < 0), slots past the cache and positions past the table: not written.
    const bool write = t_raw < p.num_ctx && slot >= 0 && slot < p.num_slots && pos >= 0 && pos < p.max_pos;
    RopeLane rope{};
    if (rope_lane_rotates<kRotaryDim>(j)) rope = load_rope_lane<kRotaryDim>(j, table + (write ? pos : 0) * kRotaryDim);
    const uint4 w_raw = gemma_weight_lane(w_lane);
    E4m3Quantizer k_q, v_q;
    if constexpr (kFp8) {
      k_q = E4m3Quantizer(__ldg(p.scale0 + p.tables.scale_offsets[l]));
      v_q = E4m3Quantizer(__ldg(p.scale0 + p.tables.scale_offsets[p.num_layers + l]));
    }
    // phase 2: V copied; K normed in fp32, materialized to bf16, rotated in fp32, rounded; both
    // halves of one contiguous cache row.
    const int64_t row = cache_row_offset(write ? slot : 0, p.block_size_log2, p.stride_cache_block,
                                         p.stride_cache_head, h) + j * kDimsPerLane;
    if (write) store_cache_copy<kFp8>(cache, row + 128, v_raw, v_q);
    float x[8];
    unpack_bf16x8(k_raw, x);
    gemma_norm_head(x, w_raw, p.eps, kFullMask);
    round_bf16x8(x);
    rope_neox_head<kRotaryDim>(x, j, rope, kFullMask);
    round_bf16x8(x);
    if (write) store_cache_lane<kFp8>(cache, row, x, k_q);
  }
}

template <int kRotaryDim, bool kFp8>
void launch(const DsparkContextKvParams& p, cudaStream_t stream) {
  const int64_t runs = (p.num_ctx + kTokensPerBlock - 1) / kTokensPerBlock;
  const dim3 grid(unsigned(p.num_layers * p.num_kv_heads), unsigned(std::min<int64_t>(runs, kMaxGridY)));
  dspark_context_kv_kernel<kRotaryDim, kFp8><<<grid, kThreads, 0, stream>>>(p);
  M3RT_LAUNCH_CHECK(stream, "dspark_context_kv_kernel");
}

template <bool kFp8>
void launch_rotary(const DsparkContextKvParams& p, cudaStream_t stream) {
  switch (p.rotary_dim) {
    case 16: return launch<16, kFp8>(p, stream);
    case 32: return launch<32, kFp8>(p, stream);
    case 64: return launch<64, kFp8>(p, stream);
  }
  throw Error("dspark_context_kv_launch: rotary_dim " + std::to_string(p.rotary_dim) +
              " has no kernel (16, 32, 64)");
}

}  // namespace

void dspark_context_kv_launch(const DsparkContextKvParams& p, CUstream_st* stream) {
  if (p.num_ctx == 0) return;
  if (p.fp8) {
    launch_rotary<true>(p, stream);
  } else {
    launch_rotary<false>(p, stream);
  }
}

}  // namespace m3rt
