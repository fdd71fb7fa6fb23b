// qknorm_rope_kv_insert kernel: per-head Gemma RMSNorm + partial NeoX RoPE of q and k in place on a
// dense qkv row, optional q outputs (bf16 copy, e4m3), optional K/V insert into a paged cache.
//
//   qkv    [T, (nq + 2 nkv) * 128] bf16: [q heads | k heads | v heads]
//   cache  [num_blocks, nkv, bs, 256] bf16 or e4m3 (uint8)
//
// Grid: (token pairs, runs of 16 head items). A half-warp (16 lanes x 8 dims) owns one head item
// for two tokens; a token has nq q items, nkv k items and, when inserting, nkv v items. The two halves of a warp may hold different tokens or
// kinds of item, so every shuffle names its own half's lanes. Tokens whose position lies outside
// the RoPE table are not written, nor are cache rows for slot < 0 or slot >= num_slots.
// Reference: qknorm_rope_kv_insert_ref.cpp; test: test_qknorm_rope_kv_insert.cpp;
// bench: bench_qknorm_rope_kv_insert.cu.
#include "core/cuda_check.h"
#include "ops/common/head_math.cuh"
#include "ops/qknorm_rope_kv_insert/qknorm_rope_kv_insert.h"

namespace m3rt {
namespace {

constexpr int kThreads = 256;
constexpr int kItemsPerBlock = kThreads / kernels::kLanesPerHead;  // head items (half-warps)
// Tokens per half-warp: their row loads are issued together, so each thread keeps this many
// 16-byte loads in flight.
constexpr int kTokensPerItem = 2;

template <int kRotaryDim, QkvInsertMode kInsert>
__global__ void __launch_bounds__(kThreads)
    qknorm_rope_kv_insert_kernel(const __grid_constant__ QknormRopeKvInsertParams p) {
  using namespace kernels;
  constexpr bool kHasInsert = kInsert != QkvInsertMode::kNone;
  constexpr bool kFp8 = kInsert == QkvInsertMode::kFp8;
  const int nq = p.num_heads, nkv = p.num_kv_heads;
  const int items = nq + nkv * (kHasInsert ? 2 : 1);
  // blockIdx.y: a run of 16 head items; blockIdx.x: a run of tokens. No 64-bit divisions.
  const int s = int(blockIdx.y) * kItemsPerBlock + int(threadIdx.x) / kLanesPerHead;
  if (s >= items) return;  // uniform per half-warp
  const int lane = threadIdx.x % 32;
  const int j = lane % kLanesPerHead;
  const unsigned mask = (lane < kLanesPerHead) ? 0x0000ffffu : 0xffff0000u;
  const int64_t t0 = int64_t(blockIdx.x) * kTokensPerItem;
  const bool is_q = s < nq, is_v = s >= nq + nkv;

  // phase 1: the item's row loads for every token, and the token indices.
  uint4 raw[kTokensPerItem];
  int64_t pos[kTokensPerItem], slot[kTokensPerItem];
#pragma unroll
  for (int i = 0; i < kTokensPerItem; ++i) {
    const int64_t t = t0 + i;
    pos[i] = -1;
    slot[i] = -1;
    if (t < p.num_tokens) {
      raw[i] = *reinterpret_cast<const uint4*>(p.qkv + t * p.stride_qkv_t + int64_t(s) * 128 + j * kDimsPerLane);
      pos[i] = __ldg(p.positions + t);
      if constexpr (kHasInsert) slot[i] = __ldg(p.slots + t);
    }
  }
  const auto* w = reinterpret_cast<const __nv_bfloat16*>(is_q ? p.q_norm_weight : p.k_norm_weight) +
                  j * kDimsPerLane;
  float scale = 1.f;
  if constexpr (kFp8) scale = __ldg(is_v ? p.v_scale : p.k_scale);

#pragma unroll
  for (int i = 0; i < kTokensPerItem; ++i) {
    const int64_t t = t0 + i;
    if (pos[i] < 0 || pos[i] >= p.max_pos) continue;  // past the end, or outside the RoPE table
    uint16_t* head = p.qkv + t * p.stride_qkv_t + int64_t(s) * 128 + j * kDimsPerLane;
    const bool write_cache = kHasInsert && slot[i] >= 0 && slot[i] < p.num_slots;
    float x[8];
    unpack_bf16x8(raw[i], x);
    if (is_v) {
      // V item (insert only): copied to the cache, never changed in qkv.
      if (write_cache) {
        const int64_t row = cache_row_offset(slot[i], p.block_size_log2, p.stride_cache_block,
                                             p.stride_cache_head, s - nq - nkv);
        store_cache_lane<kFp8>(p.cache, row + 128 + j * kDimsPerLane, x, scale);
      }
      continue;
    }
    // phase 2: Q or K item: norm and rope in fp32, one rounding.
    gemma_norm_head(x, w, p.eps, mask);
    const auto* cs_row = reinterpret_cast<const __nv_bfloat16*>(p.cos_sin) + pos[i] * kRotaryDim;
    rope_neox_head<kRotaryDim>(x, j, cs_row, mask);
    round_bf16x8(x);
    const uint4 out = pack_bf16x8(x);
    // phase 3: stores.
    if (is_q) {
      const int64_t o = t * int64_t(nq) * 128 + int64_t(s) * 128 + j * kDimsPerLane;
      if (p.q_out) *reinterpret_cast<uint4*>(p.q_out + o) = out;
      if (p.q_fp8_out) {
        float q[8];
#pragma unroll
        for (int e = 0; e < 8; ++e) q[e] = __fmul_rn(x[e], p.q_fp8_inv_scale);
        *reinterpret_cast<uint2*>(p.q_fp8_out + o) = pack_e4m3x8(q);
      }
      if (p.q_in_place) *reinterpret_cast<uint4*>(head) = out;
      continue;
    }
    *reinterpret_cast<uint4*>(head) = out;
    if (write_cache) {
      const int64_t row = cache_row_offset(slot[i], p.block_size_log2, p.stride_cache_block,
                                           p.stride_cache_head, s - nq);
      store_cache_lane<kFp8>(p.cache, row + j * kDimsPerLane, x, scale);
    }
  }
}

template <int kRotaryDim, QkvInsertMode kInsert>
void launch(const QknormRopeKvInsertParams& p, cudaStream_t stream) {
  const int items = p.num_heads + p.num_kv_heads * (kInsert != QkvInsertMode::kNone ? 2 : 1);
  const dim3 grid(unsigned((p.num_tokens + kTokensPerItem - 1) / kTokensPerItem),  // <= 2^31-1
                  unsigned((items + kItemsPerBlock - 1) / kItemsPerBlock));        // <= 65535
  qknorm_rope_kv_insert_kernel<kRotaryDim, kInsert><<<grid, kThreads, 0, stream>>>(p);
  M3RT_LAUNCH_CHECK(stream, "qknorm_rope_kv_insert_kernel");
}

template <QkvInsertMode kInsert>
void launch_rotary(const QknormRopeKvInsertParams& p, cudaStream_t stream) {
  switch (p.rotary_dim) {
    case 16: return launch<16, kInsert>(p, stream);
    case 32: return launch<32, kInsert>(p, stream);
    case 64: return launch<64, kInsert>(p, stream);
  }
  throw Error("qknorm_rope_kv_insert_launch: rotary_dim " + std::to_string(p.rotary_dim) +
              " has no kernel (16, 32, 64)");
}

}  // namespace

void qknorm_rope_kv_insert_launch(const QknormRopeKvInsertParams& p, CUstream_st* stream) {
  if (p.num_tokens == 0) return;
  switch (p.insert) {
    case QkvInsertMode::kNone: return launch_rotary<QkvInsertMode::kNone>(p, stream);
    case QkvInsertMode::kBFloat16: return launch_rotary<QkvInsertMode::kBFloat16>(p, stream);
    case QkvInsertMode::kFp8: return launch_rotary<QkvInsertMode::kFp8>(p, stream);
  }
}

}  // namespace m3rt
