// qknorm_rope_kv_insert kernel: per-head Gemma RMSNorm + partial NeoX RoPE of q and k in place on a
// dense qkv row, optional q outputs (bf16 copy, e4m3), optional K/V insert into a paged cache; on a
// MiniMax-M3 sparse row also the index heads: index_q to index_q_out, index_k in place and into
// the index cache.
//
//   qkv          [T, (nq + 2 nkv [+ Hidx + 1]) * 128] bf16: [q | k | v | index_q | index_k] heads
//   cache        [num_blocks, nkv, bs, 256] bf16 or e4m3 (uint8)
//   index_cache  [num_blocks, 128, 128] bf16 or e4m3 (uint8), unscaled
//
// Two kernels, chosen by the token count (launcher): on an H200 the quad kernel runs 1.23x the
// half-warp one at T = 1792 and 1.09x at T = 448 (2.0x fewer instructions), the half-warp kernel
// 1.28x the quad one at T = 7 and 1.12x at T = 56 (a quad lane's dependent chain is 4x longer and
// small calls are latency-bound); docs/perf.md.
// - quad kernel (T >= kQuadMinTokens). Grid: (groups of 8 head items, runs of 4 tokens). A warp owns
//   one group for one token at a time, a quad (4 lanes) per head (head_math.cuh's quad layout: 32
//   dims a lane, the norm's and RoPE 64's pairings mostly inside a lane). Every lane runs the norm
//   and RoPE (v and idle quads on their own values, never stored), so each warp shuffles with the
//   full mask. One wave of blocks; each warp walks its tokens (stride gridDim.y x 4) through a
//   3-stage cp.async pipeline of its own (the token's 8 rows, 2 KB, and indices). With
//   claim_counters (bf16 cache or none, from 2048 tokens, GPUs below the H200's DRAM bandwidth an
//   SM) the last 15% of the tokens are claimed one at a time per grid column instead (claims.cuh):
//   warps on faster SMs take more of them.
// - half-warp kernel (fewer tokens). Grid: (runs of 8 head items, token pairs). A warp owns one
//   head item of two tokens, a half-warp (16 lanes x 8 dims) per token; both halves run the same
//   code path, so the warp shuffles with the full mask; a 3-stage cp.async pipeline per warp.
// A token has nq q items, nkv k items, when inserting nkv v items, and on a sparse row Hidx
// index_q items and one index_k item (at their own qkv columns whether or not there are v items).
// Tokens whose position lies outside the RoPE table are not written, nor are cache rows for slot
// < 0 or slot >= num_slots (index cache: index slots, index_num_slots). Both kernels store through
// store_item_chunk. Reference: qknorm_rope_kv_insert_ref.cpp; checks:
// check_qknorm_rope_kv_insert.cpp (m3rt check; T >= kQuadMinTokens rows run the quad kernel),
// test_qknorm_rope_kv_insert.cpp; bench: bench_qknorm_rope_kv_insert.cu.
#include <algorithm>

#include "core/cuda_check.h"
#include "core/validate.h"
#include "m3rt/ops.h"
#include "ops/common/claims.cuh"
#include "ops/common/head_math.cuh"
#include "ops/common/sm90.cuh"
#include "ops/qknorm_rope_kv_insert/qknorm_rope_kv_insert.h"

namespace m3rt {
namespace {

constexpr int kStages = 3;  // the token (pair) being computed and two in flight
// Token counts from which the quad kernel runs (H200: it wins at 448 and 1792 tokens, loses at 7
// and 56; the crossover in between was not measured more finely).
constexpr int64_t kQuadMinTokens = 256;
// Quad kernel: 128-thread blocks, 5 resident per SM (up to 96 registers a thread; 26 KB of shared
// memory each). 6 (80 registers) spilled and ran 1.02x slower, 4 with the norm factors held in
// registers 1.07x slower (H200, T = 1792). fp8 caches: 4 (up to 128 registers): at 96 the e4m3
// instances spilled 8-16 bytes; at 4 blocks (121-128 registers, no spills) an H100 ran T = 448 /
// 1024 / 1792 / 4096 / 8192 / 16384 1.03-1.04 / 1.01 / 1.05 / 1.05-1.06 / 1.05 / 1.05-1.06x, sparse
// rows at T = 1792 1.02-1.04x (session 52, bench/results/h100-s52-qk-fp8.txt; not yet measured on
// the H200).
constexpr int kQuadThreads = 128;
constexpr int kQuadWarps = kQuadThreads / 32;
constexpr int kItemsPerQuadWarp = 32 / kernels::kQuadLanes;  // a quad per head item
constexpr int kChunksPerHead = 128 / kernels::kDimsPerLane;
constexpr int quad_blocks_per_sm(QkvInsertMode insert) { return insert == QkvInsertMode::kFp8 ? 4 : 5; }
// Half-warp kernel: 256-thread blocks, a head item per warp, two tokens a step; 4 resident per SM
// (up to 64 registers a thread), the fp8 insert, which also holds its quantizer, 3 (at 64 it spilled).
constexpr int kHalfThreads = 256;
constexpr int kItemsPerHalfBlock = kHalfThreads / 32;
constexpr int kTokensPerStep = 2;
constexpr int half_blocks_per_sm(QkvInsertMode insert) { return insert == QkvInsertMode::kFp8 ? 3 : 4; }

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

// A row's head items: the main ones (q, k, v with the insert) and all (plus index_q, index_k).
struct RowItems {
  int main, all;
};
__host__ __device__ constexpr RowItems row_items(int nq, int nkv, bool insert, int nidx) {
  return {nq + nkv * (insert ? 2 : 1), nq + nkv * (insert ? 2 : 1) + (nidx > 0 ? nidx + 1 : 0)};
}

// The kind of item s (head s of the row's items).
__device__ __forceinline__ int item_kind(int s, int nq, int nkv, int main_items, int items) {
  return s >= items ? kItemNone : s < nq ? kItemQ : s < nq + nkv ? kItemK : s < main_items ? kItemV
         : s < items - 1 ? kItemIndexQ : kItemIndexK;
}

// Where a token's outputs of one item go, for one lane.
struct ItemOut {
  int kind, s, t;
  uint16_t* head;     // the lane's elements of the item's head in the token's qkv row
  char* cache_row;    // the lane's elements of its kv head's cache row half (k and v items)
  bool write_cache;   // k / v: the slot is valid (and there is an insert)
  bool write_index;   // index_k: the index slot is valid
  uint32_t index_slot;
  int lane_elem;      // the lane's first element in the head (its chunk e adds e)
};

// Stores 8 normed values (bf16, `out`) of one item of one token at element `e` of the lane's part of
// the head: q to q_out / q_fp8_out / back into qkv, k back into qkv and into the cache, index_q to
// index_q_out, index_k back into qkv and into the index cache. (V items store their raw row with
// store_cache_copy.)
template <bool kFp8>
__device__ __forceinline__ void store_item_chunk(const QknormRopeKvInsertParams& p, const ItemOut& o, int e,
                                                 const uint4& out, const kernels::E4m3Quantizer& quant) {
  using namespace kernels;
  constexpr int kCacheElemBytes = kFp8 ? 1 : 2;
  if (o.kind == kItemQ) {
    const int64_t i = int64_t(o.t) * (p.num_heads * 128) + o.s * 128 + o.lane_elem + e;
    if (p.q_out) store16(p.q_out + i, out);
    if (p.q_fp8_out) {
      float y[8];
      unpack_bf16x8(out, y);  // the bf16-rounded q
#pragma unroll
      for (int k = 0; k < 8; ++k) y[k] = __fmul_rn(y[k], p.q_fp8_inv_scale);
      store8(p.q_fp8_out + i, pack_e4m3x8(y));
    }
    if (p.q_in_place) store16(o.head + e, out);
  } else if (o.kind == kItemIndexQ) {  // only to index_q_out, never back into qkv; bf16 or e4m3 unscaled
    const int main_items = row_items(p.num_heads, p.num_kv_heads, p.insert != QkvInsertMode::kNone, 0).main;
    const int64_t i = (int64_t(o.t) * p.num_index_heads + (o.s - main_items)) * 128 + o.lane_elem + e;
    store_index_lane(p.index_q_out, i, out, p.index_fp8);
  } else {  // k or index_k: back into qkv, and into its cache
    store16(o.head + e, out);
    if (o.kind == kItemK && o.write_cache) store_cache_copy<kFp8>(o.cache_row + e * kCacheElemBytes, 0, out, quant);
    if (o.write_index) store_index_lane(p.index_cache, int64_t(o.index_slot) * 128 + o.lane_elem + e, out, p.index_fp8);
  }
}

// One pipeline stage of one warp of the quad kernel: one token's rows of the warp's 8 heads (chunk
// c of head h at h * 16 + (c ^ 4 (h & 1)): the quads' 16-byte reads then hit distinct banks) and
// its indices.
struct QuadWarpStage {
  uint4 rows[kItemsPerQuadWarp * kChunksPerHead];
  int64_t idx[4];  // position, slot, index slot
};

template <int kRotaryDim, QkvInsertMode kInsert, bool kClaims>
__global__ void __launch_bounds__(kQuadThreads, quad_blocks_per_sm(kInsert))
    qknorm_rope_quad_kernel(const __grid_constant__ QknormRopeKvInsertParams p) {
  using namespace kernels;
  constexpr bool kHasInsert = kInsert != QkvInsertMode::kNone;
  constexpr bool kFp8 = kInsert == QkvInsertMode::kFp8;
  constexpr int kCacheElemBytes = kFp8 ? 1 : 2;
  grid_dependency_wait();  // launched with PDL (p.pdl): nothing is read before this
  if (p.pdl) launch_dependents();  // one wave: the next grid's CTAs take the SMs this one leaves
  __shared__ QuadWarpStage stages[kStages][kQuadWarps];  // 3 x 4 x 2080 bytes
  // 1 + w of each normed kind in fp32, as lane q of a quad reads it: [kind][q][k][8] (dim 8 (q + 4k) + i).
  __shared__ float4 w1_table[kNormKinds][kQuadLanes][kQuadChunks][2];
  const int nq = p.num_heads, nkv = p.num_kv_heads, nidx = p.num_index_heads;
  const RowItems counts = row_items(nq, nkv, kHasInsert, nidx);
  const int main_items = counts.main, items = counts.all;
  const int warp = int(threadIdx.x) / 32, lane = int(threadIdx.x) % 32, q = lane % kQuadLanes;
  const int h = lane / kQuadLanes;                     // the quad's head within the warp's 8
  const int s0 = int(blockIdx.x) * kItemsPerQuadWarp;  // the warp's first item
  const int s = s0 + h;                                // this quad's item
  const int kind = item_kind(s, nq, nkv, main_items, items);
  // The qkv column of item i: items past the main ones are the index heads, at column nq + 2 nkv
  // + (i - main_items) even when there are no v items.
  auto column = [&](int i) { return i >= main_items ? nq + 2 * nkv + (i - main_items) : i; };
  const int num_tokens = int(p.num_tokens);
  const uint32_t stride_t = uint32_t(p.stride_qkv_t);
  const int token_step = int(gridDim.y) * kQuadWarps;
  // The copies: each lane moves 4 of the warp's 128 16-byte pieces of a token (piece lane + 32 i:
  // head lane / 16 + 2 i, chunk lane % 16, so the bank swizzle is the lane's), lanes 0-2 the indices.
  const bool reads_slot = kHasInsert && s0 + kItemsPerQuadWarp > nq && s0 < main_items;
  const bool reads_index_slot = nidx > 0 && s0 + kItemsPerQuadWarp >= items && s0 < items;
  const int piece_head = lane / kChunksPerHead, piece_chunk = lane % kChunksPerHead;
  const uint32_t dst_smem =
      smem_u32(&stages[0][warp].rows[piece_head * kChunksPerHead + (piece_chunk ^ ((piece_head & 1) << 2))]);
  const int64_t* idx_src = lane == 0 ? p.positions : lane == 1 ? p.slots : p.index_slots;
  const bool copies_idx = lane == 0 || (lane == 1 && reads_slot) || (lane == 2 && reads_index_slot);
  const uint32_t idx_smem = smem_u32(&stages[0][warp].idx[lane < 3 ? lane : 0]);
  // The warp's tokens: by the static stride, then (kClaims) the last ones claimed at run time
  // (claims.cuh). The launcher takes the kClaims instance only for calls that claim.
  UnitPipe<kClaims> tokens(int(blockIdx.y) * kQuadWarps + warp, token_step, num_tokens, p.claims, int(blockIdx.x),
                         p.claim_from);
  auto prefetch = [&](int stage, int t_pref) {
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
  };
  static_assert(kStages == 3, "the loop below holds two tokens ahead");
  prefetch(0, tokens.first());  // before the table: the copies go out first
  prefetch(1, tokens.second());
  for (int i = int(threadIdx.x); i < kNormKinds * 64; i += kQuadThreads) {  // 2 dims a thread
    const int kd = i / 64, d = (i % 64) * 2;
    const uint16_t* wk = kd == kItemQ ? p.q_norm_weight : kd == kItemK ? p.k_norm_weight
                         : kd == kItemIndexQ ? p.index_q_norm_weight : p.index_k_norm_weight;
    if (wk != nullptr) quad_norm_factors_store(w1_table[kd], d, __ldg(reinterpret_cast<const uint32_t*>(wk + d)));
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
  for (; tokens.current() < num_tokens; tokens.advance(), cur = (cur + 1) % kStages) {
    const int t = tokens.current();
    prefetch((cur + kStages - 1) % kStages, tokens.next_copy());
    cp_async_wait<kStages - 1>();  // this token's copies have landed
    __syncwarp();
    const QuadWarpStage& st = stages[cur][warp];
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
    const ItemOut o{kind, s, t, qkv_lane + uint64_t(uint32_t(t)) * stride_t, row, write_cache,
                    kind == kItemIndexK && uint64_t(index_slot) < uint64_t(p.index_num_slots), uint32_t(index_slot),
                    q * kDimsPerLane};
    constexpr int kChunkStride = kQuadLanes * kDimsPerLane;  // elements between a lane's chunks
    if (kind == kItemV && write_cache) {  // V (insert only): the raw row to the cache, qkv unchanged
#pragma unroll
      for (int k = 0; k < kQuadChunks; ++k) store_cache_copy<kFp8>(row + k * kChunkStride * kCacheElemBytes, 0, raw[k], quant);
    }
    // Norm and RoPE per chunk pair (q, q + 4), then (q + 8, q + 12), each stored when done.
    const float inv_rms = quad_inv_rms(raw, p.eps, kFullMask);
    const bool emit = write && kind != kItemNone && kind != kItemV;  // quad-uniform
    {
      float x0[8], x1[8];
      norm_chunk(raw[0], inv_rms, w1[0], x0);
      norm_chunk(raw[1], inv_rms, w1[1], x1);
      rope_neox_quad<kRotaryDim>(x0, x1, q, rope, kFullMask);
      if (emit) {
        store_item_chunk<kFp8>(p, o, 0, pack_bf16x8(x0), quant);
        store_item_chunk<kFp8>(p, o, kChunkStride, pack_bf16x8(x1), quant);
      }
    }
    if (emit) {
#pragma unroll
      for (int k = 2; k < kQuadChunks; ++k) {
        float x[8];
        norm_chunk(raw[k], inv_rms, w1[k], x);
        store_item_chunk<kFp8>(p, o, k * kChunkStride, pack_bf16x8(x), quant);
      }
    }
  }
  tokens.finish(int(gridDim.x), gridDim.y * unsigned(kQuadWarps));
  cp_async_wait<0>();
}

// One pipeline stage of one warp of the half-warp kernel: its item's rows for two tokens and their
// indices.
struct HalfWarpStage {
  uint4 rows[kTokensPerStep][kernels::kLanesPerHead];  // [token][lane]
  int64_t idx[kTokensPerStep][2];                       // [token][position, slot]
};

template <int kRotaryDim, QkvInsertMode kInsert>
__global__ void __launch_bounds__(kHalfThreads, half_blocks_per_sm(kInsert))
    qknorm_rope_half_kernel(const __grid_constant__ QknormRopeKvInsertParams p) {
  using namespace kernels;
  constexpr bool kHasInsert = kInsert != QkvInsertMode::kNone;
  constexpr bool kFp8 = kInsert == QkvInsertMode::kFp8;
  constexpr int kCacheElemBytes = kFp8 ? 1 : 2;
  __shared__ HalfWarpStage stages[kStages][kItemsPerHalfBlock];  // 3 x 8 x 544 bytes
  if (p.pdl) launch_dependents();  // one wave, as the quad kernel's
  const int nq = p.num_heads, nkv = p.num_kv_heads, nidx = p.num_index_heads;
  const RowItems counts = row_items(nq, nkv, kHasInsert, nidx);
  const int main_items = counts.main, items = counts.all;
  // blockIdx.x: a run of 8 head items (one per warp), fastest, so the blocks running together
  // cover whole qkv rows; blockIdx.y: the first token pair this block walks (stride gridDim.y).
  // Both halves of a warp work on the same item, so the warp stays converged and shuffles with
  // the full mask. Rows and indices of the next two steps load (cp.async) while one computes.
  // Token indices are 32-bit (the launcher checks the sizes).
  const int w = int(threadIdx.x) / 32;
  const int s = int(blockIdx.x) * kItemsPerHalfBlock + w;
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
  // Launched with PDL (p.pdl), the kernel reads only the item's norm weights and (e4m3) cache scale
  // before its grid-dependency wait — parameters the preceding kernel does not write (`enable_pdl`)
  // — so that their loads overlap that kernel's tail; qkv, the indices and the caches are touched
  // only after it. The wait sits in a branch of its own so that ptxas keeps it after the loads
  // (README, "Programmatic dependent launch").
  uint4 w_raw{};
  if (!is_v) w_raw = ldg_before_wait(reinterpret_cast<const uint4*>(norm_w + j * kDimsPerLane));
  float scale = 1.f;
  if constexpr (kFp8) {
    if (!is_index) scale = ldg_before_wait(is_v ? p.v_scale : p.k_scale);
  }
  float w1[8] = {};
  if (!is_v) gemma_weight_factors(w_raw, w1);
  E4m3Quantizer quant;
  if constexpr (kFp8) {
    if (!is_index) quant = E4m3Quantizer(scale);
  }
  grid_dependency_wait_after_loads(p.pdl);
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
    const HalfWarpStage& st = stages[cur][w];
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
    const int kind = item_kind(s, nq, nkv, main_items, items);
    const ItemOut o{kind, s, t, head, cache_row, write_cache, is_ik && write_cache, slot32, j * kDimsPerLane};
    if (is_v) {  // warp-uniform: a V item (insert only), copied to the cache, never changed in qkv
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
    if (write) store_item_chunk<kFp8>(p, o, 0, pack_bf16x8(x), quant);
  }
  cp_async_wait<0>();
}

// The quad kernel's claims rule (claims.cuh, launch_claiming_or_fixed; a unit is a token): the last
// kClaimPercent% of the tokens from kClaimMinTokens tokens, with the caller's counters, bf16 caches
// or none and at most kClaimCounterInts / 2 grid columns. Not for fp8 caches: at 5 blocks an SM that
// instance spilled with the claims' state (36-52 bytes) and ran T = 1792 0.92x (session 51); at 4
// (no spills) claims ran T = 2048 / 4096 / 8192 / 16384 0.91-0.92 / 0.94 / 0.95 / 0.96x against
// the static split (H100, session 52): the e4m3 path is bound by its instructions, not by the
// slowest SMs' streams. Calls that do not claim run an instance without the claims' code (with it,
// at T = 448: 0.975x).
// M3RT_QK_CLAIM_PCT=P (investigation) claims P% at any token count (0: none). On an H100 (session
// 51, bench/results/h100-s51-qk-claims.txt) 15% ran T = 4096 / 8192 / 16384 1.03-1.05 / 1.06-1.08 /
// 1.06-1.09x, T = 1792 and 2044 1.00-1.01x, and claims lost below (T = 1024 0.94-0.96x, T = 256
// 0.67x: the warps then all reach the counters at once); 10, 20 and 25% gained less. On the H200
// claims lose (session 64, bench/results/h200-s64-writer-claims.txt, two rounds, "vs static" in the
// same run): T = 4096 / 8192 0.947 / 0.975x, 15% forced at T = 1792 0.91x. So the rule claims only
// on GPUs below the H200's DRAM bandwidth an SM (DeviceLimits::lean_dram_per_sm).
constexpr int64_t kClaimMinTokens = 2048;
constexpr int kClaimPercent = 15;

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
  const int items = row_items(p.num_heads, p.num_kv_heads, kInsert != QkvInsertMode::kNone, p.num_index_heads).all;
  const int64_t T = p.num_tokens;
  if (T >= kQuadMinTokens) {
    // One wave of blocks (each warp walks several tokens), no more than there are runs of 4 tokens:
    // on an H200 at T = 1792 one wave ran 20.8 us, two waves 23.8 us (docs/perf.md).
    const dim3 grid = detail::one_wave_grid((items + kItemsPerQuadWarp - 1) / kItemsPerQuadWarp,
                                            (T + kQuadWarps - 1) / kQuadWarps,
                                            int64_t(detail::multiprocessor_count()) * quad_blocks_per_sm(kInsert));
    constexpr bool kClaimable = kInsert != QkvInsertMode::kFp8;  // fp8: no claiming instance is built
    kernels::launch_claiming_or_fixed(qknorm_rope_quad_kernel<kRotaryDim, kInsert, kClaimable>,
                                      qknorm_rope_quad_kernel<kRotaryDim, kInsert, false>, grid, kQuadThreads, p, T,
                                      kClaimable, T >= kClaimMinTokens && detail::device_limits().lean_dram_per_sm(),
                                      kClaimPercent, "M3RT_QK_CLAIM_PCT", stream,
                                      "qknorm_rope_quad_kernel");
  } else {
    // Enough blocks to fill the GPU once (each walks several steps), no more than there are steps.
    const dim3 grid = detail::one_wave_grid((items + kItemsPerHalfBlock - 1) / kItemsPerHalfBlock,
                                            (T + kTokensPerStep - 1) / kTokensPerStep,
                                            int64_t(detail::multiprocessor_count()) * half_blocks_per_sm(kInsert));
    kernels::launch_pdl_or_plain(qknorm_rope_half_kernel<kRotaryDim, kInsert>, grid, kHalfThreads, p, p.pdl, stream,
                                 "qknorm_rope_half_kernel");
  }
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
