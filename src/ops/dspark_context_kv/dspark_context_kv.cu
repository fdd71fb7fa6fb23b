// dspark_context_kv kernel: every draft layer's context K/V into its paged cache, one launch.
//
//   all_kv  [num_ctx, L, 2, nkv, 128] bf16 (token stride given; the rest contiguous)
//   cache_l [num_blocks, nkv, bs, 256] bf16 or e4m3 (uint8), at cache0 + cache_offsets[l]
//   K: bf16(rope(bf16(gemma_norm(k; w_l)), pos)) -> bf16 or e4m3(k / k_scale_l);  V: copy / e4m3
//
// Grid: (layer x kv head, token runs of 16). A half-warp owns one token of one (layer, kv head),
// 8 dims per lane: it reads the K and V rows (256 bytes each) and writes one contiguous 512-byte
// (bf16) or 256-byte (fp8) cache row; every lane works on K and on V. One wave of blocks walks the
// token runs; a 3-stage cp.async pipeline keeps the next two runs' rows and indices loading into
// shared memory while one computes. Measured on an H200 (docs/perf.md): one token per half-warp
// beat two or four, and the pipeline beat more resident warps. Rows
// with slot < 0 (padding), slot >= num_slots or a position outside the RoPE table are not written.
// Reference: dspark_context_kv_ref.cpp; checks: check_dspark_context_kv.cpp (m3rt check),
// test_dspark_context_kv.cpp, tests/test_gpu.cu (graphs); bench: bench_dspark_context_kv.cu.
#include <algorithm>

#include "core/cuda_check.h"
#include "core/validate.h"
#include "ops/common/claims.cuh"
#include "ops/common/head_math.cuh"
#include "ops/common/sm90.cuh"
#include "ops/dspark_context_kv/dspark_context_kv.h"

namespace m3rt {
namespace {

constexpr int kThreads = 256;
// Resident blocks of 256 per SM (up to 64 registers a thread). The bytes in flight live in shared
// memory, so occupancy matters less than the pipeline depth: 4 blocks x 2 runs ahead x 8 KB = 64 KB
// of loads in flight per SM, about what the H200's bandwidth-latency product asks for.
constexpr int kMinBlocksPerSm = 4;
constexpr int kStages = 3;  // the run being computed and two in flight (4 and 5 measured slower)
constexpr int kTokensPerRun = kThreads / kernels::kLanesPerHead;  // one token per half-warp
constexpr int kWarps = kThreads / 32;
constexpr int kClaimGrain = 4;  // token pairs a claim takes (launcher's claim_from)

// One stage of the pipeline: a run's K and V rows (each lane's 16 bytes) and its indices.
struct Stage {
  uint4 rows[kTokensPerRun][2][kernels::kLanesPerHead];  // [token][K, V][lane]
  int64_t idx[kTokensPerRun][2];                          // [token][slot, position]
};

template <int kRotaryDim, bool kFp8, bool kClaims>
__global__ void __launch_bounds__(kThreads, kMinBlocksPerSm)
    dspark_context_kv_kernel(const __grid_constant__ DsparkContextKvParams p) {
  using namespace kernels;
  __shared__ Stage stages[kStages];  // 8.25 KB each
  // Launched with PDL (p.pdl), the kernel waits for the preceding grid (griddepcontrol.wait) before
  // it touches the call's inputs or the caches: bf16 caches first; e4m3 caches after the index math
  // and the layer's norm weights and cache scales (parameters the preceding kernel does not write,
  // `enable_pdl`), in a branch of its own so that ptxas keeps it after them (README, "Programmatic
  // dependent launch", for the forms measured).
  if constexpr (!kFp8) grid_dependency_wait();
  if (p.pdl) launch_dependents();  // one wave: the next grid's CTAs take the SMs this one leaves
  // blockIdx.x: one (layer, kv head) pair, fastest, so the blocks running together read whole
  // all_kv rows; blockIdx.y: the first of the runs of 16 tokens this block walks (stride
  // gridDim.y). Token indices are 32-bit (the launcher checks the sizes); the prefetch walks
  // pointers by a fixed step.
  const int l = int(blockIdx.x) / p.num_kv_heads;
  const int h = int(blockIdx.x) - l * p.num_kv_heads;
  const int j = threadIdx.x % kLanesPerHead;
  const int tok = threadIdx.x / kLanesPerHead;  // the half-warp's token within a run
  const int num_ctx = int(p.num_ctx);
  const int64_t v_offset = int64_t(p.num_kv_heads) * 128;
  constexpr int kElemBytes = kFp8 ? 1 : 2;
  // This lane's 8 elements of head h of layer l's cache, at slot 0.
  char* cache_lane = static_cast<char*>(p.cache0) +
                     (p.tables.cache_offsets[l] + h * p.stride_cache_head + j * kDimsPerLane) * kElemBytes;
  const uint32_t block_bytes = uint32_t(p.stride_cache_block) * kElemBytes;
  const uint32_t offset_mask = (1u << p.block_size_log2) - 1;
  const auto* table = reinterpret_cast<const __nv_bfloat16*>(p.cos_sin);
  const uint16_t* const w_lane = p.k_norm_weight + l * 128 + j * kDimsPerLane;  // this lane's 8 weights
  float w1[8];
  E4m3Quantizer k_q, v_q;
  if constexpr (kFp8) {
    const uint4 w_raw = ldg_before_wait(reinterpret_cast<const uint4*>(w_lane));
    const float k_scale = ldg_before_wait(p.scale0 + p.tables.scale_offsets[l]);
    const float v_scale = ldg_before_wait(p.scale0 + p.tables.scale_offsets[p.num_layers + l]);
    gemma_weight_factors(w_raw, w1);
    k_q = E4m3Quantizer(k_scale);
    v_q = E4m3Quantizer(v_scale);
    grid_dependency_wait_after_loads(p.pdl);
  } else {
    gemma_weight_lane(reinterpret_cast<const __nv_bfloat16*>(w_lane), w1);
  }
  // Each lane copies (and later reads) its own 16 bytes of the rows; lane 0 of a half-warp copies
  // the token's slot and position, read by the half-warp after a __syncwarp.
  const uint32_t rows_smem = smem_u32(&stages[0].rows[tok][0][j]);
  const uint32_t idx_smem = smem_u32(&stages[0].idx[tok][0]);
  // The walk. Static (the instance every call takes unless it claims): the block's runs of 16
  // tokens, stride gridDim.y runs, its pointers stepped by a fixed amount. kClaims: a warp's unit
  // is a token pair (half-warp tok % 2 takes token 2 u + tok % 2), the static units by the same
  // stride, then the last ones claimed kClaimGrain at a time (claims.cuh).
  const int run_step = int(gridDim.y) * kTokensPerRun;  // tokens between a block's runs
  const int64_t src_step = int64_t(run_step) * p.stride_all_kv_t;
  const int num_units = (num_ctx + 1) / 2;
  UnitPipe<kClaims, kClaimGrain> units(int(blockIdx.y) * kWarps + int(threadIdx.x) / 32, int(gridDim.y) * kWarps,
                                       num_units, p.claims, int(blockIdx.x), p.claim_from);
  const uint16_t* const src0 = p.all_kv + (int64_t(l) * 2 * p.num_kv_heads + h) * 128 + j * kDimsPerLane;
  int t_pref = int(blockIdx.y) * kTokensPerRun + tok;  // static: this lane's token of the next copy
  const uint16_t* src = src0 + int64_t(t_pref) * p.stride_all_kv_t;
  auto prefetch = [&](int stage, int u) {  // u: the unit (kClaims; the static walk ignores it)
    int t = t_pref;
    const uint16_t* from = src;
    if constexpr (kClaims) {
      t = u < num_units ? 2 * u + (tok & 1) : num_ctx;
      from = src0 + int64_t(t) * p.stride_all_kv_t;
    }
    if (t < num_ctx) {
      cp_async_16(rows_smem + stage * sizeof(Stage), from);
      cp_async_16(rows_smem + stage * sizeof(Stage) + sizeof(uint4) * kLanesPerHead, from + v_offset);
      if (j == 0) {
        cp_async_8(idx_smem + stage * sizeof(Stage), p.slots + t);
        cp_async_8(idx_smem + stage * sizeof(Stage) + 8, p.positions + t);
      }
    }
    cp_async_commit();  // an empty group past the end keeps the wait counts uniform
    if constexpr (!kClaims) {
      t_pref += run_step;
      src += src_step;
    }
  };
  // One unit's (static: one run's) step: stage `cur`'s rows landed, this half-warp's token t.
  auto step = [&](int cur, int t) {
    cp_async_wait<kStages - 1>();  // this step's copies have landed
    __syncwarp();
    const Stage& st = stages[cur];
    // Padding (slot < 0), slots past the cache and positions past the table: not written.
    const int64_t slot = st.idx[tok][0], pos = st.idx[tok][1];
    const bool write = t < num_ctx && uint64_t(slot) < uint64_t(p.num_slots) &&
                       uint64_t(pos) < uint64_t(p.max_pos);
    RopeLane rope{};
    if (rope_lane_rotates<kRotaryDim>(j)) rope = load_rope_lane<kRotaryDim>(j, table + (write ? int(pos) : 0) * kRotaryDim);
    // V copied; K normed in fp32, materialized to bf16, rotated in fp32, rounded; both halves of
    // one contiguous cache row.
    const uint32_t slot32 = write ? uint32_t(slot) : 0u;
    char* row = cache_row_at<kElemBytes>(cache_lane, slot32, p.block_size_log2, block_bytes, offset_mask);
    if (write) store_cache_copy<kFp8>(row + 128 * kElemBytes, 0, st.rows[tok][1][j], v_q);
    float x[8];
    unpack_bf16x8(st.rows[tok][0][j], x);
    gemma_norm_head(x, w1, p.eps, kFullMask);
    round_bf16x8(x);
    rope_neox_head<kRotaryDim>(x, j, rope, kFullMask);
    if (write) store_cache_copy<kFp8>(row, 0, pack_bf16x8(x), k_q);
    __syncwarp();  // every lane has read this stage before it is refilled
  };
  // The loop bounds are warp-uniform (block-uniform when static) and nothing in a step branches
  // around the shuffles, so each warp stays converged and shuffles with the full mask (xor
  // distances < 16 stay in each half).
  if constexpr (kClaims) {
    static_assert(kStages == 3, "the walk holds two units ahead");
    prefetch(0, units.first());
    prefetch(1, units.second());
    for (int cur = 0; units.current() < num_units; units.advance(), cur = (cur + 1) % kStages) {
      prefetch((cur + kStages - 1) % kStages, units.next_copy());
      step(cur, 2 * units.current() + (tok & 1));
    }
  } else {
#pragma unroll
    for (int i = 0; i < kStages - 1; ++i) prefetch(i, 0);
    int cur = 0;
    for (int t0 = int(blockIdx.y) * kTokensPerRun; t0 < num_ctx; t0 += run_step, cur = (cur + 1) % kStages) {
      prefetch((cur + kStages - 1) % kStages, 0);
      step(cur, t0 + tok);
    }
  }
  units.finish(int(gridDim.x), gridDim.y * unsigned(kWarps));
  cp_async_wait<0>();
}

// ---- The quad kernel (head_math.cuh's quad layout): a quad (4 lanes) per (token, layer, kv
// head), lane q owning the K and V chunks q, q + 4, q + 8, q + 12. A warp holds 8 quads: 4 (layer,
// kv head) pairs x 2 tokens; a block of 2 warps walks token steps of 4 (stride gridDim.y x 4)
// through a 3-stage cp.async pipeline per warp (2 tokens x 4 pairs x [K | V] rows, 4 KB, stored with
// the bank swizzle chunk ^ 4 (quad & 1)).
// Used for fp8 caches from kQuadMinTokens tokens on GPUs with the H200's DRAM bandwidth an SM: on an
// H200 (same run) fp8 n = 32768 138.9 us (85.2% of the copy ceiling) against the half-warp kernel's
// 151.5 us (78.4%), but n = 8192 41.8 vs 40.7 us and bf16 slower at every size (n = 32768 192.6 vs
// 181.5 us: the half-warp kernel is at its access pattern's ceiling already, docs/perf.md); 16384
// lies between the measured sizes. Not on GPUs with less (DeviceLimits::lean_dram_per_sm), where
// the half-warp kernel moves the fp8 bytes at the pattern's ceiling too: on an H100 80GB HBM3 it ran
// n = 16384 / 24576 / 32768 / 65536 1.14 / 1.11 / 1.08 / 1.045x the quad kernel (89-90% of that
// GPU's ceiling against 79-87%; session 50, two rounds, bench/results/h100-s50-writer-quad-min.txt).
constexpr int64_t kQuadMinTokens = 16384;
constexpr int kQuadThreads = 64;
constexpr int kQuadWarps = kQuadThreads / 32;
constexpr int kPairsPerWarp = 4;   // x 2 tokens = 8 quads
constexpr int kQuadBlocksPerSm = 8;  // up to 128 registers a thread; 27 KB of shared memory each
// Run-time claims (kClaims instances, launch()'s rule): a claim takes one unit, a warp's step of 2
// tokens x 4 pairs (8 KB of reads, 8x the half-warp kernel's unit, so one a claim hits the counters
// half as often as its claims of 4).
constexpr int kQuadClaimGrain = 1;

struct QuadStage {
  uint4 rows[2 * kPairsPerWarp * 2 * 16];  // [token][pair][K, V][chunk, swizzled]
  int64_t idx[2][2];                       // [token][slot, position]
};

// kClaims: a warp's unit is its step's token pair (tokens 2 u, 2 u + 1 of its block's 4 pairs), the
// static units by the same stride, then the last ones claimed kQuadClaimGrain at a time (claims.cuh).
template <int kRotaryDim, bool kFp8, bool kClaims>
__global__ void __launch_bounds__(kQuadThreads, kQuadBlocksPerSm)
    dspark_context_kv_quad_kernel(const __grid_constant__ DsparkContextKvParams p) {
  using namespace kernels;
  constexpr int kElemBytes = kFp8 ? 1 : 2;
  __shared__ QuadStage stages[kStages][kQuadWarps];  // 3 x 2 x 4128 bytes
  grid_dependency_wait();  // as dspark_context_kv_kernel's
  if (p.pdl) launch_dependents();
  // 1 + w of the block's 4 pairs' layers in fp32, as lane q of a quad reads it: [pair][q][k][8].
  __shared__ float4 w1_table[kPairsPerWarp][kQuadLanes][kQuadChunks][2];
  const int nkv = p.num_kv_heads, pairs = p.num_layers * nkv, num_ctx = int(p.num_ctx);
  const int warp = int(threadIdx.x) / 32, lane = int(threadIdx.x) % 32, q = lane % kQuadLanes;
  const int g = lane / kQuadLanes;                        // the quad: token g / 4, pair g % 4
  const int half = g / kPairsPerWarp, pair0 = int(blockIdx.x) * kPairsPerWarp, pair = pair0 + g % kPairsPerWarp;
  const bool active = pair < pairs;
  const int l = active ? pair / nkv : 0, h = active ? pair - l * nkv : 0;
  // The copies: a lane moves 8 of the warp's 256 16-byte pieces per step; piece lane + 32 i is row
  // 2 i + lane / 16 (token i / 4, pair i % 4, K or V by lane / 16), chunk lane % 16.
  const int c_piece = lane % 16, kv_piece = lane / 16;
  uint32_t src_off[kPairsPerWarp];  // elements within a token's all_kv row, per pair of the block
#pragma unroll
  for (int i = 0; i < kPairsPerWarp; ++i) {
    const int pr = min(pair0 + i, pairs - 1), pl = pr / nkv;
    src_off[i] = uint32_t(((pl * 2 + kv_piece) * nkv + (pr - pl * nkv)) * 128 + c_piece * kDimsPerLane);
  }
  const int valid_pairs = min(kPairsPerWarp, pairs - pair0);
  const uint32_t rows_smem = smem_u32(&stages[0][warp].rows[0]);
  const uint32_t idx_smem = smem_u32(&stages[0][warp].idx[(lane / 2) % 2][lane % 2]);
  const int num_units = (num_ctx + 1) / 2;
  UnitPipe<kClaims, kQuadClaimGrain> units(int(blockIdx.y) * kQuadWarps + warp, int(gridDim.y) * kQuadWarps,
                                           num_units, p.claims, int(blockIdx.x), p.claim_from);
  auto prefetch = [&](int stage, int u) {  // u: the unit (tokens 2 u, 2 u + 1; past the end: none)
    const int t = u < num_units ? 2 * u : num_ctx;
    if (t < num_ctx) {
      const uint16_t* row0 = p.all_kv + int64_t(t) * p.stride_all_kv_t;
#pragma unroll
      for (int i = 0; i < 2 * kPairsPerWarp; ++i) {
        const int tk = i / kPairsPerWarp, pi = i % kPairsPerWarp;
        if (t + tk < num_ctx && pi < valid_pairs) {
          const int r = 2 * i + kv_piece;
          cp_async_16(rows_smem + stage * sizeof(stages[0]) + (r * 16 + (c_piece ^ ((i & 1) << 2))) * sizeof(uint4),
                      row0 + (tk ? p.stride_all_kv_t : 0) + src_off[pi]);
        }
      }
      if (lane < 4 && t + lane / 2 < num_ctx)
        cp_async_8(idx_smem + stage * sizeof(stages[0]), (lane % 2 ? p.positions : p.slots) + t + lane / 2);
    }
    cp_async_commit();  // an empty group past the end keeps the wait counts uniform
  };
  static_assert(kStages == 3, "the walk holds two units ahead");
  prefetch(0, units.first());  // before the table: the copies go out first
  prefetch(1, units.second());
  for (int i = int(threadIdx.x); i < kPairsPerWarp * 64; i += kQuadThreads) {  // 2 dims a thread
    const int pi = i / 64, d = (i % 64) * 2;
    if (pair0 + pi < pairs) {
      const int pl = (pair0 + pi) / nkv;
      quad_norm_factors_store(w1_table[pi], d, __ldg(reinterpret_cast<const uint32_t*>(p.k_norm_weight + pl * 128 + d)));
    }
  }
  __syncthreads();  // the only block-wide barrier
  const float4 (&w1)[kQuadChunks][2] = w1_table[active ? g % kPairsPerWarp : 0][q];
  E4m3Quantizer k_q, v_q;
  if constexpr (kFp8) {
    if (active) {
      k_q = E4m3Quantizer(__ldg(p.scale0 + p.tables.scale_offsets[l]));
      v_q = E4m3Quantizer(__ldg(p.scale0 + p.tables.scale_offsets[p.num_layers + l]));
    }
  }
  // This lane's elements of its (layer, kv head)'s cache row at slot 0 (chunk k at + 32 k).
  char* const cache_lane = static_cast<char*>(p.cache0) +
                           (p.tables.cache_offsets[l] + h * p.stride_cache_head + q * kDimsPerLane) * kElemBytes;
  const uint32_t block_bytes = uint32_t(p.stride_cache_block) * kElemBytes;
  const uint32_t offset_mask = (1u << p.block_size_log2) - 1;
  const auto* table = reinterpret_cast<const __nv_bfloat16*>(p.cos_sin);
  const int swz = (g & 1) << 2;  // the quad's bank swizzle
  constexpr int kChunkStride = kQuadLanes * kDimsPerLane;  // elements between a lane's chunks
  // One step: stage `cur`'s rows landed, the warp's tokens t0 and t0 + 1.
  auto step = [&](int cur, int t0) {
    cp_async_wait<kStages - 1>();  // this step's copies have landed
    __syncwarp();
    const QuadStage& st = stages[cur][warp];
    const int t = t0 + half;
    const int64_t slot = st.idx[half][0], pos = st.idx[half][1];
    const int r = 2 * g;  // the quad's K row in the stage; V is r + 1
    uint4 kraw[kQuadChunks], vraw[kQuadChunks];
#pragma unroll
    for (int k = 0; k < kQuadChunks; ++k) {
      kraw[k] = st.rows[r * 16 + (quad_chunk(q, k) ^ swz)];
      vraw[k] = st.rows[(r + 1) * 16 + (quad_chunk(q, k) ^ swz)];
    }
    __syncwarp();  // every lane has read the stage before it is refilled
    // Padding (slot < 0), slots past the cache, positions past the table, idle quads: not written.
    const bool write = active && t < num_ctx && uint64_t(slot) < uint64_t(p.num_slots) &&
                       uint64_t(pos) < uint64_t(p.max_pos);
    RopeLane rope{};
    if (quad_lane_rotates<kRotaryDim>(q)) rope = load_rope_quad<kRotaryDim>(q, table + (write ? int(pos) : 0) * kRotaryDim);
    char* const row = cache_row_at<kElemBytes>(cache_lane, write ? uint32_t(slot) : 0u, p.block_size_log2, block_bytes, offset_mask);
    if (write) {
#pragma unroll
      for (int k = 0; k < kQuadChunks; ++k) store_cache_copy<kFp8>(row + (128 + k * kChunkStride) * kElemBytes, 0, vraw[k], v_q);
    }
    // K: normed in fp32, materialized to bf16, rotated in fp32, rounded (every lane runs it).
    const float inv_rms = quad_inv_rms(kraw, p.eps, kFullMask);
    {
      float x0[8], x1[8];
      norm_chunk(kraw[0], inv_rms, w1[0], x0);
      norm_chunk(kraw[1], inv_rms, w1[1], x1);
      round_bf16x8(x0);
      round_bf16x8(x1);
      rope_neox_quad<kRotaryDim>(x0, x1, q, rope, kFullMask);
      if (write) {
        store_cache_copy<kFp8>(row, 0, pack_bf16x8(x0), k_q);
        store_cache_copy<kFp8>(row + kChunkStride * kElemBytes, 0, pack_bf16x8(x1), k_q);
      }
    }
    if (write) {
#pragma unroll
      for (int k = 2; k < kQuadChunks; ++k) {
        float x[8];
        norm_chunk(kraw[k], inv_rms, w1[k], x);
        store_cache_copy<kFp8>(row + k * kChunkStride * kElemBytes, 0, pack_bf16x8(x), k_q);
      }
    }
  };
  for (int cur = 0; units.current() < num_units; units.advance(), cur = (cur + 1) % kStages) {
    prefetch((cur + kStages - 1) % kStages, units.next_copy());
    step(cur, 2 * units.current());
  }
  units.finish(int(gridDim.x), gridDim.y * unsigned(kQuadWarps));
  cp_async_wait<0>();
}

// The half-warp kernel's claims rule (claims.cuh, launch_claiming_or_fixed; a unit is a token
// pair): the last kClaimPercent% of the pairs, kClaimGrain pairs a claim, from kClaimMinTokens tokens
// (bf16 caches) or kClaimMinTokensFp8 (fp8: on an H100, session 51, claims of 4 pairs ran fp8
// n = 8192 / 16384 / 32768 0.94 / 1.00-1.01 / 1.055x, claims of one pair 0.92-0.96x) with the
// caller's counters and at most kClaimCounterInts / 2 (layer, kv head) pairs. The quad kernel (fp8
// from kQuadMinTokens tokens on GPUs with the H200's DRAM bandwidth an SM) claims the same share
// from kQuadMinTokens, a unit a claim: forced on an H100 (session 61,
// bench/results/h100-s61-writer-quad-claims.txt), 15% ran n = 8192 / 16384 / 32768 1.06-1.07 /
// 1.12-1.13 / 1.12x over its static split (30%: 1.04-1.05 / 1.11 / 1.10-1.11x; 50% less). On the
// H200, where it runs by default, claims lose (session 64, bench/results/h200-s64-writer-claims.txt,
// two rounds, "vs static" in the same run): 15% ran the quad kernel n = 16384 / 32768 / 65536
// 0.947-0.953 / 0.951-0.965 / 0.863-0.876x and the half-warp kernel's bf16 n = 8192 0.938-0.941x
// (16384 / 32768 / 65536: 1.005-1.009 / 1.022-1.025 / 1.022-1.025x). So on GPUs with the H200's DRAM
// bandwidth an SM the quad kernel never claims by rule, and bf16 claims from kClaimMinTokensRich.
// M3RT_WRITER_CLAIM_PCT=P (investigation) claims P% at any token count (0: none), in either kernel.
// H100, session 51 (bench/results/h100-s51-writer-claims.txt), the half-warp kernel, bf16 against
// the static split: 15% in claims of 4 pairs n = 8192 / 16384 / 32768 1.03 / 1.05 / 1.05x; claims
// of 1 pair gained 1.01-1.03x at 5% (a pair is 1 KB of reads: the counters are hit 4x as often as
// the QK insert's for the bytes), 10% in claims of 2 or 4 1.02-1.05x, 20% in claims of 8
// 1.00-1.05x; below 8192 tokens every form lost (n = 2048 0.80-0.85x, n = 4096 0.94-0.96x).
constexpr int64_t kClaimMinTokens = 8192;
constexpr int64_t kClaimMinTokensRich = 16384;  // bf16, GPUs with the H200's DRAM bandwidth an SM
constexpr int64_t kClaimMinTokensFp8 = 32768;
constexpr int kClaimPercent = 15;

template <int kRotaryDim, bool kFp8>
void launch(const DsparkContextKvParams& p, cudaStream_t stream) {
  // The kernel indexes tokens, slots, positions and a block's bytes in 32 bits.
  detail::require_below_2_31("dspark_context_kv_write", "num_ctx", p.num_ctx);
  detail::require_below_2_31("dspark_context_kv_write", "num_blocks * block_size", p.num_slots);
  detail::require_below_2_31("dspark_context_kv_write", "cos_sin_cache rows", p.max_pos);
  detail::require_below_2_31("dspark_context_kv_write", "cache block stride in bytes", p.stride_cache_block * 2);
  // Enough blocks to fill the GPU once (each then walks several runs, prefetching the next while
  // computing the current), but no more than there are runs.
  const int pairs = p.num_layers * p.num_kv_heads;
  const bool lean = detail::device_limits().lean_dram_per_sm();
  if constexpr (kFp8) {  // bf16 caches never take the quad kernel (no instance is built for them)
    // M3RT_WRITER_QUAD_MIN (investigation): the quad kernel from that many tokens on any GPU instead.
    const int quad_min = detail::env_int("M3RT_WRITER_QUAD_MIN", 0);
    if (quad_min > 0 ? p.num_ctx >= quad_min
                     : p.num_ctx >= kQuadMinTokens && !lean) {
      // M3RT_WRITER_QUAD_BLOCKS (investigation): blocks an SM in the one-wave grid, 1..8 (fewer
      // warps walk more steps each, so a claimed tail is a smaller share of a call).
      const int per_sm = std::clamp(detail::env_int("M3RT_WRITER_QUAD_BLOCKS", kQuadBlocksPerSm), 1, kQuadBlocksPerSm);
      const dim3 grid = detail::one_wave_grid((pairs + kPairsPerWarp - 1) / kPairsPerWarp,
                                              (p.num_ctx + kQuadWarps * 2 - 1) / (kQuadWarps * 2),
                                              int64_t(detail::multiprocessor_count()) * per_sm);
      kernels::launch_claiming_or_fixed(dspark_context_kv_quad_kernel<kRotaryDim, kFp8, true>,
                                        dspark_context_kv_quad_kernel<kRotaryDim, kFp8, false>, grid, kQuadThreads, p,
                                        (p.num_ctx + 1) / 2, true, lean && p.num_ctx >= kQuadMinTokens, kClaimPercent,
                                        "M3RT_WRITER_CLAIM_PCT", stream, "dspark_context_kv_quad_kernel");
      return;
    }
  }
  const dim3 grid = detail::one_wave_grid(pairs, (p.num_ctx + kTokensPerRun - 1) / kTokensPerRun,
                                          int64_t(detail::multiprocessor_count()) * kMinBlocksPerSm);
  const bool by_rule = p.num_ctx >= (kFp8 ? kClaimMinTokensFp8 : lean ? kClaimMinTokens : kClaimMinTokensRich);
  kernels::launch_claiming_or_fixed(dspark_context_kv_kernel<kRotaryDim, kFp8, true>,
                                    dspark_context_kv_kernel<kRotaryDim, kFp8, false>, grid, kThreads, p,
                                    (p.num_ctx + 1) / 2, true, by_rule, kClaimPercent, "M3RT_WRITER_CLAIM_PCT", stream,
                                    "dspark_context_kv_kernel");
}

}  // namespace

void dspark_context_kv_launch(const DsparkContextKvParams& p, CUstream_st* stream) {
  if (p.num_ctx == 0) return;
  kernels::dispatch_rotary_dim(p.rotary_dim, "dspark_context_kv_launch", [&](auto rotary) {
    if (p.fp8) {
      launch<decltype(rotary)::value, true>(p, stream);
    } else {
      launch<decltype(rotary)::value, false>(p, stream);
    }
  });
}

}  // namespace m3rt
