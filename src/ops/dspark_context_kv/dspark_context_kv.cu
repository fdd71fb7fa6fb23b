// dspark_context_kv kernel: every draft layer's context K/V into its paged cache, one launch.
//
//   all_kv  [num_ctx, L, 2, nkv, 128] bf16 (token stride given; the rest contiguous)
//   cache_l [num_blocks, nkv, bs, 256] bf16 or e4m3 (uint8), at cache0 + cache_offsets[l]
//   K: bf16(rope(bf16(gemma_norm(k; w_l)), pos)) -> bf16 or e4m3(k / k_scale_l);  V: copy / e4m3
//
// Grid: (token runs, layer x kv head). A half-warp owns one or a few tokens of one (layer, kv head),
// 8 dims per lane: per token it reads the K and V rows (256 bytes each) and writes one contiguous
// 512-byte (bf16) or 256-byte (fp8) cache row; every lane works on K and on V. Rows with slot < 0 (padding), slot >= num_slots or a position outside the RoPE table
// are not written. Reference: dspark_context_kv_ref.cpp; test: test_dspark_context_kv.cpp;
// bench: bench_dspark_context_kv.cu.
#include "core/cuda_check.h"
#include "ops/common/head_math.cuh"
#include "ops/dspark_context_kv/dspark_context_kv.h"

namespace m3rt {
namespace {

constexpr int kThreads = 256;
constexpr int kWorkersPerBlock = kThreads / kernels::kLanesPerHead;  // half-warps

// A worker (half-warp) owns kTokens tokens of one (layer, kv head): it issues all their K and V
// row loads, then all their RoPE-table loads, before using any, so each lane keeps 2 * kTokens
// 16-byte loads in flight and pays the position -> table dependency once.
template <int kRotaryDim, bool kFp8, int kTokens>
__global__ void __launch_bounds__(kThreads)
    dspark_context_kv_kernel(const __grid_constant__ DsparkContextKvParams p) {
  using namespace kernels;
  // blockIdx.y: one (layer, kv head) pair; blockIdx.x: a run of tokens. No 64-bit divisions.
  const int l = int(blockIdx.y) / p.num_kv_heads;
  const int h = int(blockIdx.y) - l * p.num_kv_heads;
  const int lane = threadIdx.x % 32;
  const int j = lane % kLanesPerHead;
  const unsigned mask = lane < kLanesPerHead ? 0x0000ffffu : 0xffff0000u;
  const int64_t t0 = (int64_t(blockIdx.x) * kWorkersPerBlock + threadIdx.x / kLanesPerHead) * kTokens;

  // phase 1: K and V row loads and the index loads of every token, before any use.
  const uint16_t* k_src = p.all_kv + (int64_t(l) * 2 * p.num_kv_heads + h) * 128 + j * kDimsPerLane;
  const uint16_t* v_src = k_src + int64_t(p.num_kv_heads) * 128;
  uint4 k_raw[kTokens], v_raw[kTokens];
  int64_t slot[kTokens], pos[kTokens];
#pragma unroll
  for (int i = 0; i < kTokens; ++i) {
    const int64_t t = t0 + i;
    slot[i] = -1;
    pos[i] = 0;
    if (t < p.num_ctx) {
      k_raw[i] = __ldcs(reinterpret_cast<const uint4*>(k_src + t * p.stride_all_kv_t));  // read once
      v_raw[i] = __ldcs(reinterpret_cast<const uint4*>(v_src + t * p.stride_all_kv_t));
      slot[i] = __ldg(p.slots + t);
      pos[i] = __ldg(p.positions + t);
    }
  }
  // Padding (slot < 0), slots past the cache and positions past the table: not written.
#pragma unroll
  for (int i = 0; i < kTokens; ++i)
    if (slot[i] >= p.num_slots || pos[i] < 0 || pos[i] >= p.max_pos) slot[i] = -1;
  // phase 2: the RoPE table loads of every token (they depend on the positions).
  RopeLane rope[kTokens];
  const auto* table = reinterpret_cast<const __nv_bfloat16*>(p.cos_sin);
#pragma unroll
  for (int i = 0; i < kTokens; ++i)
    if (slot[i] >= 0 && rope_lane_rotates<kRotaryDim>(j))
      rope[i] = load_rope_lane<kRotaryDim>(j, table + pos[i] * kRotaryDim);
  float w1[8];
  gemma_weight_lane(reinterpret_cast<const __nv_bfloat16*>(p.k_norm_weight) + l * 128 + j * kDimsPerLane, w1);
  const int64_t elem_size = kFp8 ? 1 : 2;
  void* cache = static_cast<char*>(p.cache0) + p.tables.cache_offsets[l] * elem_size;
  float k_scale = 1.f, v_scale = 1.f;
  if constexpr (kFp8) {
    k_scale = __ldg(p.scale0 + p.tables.scale_offsets[l]);
    v_scale = __ldg(p.scale0 + p.tables.scale_offsets[p.num_layers + l]);
  }

  // phase 3: per token, V copied, K normed in fp32, materialized to bf16, rotated in fp32, rounded;
  // both halves of one contiguous cache row.
#pragma unroll
  for (int i = 0; i < kTokens; ++i) {
    if (slot[i] < 0) continue;  // uniform per half-warp
    const int64_t row = cache_row_offset(slot[i], p.block_size_log2, p.stride_cache_block,
                                         p.stride_cache_head, h) + j * kDimsPerLane;
    store_cache_copy<kFp8>(cache, row + 128, v_raw[i], v_scale);
    float x[8];
    unpack_bf16x8(k_raw[i], x);
    gemma_norm_head(x, w1, p.eps, mask);
    round_bf16x8(x);
    rope_neox_head<kRotaryDim>(x, j, rope[i], mask);
    round_bf16x8(x);
    store_cache_lane<kFp8>(cache, row, x, k_scale);
  }
}

template <int kRotaryDim, bool kFp8, int kTokens>
void launch(const DsparkContextKvParams& p, cudaStream_t stream) {
  constexpr int kTokensPerBlock = kWorkersPerBlock * kTokens;
  const dim3 grid(unsigned((p.num_ctx + kTokensPerBlock - 1) / kTokensPerBlock),  // <= 2^31-1
                  unsigned(p.num_layers * p.num_kv_heads));                      // <= 65535
  dspark_context_kv_kernel<kRotaryDim, kFp8, kTokens><<<grid, kThreads, 0, stream>>>(p);
  M3RT_LAUNCH_CHECK(stream, "dspark_context_kv_kernel");
}

template <int kRotaryDim, bool kFp8>
void launch(const DsparkContextKvParams& p, cudaStream_t stream) {
  // Small calls are latency-bound: one token per worker spreads them over more SMs.
  int tokens = p.num_ctx <= 4096 ? 1 : 2;
  if (const int forced = detail::tuning_tokens_per_worker()) tokens = forced;
  if (tokens == 1) return launch<kRotaryDim, kFp8, 1>(p, stream);
  if (tokens == 4) return launch<kRotaryDim, kFp8, 4>(p, stream);
  launch<kRotaryDim, kFp8, 2>(p, stream);
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
