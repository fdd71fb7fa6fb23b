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
#include "ops/common/head_math.cuh"
#include "ops/qknorm_rope_kv_insert/qknorm_rope_kv_insert.h"

namespace m3rt {
namespace {

constexpr int kThreads = 256;
constexpr int kItemsPerBlock = kThreads / 32;  // one head item per warp
constexpr int kTokensPerStep = 2;              // one token per half-warp
constexpr int kMinBlocksPerSm = 4;             // up to 64 registers a thread
constexpr int kStages = 3;                     // the step being computed and two in flight
constexpr unsigned kMaxGridY = 65535;

// Stores a lane's 8 bf16 values of an index head: as they are, or (fp8, a runtime flag uniform over
// the grid) as e4m3 of the bf16 values with no scale, saturating to +-448.
__device__ __forceinline__ void store_index_lane(void* base, int64_t elem_offset, const uint4& raw,
                                                 bool fp8) {
  if (fp8) {
    float x[8];
    kernels::unpack_bf16x8(raw, x);
    *reinterpret_cast<uint2*>(static_cast<uint8_t*>(base) + elem_offset) = kernels::pack_e4m3x8(x);
  } else {
    *reinterpret_cast<uint4*>(static_cast<uint16_t*>(base) + elem_offset) = raw;
  }
}

// One pipeline stage of one warp: its item's rows for two tokens and their indices.
struct WarpStage {
  uint4 rows[kTokensPerStep][kernels::kLanesPerHead];  // [token][lane]
  int64_t idx[kTokensPerStep][2];                       // [token][position, slot]
};

template <int kRotaryDim, QkvInsertMode kInsert>
__global__ void __launch_bounds__(kThreads, kMinBlocksPerSm)
    qknorm_rope_kv_insert_kernel(const __grid_constant__ QknormRopeKvInsertParams p) {
  using namespace kernels;
  constexpr bool kHasInsert = kInsert != QkvInsertMode::kNone;
  constexpr bool kFp8 = kInsert == QkvInsertMode::kFp8;
  __shared__ WarpStage stages[kStages][kItemsPerBlock];  // 3 x 8 x 544 bytes
  const int nq = p.num_heads, nkv = p.num_kv_heads, nidx = p.num_index_heads;
  const int main_items = nq + nkv * (kHasInsert ? 2 : 1);
  const int items = main_items + (nidx > 0 ? nidx + 1 : 0);
  // blockIdx.x: a run of 8 head items (one per warp), fastest, so the blocks running together
  // cover whole qkv rows; blockIdx.y: the first token pair this block walks (stride gridDim.y).
  // Both halves of a warp work on the same item, so the warp stays converged and shuffles with
  // the full mask. Rows and indices of the next two steps load (cp.async) while one computes.
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
  const int64_t num_slots = is_ik ? p.index_num_slots : p.num_slots;
  const auto* table = reinterpret_cast<const __nv_bfloat16*>(p.cos_sin);
  const uint16_t* norm_w = is_q ? p.q_norm_weight : !is_index ? p.k_norm_weight
                           : is_iq ? p.index_q_norm_weight : p.index_k_norm_weight;
  const uint4 w_raw = is_v ? uint4{} : gemma_weight_lane(reinterpret_cast<const __nv_bfloat16*>(norm_w) +
                                                         j * kDimsPerLane);
  E4m3Quantizer quant;
  if constexpr (kFp8) {
    if (!is_index) quant = E4m3Quantizer(__ldg(is_v ? p.v_scale : p.k_scale));
  }
  auto prefetch = [&](int64_t step, WarpStage& st) {
    const int64_t t = step * kTokensPerStep + half;
    if (t < p.num_tokens) {
      cp_async_16(&st.rows[half][j], p.qkv + t * p.stride_qkv_t + int64_t(col) * 128 + j * kDimsPerLane);
      if (j == 0) {
        cp_async_8(&st.idx[half][0], p.positions + t);
        if (has_slot) cp_async_8(&st.idx[half][1], slots + t);
      }
    }
    cp_async_commit();  // an empty group past the end keeps the wait counts uniform
  };
#pragma unroll
  for (int i = 0; i < kStages - 1; ++i) prefetch(blockIdx.y + int64_t(i) * gridDim.y, stages[i][w]);

  int cur = 0;
  for (int64_t step = blockIdx.y; step * kTokensPerStep < p.num_tokens;
       step += gridDim.y, cur = (cur + 1) % kStages) {
    prefetch(step + int64_t(kStages - 1) * gridDim.y, stages[(cur + kStages - 1) % kStages][w]);
    cp_async_wait<kStages - 1>();  // this step's copies have landed
    __syncwarp();
    const WarpStage& st = stages[cur][w];
    const int64_t t = step * kTokensPerStep + half;
    const bool in_range = t < p.num_tokens;
    const int64_t pos = in_range ? st.idx[half][0] : -1;
    const int64_t slot = in_range && has_slot ? st.idx[half][1] : -1;
    const uint4 raw = st.rows[half][j];
    __syncwarp();  // every lane has read this stage before lane 0 refills it
    // A token past the end or whose position lies outside the RoPE table is not written.
    const bool write = pos >= 0 && pos < p.max_pos;
    const bool write_cache = write && has_slot && slot >= 0 && slot < num_slots;
    uint16_t* head = p.qkv + t * p.stride_qkv_t + int64_t(col) * 128 + j * kDimsPerLane;
    if (is_v) {  // warp-uniform
      // V item (insert only): copied to the cache, never changed in qkv.
      if (write_cache) {
        const int64_t row = cache_row_offset(slot, p.block_size_log2, p.stride_cache_block,
                                             p.stride_cache_head, s - nq - nkv);
        store_cache_copy<kFp8>(p.cache, row + 128 + j * kDimsPerLane, raw, quant);
      }
      continue;
    }
    // Q, K, index_q or index_k item: norm and rope in fp32, one rounding.
    RopeLane rope{};
    if (rope_lane_rotates<kRotaryDim>(j)) rope = load_rope_lane<kRotaryDim>(j, table + (write ? pos : 0) * kRotaryDim);
    float x[8];
    unpack_bf16x8(raw, x);
    gemma_norm_head(x, w_raw, p.eps, kFullMask);
    rope_neox_head<kRotaryDim>(x, j, rope, kFullMask);
    const uint4 out = pack_bf16x8(x);
    if (!write) continue;
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
    if (is_index) {  // warp-uniform: a sparse row's index head; bf16, or e4m3(bf16 value) unscaled
      if (is_iq) {  // only to index_q_out, never back into qkv
        const int64_t o = (t * nidx + (s - main_items)) * 128 + j * kDimsPerLane;
        store_index_lane(p.index_q_out, o, out, p.index_fp8);
        continue;
      }
      // index_k: back into qkv, and into the index cache at row `slot` (block slot / 128).
      *reinterpret_cast<uint4*>(head) = out;
      if (write_cache) store_index_lane(p.index_cache, slot * 128 + j * kDimsPerLane, out, p.index_fp8);
      continue;
    }
    *reinterpret_cast<uint4*>(head) = out;
    if (write_cache) {
      const int64_t row = cache_row_offset(slot, p.block_size_log2, p.stride_cache_block,
                                           p.stride_cache_head, s - nq);
      store_cache_copy<kFp8>(p.cache, row + j * kDimsPerLane, out, quant);
    }
  }
  cp_async_wait<0>();
}

template <int kRotaryDim, QkvInsertMode kInsert>
void launch(const QknormRopeKvInsertParams& p, cudaStream_t stream) {
  const int resident = detail::multiprocessor_count() * kMinBlocksPerSm;
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
