// dspark_context_kv kernel: every draft layer's context K/V into its paged cache, one launch.
//
//   all_kv  [num_ctx, L, 2, nkv, 128] bf16 (token stride given; the rest contiguous)
//   cache_l [num_blocks, nkv, bs, 256] bf16 or e4m3 (uint8), at cache0 + cache_offsets[l]
//   K: bf16(rope(bf16(gemma_norm(k; w_l)), pos)) -> bf16 or e4m3(k / k_scale_l);  V: copy / e4m3
//
// Grid: (token runs, layer x kv head). A warp owns two tokens of one (layer, kv head); lanes 0..15
// own K (8 dims each), lanes 16..31 own V, so per token a warp reads two 256-byte rows and writes
// one contiguous 512-byte (bf16) or 256-byte (fp8) cache row. Rows with slot < 0 (padding), slot >= num_slots or a position outside the RoPE table
// are not written. Reference: dspark_context_kv_ref.cpp; test: test_dspark_context_kv.cpp;
// bench: bench_dspark_context_kv.cu.
#include "core/cuda_check.h"
#include "ops/common/head_math.cuh"
#include "ops/dspark_context_kv/dspark_context_kv.h"

namespace m3rt {
namespace {

constexpr int kThreads = 256;
constexpr int kWarpsPerBlock = kThreads / 32;
// Tokens per warp: their row loads are all issued before any is used, so each thread keeps this
// many 16-byte loads in flight (one alone leaves DRAM latency exposed).
constexpr int kTokensPerWarp = 2;
constexpr int kTokensPerBlock = kWarpsPerBlock * kTokensPerWarp;

template <int kRotaryDim, bool kFp8>
__global__ void __launch_bounds__(kThreads)
    dspark_context_kv_kernel(const __grid_constant__ DsparkContextKvParams p) {
  using namespace kernels;
  // blockIdx.y: one (layer, kv head) pair; blockIdx.x: a run of tokens. No 64-bit divisions.
  const int l = int(blockIdx.y) / p.num_kv_heads;
  const int h = int(blockIdx.y) - l * p.num_kv_heads;
  const int lane = threadIdx.x % 32;
  const int side = lane / kLanesPerHead;  // 0: K, 1: V
  const int j = lane % kLanesPerHead;
  const int64_t t0 = int64_t(blockIdx.x) * kTokensPerBlock + (threadIdx.x / 32) * kTokensPerWarp;

  // phase 1: every row load and index load of the warp's tokens, before any use.
  const uint16_t* src = p.all_kv + ((int64_t(l) * 2 + side) * p.num_kv_heads + h) * 128 + j * kDimsPerLane;
  uint4 raw[kTokensPerWarp];
  int64_t slot[kTokensPerWarp], pos[kTokensPerWarp];
#pragma unroll
  for (int i = 0; i < kTokensPerWarp; ++i) {
    const int64_t t = t0 + i;
    slot[i] = -1;
    if (t < p.num_ctx) {
      raw[i] = __ldcs(reinterpret_cast<const uint4*>(src + t * p.stride_all_kv_t));  // read once
      slot[i] = __ldg(p.slots + t);
      pos[i] = __ldg(p.positions + t);
    }
  }
  const int64_t elem_size = kFp8 ? 1 : 2;
  void* cache = static_cast<char*>(p.cache0) + p.tables.cache_offsets[l] * elem_size;
  float scale = 1.f;
  if constexpr (kFp8) scale = __ldg(p.scale0 + p.tables.scale_offsets[side * p.num_layers + l]);
  const auto* w = reinterpret_cast<const __nv_bfloat16*>(p.k_norm_weight) + l * 128 + j * kDimsPerLane;

#pragma unroll
  for (int i = 0; i < kTokensPerWarp; ++i) {
    // Padding (slot < 0), slots past the cache and positions past the table: not written.
    if (slot[i] < 0 || slot[i] >= p.num_slots || pos[i] < 0 || pos[i] >= p.max_pos) continue;  // warp-uniform
    float x[8];
    unpack_bf16x8(raw[i], x);
    if (side == 0) {
      // phase 2 (K lanes): norm in fp32, materialize to bf16, rotate in fp32, round to bf16.
      constexpr unsigned kKMask = 0x0000ffffu;
      gemma_norm_head(x, w, p.eps, kKMask);
      round_bf16x8(x);
      const auto* cs_row = reinterpret_cast<const __nv_bfloat16*>(p.cos_sin) + pos[i] * kRotaryDim;
      rope_neox_head<kRotaryDim>(x, j, cs_row, kKMask);
      round_bf16x8(x);
    }
    // phase 3: K lanes fill [row, row+128), V lanes [row+128, row+256): one contiguous cache row.
    const int64_t row = cache_row_offset(slot[i], p.block_size_log2, p.stride_cache_block,
                                         p.stride_cache_head, h);
    store_cache_lane<kFp8>(cache, row + side * 128 + j * kDimsPerLane, x, scale);
  }
}

template <int kRotaryDim, bool kFp8>
void launch(const DsparkContextKvParams& p, cudaStream_t stream) {
  const dim3 grid(unsigned((p.num_ctx + kTokensPerBlock - 1) / kTokensPerBlock),  // <= 2^31-1
                  unsigned(p.num_layers * p.num_kv_heads));                      // <= 65535
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
