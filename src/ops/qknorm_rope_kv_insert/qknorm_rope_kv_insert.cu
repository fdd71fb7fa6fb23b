// qknorm_rope_kv_insert kernel: per-head Gemma RMSNorm + partial NeoX RoPE of q and k in place on a
// dense qkv row, optional q outputs (bf16 copy, e4m3), optional K/V insert into a paged cache.
//
//   qkv    [T, (nq + 2 nkv) * 128] bf16: [q heads | k heads | v heads]
//   cache  [num_blocks, nkv, bs, 256] bf16 or e4m3 (uint8)
//
// Grid: (token runs, runs of 16 head items). A half-warp (16 lanes x 8 dims) owns one head item
// for one to four tokens; a token has nq q items, nkv k items and, when inserting, nkv v items. The two halves of a warp may hold different tokens or
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

// A worker (half-warp) owns one head item for kTokens tokens: their row loads are issued together,
// then their RoPE-table loads, so each lane keeps kTokens 16-byte loads in flight and pays the
// position -> table dependency once.
template <int kRotaryDim, QkvInsertMode kInsert, int kTokens>
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
  const int64_t t0 = int64_t(blockIdx.x) * kTokens;
  const bool is_q = s < nq, is_v = s >= nq + nkv;

  // phase 1: the item's row loads for every token, and the token indices.
  uint4 raw[kTokens];
  int64_t pos[kTokens], slot[kTokens];
#pragma unroll
  for (int i = 0; i < kTokens; ++i) {
    const int64_t t = t0 + i;
    pos[i] = -1;
    slot[i] = -1;
    if (t < p.num_tokens) {
      raw[i] = *reinterpret_cast<const uint4*>(p.qkv + t * p.stride_qkv_t + int64_t(s) * 128 + j * kDimsPerLane);
      pos[i] = __ldg(p.positions + t);
      if constexpr (kHasInsert) slot[i] = __ldg(p.slots + t);
    }
  }
  // A token whose position lies outside the RoPE table (or past the end) is not written.
#pragma unroll
  for (int i = 0; i < kTokens; ++i)
    if (pos[i] >= p.max_pos) pos[i] = -1;
  // phase 2: the RoPE table loads of every token (q and k items only).
  RopeLane rope[kTokens];
  const auto* table = reinterpret_cast<const __nv_bfloat16*>(p.cos_sin);
#pragma unroll
  for (int i = 0; i < kTokens; ++i)
    if (!is_v && pos[i] >= 0 && rope_lane_rotates<kRotaryDim>(j))
      rope[i] = load_rope_lane<kRotaryDim>(j, table + pos[i] * kRotaryDim);
  float w1[8];
  if (!is_v)
    gemma_weight_lane(reinterpret_cast<const __nv_bfloat16*>(is_q ? p.q_norm_weight : p.k_norm_weight) +
                          j * kDimsPerLane, w1);
  float scale = 1.f;
  if constexpr (kFp8) scale = __ldg(is_v ? p.v_scale : p.k_scale);

#pragma unroll
  for (int i = 0; i < kTokens; ++i) {
    const int64_t t = t0 + i;
    if (pos[i] < 0) continue;  // uniform per half-warp
    uint16_t* head = p.qkv + t * p.stride_qkv_t + int64_t(s) * 128 + j * kDimsPerLane;
    const bool write_cache = kHasInsert && slot[i] >= 0 && slot[i] < p.num_slots;
    if (is_v) {
      // V item (insert only): copied to the cache, never changed in qkv.
      if (write_cache) {
        const int64_t row = cache_row_offset(slot[i], p.block_size_log2, p.stride_cache_block,
                                             p.stride_cache_head, s - nq - nkv);
        store_cache_copy<kFp8>(p.cache, row + 128 + j * kDimsPerLane, raw[i], scale);
      }
      continue;
    }
    // phase 3: Q or K item: norm and rope in fp32, one rounding.
    float x[8];
    unpack_bf16x8(raw[i], x);
    gemma_norm_head(x, w1, p.eps, mask);
    rope_neox_head<kRotaryDim>(x, j, rope[i], mask);
    const uint4 out = pack_bf16x8(x);
    // phase 4: stores.
    if (is_q) {
      const int64_t o = t * int64_t(nq) * 128 + int64_t(s) * 128 + j * kDimsPerLane;
      if (p.q_out) *reinterpret_cast<uint4*>(p.q_out + o) = out;
      if (p.q_fp8_out) {
        float q[8];
        unpack_bf16x8(out, q);  // the bf16-rounded q
#pragma unroll
        for (int e = 0; e < 8; ++e) q[e] = __fmul_rn(q[e], p.q_fp8_inv_scale);
        *reinterpret_cast<uint2*>(p.q_fp8_out + o) = pack_e4m3x8(q);
      }
      if (p.q_in_place) *reinterpret_cast<uint4*>(head) = out;
      continue;
    }
    *reinterpret_cast<uint4*>(head) = out;
    if (write_cache) {
      const int64_t row = cache_row_offset(slot[i], p.block_size_log2, p.stride_cache_block,
                                           p.stride_cache_head, s - nq);
      store_cache_copy<kFp8>(p.cache, row + j * kDimsPerLane, out, scale);
    }
  }
}

template <int kRotaryDim, QkvInsertMode kInsert, int kTokens>
void launch(const QknormRopeKvInsertParams& p, cudaStream_t stream) {
  const int items = p.num_heads + p.num_kv_heads * (kInsert != QkvInsertMode::kNone ? 2 : 1);
  const dim3 grid(unsigned((p.num_tokens + kTokens - 1) / kTokens),       // <= 2^31-1
                  unsigned((items + kItemsPerBlock - 1) / kItemsPerBlock));  // <= 65535
  qknorm_rope_kv_insert_kernel<kRotaryDim, kInsert, kTokens><<<grid, kThreads, 0, stream>>>(p);
  M3RT_LAUNCH_CHECK(stream, "qknorm_rope_kv_insert_kernel");
}

template <int kRotaryDim, QkvInsertMode kInsert>
void launch(const QknormRopeKvInsertParams& p, cudaStream_t stream) {
  // Few tokens: one per worker spreads the call over more SMs.
  int tokens = p.num_tokens <= 256 ? 1 : 2;
  if (const int forced = detail::tuning_tokens_per_worker()) tokens = forced;
  if (tokens == 1) return launch<kRotaryDim, kInsert, 1>(p, stream);
  if (tokens == 4) return launch<kRotaryDim, kInsert, 4>(p, stream);
  launch<kRotaryDim, kInsert, 2>(p, stream);
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
