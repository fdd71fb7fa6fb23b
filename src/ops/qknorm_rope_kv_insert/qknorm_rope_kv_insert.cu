// qknorm_rope_kv_insert kernel: per-head Gemma RMSNorm + partial NeoX RoPE of q and k in place on a
// dense qkv row, optional q outputs (bf16 copy, e4m3), optional K/V insert into a paged cache; on a
// MiniMax-M3 sparse row also the index heads: index_q to index_q_out, index_k in place and into
// the index cache.
//
//   qkv          [T, (nq + 2 nkv [+ Hidx + 1]) * 128] bf16: [q | k | v | index_q | index_k] heads
//   cache        [num_blocks, nkv, bs, 256] bf16 or e4m3 (uint8)
//   index_cache  [num_blocks, 128, 128] bf16 or e4m3 (uint8), unscaled
//
// Grid: (runs of 8 head items, token pairs). A warp owns one head item of two tokens, a half-warp
// (16 lanes x 8 dims) per token; a token has nq q items, nkv k items, when inserting nkv v items,
// and on a sparse row Hidx index_q items and one index_k item (at their own qkv columns whether or
// not there are v items). Both halves run the same code path, so the warp shuffles with the full
// mask. Tokens whose position lies outside the RoPE table are not written, nor are cache rows for
// slot < 0 or slot >= num_slots (index cache: index slots, index_num_slots). Reference:
// qknorm_rope_kv_insert_ref.cpp; checks: check_qknorm_rope_kv_insert.cpp (m3rt check),
// test_qknorm_rope_kv_insert.cpp; bench: bench_qknorm_rope_kv_insert.cu.
#include <algorithm>

#include "core/cuda_check.h"
#include "core/validate.h"
#include "ops/common/head_math.cuh"
#include "ops/qknorm_rope_kv_insert/qknorm_rope_kv_insert.h"

namespace m3rt {
namespace {

constexpr int kThreads = 256;
constexpr int kItemsPerBlock = kThreads / 32;  // one head item per warp
constexpr int kTokensPerStep = 2;              // one token per half-warp
// Resident blocks per SM: 4 (up to 64 registers a thread); the fp8 insert, which also holds its
// quantizer, 3 (at 64 it spilled).
constexpr int min_blocks_per_sm(QkvInsertMode insert) { return insert == QkvInsertMode::kFp8 ? 3 : 4; }
constexpr int kStages = 3;                     // the step being computed and two in flight
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

// One pipeline stage of one warp: its item's rows for two tokens and their indices.
struct WarpStage {
  uint4 rows[kTokensPerStep][kernels::kLanesPerHead];  // [token][lane]
  int64_t idx[kTokensPerStep][2];                       // [token][position, slot]
};

template <int kRotaryDim, QkvInsertMode kInsert>
__global__ void __launch_bounds__(kThreads, min_blocks_per_sm(kInsert))
    qknorm_rope_kv_insert_kernel(const __grid_constant__ QknormRopeKvInsertParams p) {
  using namespace kernels;
  constexpr bool kHasInsert = kInsert != QkvInsertMode::kNone;
  constexpr bool kFp8 = kInsert == QkvInsertMode::kFp8;
  constexpr int kCacheElemBytes = kFp8 ? 1 : 2;
  __shared__ WarpStage stages[kStages][kItemsPerBlock];  // 3 x 8 x 544 bytes
  const int nq = p.num_heads, nkv = p.num_kv_heads, nidx = p.num_index_heads;
  const int main_items = nq + nkv * (kHasInsert ? 2 : 1);
  const int items = main_items + (nidx > 0 ? nidx + 1 : 0);
  // blockIdx.x: a run of 8 head items (one per warp), fastest, so the blocks running together
  // cover whole qkv rows; blockIdx.y: the first token pair this block walks (stride gridDim.y).
  // Both halves of a warp work on the same item, so the warp stays converged and shuffles with
  // the full mask. Rows and indices of the next two steps load (cp.async) while one computes.
  // Token indices are 32-bit (the launcher checks the sizes).
  const int w = int(threadIdx.x) / 32;
  const int s = int(blockIdx.x) * kItemsPerBlock + w;
  if (s >= items) return;  // warp-uniform; no block-wide barrier follows
  const int j = threadIdx.x % kLanesPerHead;
  const int half = (threadIdx.x / kLanesPerHead) % 2;
  // The item's kind (warp-uniform) and its head's qkv column: items past the main ones are the
  // index heads, at column nq + 2 nkv + i even when there are no v items.
  const bool is_index = s >= main_items;
  const bool is_iq = is_index && s < items - 1, is_ik = s == items - 1 && is_index;
  const bool is_q = s < nq, is_v = !is_index && s >= nq + nkv;
  const int col = is_index ? nq + 2 * nkv + (s - main_items) : s;
  // Whether the item reads a slot: every main item with the main insert (q ignores it), index_k
  // always, from its own slot mapping.
  const bool has_slot = kHasInsert || is_ik;
  const int64_t* slots = is_ik ? p.index_slots : p.slots;
  const uint64_t num_slots = uint64_t(is_ik ? p.index_num_slots : p.num_slots);
  const int num_tokens = int(p.num_tokens);
  const uint32_t stride_t = uint32_t(p.stride_qkv_t);
  const int step_tokens = int(gridDim.y) * kTokensPerStep;
  const auto* table = reinterpret_cast<const __nv_bfloat16*>(p.cos_sin);
  const uint16_t* norm_w = is_q ? p.q_norm_weight : !is_index ? p.k_norm_weight
                           : is_iq ? p.index_q_norm_weight : p.index_k_norm_weight;
  float w1[8] = {};
  if (!is_v) gemma_weight_lane(reinterpret_cast<const __nv_bfloat16*>(norm_w) + j * kDimsPerLane, w1);
  E4m3Quantizer quant;
  if constexpr (kFp8) {
    if (!is_index) quant = E4m3Quantizer(__ldg(is_v ? p.v_scale : p.k_scale));
  }
  // This lane's 8 elements of the item's head in token 0's qkv row; of its kv head's cache row
  // half at slot 0 (main items with an insert).
  uint16_t* const qkv_lane = p.qkv + int64_t(col) * 128 + j * kDimsPerLane;
  char* cache_lane = nullptr;
  if (kHasInsert && !is_q && !is_index) {
    const int kv_head = is_v ? s - nq - nkv : s - nq;
    cache_lane = static_cast<char*>(p.cache) +
                 (int64_t(kv_head) * p.stride_cache_head + (is_v ? 128 : 0) + j * kDimsPerLane) * kCacheElemBytes;
  }
  const uint32_t block_bytes = uint32_t(p.stride_cache_block) * kCacheElemBytes;
  const uint32_t offset_mask = (1u << p.block_size_log2) - 1;
  const uint32_t rows_smem = smem_u32(&stages[0][w].rows[half][j]);
  const uint32_t idx_smem = smem_u32(&stages[0][w].idx[half][0]);
  int t_pref = int(blockIdx.y) * kTokensPerStep + half;  // this lane's token of the next copy
  auto prefetch = [&](int stage) {
    if (t_pref < num_tokens) {
      cp_async_16(rows_smem + stage * sizeof(stages[0]), qkv_lane + uint64_t(uint32_t(t_pref)) * stride_t);
      if (j == 0) {
        cp_async_8(idx_smem + stage * sizeof(stages[0]), p.positions + t_pref);
        if (has_slot) cp_async_8(idx_smem + stage * sizeof(stages[0]) + 8, slots + t_pref);
      }
    }
    cp_async_commit();  // an empty group past the end keeps the wait counts uniform
    t_pref += step_tokens;
  };
#pragma unroll
  for (int i = 0; i < kStages - 1; ++i) prefetch(i);

  int cur = 0;
  for (int t0 = int(blockIdx.y) * kTokensPerStep; t0 < num_tokens; t0 += step_tokens, cur = (cur + 1) % kStages) {
    prefetch((cur + kStages - 1) % kStages);
    cp_async_wait<kStages - 1>();  // this step's copies have landed
    __syncwarp();
    const WarpStage& st = stages[cur][w];
    const int t = t0 + half;
    const int64_t pos = st.idx[half][0], slot = st.idx[half][1];
    const uint4 raw = st.rows[half][j];
    __syncwarp();  // every lane has read this stage before lane 0 refills it
    // A token past the end or whose position lies outside the RoPE table is not written.
    const bool write = t < num_tokens && uint64_t(pos) < uint64_t(p.max_pos);
    const bool write_cache = write && has_slot && uint64_t(slot) < num_slots;
    const uint32_t slot32 = uint32_t(slot);
    uint16_t* head = qkv_lane + uint64_t(uint32_t(t)) * stride_t;
    char* cache_row = cache_row_at<kCacheElemBytes>(cache_lane, slot32, p.block_size_log2, block_bytes, offset_mask);
    if (is_v) {  // warp-uniform
      // V item (insert only): copied to the cache, never changed in qkv.
      if (write_cache) store_cache_copy<kFp8>(cache_row, 0, raw, quant);
      continue;
    }
    // Q, K, index_q or index_k item: norm and rope in fp32, one rounding.
    RopeLane rope{};
    if (rope_lane_rotates<kRotaryDim>(j)) rope = load_rope_lane<kRotaryDim>(j, table + (write ? int(pos) : 0) * kRotaryDim);
    float x[8];
    unpack_bf16x8(raw, x);
    gemma_norm_head(x, w1, p.eps, kFullMask);
    rope_neox_head<kRotaryDim>(x, j, rope, kFullMask);
    const uint4 out = pack_bf16x8(x);
    if (!write) continue;
    if (is_q) {
      const int64_t o = int64_t(t) * (nq * 128) + s * 128 + j * kDimsPerLane;
      if (p.q_out) store16(p.q_out + o, out);
      if (p.q_fp8_out) {
        float q[8];
        unpack_bf16x8(out, q);  // the bf16-rounded q
#pragma unroll
        for (int e = 0; e < 8; ++e) q[e] = __fmul_rn(q[e], p.q_fp8_inv_scale);
        store8(p.q_fp8_out + o, pack_e4m3x8(q));
      }
      if (p.q_in_place) store16(head, out);
      continue;
    }
    if (is_index) {  // warp-uniform: a sparse row's index head; bf16, or e4m3(bf16 value) unscaled
      if (is_iq) {  // only to index_q_out, never back into qkv
        const int64_t o = (int64_t(t) * nidx + (s - main_items)) * 128 + j * kDimsPerLane;
        store_index_lane(p.index_q_out, o, out, p.index_fp8);
        continue;
      }
      // index_k: back into qkv, and into the index cache at row `slot` (block slot / 128).
      store16(head, out);
      if (write_cache) store_index_lane(p.index_cache, int64_t(slot32) * 128 + j * kDimsPerLane, out, p.index_fp8);
      continue;
    }
    store16(head, out);
    if (write_cache) store_cache_copy<kFp8>(cache_row, 0, out, quant);
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
  const int resident = detail::multiprocessor_count() * min_blocks_per_sm(kInsert);
  const int items = p.num_heads + p.num_kv_heads * (kInsert != QkvInsertMode::kNone ? 2 : 1) +
                    (p.num_index_heads > 0 ? p.num_index_heads + 1 : 0);
  const int x_blocks = (items + kItemsPerBlock - 1) / kItemsPerBlock;
  const int64_t steps = (p.num_tokens + kTokensPerStep - 1) / kTokensPerStep;
  // Enough blocks to fill the GPU once (each walks several steps), no more than there are steps.
  const int64_t waves = std::max<int64_t>(1, resident / x_blocks);
  const dim3 grid(unsigned(x_blocks), unsigned(std::min<int64_t>({steps, waves, kMaxGridY})));
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
