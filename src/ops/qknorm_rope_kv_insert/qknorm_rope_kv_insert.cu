// qknorm_rope_kv_insert kernel: per-head Gemma RMSNorm + partial NeoX RoPE of q and k in place on a
// dense qkv row, optional q outputs (bf16 copy, e4m3), optional K/V insert into a paged cache; on a
// MiniMax-M3 sparse row also the index heads: index_q to index_q_out, index_k in place and into
// the index cache.
//
//   qkv          [T, (nq + 2 nkv [+ Hidx + 1]) * 128] bf16: [q | k | v | index_q | index_k] heads
//   cache        [num_blocks, nkv, bs, 256] bf16 or e4m3 (uint8)
//   index_cache  [num_blocks, 128, 128] bf16 or e4m3 (uint8), unscaled
//
// Grid: (groups of 8 head items, runs of 4 tokens). A warp owns one group for one token at a
// time, a quad (4 lanes) per head (head_math.cuh's quad layout: 32 dims a lane, the norm's and
// RoPE 64's pairings mostly inside a lane); a token has nq q items, nkv k items, when inserting
// nkv v items, and on a sparse row Hidx index_q items and one index_k item (at their own qkv
// columns whether or not there are v items). Every lane runs the norm and RoPE (v and idle quads
// on their own values, never stored), so each warp shuffles with the full mask. One wave of blocks;
// each warp walks its tokens (stride gridDim.y x 4) through a 3-stage cp.async pipeline of its own
// (the token's 8 rows, 2 KB, and indices), so two tokens load while one computes. Tokens whose
// position lies outside the RoPE table are not written, nor are cache rows for slot < 0 or slot >=
// num_slots (index cache: index slots, index_num_slots). Measured on an H200 (docs/perf.md): at
// T = 1792 this layout runs 1.23x the earlier half-warp-per-head kernel (2.3x fewer instructions);
// at T <= 56 it is ~0.3-0.6 us slower (a lane's longer dependent chain). Reference:
// qknorm_rope_kv_insert_ref.cpp; checks: check_qknorm_rope_kv_insert.cpp (m3rt check),
// test_qknorm_rope_kv_insert.cpp; bench: bench_qknorm_rope_kv_insert.cu.
#include <algorithm>

#include "core/cuda_check.h"
#include "core/validate.h"
#include "ops/common/head_math.cuh"
#include "ops/qknorm_rope_kv_insert/qknorm_rope_kv_insert.h"

namespace m3rt {
namespace {

constexpr int kThreads = 128;
constexpr int kWarps = kThreads / 32;
constexpr int kItemsPerWarp = 32 / kernels::kQuadLanes;  // a quad per head item
constexpr int kChunksPerHead = 128 / kernels::kDimsPerLane;
constexpr int kStages = 3;  // the token being computed and two in flight
// Resident blocks of 128 threads per SM: 5 (up to 96 registers a thread; 26 KB of shared memory
// each). 6 (80 registers) spilled and ran 1.02x slower, 4 with the norm factors held in registers
// 1.07x slower (H200, T = 1792).
constexpr int kMinBlocksPerSm = 5;
constexpr unsigned kMaxGridY = 65535;

// Stores a lane's 8 bf16 values of an index head: as they are, or (fp8, a runtime flag uniform over
// the grid) as e4m3 of the bf16 values with no scale, saturating to +-448.
__device__ __forceinline__ void store_index_lane(void* base, int64_t elem_offset, const uint4& raw,
                                                 bool fp8) {
  if (fp8) {
    float x[8];
    kernels::unpack_bf16x8(raw, x);
    kernels::store8(static_cast<uint8_t*>(base) + elem_offset, kernels::pack_e4m3x8(x));
  } else {
    kernels::store16(static_cast<uint16_t*>(base) + elem_offset, raw);
  }
}

// The item kinds; the first four are normed, with their own weights (rows of the kernel's table).
enum ItemKind : int { kItemQ, kItemK, kItemIndexQ, kItemIndexK, kItemV, kItemNone };
constexpr int kNormKinds = 4;

// One pipeline stage of one warp: one token's rows of the warp's 8 heads (chunk c of head h at
// h * 16 + (c ^ 4 (h & 1)): the quads' 16-byte reads then hit distinct banks) and its indices.
struct WarpStage {
  uint4 rows[kItemsPerWarp * kChunksPerHead];
  int64_t idx[4];  // position, slot, index slot
};

template <int kRotaryDim, QkvInsertMode kInsert>
__global__ void __launch_bounds__(kThreads, kMinBlocksPerSm)
    qknorm_rope_kv_insert_kernel(const __grid_constant__ QknormRopeKvInsertParams p) {
  using namespace kernels;
  constexpr bool kHasInsert = kInsert != QkvInsertMode::kNone;
  constexpr bool kFp8 = kInsert == QkvInsertMode::kFp8;
  constexpr int kCacheElemBytes = kFp8 ? 1 : 2;
  __shared__ WarpStage stages[kStages][kWarps];  // 3 x 4 x 2080 bytes
  // 1 + w of each normed kind in fp32, as lane q of a quad reads it: [kind][q][k][8] (dim 8 (q + 4k) + i).
  __shared__ float4 w1_table[kNormKinds][kQuadLanes][kQuadChunks][2];
  const int nq = p.num_heads, nkv = p.num_kv_heads, nidx = p.num_index_heads;
  const int main_items = nq + nkv * (kHasInsert ? 2 : 1);
  const int items = main_items + (nidx > 0 ? nidx + 1 : 0);
  const int warp = int(threadIdx.x) / 32, lane = int(threadIdx.x) % 32, q = lane % kQuadLanes;
  const int h = lane / kQuadLanes;                    // the quad's head within the warp's 8
  const int s0 = int(blockIdx.x) * kItemsPerWarp;     // the warp's first item
  const int s = s0 + h;                               // this quad's item
  const int kind = s >= items ? kItemNone : s < nq ? kItemQ : s < nq + nkv ? kItemK : s < main_items ? kItemV
                   : s < items - 1 ? kItemIndexQ : kItemIndexK;
  // The qkv column of item i: items past the main ones are the index heads, at column nq + 2 nkv
  // + (i - main_items) even when there are no v items.
  auto column = [&](int i) { return i >= main_items ? nq + 2 * nkv + (i - main_items) : i; };
  const int num_tokens = int(p.num_tokens);
  const uint32_t stride_t = uint32_t(p.stride_qkv_t);
  const int token_step = int(gridDim.y) * kWarps;
  // The copies: each lane moves 4 of the warp's 128 16-byte pieces of a token (piece lane + 32 i:
  // head lane / 16 + 2 i, chunk lane % 16, so the bank swizzle is the lane's), lanes 0-2 the indices.
  const bool reads_slot = kHasInsert && s0 + kItemsPerWarp > nq && s0 < main_items;
  const bool reads_index_slot = nidx > 0 && s0 + kItemsPerWarp >= items && s0 < items;
  const int piece_head = lane / kChunksPerHead, piece_chunk = lane % kChunksPerHead;
  const uint32_t dst_smem =
      smem_u32(&stages[0][warp].rows[piece_head * kChunksPerHead + (piece_chunk ^ ((piece_head & 1) << 2))]);
  const int64_t* idx_src = lane == 0 ? p.positions : lane == 1 ? p.slots : p.index_slots;
  const bool copies_idx = lane == 0 || (lane == 1 && reads_slot) || (lane == 2 && reads_index_slot);
  const uint32_t idx_smem = smem_u32(&stages[0][warp].idx[lane < 3 ? lane : 0]);
  int t_pref = int(blockIdx.y) * kWarps + warp;  // the warp's token of the next copy
  auto prefetch = [&](int stage) {
    if (t_pref < num_tokens) {
      const uint16_t* row = p.qkv + uint64_t(uint32_t(t_pref)) * stride_t;
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        const int item = s0 + piece_head + 2 * i;
        if (item < items) {
          cp_async_16(dst_smem + stage * sizeof(stages[0]) + i * 2 * kChunksPerHead * sizeof(uint4),
                      row + column(item) * 128 + piece_chunk * kDimsPerLane);
        }
      }
      if (copies_idx) cp_async_8(idx_smem + stage * sizeof(stages[0]), idx_src + t_pref);
    }
    cp_async_commit();  // an empty group past the end keeps the wait counts uniform
    t_pref += token_step;
  };
#pragma unroll
  for (int i = 0; i < kStages - 1; ++i) prefetch(i);  // before the table: the copies go out first
  for (int i = int(threadIdx.x); i < kNormKinds * 64; i += kThreads) {  // 2 dims a thread
    const int kd = i / 64, d = (i % 64) * 2;
    const uint16_t* wk = kd == kItemQ ? p.q_norm_weight : kd == kItemK ? p.k_norm_weight
                         : kd == kItemIndexQ ? p.index_q_norm_weight : p.index_k_norm_weight;
    if (wk != nullptr) {
      const uint32_t two = __ldg(reinterpret_cast<const uint32_t*>(wk + d));
      const int c = d / 8, e = d % 8;
      float* dst = reinterpret_cast<float*>(&w1_table[kd][c % kQuadLanes][c / kQuadLanes][0]) + e;
      dst[0] = __fadd_rn(1.f, __uint_as_float(two << 16));
      dst[1] = __fadd_rn(1.f, __uint_as_float(two & 0xffff0000u));
    }
  }
  __syncthreads();  // the only block-wide barrier
  // The lane's norm factors (v and idle quads norm with q's, never stored).
  const float4 (&w1)[kQuadChunks][2] = w1_table[kind < kNormKinds ? kind : kItemQ][q];
  const bool is_kv = kind == kItemK || kind == kItemV;
  E4m3Quantizer quant;
  if constexpr (kFp8) {
    if (is_kv) quant = E4m3Quantizer(__ldg(kind == kItemV ? p.v_scale : p.k_scale));
  }
  const auto* table = reinterpret_cast<const __nv_bfloat16*>(p.cos_sin);
  // This lane's elements of the item's head in token 0's qkv row (chunk k at + 8 (q + 4k)); of its
  // kv head's cache row half at slot 0 (k and v items with an insert).
  uint16_t* const qkv_lane = p.qkv + int64_t(column(s)) * 128 + q * kDimsPerLane;
  char* cache_lane = nullptr;
  if (kHasInsert && is_kv) {
    const int kv_head = kind == kItemV ? s - nq - nkv : s - nq;
    cache_lane = static_cast<char*>(p.cache) +
                 (int64_t(kv_head) * p.stride_cache_head + (kind == kItemV ? 128 : 0) + q * kDimsPerLane) * kCacheElemBytes;
  }
  const uint32_t block_bytes = uint32_t(p.stride_cache_block) * kCacheElemBytes;
  const uint32_t offset_mask = (1u << p.block_size_log2) - 1;
  int cur = 0;
  for (int t = int(blockIdx.y) * kWarps + warp; t < num_tokens; t += token_step, cur = (cur + 1) % kStages) {
    prefetch((cur + kStages - 1) % kStages);
    cp_async_wait<kStages - 1>();  // this token's copies have landed
    __syncwarp();
    const WarpStage& st = stages[cur][warp];
    const int64_t pos = st.idx[0];
    const int64_t slot = reads_slot ? st.idx[1] : -1, index_slot = reads_index_slot ? st.idx[2] : -1;
    uint4 raw[kQuadChunks];
#pragma unroll
    for (int k = 0; k < kQuadChunks; ++k) raw[k] = st.rows[h * kChunksPerHead + (quad_chunk(q, k) ^ ((h & 1) << 2))];
    __syncwarp();  // every lane has read the stage before it is refilled
    // A token whose position lies outside the RoPE table is not written.
    const bool write = uint64_t(pos) < uint64_t(p.max_pos);
    RopeLane rope{};
    if (quad_lane_rotates<kRotaryDim>(q)) rope = load_rope_quad<kRotaryDim>(q, table + (write ? int(pos) : 0) * kRotaryDim);
    const bool write_cache = kHasInsert && write && uint64_t(slot) < uint64_t(p.num_slots);
    char* const row = cache_row_at<kCacheElemBytes>(cache_lane, uint32_t(slot), p.block_size_log2, block_bytes, offset_mask);
    if (kind == kItemV && write_cache) {  // V (insert only): the cache, qkv unchanged
#pragma unroll
      for (int k = 0; k < kQuadChunks; ++k) store_cache_copy<kFp8>(row + k * kQuadLanes * kDimsPerLane * kCacheElemBytes, 0, raw[k], quant);
    }
    // Norm and RoPE per chunk pair (q, q + 4), then (q + 8, q + 12), each emitted when done.
    const float inv_rms = quad_inv_rms(raw, p.eps, kFullMask);
    uint16_t* const head = qkv_lane + uint64_t(uint32_t(t)) * stride_t;
    const bool emit = write && kind != kItemNone && kind != kItemV;  // quad-uniform
    const bool write_index = kind == kItemIndexK && uint64_t(index_slot) < uint64_t(p.index_num_slots);
    auto store_chunk = [&](int k, const float (&x)[8]) {
      const uint4 out = pack_bf16x8(x);
      const int e = k * kQuadLanes * kDimsPerLane;  // the chunk's first element in the head
      if (kind == kItemQ) {
        const int64_t o = int64_t(t) * (nq * 128) + s * 128 + q * kDimsPerLane + e;
        if (p.q_out) store16(p.q_out + o, out);
        if (p.q_fp8_out) {
          float y[8];
          unpack_bf16x8(out, y);  // the bf16-rounded q
#pragma unroll
          for (int i = 0; i < 8; ++i) y[i] = __fmul_rn(y[i], p.q_fp8_inv_scale);
          store8(p.q_fp8_out + o, pack_e4m3x8(y));
        }
        if (p.q_in_place) store16(head + e, out);
      } else if (kind == kItemIndexQ) {  // only to index_q_out, never back into qkv; bf16 or e4m3 unscaled
        store_index_lane(p.index_q_out, (int64_t(t) * nidx + (s - main_items)) * 128 + q * kDimsPerLane + e, out, p.index_fp8);
      } else {  // K or index_k: back into qkv, and into its cache
        store16(head + e, out);
        if (kind == kItemK && write_cache) store_cache_copy<kFp8>(row + e * kCacheElemBytes, 0, out, quant);
        if (write_index) store_index_lane(p.index_cache, int64_t(uint32_t(index_slot)) * 128 + q * kDimsPerLane + e, out, p.index_fp8);
      }
    };
    {
      float x0[8], x1[8];
      norm_chunk(raw[0], inv_rms, w1[0], x0);
      norm_chunk(raw[1], inv_rms, w1[1], x1);
      rope_neox_quad<kRotaryDim>(x0, x1, q, rope, kFullMask);
      if (emit) {
        store_chunk(0, x0);
        store_chunk(1, x1);
      }
    }
    if (emit) {
#pragma unroll
      for (int k = 2; k < kQuadChunks; ++k) {
        float x[8];
        norm_chunk(raw[k], inv_rms, w1[k], x);
        store_chunk(k, x);
      }
    }
  }
  cp_async_wait<0>();
}

template <int kRotaryDim, QkvInsertMode kInsert>
void launch(const QknormRopeKvInsertParams& p, cudaStream_t stream) {
  // The kernel indexes tokens, slots, positions, a qkv row and a cache block's bytes in 32 bits.
  const char* kName = "qknorm_rope_kv_insert";
  detail::require_below_2_31(kName, "num_tokens", p.num_tokens);
  detail::require_below_2_31(kName, "qkv row stride", p.stride_qkv_t);
  detail::require_below_2_31(kName, "cos_sin_cache rows", p.max_pos);
  if (kInsert != QkvInsertMode::kNone) {
    detail::require_below_2_31(kName, "num_blocks * block_size", p.num_slots);
    detail::require_below_2_31(kName, "cache block stride in bytes", p.stride_cache_block * 2);
  }
  if (p.num_index_heads > 0) detail::require_below_2_31(kName, "index cache rows", p.index_num_slots);
  const int items = p.num_heads + p.num_kv_heads * (kInsert != QkvInsertMode::kNone ? 2 : 1) +
                    (p.num_index_heads > 0 ? p.num_index_heads + 1 : 0);
  const int x_blocks = (items + kItemsPerWarp - 1) / kItemsPerWarp;
  const int64_t runs = (p.num_tokens + kWarps - 1) / kWarps;
  // One wave of blocks (each warp walks several tokens), no more than there are runs of 4 tokens:
  // on an H200 at T = 1792 one wave ran 20.8 us, two 23.8 us, a block per run 25.5 us (docs/perf.md).
  const int resident = detail::multiprocessor_count() * kMinBlocksPerSm;
  const int64_t waves = std::max<int64_t>(1, resident / x_blocks);
  const dim3 grid(unsigned(x_blocks), unsigned(std::min<int64_t>({runs, waves, kMaxGridY})));
  qknorm_rope_kv_insert_kernel<kRotaryDim, kInsert><<<grid, kThreads, 0, stream>>>(p);
  M3RT_LAUNCH_CHECK(stream, "qknorm_rope_kv_insert_kernel");
}

}  // namespace

void qknorm_rope_kv_insert_launch(const QknormRopeKvInsertParams& p, CUstream_st* stream) {
  if (p.num_tokens == 0) return;
  kernels::dispatch_rotary_dim(p.rotary_dim, "qknorm_rope_kv_insert_launch", [&](auto rotary) {
    constexpr int kRotaryDim = decltype(rotary)::value;
    switch (p.insert) {
      case QkvInsertMode::kNone: return launch<kRotaryDim, QkvInsertMode::kNone>(p, stream);
      case QkvInsertMode::kBFloat16: return launch<kRotaryDim, QkvInsertMode::kBFloat16>(p, stream);
      case QkvInsertMode::kFp8: return launch<kRotaryDim, QkvInsertMode::kFp8>(p, stream);
    }
  });
}

}  // namespace m3rt
