// lightning_indexer kernels: block scores on tensor cores and top-k block selection.
//
//   index_q      [T, Hidx, 128]          bf16, or e4m3 with an fp8 index cache
//   index_cache  [num_blocks, 128, 128]  bf16 or e4m3: one 128-dim key per token
//   scores       [T, Hidx, max_blocks]   fp32 scratch: score[t, h, j] for j < the token's nb
//   topk_out     [T, Hidx, topk]         int32, ascending ids, -1 after
//
// Dot products run on tensor cores with fp32 accumulation (bf16 inputs as bf16; e4m3 inputs
// converted exactly to f16). Hopper (compute capability 9.x) runs the *_sm90 kernels; every other
// GPU the portable ones (mma.sync, sm_80 PTX); `indexer_force_portable` runs the portable ones on
// Hopper too (tests, bench baselines).
//
// Decode, one launch: grid (splits, requests, row groups of 128 query rows). A CTA scores the pages
// split, split + splits, ... of its request below the visible ones (from the device-side seq_len,
// so the grid depends only on shapes): keys as the M dimension of m16n8k16
// MMAs, the request's dql x Hidx query rows as N. Hopper: whole pages bulk-copied into shared
// memory (two in flight), a warp per 32 keys; portable: a warp per page, its chunks loaded
// straight into registers, with the 128 dims of a row permuted so that lane c of a quad owns the
// 16-byte chunks 4i + c (load_row_chunks / chunks_to_words; Q and K use the same permutation, so
// each dot product pairs the same dims, only the order of the sum changes). Scores go to the
// scratch; the last CTA of a request to arrive (a per-request counter, reset by that CTA) selects
// every row of the request.
// Prefill, two launches: scoring over a grid (query tiles x page chunks, requests), the longest
// tiles first. Hopper, bf16: 2 warpgroups x 64 query rows in registers, wgmma m64n128k16 against
// each page (128 keys, 128-byte swizzle) in shared memory; e4m3: the page's keys as the A operand
// (converted in registers, 64 keys a warpgroup) against the tile's 128 rows as an f16 B image;
// both with a 3-stage cp.async pipeline. Portable: 8 warps x 32 rows, mma.sync, 2 stages. Each
// row's masked max over a page's keys is its score. Then one warp per (token, head) row selects.
//
// Reference: lightning_indexer_ref.cpp; checks: check_lightning_indexer.cpp (m3rt check),
// tests/test_gpu.cu; bench: bench_lightning_indexer.cu.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>

#include <algorithm>

#include "core/cuda_check.h"
#include "m3rt/error.h"
#include "ops/common/head_math.cuh"
#include "ops/common/mma.cuh"
#include "ops/common/sm90.cuh"
#include "ops/lightning_indexer/lightning_indexer.h"

namespace m3rt {
namespace {

using kernels::cp_async_16;
using kernels::cp_async_commit;
using kernels::cp_async_wait;
using kernels::e4m3x2_to_f16x2;
using kernels::e4m3x4_to_f16x2x2;
using kernels::bulk_copy_to_shared;
using kernels::fence_mbarrier_init;
using kernels::fence_proxy_async;
using kernels::mbar_arrive;
using kernels::mbar_arrive_expect_tx;
using kernels::mbar_init;
using kernels::mbar_wait;
using kernels::kFullMask;
using kernels::mma_16816;
using kernels::smem_u32;
using kernels::sw128_desc;
using kernels::wgmma_commit;
using kernels::wgmma_fence;
using kernels::wgmma_k128;
using kernels::wgmma_m64k16;
using kernels::wgmma_wait_all;

constexpr int kPage = 128;      // tokens per index-cache page and per scored block
constexpr int kWords = 16;      // 32-bit fragment words a lane holds for one 128-dim row
constexpr unsigned kMaxGridY = 65535;

// ------------------------------------------------------------------------------------------------
// Fragments. A lane (g = lane / 4, c = lane % 4) of an m16n8k16 MMA holds, per k-step s, the pair
// of k indices (2c, 2c+1) in one word and (2c+8, 2c+9) in the next. Here lane c's words come from
// the 16-byte chunks 4i + c of the row: w[2s], w[2s+1] are 4 consecutive dims, so k-step s covers
// dims {16i' + ...} of the chunks lane c owns. Q and K fragments use the same map.
//   bf16: chunk = 8 dims = 4 words = 2 k-steps; a lane reads chunks c, c+4, c+8, c+12.
//   e4m3: chunk = 16 dims -> 8 f16 words = 4 k-steps; a lane reads chunks c, c+4.
template <bool kFp8>
struct FragChunks {
  static constexpr int kCount = kFp8 ? 2 : 4;  // 16-byte chunks per lane per row
};


// Raw chunks -> fragment words.
template <bool kFp8>
__device__ __forceinline__ void chunks_to_words(const uint4 (&ch)[FragChunks<kFp8>::kCount],
                                                uint32_t (&w)[kWords]) {
#pragma unroll
  for (int i = 0; i < FragChunks<kFp8>::kCount; ++i) {
    const uint32_t comp[4] = {ch[i].x, ch[i].y, ch[i].z, ch[i].w};
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      if constexpr (kFp8) {
        // The shifted high pair: with e4m3x4_to_f16x2x2 here the Hopper decode kernel took 122
        // registers instead of 114 and ran batch 1 at 0.98-0.99x (H200, session 28).
        w[8 * i + 2 * e] = e4m3x2_to_f16x2(comp[e] & 0xffffu);
        w[8 * i + 2 * e + 1] = e4m3x2_to_f16x2(comp[e] >> 16);
      } else {
        w[4 * i + e] = comp[e];
      }
    }
  }
}

// Lane c's chunks of one row in global memory.
template <bool kFp8, bool kStream>
__device__ __forceinline__ void load_row_chunks(const void* row, int c,
                                                uint4 (&ch)[FragChunks<kFp8>::kCount]) {
  const uint4* r = static_cast<const uint4*>(row);
#pragma unroll
  for (int i = 0; i < FragChunks<kFp8>::kCount; ++i) ch[i] = kStream ? __ldcs(r + 4 * i + c) : __ldg(r + 4 * i + c);
}


// The max over visible keys: NaN for a masked key, so that fmaxf (which ignores NaN) skips it and a
// block with no non-NaN visible dot stays NaN.
__device__ __forceinline__ float kNaN() { return __int_as_float(0x7fffffff); }

// The arrival on a request's counter: release of this CTA's score stores (with the barrier before
// it) and acquire of every earlier arrival's, in one atomic (H200, session 24: 1.01-1.02x on the
// batch-8 rows against the fence + relaxed atomic + fence it replaced, same call). Returns the
// count before.
__device__ __forceinline__ unsigned arrive_acq_rel_gpu(int* counter) {
  unsigned old;
  asm volatile("atom.acq_rel.gpu.global.add.u32 %0, [%1], 1;\n" : "=r"(old) : "l"(counter) : "memory");
  return old;
}

// ------------------------------------------------------------------------------------------------
// Request geometry, as the reference defines it. A request whose lengths are inconsistent (a
// negative length, more visible pages than the block table holds, a query longer than its
// sequence or than max_query_len) is skipped: its rows are left unwritten.
struct Request {
  int seq_len, q_begin, q_len;
};

__device__ __forceinline__ bool load_request(const IndexerParams& p, int b, Request& r) {
  r.seq_len = p.seq_lens[b];
  if (p.cu_seqlens_q) {
    r.q_begin = p.cu_seqlens_q[b];
    r.q_len = p.cu_seqlens_q[b + 1] - r.q_begin;
    if (r.q_begin < 0 || r.q_len < 0 || r.q_len > p.max_query_len || r.q_begin + r.q_len > p.num_tokens ||
        r.seq_len < r.q_len)
      return false;
  } else {
    r.q_begin = b * p.decode_query_len;
    r.q_len = p.decode_query_len;
    if (r.seq_len < 0) return false;
  }
  return (int64_t(r.seq_len) + kPage - 1) / kPage <= p.max_blocks;
}

// ------------------------------------------------------------------------------------------------
// Selection. Scores order by a 32-bit key: larger score -> larger key, NaN -> 0 (below -inf),
// -0 -> +0 (equal scores tie). Ties go to the lower block id.
__device__ __forceinline__ uint32_t score_key(float s) {
  if (s != s) return 0u;
  const uint32_t u = __float_as_uint(s == 0.f ? 0.f : s);
  return (u & 0x80000000u) ? ~u : (u | 0x80000000u);
}

// Shared memory one warp uses to select a row.
constexpr int kSelectMaxBlocks = 1024;  // rows up to 128K tokens; longer rows: warp_select_long_row
constexpr int kMaxSurvivors = 64;
struct SelectScratch {
  uint32_t key[kSelectMaxBlocks];  // the row's candidate keys (0 elsewhere)
  uint32_t surv_key[kMaxSurvivors];
  int32_t surv_id[kMaxSurvivors];
};

// Rows longer than kSelectMaxBlocks: the bit-by-bit threshold (below) with the keys re-read from
// memory on every pass (slow, but such rows are rare and their scans dominate anyway).
__device__ void warp_select_long_row(const float* scores, int nb, int topk, int init_blocks,
                                     int local_blocks, int32_t* out) {
  const int lane = threadIdx.x % 32;
  const int lo = init_blocks, hi = nb - local_blocks, need = topk - init_blocks - local_blocks;
  auto count_at_least = [&](uint32_t t) {
    unsigned n = 0;
    for (int j = lo + lane; j < hi; j += 32) n += score_key(__ldcg(scores + j)) >= t ? 1u : 0u;
    return int(__reduce_add_sync(kFullMask, n));
  };
  uint32_t threshold = 0;
  int take_equal = 0;
  if (need > 0) {
    for (int bit = 31; bit >= 0; --bit)
      if (count_at_least(threshold | (1u << bit)) >= need) threshold |= 1u << bit;
    take_equal = need - (threshold == 0xffffffffu ? 0 : count_at_least(threshold + 1));
  }
  const unsigned lt = (1u << lane) - 1u;
  int written = 0, equal_seen = 0;
  for (int base = 0; base < nb; base += 32) {
    const int j = base + lane;
    bool sel = false, eq = false;
    if (j < nb) {
      if (j < lo || j >= hi) {
        sel = true;
      } else if (need > 0) {
        const uint32_t key = score_key(__ldcg(scores + j));
        sel = key > threshold;
        eq = key == threshold;
      }
    }
    const unsigned eq_ballot = __ballot_sync(kFullMask, eq);
    if (eq && equal_seen + __popc(eq_ballot & lt) < take_equal) sel = true;
    equal_seen += __popc(eq_ballot);
    const unsigned sel_ballot = __ballot_sync(kFullMask, sel);
    if (sel) out[written + __popc(sel_ballot & lt)] = j;
    written += __popc(sel_ballot);
  }
  for (int j = written + lane; j < topk; j += 32) out[j] = -1;
}

// Steps 1-4 of select_row over chunks of 32 * kPer blocks (kPer keys a lane in flight).
template <int kPer>
__device__ __forceinline__ void select_candidates(const float* scores, int nb, int lo, int hi, int need, int32_t* out,
                                                  SelectScratch& sc) {
  const int lane = threadIdx.x % 32;
  const unsigned lt = (1u << lane) - 1u;
  constexpr int kChunk = 32 * kPer;
  const int chunks = (nb + kChunk - 1) / kChunk;
  // 1. Keys and lane maxima; a lane's keys are the blocks c * kChunk + 32 i + lane.
  auto load_chunk = [&](int c, float (&v)[kPer]) {
#pragma unroll
    for (int i = 0; i < kPer; ++i) {
      const int j = c * kChunk + 32 * i + lane;
      v[i] = j >= lo && j < hi ? __ldcg(scores + j) : kNaN();  // a NaN and a non-candidate: key 0
    }
  };
  uint32_t lane_max = 0;
  float cur[kPer];
  load_chunk(0, cur);
  for (int c = 0; c < chunks; ++c) {
    float next[kPer];
    load_chunk(c + 1, next);  // nothing past the last chunk (every j >= hi)
#pragma unroll
    for (int i = 0; i < kPer; ++i) {
      const uint32_t key = score_key(cur[i]);
      sc.key[c * kChunk + 32 * i + lane] = key;
      lane_max = max(lane_max, key);
      cur[i] = next[i];
    }
  }
  // 2. T: the need-th largest lane maximum (the smallest maximum with fewer than `need` above it).
  uint32_t t = 0;
  if (need <= 32) {
    int above[4] = {0, 0, 0, 0};  // independent counts: the 32 broadcasts are not a chain
#pragma unroll
    for (int l = 0; l < 32; ++l) above[l % 4] += __shfl_sync(kFullMask, lane_max, l) > lane_max ? 1 : 0;
    t = __reduce_min_sync(kFullMask, above[0] + above[1] + above[2] + above[3] < need ? lane_max : ~0u);
  }
  // 3. The survivors (candidates >= T) in id order.
  int survivors = 0;
  for (int c = 0; c < chunks; ++c) {
    uint32_t key[kPer];
#pragma unroll
    for (int i = 0; i < kPer; ++i) key[i] = sc.key[c * kChunk + 32 * i + lane];
#pragma unroll
    for (int i = 0; i < kPer; ++i) {
      const int j = c * kChunk + 32 * i + lane;
      const bool s = j >= lo && j < hi && key[i] >= t;
      const unsigned ballot = __ballot_sync(kFullMask, s);
      const int idx = survivors + __popc(ballot & lt);
      if (s && idx < kMaxSurvivors) {
        sc.surv_key[idx] = key[i];
        sc.surv_id[idx] = j;
      }
      survivors += __popc(ballot);
    }
  }
  __syncwarp();
  if (survivors <= kMaxSurvivors) {
    // Lane l ranks survivors l and l + 32; a survivor's index order is its id order.
    const int q0 = lane, q1 = lane + 32;
    const uint32_t k0 = q0 < survivors ? sc.surv_key[q0] : 0u, k1 = q1 < survivors ? sc.surv_key[q1] : 0u;
    int r0 = 0, r1 = 0;
#pragma unroll 8
    for (int e = 0; e < survivors; ++e) {
      const uint32_t ke = sc.surv_key[e];
      r0 += ke > k0 || (ke == k0 && e < q0) ? 1 : 0;
      r1 += ke > k1 || (ke == k1 && e < q1) ? 1 : 0;
    }
    const bool c0 = q0 < survivors && r0 < need, c1 = q1 < survivors && r1 < need;
    const unsigned b0 = __ballot_sync(kFullMask, c0), b1 = __ballot_sync(kFullMask, c1);
    if (c0) out[lo + __popc(b0 & lt)] = sc.surv_id[q0];
    if (c1) out[lo + __popc(b0) + __popc(b1 & lt)] = sc.surv_id[q1];
  } else {
    // 4. Bit by bit.
    auto count_at_least = [&](uint32_t th) {
      unsigned n = 0;
      for (int c = 0; c < chunks; ++c) {
#pragma unroll
        for (int i = 0; i < kPer; ++i) {
          const int j = c * kChunk + 32 * i + lane;
          n += j >= lo && j < hi && sc.key[j] >= th ? 1u : 0u;
        }
      }
      return int(__reduce_add_sync(kFullMask, n));
    };
    uint32_t threshold = 0;
    for (int bit = 31; bit >= 0; --bit)
      if (count_at_least(threshold | (1u << bit)) >= need) threshold |= 1u << bit;
    const int take_equal = need - (threshold == 0xffffffffu ? 0 : count_at_least(threshold + 1));
    int written = 0, equal_seen = 0;
    for (int c = 0; c < chunks; ++c) {
#pragma unroll
      for (int i = 0; i < kPer; ++i) {
        const int j = c * kChunk + 32 * i + lane;
        const bool cand = j >= lo && j < hi;
        const uint32_t key = cand ? sc.key[j] : 0u;
        const bool eq = cand && key == threshold;
        const unsigned eq_ballot = __ballot_sync(kFullMask, eq);
        const bool sel = (cand && key > threshold) || (eq && equal_seen + __popc(eq_ballot & lt) < take_equal);
        equal_seen += __popc(eq_ballot);
        const unsigned sel_ballot = __ballot_sync(kFullMask, sel);
        if (sel) out[lo + written + __popc(sel_ballot & lt)] = j;
        written += __popc(sel_ballot);
      }
    }
  }
}

// One warp selects one row: forced blocks [0, init) and [nb - local, nb), then the best `need` of
// the candidates [init, nb - local), ranked by key (ties: the lower id). Writes the selected ids in
// ascending order, then -1. In the decode kernel this runs once per request on an SM that has not
// run it before, after every split has stored its scores, so its length is the call's tail: each
// step is a short chain of independent instructions (no loop-carried memory round trips; the code is
// rolled over chunks of 64, 256 or 512 blocks, so little of it has to be fetched).
//   1. The keys (L2 -> shared memory; one chunk's loads in flight while the previous one is stored)
//      and each lane's maximum candidate key.
//   2. T = the need-th largest of the 32 lane maxima: at least `need` candidate keys are >= T, so
//      every selected key is >= T (need > 32: T = 0, no filter). For random scores ~20 keys pass.
//   3. The candidates >= T are compacted in id order (ballots); each is chosen when fewer than
//      `need` of them rank above it (a larger key, or an equal key at a lower id). The chosen ids
//      follow the init blocks in the output, in id order, and the local blocks follow them.
//   4. When more than kMaxSurvivors pass T (many equal keys): the threshold bit by bit from the top
//      (it keeps a bit when at least `need` keys are >= it; one warp reduction per bit); keys above
//      it are chosen, and of those equal to it the lowest ids.
__device__ void select_row(const float* scores, int nb, int topk, int init_blocks, int local_blocks,
                           int32_t* out, SelectScratch& sc) {
  const int lane = threadIdx.x % 32;
  if (nb <= topk) {
    for (int j = lane; j < topk; j += 32) out[j] = j < nb ? j : -1;
    return;
  }
  if (nb > kSelectMaxBlocks) return warp_select_long_row(scores, nb, topk, init_blocks, local_blocks, out);
  const int lo = init_blocks, hi = nb - local_blocks;  // candidates; nb > topk >= init + local
  const int need = topk - init_blocks - local_blocks;
  // The forced blocks, at their final places: [0, init) first, [hi, nb) after the `need` chosen.
  for (int j = lane; j < lo; j += 32) out[j] = j;
  for (int j = hi + lane; j < nb; j += 32) out[lo + need + j - hi] = j;
  if (need == 0) return;
  // Rows of up to 64 blocks (most prefill rows) in one pass of 2 keys a lane, up to 512 in passes
  // of 8, longer rows in passes of 16 (a 1024-block row in two chunks instead of four: 0.3-0.6 us
  // less a call at 128K, H200 session 26; 16 for rows of 257-512 blocks not measured).
  // Every chunk's keys are staged through shared memory and the loops are rolled over chunks: the
  // code runs once per request on a cold SM, and forms that held a row's keys in registers (fully
  // unrolled) or staged them by 4-byte cp.async ran slower at every decode row, up to 1.5x the time
  // at batch 1, 128K (docs/perf.md, session 26).
  if (nb <= 64)
    select_candidates<2>(scores, nb, lo, hi, need, out, sc);
  else if (nb <= 512)
    select_candidates<8>(scores, nb, lo, hi, need, out, sc);
  else
    select_candidates<16>(scores, nb, lo, hi, need, out, sc);
  __syncwarp();  // the scratch is free for the warp's next row
}

// ------------------------------------------------------------------------------------------------
// Decode. Two kernels share the pieces below: the portable one (every GPU) where each warp streams
// its own pages from global memory into registers, and the Hopper one where whole pages stream into
// shared memory by bulk copy (cp.async.bulk + mbarrier, two pages in flight per CTA).
constexpr int kDecodeWarps = 4;
constexpr int kDecodeThreads = kDecodeWarps * 32;
constexpr int kDecodeMinBlocks = 4;
constexpr int kDecodeRows = 128;  // query rows (dql x Hidx) per CTA; more go to further row groups
constexpr int kDecodeNTiles = kDecodeRows / 8;

// Query row `row` of request b's dql x Hidx rows.
__device__ __forceinline__ const void* decode_q_row(const IndexerParams& p, int b, int row) {
  return static_cast<const char*>(p.index_q) +
         (int64_t(b) * p.decode_query_len * p.num_heads + row) * 128 * (p.fp8 ? 1 : 2);
}

// A lane's raw chunks of its row of n-tile nt (zeros past the rows) as B fragments in shared
// memory, q_frag[(nt * 8 + s) * 32 + lane] for k-step s.
template <bool kFp8>
__device__ __forceinline__ void store_q_tile(const uint4 (&ch)[FragChunks<kFp8>::kCount], int nt, uint2* q_frag) {
  const int lane = threadIdx.x % 32;
  uint32_t w[kWords];
  chunks_to_words<kFp8>(ch, w);
#pragma unroll
  for (int s = 0; s < 8; ++s) q_frag[(nt * 8 + s) * 32 + lane] = make_uint2(w[2 * s], w[2 * s + 1]);
}

// The query rows [row0, row0 + rows) of request b as B fragments in shared memory: n-tiles
// warp + skip, warp + skip + warps, ... (skip > 0: the caller stored the first ones).
template <bool kFp8>
__device__ void decode_fill_q_frags(const IndexerParams& p, int b, int row0, int rows, uint2* q_frag, int skip = 0) {
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, g = lane / 4, c = lane % 4;
  for (int nt = warp + skip; nt < (rows + 7) / 8; nt += int(blockDim.x) / 32) {
    uint4 ch[FragChunks<kFp8>::kCount] = {};
    if (8 * nt + g < rows) load_row_chunks<kFp8, false>(decode_q_row(p, b, row0 + 8 * nt + g), c, ch);
    store_q_tile<kFp8>(ch, nt, q_frag);
  }
}

// 32 keys (two m-tiles: kw[mt][hf] holds key key_pos0 + 16 mt + 8 hf + g) against every query row
// of the group: each row's max over the keys it sees (NaN for keys past its position when
// `masked`), combined into row_max[row] (lanes g == 0 write; `first`: overwrite instead).
template <bool kFp8>
__device__ __forceinline__ void decode_keys_max(const uint32_t (&kw)[2][2][kWords], const uint2* q_frag,
                                                int n_tiles, int key_pos0, bool masked, int first_pos,
                                                int row0, int H, float* row_max, bool first) {
  const int lane = threadIdx.x % 32, g = lane / 4, c = lane % 4;
  for (int nt = 0; nt < n_tiles; ++nt) {
    float acc[2][4] = {};
#pragma unroll
    for (int s = 0; s < 8; ++s) {
      const uint2 bq = q_frag[(nt * 8 + s) * 32 + lane];
#pragma unroll
      for (int mt = 0; mt < 2; ++mt)
        mma_16816<kFp8>(acc[mt], kw[mt][0][2 * s], kw[mt][1][2 * s], kw[mt][0][2 * s + 1],
                        kw[mt][1][2 * s + 1], bq.x, bq.y);
    }
    // acc[mt]: {key g, row 2c}, {key g, row 2c+1}, {key g+8, row 2c}, {key g+8, row 2c+1}.
    float m[2] = {kNaN(), kNaN()};
#pragma unroll
    for (int e = 0; e < 2; ++e) {
      const int row_pos = first_pos + (row0 + 8 * nt + 2 * c + e) / H;
#pragma unroll
      for (int mt = 0; mt < 2; ++mt)
#pragma unroll
        for (int hf = 0; hf < 2; ++hf) {
          const int key_pos = key_pos0 + mt * 16 + hf * 8 + g;
          m[e] = fmaxf(m[e], (!masked || key_pos <= row_pos) ? acc[mt][2 * hf + e] : kNaN());
        }
    }
#pragma unroll
    for (int e = 0; e < 2; ++e)
#pragma unroll
      for (int x = 4; x < 32; x *= 2) m[e] = fmaxf(m[e], __shfl_xor_sync(kFullMask, m[e], x));
    if (g == 0) {
#pragma unroll
      for (int e = 0; e < 2; ++e) {
        float& slot = row_max[8 * nt + 2 * c + e];
        slot = first ? m[e] : fmaxf(slot, m[e]);
      }
    }
  }
}

// After a CTA's scores are stored: the last CTA of the request to arrive selects every row of the
// request and resets its counter (ready for the next call or graph replay). `scratch`: one
// SelectScratch per warp, in shared memory the CTA no longer needs.
__device__ void decode_arrive_and_select(const IndexerParams& p, int b, const Request& req,
                                         int arrivals, bool* last_arrival, SelectScratch* scratch) {
  __syncthreads();  // the CTA's score stores come before thread 0's release (cumulative over the barrier)
  if (threadIdx.x == 0) *last_arrival = arrive_acq_rel_gpu(p.counters + b) + 1 == unsigned(arrivals);
  __syncthreads();
  if (!*last_arrival) return;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int H = p.num_heads, dql = p.decode_query_len, rows_total = dql * H;
  for (int row = warp; row < rows_total; row += int(blockDim.x) / 32) {
    const int r = row / H, h = row % H;
    const int64_t t = int64_t(b) * dql + r;
    int32_t* out = p.topk_out + t * p.topk_stride_t + int64_t(h) * p.topk;
    const int pos = req.seq_len - dql + r;
    if (pos < 0) {  // a padded row (seq_len 0) or one before the sequence: nothing visible
      for (int i = lane; i < p.topk; i += 32) out[i] = -1;
      continue;
    }
    select_row(p.scores + (int64_t(b) * rows_total + row) * p.max_blocks, pos / kPage + 1, p.topk,
               p.init_blocks, p.local_blocks, out, scratch[warp]);
  }
  if (threadIdx.x == 0) p.counters[b] = 0;
}

// The pages of split `split`: split, split + num_splits, split + 2 num_splits, ... below the
// request's visible pages (from the device-side length); their count. Strided rather than
// contiguous ranges so that a split's first pages do not depend on the length: the Hopper kernel
// loads their table entries beside the length, one round trip instead of two before its first copy.
__device__ __forceinline__ int split_page_count(const Request& req, int num_splits, int split) {
  const int nb_seq = (req.seq_len + kPage - 1) / kPage;
  return nb_seq > split ? (nb_seq - 1 - split) / num_splits + 1 : 0;
}
// The request's page of this CTA's (split = blockIdx.x) i-th page.
__device__ __forceinline__ int split_page(int num_splits, int i) { return int(blockIdx.x) + i * num_splits; }

template <bool kFp8>
__global__ void __launch_bounds__(kDecodeThreads, kDecodeMinBlocks)
    indexer_decode_kernel(const __grid_constant__ IndexerParams p, int num_splits, int row_groups) {
  __shared__ uint2 q_frag[kDecodeNTiles * 8 * 32];         // 32 KB
  __shared__ float page_max[kDecodeWarps][kDecodeRows];   // a warp's page: max per query row
  __shared__ bool last_arrival;
  constexpr int kElemBytes = kFp8 ? 1 : 2;
  const int b = blockIdx.y, group = blockIdx.z;
  const int H = p.num_heads, rows_total = p.decode_query_len * H;
  const int row0 = group * kDecodeRows, rows = min(kDecodeRows, rows_total - row0);
  Request req;
  if (!load_request(p, b, req)) return;  // uniform over the request's CTAs: no arrival either
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, g = lane / 4, c = lane % 4;
  const int n_tiles = (rows + 7) / 8;
  decode_fill_q_frags<kFp8>(p, b, row0, rows, q_frag);
  __syncthreads();
  const int n_pages = split_page_count(req, num_splits, blockIdx.x);
  const int first_pos = req.seq_len - p.decode_query_len;  // position of the request's row 0
  const int32_t* table = p.block_table + int64_t(b) * p.block_table_stride;
  const char* cache = static_cast<const char*>(p.index_cache);
  // Each warp owns whole pages; the 128 keys of a page in 4 passes of 32.
  for (int i = warp; i < n_pages; i += kDecodeWarps) {
    const int j = split_page(num_splits, i);
    const int page = table[j];
    for (int r = lane; r < rows; r += 32) page_max[warp][r] = kNaN();
    __syncwarp();
    if (page >= 0 && page < p.num_cache_blocks) {  // warp-uniform; else the page scores NaN
      const bool masked = j * kPage + kPage - 1 > first_pos;  // some key lies past some row
      const char* page_base = cache + int64_t(page) * kPage * 128 * kElemBytes;
      for (int sub = 0; sub < kPage / 32; ++sub) {
        uint4 ch[2][2][FragChunks<kFp8>::kCount];
#pragma unroll
        for (int mt = 0; mt < 2; ++mt)
#pragma unroll
          for (int hf = 0; hf < 2; ++hf)
            load_row_chunks<kFp8, true>(page_base + (sub * 32 + mt * 16 + hf * 8 + g) * 128 * kElemBytes, c,
                                        ch[mt][hf]);
        uint32_t kw[2][2][kWords];
#pragma unroll
        for (int mt = 0; mt < 2; ++mt)
#pragma unroll
          for (int hf = 0; hf < 2; ++hf) chunks_to_words<kFp8>(ch[mt][hf], kw[mt][hf]);
        decode_keys_max<kFp8>(kw, q_frag, n_tiles, j * kPage + sub * 32, masked, first_pos, row0, H,
                              page_max[warp], false);
      }
    }
    __syncwarp();
    for (int r = lane; r < rows; r += 32)
      p.scores[(int64_t(b) * rows_total + row0 + r) * p.max_blocks + j] = page_max[warp][r];
    __syncwarp();
  }
  static_assert(sizeof(q_frag) >= kDecodeWarps * sizeof(SelectScratch), "selection scratch");
  decode_arrive_and_select(p, b, req, num_splits * row_groups, &last_arrival,
                           reinterpret_cast<SelectScratch*>(q_frag));  // the queries are done with
}

// ---- Hopper decode: pages by bulk copy into shared memory.
// Two pages in flight a CTA (3 CTAs a SM for bf16, by shared memory; 4 for fp8, by its 125
// registers): on the H200 (same run, B8) faster
// than three (bf16 128K 67.7-68.0 vs 70.6-71.0 us, fp8 32K 14.3-14.5 vs 15.5-15.6, fp8 128K
// 40.2-40.3 vs 41.1-41.6; bf16 32K unchanged) and four (79.4, 16.5-16.7, 41.7-41.9): fewer bytes
// queued in a saturated memory system, so the last pages and the arrivals wait less.
constexpr int kDecodeStages = 2;

template <bool kFp8>
__host__ __device__ constexpr int decode_sm90_page_bytes() {
  return kPage * 128 * (kFp8 ? 1 : 2);
}

#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
// Thread 0 of a Hopper decode CTA (the decode kernel and its read floor): the CTA's page i (cache
// page `page`) into stage i % kDecodeStages by bulk copy on its barrier, or, for a page outside the
// cache, an arrival alone (nothing to copy); kOk: ok[stage] says which, before the copy is issued.
template <int kPageBytes, bool kOk>
__device__ __forceinline__ void decode_issue_page(const IndexerParams& p, const char* cache, int page, int i,
                                                  uint8_t* dsmem, uint64_t* full, bool* ok) {
  const int stage = i % kDecodeStages;
  const bool copy = page >= 0 && page < p.num_cache_blocks;
  if constexpr (kOk) ok[stage] = copy;
  if (copy) {
    mbar_arrive_expect_tx(&full[stage], kPageBytes);
    bulk_copy_to_shared(dsmem + stage * kPageBytes, cache + int64_t(page) * kPageBytes, kPageBytes, &full[stage]);
  } else {
    mbar_arrive(&full[stage]);
  }
}

// Thread 0, before the CTA's first barrier: the stages' barriers initialised (visible to the copy
// engine) and the first of the CTA's n_pages pages issued (first[i]: page i's table entry).
template <int kPageBytes, bool kOk>
__device__ __forceinline__ void decode_start_pages(const IndexerParams& p, const char* cache,
                                                   const int (&first)[kDecodeStages], int n_pages, uint8_t* dsmem,
                                                   uint64_t* full, bool* ok) {
  for (int s = 0; s < kDecodeStages; ++s) mbar_init(&full[s], 1);
  fence_mbarrier_init();
  for (int i = 0; i < min(kDecodeStages, n_pages); ++i)
    decode_issue_page<kPageBytes, kOk>(p, cache, first[i], i, dsmem, full, ok);
}

// Thread 0, at the CTA's start: the table entries of its first kDecodeStages pages (split + s x
// splits), loaded before the request's length is known so that the two loads overlap (entries
// past the visible pages are read, never used; the table row holds max_blocks entries).
__device__ __forceinline__ void decode_first_entries(const IndexerParams& p, const int32_t* table, int num_splits,
                                                     int (&first)[kDecodeStages]) {
#pragma unroll
  for (int s = 0; s < kDecodeStages; ++s) {
    const int j = split_page(num_splits, s);
    first[s] = j < p.max_blocks ? table[j] : -1;
  }
}
#endif

// Dynamic shared memory: kDecodeStages pages, then the query fragments (2 KB per n-tile).
template <bool kFp8>
__global__ void __launch_bounds__(kDecodeThreads)
    indexer_decode_sm90_kernel(const __grid_constant__ IndexerParams p, int num_splits, int row_groups) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  extern __shared__ __align__(128) uint8_t dsmem[];
  __shared__ uint64_t full[kDecodeStages];
  __shared__ bool page_ok[kDecodeStages];
  __shared__ float part_max[2][kDecodeWarps][kDecodeRows];  // per page (double-buffered): per warp
  __shared__ bool last_arrival;
  constexpr int kPageBytes = decode_sm90_page_bytes<kFp8>();
  constexpr int kRowBytes = 128 * (kFp8 ? 1 : 2);
  uint2* q_frag = reinterpret_cast<uint2*>(dsmem + kDecodeStages * kPageBytes);
  kernels::grid_dependency_wait();  // launched with PDL (p.pdl): nothing is read before this
  if (p.pdl_trigger) kernels::launch_dependents();
  const int b = blockIdx.y, group = blockIdx.z;
  const int H = p.num_heads, rows_total = p.decode_query_len * H;
  const int row0 = group * kDecodeRows, rows = min(kDecodeRows, rows_total - row0);
  const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32, g = lane / 4, c = lane % 4;
  const int n_tiles = (rows + 7) / 8;
  const int32_t* table = p.block_table + int64_t(b) * p.block_table_stride;
  // Before the length: each warp's first query tile (so that its loads leave ahead of the pages'
  // copies, which they would otherwise queue behind: 1-7 us at batch 8, session 24) and thread 0's
  // first table entries.
  uint4 q_first[FragChunks<kFp8>::kCount] = {};
  if (warp < n_tiles && 8 * warp + g < rows)
    load_row_chunks<kFp8, false>(decode_q_row(p, b, row0 + 8 * warp + g), c, q_first);
  int first[kDecodeStages];
  if (tid == 0) decode_first_entries(p, table, num_splits, first);
  Request req;
  if (!load_request(p, b, req)) return;
  const int n_pages = split_page_count(req, num_splits, blockIdx.x);
  const char* cache = static_cast<const char*>(p.index_cache);
  // A page outside the cache is not copied (page_ok false): it scores NaN.
  if (tid == 0) decode_start_pages<kPageBytes, true>(p, cache, first, n_pages, dsmem, full, page_ok);
  if (warp < n_tiles) store_q_tile<kFp8>(q_first, warp, q_frag);
  decode_fill_q_frags<kFp8>(p, b, row0, rows, q_frag, kDecodeWarps);
  __syncthreads();
  const int first_pos = req.seq_len - p.decode_query_len;
  for (int i = 0; i < n_pages; ++i) {
    const int j = split_page(num_splits, i), stage = i % kDecodeStages;
    mbar_wait(&full[stage], uint32_t(i / kDecodeStages) & 1u);
    float* my_max = part_max[i % 2][warp];
    if (page_ok[stage]) {  // block-uniform
      // This warp's 32 keys (32 warp .. 32 warp + 31) as two m-tiles, from shared memory.
      const uint8_t* page = dsmem + stage * kPageBytes;
      uint32_t kw[2][2][kWords];
#pragma unroll
      for (int mt = 0; mt < 2; ++mt)
#pragma unroll
        for (int hf = 0; hf < 2; ++hf) {
          const uint4* row = reinterpret_cast<const uint4*>(page + (warp * 32 + mt * 16 + hf * 8 + g) * kRowBytes);
          uint4 ch[FragChunks<kFp8>::kCount];
#pragma unroll
          for (int k = 0; k < FragChunks<kFp8>::kCount; ++k) ch[k] = row[4 * k + c];
          chunks_to_words<kFp8>(ch, kw[mt][hf]);
        }
      const bool masked = j * kPage + kPage - 1 > first_pos;
      decode_keys_max<kFp8>(kw, q_frag, n_tiles, j * kPage + warp * 32, masked, first_pos, row0, H, my_max, true);
    } else {
      for (int r = lane; r < rows; r += 32) my_max[r] = kNaN();
    }
    __syncthreads();  // every warp's maxima are in; every warp is done reading the stage
    if (tid == 0 && i + kDecodeStages < n_pages) {
      fence_proxy_async();  // the stage's generic reads, ordered before the copy engine refills it
      decode_issue_page<kPageBytes, true>(p, cache, table[split_page(num_splits, i + kDecodeStages)], i + kDecodeStages,
                                          dsmem, full, page_ok);
    }
    for (int r = tid; r < rows; r += kDecodeThreads) {
      float v = part_max[i % 2][0][r];
#pragma unroll
      for (int w = 1; w < kDecodeWarps; ++w) v = fmaxf(v, part_max[i % 2][w][r]);
      p.scores[(int64_t(b) * rows_total + row0 + r) * p.max_blocks + j] = v;
    }
  }
  static_assert(kDecodeStages * decode_sm90_page_bytes<true>() >= kDecodeWarps * sizeof(SelectScratch),
                "selection scratch");
  decode_arrive_and_select(p, b, req, num_splits * row_groups, &last_arrival,
                           reinterpret_cast<SelectScratch*>(dsmem));  // every page has been consumed
#endif
}

// ------------------------------------------------------------------------------------------------
// Prefill scoring.
// The query tile and the chunk of pages a prefill scoring CTA owns. blockIdx.x = (query tile,
// chunk of `chunk_pages` pages): a page's scores need no other page, so long causal rows split into
// equal CTAs and the grid stays balanced; the last query tiles (the most pages) come first, so the
// short tiles fill the tail of the grid. False when the CTA has nothing to do.
struct PrefillWork {
  Request req;
  int t_begin, t_end;  // query tokens of the request, [t_begin, t_end)
  int ctx;             // position of the request's first query token
  int lowest_pos;      // position of the tile's first token
  int j_begin, j_end;  // pages
};

__device__ __forceinline__ bool prefill_work(const IndexerParams& p, int tokens_per_tile, int chunks,
                                             int chunk_pages, PrefillWork& w) {
  const int chunk = int(blockIdx.x) % chunks, tile = int(gridDim.x) / chunks - 1 - int(blockIdx.x) / chunks;
  if (!load_request(p, blockIdx.y, w.req)) return false;
  w.t_begin = tile * tokens_per_tile;
  if (w.t_begin >= w.req.q_len) return false;
  w.t_end = min(w.req.q_len, w.t_begin + tokens_per_tile);
  w.ctx = w.req.seq_len - w.req.q_len;
  w.lowest_pos = w.ctx + w.t_begin;
  w.j_begin = chunk * chunk_pages;
  w.j_end = min((w.ctx + w.t_end - 1) / kPage + 1, w.j_begin + chunk_pages);
  return w.j_begin < w.j_end;
}


constexpr int kPrefillWarps = 8;
constexpr int kPrefillThreads = kPrefillWarps * 32;
constexpr int kPrefillRows = kPrefillWarps * 32;  // query rows (tokens x heads) per CTA
constexpr int kPrefillStages = 2;
constexpr int kPrefillChunkPages = 8;  // pages per CTA

template <bool kFp8>
__host__ __device__ constexpr int page_chunks() {  // 16-byte chunks per key row
  return kFp8 ? 8 : 16;
}
template <bool kFp8>
__host__ __device__ constexpr int prefill_smem_bytes() {
  return kPrefillStages * kPage * page_chunks<kFp8>() * 16;
}

template <bool kFp8>
__global__ void __launch_bounds__(kPrefillThreads, 2)
    indexer_prefill_score_kernel(const __grid_constant__ IndexerParams p, int tokens_per_tile, int chunks) {
  extern __shared__ uint4 kbuf[];  // [stage][key][chunk ^ (key & 7)]
  __shared__ bool page_ok[kPrefillStages];
  constexpr int kChunks = page_chunks<kFp8>();
  constexpr int kElemBytes = kFp8 ? 1 : 2;
  const int b = blockIdx.y;
  PrefillWork w;
  if (!prefill_work(p, tokens_per_tile, chunks, kPrefillChunkPages, w)) return;
  const Request& req = w.req;
  const int t_begin = w.t_begin, t_end = w.t_end, ctx = w.ctx, lowest_pos = w.lowest_pos;
  const int j_begin = w.j_begin, j_end = w.j_end;
  const int H = p.num_heads;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, g = lane / 4, c = lane % 4;
  const int32_t* table = p.block_table + int64_t(b) * p.block_table_stride;
  const char* cache = static_cast<const char*>(p.index_cache);

  // This warp's 32 query rows (two m-tiles; rows g and g+8 of each) as A fragments.
  uint32_t qa[2][2][kWords];
  int row_pos[2][2];
#pragma unroll
  for (int mt = 0; mt < 2; ++mt)
#pragma unroll
    for (int hf = 0; hf < 2; ++hf) {
      const int r = warp * 32 + mt * 16 + hf * 8 + g;
      const int t = t_begin + r / H;
      const bool valid = r < tokens_per_tile * H && t < t_end;
      row_pos[mt][hf] = valid ? ctx + t : -1;
      uint4 ch[FragChunks<kFp8>::kCount] = {};
      if (valid)
        load_row_chunks<kFp8, false>(static_cast<const char*>(p.index_q) +
                                         ((int64_t(req.q_begin) + t) * H + r % H) * 128 * kElemBytes,
                                     c, ch);
      chunks_to_words<kFp8>(ch, qa[mt][hf]);
    }

  auto load_page = [&](int j, int stage) {
    const int page = table[j];
    const bool ok = page >= 0 && page < p.num_cache_blocks;
    if (threadIdx.x == 0) page_ok[stage] = ok;
    if (ok) {
      const uint4* src = reinterpret_cast<const uint4*>(cache + int64_t(page) * kPage * 128 * kElemBytes);
      uint4* dst = kbuf + stage * kPage * kChunks;
#pragma unroll
      for (int i = 0; i < kPage * kChunks / kPrefillThreads; ++i) {
        const int idx = int(threadIdx.x) + i * kPrefillThreads;
        const int key = idx / kChunks, q = idx % kChunks;
        cp_async_16(dst + key * kChunks + (q ^ (key & 7)), src + idx);
      }
    }
    cp_async_commit();
  };

  load_page(j_begin, 0);
  for (int j = j_begin; j < j_end; ++j) {
    const int stage = (j - j_begin) % kPrefillStages;
    if (j + 1 < j_end) {
      load_page(j + 1, (j + 1 - j_begin) % kPrefillStages);
    } else {
      cp_async_commit();
    }
    cp_async_wait<1>();
    __syncthreads();
    float run[2][2] = {{kNaN(), kNaN()}, {kNaN(), kNaN()}};
    if (page_ok[stage]) {  // block-uniform
      const bool masked = j * kPage + kPage - 1 > lowest_pos;
      const uint4* kb = kbuf + stage * kPage * kChunks;
      for (int nt = 0; nt < kPage / 8; nt += 2) {
        uint32_t bw[2][kWords];
#pragma unroll
        for (int nn = 0; nn < 2; ++nn) {
          const int key = (nt + nn) * 8 + g;
          uint4 ch[FragChunks<kFp8>::kCount];
#pragma unroll
          for (int i = 0; i < FragChunks<kFp8>::kCount; ++i) ch[i] = kb[key * kChunks + ((4 * i + c) ^ (key & 7))];
          chunks_to_words<kFp8>(ch, bw[nn]);
        }
        float acc[2][2][4] = {};
#pragma unroll
        for (int s = 0; s < 8; ++s)
#pragma unroll
          for (int mt = 0; mt < 2; ++mt)
#pragma unroll
            for (int nn = 0; nn < 2; ++nn)
              mma_16816<kFp8>(acc[mt][nn], qa[mt][0][2 * s], qa[mt][1][2 * s], qa[mt][0][2 * s + 1],
                              qa[mt][1][2 * s + 1], bw[nn][2 * s], bw[nn][2 * s + 1]);
        // acc[mt][nn]: {row g, key 2c}, {row g, key 2c+1}, {row g+8, key 2c}, {row g+8, key 2c+1}.
#pragma unroll
        for (int mt = 0; mt < 2; ++mt)
#pragma unroll
          for (int nn = 0; nn < 2; ++nn)
#pragma unroll
            for (int e = 0; e < 4; ++e) {
              const int hf = e / 2;
              const int key_pos = j * kPage + (nt + nn) * 8 + 2 * c + (e & 1);
              const float v = acc[mt][nn][e];
              run[mt][hf] = fmaxf(run[mt][hf], (!masked || key_pos <= row_pos[mt][hf]) ? v : kNaN());
            }
      }
    }
    // Reduce over the quad (keys 2c, 2c+1 of every n-tile) and store the rows' scores.
#pragma unroll
    for (int mt = 0; mt < 2; ++mt)
#pragma unroll
      for (int hf = 0; hf < 2; ++hf) {
        float v = run[mt][hf];
        v = fmaxf(v, __shfl_xor_sync(kFullMask, v, 1));
        v = fmaxf(v, __shfl_xor_sync(kFullMask, v, 2));
        const int r = warp * 32 + mt * 16 + hf * 8 + g;
        if (c == 0 && row_pos[mt][hf] >= 0 && j * kPage <= row_pos[mt][hf]) {
          const int64_t t = int64_t(req.q_begin) + t_begin + r / H;
          p.scores[(t * H + r % H) * p.max_blocks + j] = v;
        }
      }
    __syncthreads();  // every warp is done with this stage before it is refilled
  }
  cp_async_wait<0>();
}

// ------------------------------------------------------------------------------------------------
// Prefill scoring on Hopper (sm_90a), bf16 index cache: wgmma m64n128k16, one page (128 keys) per
// instruction chain. A CTA holds 2 warpgroups x 64 query rows (two CTAs per SM); the query rows are
// the A operand in registers (natural dim order), the page the B operand in shared memory in the
// 128-byte-swizzled K-major layout (two 64-dim halves of 128 keys x 128 bytes; 16-byte chunk q of
// key n at q ^ (n % 8)). Pages stream through a 3-stage cp.async pipeline. (An e4m3 cache takes the
// keys-as-A kernel below; converting each e4m3 page to an f16 image for this kernel's B operand
// measured 1.13-1.16x slower on the H200, docs/perf.md.)
constexpr int kSm90WarpGroups = 2;
constexpr int kSm90Threads = kSm90WarpGroups * 128;
constexpr int kSm90Rows = kSm90WarpGroups * 64;
constexpr int kSm90Stages = 3;
constexpr int kSm90MinBlocks = 2;  // two CTAs per SM: one's epilogue overlaps the other's MMAs
// Pages per CTA: 16 amortize the CTA's query load and pipeline fill; tables of fewer than 128
// pages (short prefills) use 8, so the causal grid splits into more, better-balanced CTAs.
__host__ __device__ constexpr int sm90_chunk_pages(int max_blocks) { return max_blocks >= 128 ? 16 : 8; }
__host__ __device__ constexpr int sm90_smem_bytes() {
  return kSm90Stages * kPage * 128 * 2 + 1024;  // +1024: alignment
}

// Byte offset of 16-byte chunk q (0..15) of key n in a swizzled page image.
[[maybe_unused]] __device__ __forceinline__ int sw128_offset(int n, int q) {
  return (q / 8) * (kPage * 128) + n * 128 + (((q % 8) ^ (n & 7)) * 16);
}

__global__ void __launch_bounds__(kSm90Threads, kSm90MinBlocks)
    indexer_prefill_score_sm90_kernel(const __grid_constant__ IndexerParams p, int tokens_per_tile, int chunks) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  extern __shared__ uint8_t smem_raw[];
  __shared__ bool page_ok[kSm90Stages];
  constexpr int kPageBytes = kPage * 128 * 2;
  uint8_t* smem = smem_raw + ((1024 - (static_cast<uint32_t>(__cvta_generic_to_shared(smem_raw)) & 1023)) & 1023);
  const int b = blockIdx.y;
  // prefill_work's split, spelled out: through the helper's struct this kernel measured 15% slower
  // (bf16 8K: 120 vs 103 µs scoring on the H200; same registers, no spills; see docs/perf.md).
  const int chunk = int(blockIdx.x) % chunks, tile = int(gridDim.x) / chunks - 1 - int(blockIdx.x) / chunks;
  Request req;
  if (!load_request(p, b, req)) return;
  const int t_begin = tile * tokens_per_tile;
  if (t_begin >= req.q_len) return;
  const int t_end = min(req.q_len, t_begin + tokens_per_tile);
  const int H = p.num_heads;
  const int ctx = req.seq_len - req.q_len;
  const int lowest_pos = ctx + t_begin;
  const int chunk_pages = sm90_chunk_pages(p.max_blocks);
  const int j_begin = chunk * chunk_pages;
  const int j_end = min((ctx + t_end - 1) / kPage + 1, j_begin + chunk_pages);
  if (j_begin >= j_end) return;
  const int tid = threadIdx.x, lane = tid % 32, g = lane / 4, c = lane % 4;
  const int row_base = (tid / 128) * 64 + ((tid / 32) % 4) * 16;  // this warp's 16 rows
  const int32_t* table = p.block_table + int64_t(b) * p.block_table_stride;
  const char* cache = static_cast<const char*>(p.index_cache);
  // The chunk's page ids, read once (not one exposed global load per page).
  __shared__ int page_id[16];
  static_assert(sm90_chunk_pages(1 << 30) <= 16, "page_id holds a chunk");
  if (tid < j_end - j_begin) page_id[tid] = table[j_begin + tid];

  // A fragments: a[s] = {(row g, k 2c..2c+1), (row g+8, ...), (row g, k 2c+8..), (row g+8, ...)}
  // of k-step s (dims 16 s ..), as bf16x2 words.
  uint32_t a[8][4];
  int row_pos[2];
#pragma unroll
  for (int hf = 0; hf < 2; ++hf) {
    const int r = row_base + hf * 8 + g;
    const int t = t_begin + r / H;
    const bool valid = r < tokens_per_tile * H && t < t_end;
    row_pos[hf] = valid ? ctx + t : -1;
    const char* q = static_cast<const char*>(p.index_q) + ((int64_t(req.q_begin) + t) * H + r % H) * 128 * 2;
#pragma unroll
    for (int s = 0; s < 8; ++s)
#pragma unroll
      for (int kh = 0; kh < 2; ++kh) {
        const int d = 16 * s + 2 * c + 8 * kh;
        a[s][hf + 2 * kh] = valid ? __ldg(reinterpret_cast<const uint32_t*>(q + 2 * d)) : 0u;
      }
  }

  __syncthreads();  // page_id (the A fragments' loads stay in flight)
  auto load_page = [&](int j, int stage) {
    const int page = page_id[j - j_begin];
    const bool ok = page >= 0 && page < p.num_cache_blocks;
    if (tid == 0) page_ok[stage] = ok;
    if (ok) {
      const uint4* src = reinterpret_cast<const uint4*>(cache + int64_t(page) * kPageBytes) + tid;
      // Chunk tid + 256 k, swizzled: it lands 2048 k bytes past chunk tid (16 keys on: the same
      // swizzle phase).
      uint8_t* dst = smem + stage * kPageBytes + sw128_offset(tid / 16, tid % 16);
#pragma unroll
      for (int k = 0; k < kPageBytes / 16 / kSm90Threads; ++k) cp_async_16(dst + k * 2048, src + k * kSm90Threads);
    }
    cp_async_commit();
  };

#pragma unroll
  for (int i = 0; i < kSm90Stages - 1; ++i) {
    if (j_begin + i < j_end)
      load_page(j_begin + i, i);
    else
      cp_async_commit();
  }
  for (int j = j_begin; j < j_end; ++j) {
    const int it = j - j_begin, stage = it % kSm90Stages;
    cp_async_wait<kSm90Stages - 2>();
    fence_proxy_async();  // this thread's shared-memory writes, visible to the tensor cores
    __syncthreads();
    // The stage read in the previous iteration is free: refill it.
    if (j + kSm90Stages - 1 < j_end)
      load_page(j + kSm90Stages - 1, (it + kSm90Stages - 1) % kSm90Stages);
    else
      cp_async_commit();
    float run[2] = {kNaN(), kNaN()};
    if (page_ok[stage]) {  // block-uniform
      const uint32_t base = static_cast<uint32_t>(__cvta_generic_to_shared(smem + stage * kPageBytes));
      float d[64];
#pragma unroll
      for (int i = 0; i < 64; ++i) d[i] = 0.f;
      wgmma_fence();
#pragma unroll
      for (int s = 0; s < 8; ++s) wgmma_m64k16<128, false>(d, a[s], sw128_desc(base + (s / 4) * (kPage * 128) + (s % 4) * 32));
      wgmma_commit();
      wgmma_wait_all();
      // d[4i + e]: row g + 8 (e / 2), key 8 i + 2 c + (e % 2).
      const bool masked = j * kPage + kPage - 1 > lowest_pos;  // block-uniform: the diagonal pages
      if (masked) {
#pragma unroll
        for (int i = 0; i < 16; ++i)
#pragma unroll
          for (int e = 0; e < 4; ++e) {
            const int key_pos = j * kPage + 8 * i + 2 * c + (e & 1);
            if (key_pos > row_pos[e / 2]) d[4 * i + e] = kNaN();
          }
      }
      // Each row's max over its 32 values as a tree of depth 5 (fmaxf skips NaN), not a chain of
      // 32: with the mask paid on the diagonal pages only, the epilogue was the kernel's bound
      // (bf16 8K scoring 102.6 -> 74.5 us on the H200 with the constant-stride addresses below).
#pragma unroll
      for (int i = 0; i < 32; ++i) d[i] = fmaxf(d[i], d[i + 32]);
#pragma unroll
      for (int i = 0; i < 16; ++i) d[i] = fmaxf(d[i], d[i + 16]);
#pragma unroll
      for (int i = 0; i < 8; ++i) d[i] = fmaxf(d[i], d[i + 8]);
#pragma unroll
      for (int i = 0; i < 4; ++i) d[i] = fmaxf(d[i], d[i + 4]);
      run[0] = fmaxf(d[0], d[1]);
      run[1] = fmaxf(d[2], d[3]);
    }
#pragma unroll
    for (int hf = 0; hf < 2; ++hf) {
      float v = run[hf];
      v = fmaxf(v, __shfl_xor_sync(kFullMask, v, 1));
      v = fmaxf(v, __shfl_xor_sync(kFullMask, v, 2));
      const int r = row_base + hf * 8 + g;
      if (c == 0 && row_pos[hf] >= 0 && j * kPage <= row_pos[hf]) {
        const int64_t t = int64_t(req.q_begin) + t_begin + r / H;
        p.scores[(t * H + r % H) * p.max_blocks + j] = v;
      }
    }
  }
  cp_async_wait<0>();
#endif
}

// ------------------------------------------------------------------------------------------------
// Prefill scoring on Hopper for an e4m3 index cache, keys as the A operand: S^T = K Q^T with
// wgmma m64n128k16, warpgroup w taking keys 64 w .. 64 w + 63 of each page (M) against the CTA's
// 128 query rows (N). The raw e4m3 page goes from shared memory straight into registers (two
// 16-byte loads per key row a thread), converted there exactly to f16 A fragments: no f16 page
// image is written and read back, and no CTA-wide conversion pass. The query rows are converted
// once per CTA into an f16 B image (128-byte swizzle, K-major, as the page images above).
//
// The dims are permuted (the dot product pairs the same dims, only the order of the sum changes):
// k-step s of lane c's A fragment takes the four bytes at dims 32 c + 4 s .. + 3 of its key row
// (pairs 0-1 as k 2c, 2c+1; pairs 2-3 as k 2c+8, 2c+9), so lane c reads the 32 contiguous bytes
// 32 c .. 32 c + 31 of each of its two rows; the Q image holds the same dims at those k
// positions. A page's max over keys for query row n is then a reduction over the M dimension:
// over the thread's two keys, over the 8 lanes of a column group (shuffles that halve the values
// each round), and over the CTA's 8 warps through shared memory, finished for page j - 1 after
// page j's barrier (one CTA barrier a page).
constexpr int kSm90KaStages = 3;
constexpr int kSm90KaRawPage = kPage * 128;         // bytes of an e4m3 page
constexpr int kSm90KaQImage = kSm90Rows * 128 * 2;  // the f16 query rows
constexpr int kSm90KaRed = 2 * 8 * kSm90Rows * 4;   // partial maxima [2 pages][8 warps][128 rows] fp32
__host__ __device__ constexpr int sm90_keys_a_smem_bytes() {
  return kSm90KaStages * kSm90KaRawPage + kSm90KaQImage + kSm90KaRed + 1024;  // +1024: alignment
}

// One round of a max over the lanes xor kHalf (kHalf = 16, 8, 4): v[0, 2 kHalf) -> v[0, kHalf),
// the lane with bit kHalf set keeping (and receiving the partner's) upper half.
template <int kHalf>
__device__ __forceinline__ void max_halve(float (&v)[32], int lane) {
  const bool up = (lane & kHalf) != 0;
#pragma unroll
  for (int k = 0; k < kHalf; ++k) {
    const float send = up ? v[k] : v[k + kHalf], keep = up ? v[k + kHalf] : v[k];
    v[k] = fmaxf(keep, __shfl_xor_sync(kFullMask, send, kHalf));
  }
}

__global__ void __launch_bounds__(kSm90Threads, kSm90MinBlocks)
    indexer_prefill_score_sm90_keys_a_kernel(const __grid_constant__ IndexerParams p, int tokens_per_tile,
                                             int chunks) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  extern __shared__ uint8_t smem_raw[];
  uint8_t* smem = smem_raw + ((1024 - (static_cast<uint32_t>(__cvta_generic_to_shared(smem_raw)) & 1023)) & 1023);
  uint8_t* qimg = smem + kSm90KaStages * kSm90KaRawPage;
  float* red = reinterpret_cast<float*>(qimg + kSm90KaQImage);
  const int b = blockIdx.y;
  PrefillWork work;
  if (!prefill_work(p, tokens_per_tile, chunks, sm90_chunk_pages(p.max_blocks), work)) return;
  const Request& req = work.req;
  const int t_begin = work.t_begin, t_end = work.t_end, lowest_pos = work.lowest_pos;
  const int j_begin = work.j_begin, j_end = work.j_end;
  const int H = p.num_heads;
  const int tid = threadIdx.x, lane = tid % 32, g = lane / 4, c = lane % 4;
  const int wg = tid / 128, n0 = wg * 64 + ((tid / 32) % 4) * 16 + g;  // this thread's keys: n0, n0 + 8
  const int valid_rows = (t_end - t_begin) * H;  // query rows past these hold zeros, never stored
  const int64_t row0 = (int64_t(req.q_begin) + t_begin) * H;  // the tile's first (token, head) row
  const int32_t* table = p.block_table + int64_t(b) * p.block_table_stride;
  const char* cache = static_cast<const char*>(p.index_cache);
  __shared__ int page_id[16];
  if (tid < j_end - j_begin) page_id[tid] = table[j_begin + tid];

  // The Q image: task (row r, k-step s) converts dims 32 c + 4 s .. + 3 (c = 0..3) of row r into
  // k 16 s + 2 c, + 1 (16-byte chunk 2 (s % 4) of half s / 4) and 16 s + 2 c + 8, + 9 (the next
  // chunk); chunk q of row r stored at q ^ (r % 8).
  for (int k = tid; k < kSm90Rows * 8; k += kSm90Threads) {
    const int r = k / 8, s = k % 8;
    uint32_t w[4] = {0, 0, 0, 0};
    if (r < valid_rows) {
      const uint8_t* q = static_cast<const uint8_t*>(p.index_q) + (row0 + r) * 128 + 4 * s;
#pragma unroll
      for (int cc = 0; cc < 4; ++cc) w[cc] = __ldg(reinterpret_cast<const uint32_t*>(q + 32 * cc));
    }
    uint8_t* row = qimg + (s / 4) * (kSm90Rows * 128) + r * 128;
    const int q0 = 2 * (s % 4);
    uint32_t lo[4], hi[4];
#pragma unroll
    for (int cc = 0; cc < 4; ++cc) e4m3x4_to_f16x2x2(w[cc], lo[cc], hi[cc]);
    *reinterpret_cast<uint4*>(row + ((q0 ^ (r & 7)) * 16)) = make_uint4(lo[0], lo[1], lo[2], lo[3]);
    *reinterpret_cast<uint4*>(row + (((q0 + 1) ^ (r & 7)) * 16)) = make_uint4(hi[0], hi[1], hi[2], hi[3]);
  }
  fence_proxy_async();  // the Q image, visible to the tensor cores
  __syncthreads();      // and page_id

  auto page_ok = [&](int j) {
    const int page = page_id[j - j_begin];
    return page >= 0 && page < p.num_cache_blocks;
  };
  // A raw page: warpgroup w copies its own 64 keys (512 16-byte chunks, 4 a thread), chunk q of
  // key n stored at q ^ (n % 8).
  auto load_page = [&](int j, int stage) {
    if (page_ok(j)) {
      const int ci = tid % 128, n = wg * 64 + ci / 8;
      const char* src = cache + int64_t(page_id[j - j_begin]) * kSm90KaRawPage + n * 128 + (ci % 8) * 16;
      uint8_t* dst = smem + stage * kSm90KaRawPage + n * 128 + (((ci % 8) ^ (n & 7)) * 16);
#pragma unroll
      for (int k = 0; k < 4; ++k) cp_async_16(dst + k * 2048, src + k * 2048);  // 16 keys on
    }
    cp_async_commit();
  };
  // Page jj's scores (threads 0..127: query row tid) from the partial maxima of the 8 warps.
  const bool fin_row = tid < valid_rows;
  const int fin_pos = lowest_pos + tid / H;
  auto finish = [&](int jj) {
    if (fin_row && jj * kPage <= fin_pos) {
      float v = kNaN();
      if (page_ok(jj)) {
        const float* rr = red + ((jj - j_begin) & 1) * (8 * kSm90Rows) + tid;
#pragma unroll
        for (int w = 0; w < 8; ++w) v = fmaxf(v, rr[w * kSm90Rows]);
      }
      p.scores[(row0 + tid) * p.max_blocks + jj] = v;
    }
  };

#pragma unroll
  for (int i = 0; i < kSm90KaStages - 1; ++i) {
    if (j_begin + i < j_end)
      load_page(j_begin + i, i);
    else
      cp_async_commit();
  }
  const uint32_t qbase = static_cast<uint32_t>(__cvta_generic_to_shared(qimg));
  for (int j = j_begin; j < j_end; ++j) {
    const int it = j - j_begin, stage = it % kSm90KaStages;
    cp_async_wait<kSm90KaStages - 2>();
    // Page j's bytes landed everywhere; page j - 1's stage read and its partial maxima written by
    // every warp.
    __syncthreads();
    if (j + kSm90KaStages - 1 < j_end)
      load_page(j + kSm90KaStages - 1, (it + kSm90KaStages - 1) % kSm90KaStages);
    else
      cp_async_commit();
    if (j > j_begin) finish(j - 1);
    if (page_ok(j)) {  // block-uniform
      const uint8_t* st = smem + stage * kSm90KaRawPage;
      const uint4 k0a = *reinterpret_cast<const uint4*>(st + n0 * 128 + (((2 * c) ^ g) * 16));
      const uint4 k0b = *reinterpret_cast<const uint4*>(st + n0 * 128 + (((2 * c + 1) ^ g) * 16));
      const uint4 k1a = *reinterpret_cast<const uint4*>(st + (n0 + 8) * 128 + (((2 * c) ^ g) * 16));
      const uint4 k1b = *reinterpret_cast<const uint4*>(st + (n0 + 8) * 128 + (((2 * c + 1) ^ g) * 16));
      const uint32_t w0[8] = {k0a.x, k0a.y, k0a.z, k0a.w, k0b.x, k0b.y, k0b.z, k0b.w};
      const uint32_t w1[8] = {k1a.x, k1a.y, k1a.z, k1a.w, k1b.x, k1b.y, k1b.z, k1b.w};
      uint32_t a[8][4];
#pragma unroll
      for (int s = 0; s < 8; ++s) {
        e4m3x4_to_f16x2x2(w0[s], a[s][0], a[s][2]);
        e4m3x4_to_f16x2x2(w1[s], a[s][1], a[s][3]);
      }
      float d[64];
      wgmma_fence();
      wgmma_k128<128, true>(d, a, qbase, kSm90Rows * 128);
      wgmma_commit();
      wgmma_wait_all();
      // d[4 i + e]: key n0 + 8 (e / 2), query row 8 i + 2 c + (e % 2). Key position kp is hidden
      // from row n (position lowest_pos + n / H) iff n < (kp - lowest_pos) H.
      if (j * kPage + kPage - 1 > lowest_pos) {  // block-uniform: the diagonal pages
        const int lim0 = (j * kPage + n0 - lowest_pos) * H, lim1 = lim0 + 8 * H;
#pragma unroll
        for (int i = 0; i < 16; ++i)
#pragma unroll
          for (int e = 0; e < 4; ++e)
            if (8 * i + 2 * c + (e & 1) < (e < 2 ? lim0 : lim1)) d[4 * i + e] = kNaN();
      }
      float v[32];  // v[2 i + e]: row 8 i + 2 c + e, max over the thread's two keys
#pragma unroll
      for (int i = 0; i < 16; ++i)
#pragma unroll
        for (int e = 0; e < 2; ++e) v[2 * i + e] = fmaxf(d[4 * i + e], d[4 * i + 2 + e]);
      // Over g (lane bits 4, 3, 2), halving: the lane whose bit is set keeps the upper half.
      max_halve<16>(v, lane);
      max_halve<8>(v, lane);
      max_halve<4>(v, lane);
      // Lane (g, c) now holds v[2 i' + e] for i' = 2 g + 0, 1: rows 16 g + 2 c + e and 16 g + 8 + 2 c + e.
      float* out = red + (it & 1) * (8 * kSm90Rows) + (tid / 32) * kSm90Rows + 16 * g + 2 * c;
      *reinterpret_cast<float2*>(out) = make_float2(v[0], v[1]);
      *reinterpret_cast<float2*>(out + 8) = make_float2(v[2], v[3]);
    }
  }
  __syncthreads();
  finish(j_end - 1);
  cp_async_wait<0>();
#endif
}

// Prefill selection: one warp per (token, head) row.
constexpr int kSelectWarps = 8;

__global__ void __launch_bounds__(kSelectWarps * 32)
    indexer_prefill_select_kernel(const __grid_constant__ IndexerParams p) {
  __shared__ SelectScratch scratch[kSelectWarps];
  const int warp = threadIdx.x / 32;
  const int64_t row = int64_t(blockIdx.x) * kSelectWarps + warp;
  const int H = p.num_heads;
  const int64_t t = row / H;
  const int h = int(row % H);
  if (t >= p.num_tokens) return;
  // The request holding token t: the last b with cu_seqlens_q[b] <= t.
  int lo = 0, hi = p.num_seqs - 1;
  while (lo < hi) {
    const int mid = (lo + hi + 1) / 2;
    if (p.cu_seqlens_q[mid] <= t) lo = mid; else hi = mid - 1;
  }
  Request req;
  if (!load_request(p, lo, req) || t < req.q_begin || t >= req.q_begin + req.q_len) return;
  const int pos = req.seq_len - req.q_len + int(t - req.q_begin);
  select_row(p.scores + (t * H + h) * p.max_blocks, pos / kPage + 1, p.topk, p.init_blocks,
             p.local_blocks, p.topk_out + t * p.topk_stride_t + int64_t(h) * p.topk, scratch[warp]);
}

bool g_force_portable = false;

template <bool kFp8>
void launch_prefill_score(const IndexerParams& p, cudaStream_t stream) {
  // Hopper: the wgmma kernels (bf16: the page as the B operand; e4m3: the keys as the A operand);
  // other GPUs: the portable mma.sync kernel.
  const bool sm90 = !g_force_portable && kernels::hopper_paths_run();
  const bool keys_a = kFp8 && sm90;
  const void* kernel = keys_a ? reinterpret_cast<const void*>(indexer_prefill_score_sm90_keys_a_kernel)
                       : sm90 ? reinterpret_cast<const void*>(indexer_prefill_score_sm90_kernel)
                              : reinterpret_cast<const void*>(indexer_prefill_score_kernel<kFp8>);
  const int smem = keys_a ? sm90_keys_a_smem_bytes() : sm90 ? sm90_smem_bytes() : prefill_smem_bytes<kFp8>();
  detail::raise_smem_limit(kernel, smem);
  const int rows = sm90 ? kSm90Rows : kPrefillRows;
  const int chunk_pages = sm90 ? sm90_chunk_pages(p.max_blocks) : kPrefillChunkPages;
  const int tokens_per_tile = rows / p.num_heads;
  const int64_t tiles = (p.max_query_len + tokens_per_tile - 1) / tokens_per_tile;
  const int chunks = (p.max_blocks + chunk_pages - 1) / chunk_pages;
  if (tiles == 0) return;
  const dim3 grid(unsigned(tiles * chunks), unsigned(p.num_seqs));
  if (keys_a) {
    indexer_prefill_score_sm90_keys_a_kernel<<<grid, kSm90Threads, smem, stream>>>(p, tokens_per_tile, chunks);
    M3RT_LAUNCH_CHECK(stream, "indexer_prefill_score_sm90_keys_a_kernel");
  } else if (sm90) {
    indexer_prefill_score_sm90_kernel<<<grid, kSm90Threads, smem, stream>>>(p, tokens_per_tile, chunks);
    M3RT_LAUNCH_CHECK(stream, "indexer_prefill_score_sm90_kernel");
  } else {
    indexer_prefill_score_kernel<kFp8><<<grid, kPrefillThreads, smem, stream>>>(p, tokens_per_tile, chunks);
    M3RT_LAUNCH_CHECK(stream, "indexer_prefill_score_kernel");
  }
}

void require_grid_y(const IndexerParams& p) {
  if (p.num_seqs > int(kMaxGridY))
    throw_arg_error("lightning_indexer", "seq_lens.shape", "[" + std::to_string(p.num_seqs) + "]",
                    "at most 65535 requests per call on a GPU");
}

}  // namespace

void indexer_force_portable(bool on) { g_force_portable = on; }

void indexer_prefill_score_launch(const IndexerParams& p, CUstream_st* stream) {
  require_grid_y(p);
  if (p.fp8)
    launch_prefill_score<true>(p, stream);
  else
    launch_prefill_score<false>(p, stream);
}

void indexer_prefill_select_launch(const IndexerParams& p, CUstream_st* stream) {
  const int64_t rows = p.num_tokens * p.num_heads;
  if (rows == 0) return;
  indexer_prefill_select_kernel<<<unsigned((rows + kSelectWarps - 1) / kSelectWarps), kSelectWarps * 32, 0,
                                  stream>>>(p);
  M3RT_LAUNCH_CHECK(stream, "indexer_prefill_select_kernel");
}

void indexer_prefill_launch(const IndexerParams& p, CUstream_st* stream) {
  indexer_prefill_score_launch(p, stream);
  indexer_prefill_select_launch(p, stream);
}

namespace {

// The decode launch's geometry: grid (splits, requests, row groups), dynamic shared memory, and the
// CTAs a SM can hold (the split count's basis).
struct DecodeGrid {
  int splits, groups, smem, resident;
  bool sm90;
};

DecodeGrid decode_grid(const IndexerParams& p) {
  require_grid_y(p);
  DecodeGrid d{};
  const int rows = p.decode_query_len * p.num_heads;
  d.groups = (rows + kDecodeRows - 1) / kDecodeRows;
  const int n_tiles = (std::min(rows, kDecodeRows) + 7) / 8;
  d.sm90 = !g_force_portable && kernels::hopper_paths_run();
  // Hopper: two pages per CTA in flight through shared memory; CTAs per SM as the shared memory
  // allows. Portable: four CTAs per SM, a warp per page.
  d.smem = d.sm90 ? kDecodeStages * (p.fp8 ? decode_sm90_page_bytes<true>() : decode_sm90_page_bytes<false>()) +
                        n_tiles * 8 * 32 * int(sizeof(uint2))
                  : 0;
  int per_sm = kDecodeMinBlocks;
  if (d.sm90) {
    const void* fn = reinterpret_cast<const void*>(p.fp8 ? indexer_decode_sm90_kernel<true> : indexer_decode_sm90_kernel<false>);
    detail::raise_smem_limit(fn, d.smem);
    per_sm = std::max(detail::max_active_blocks_per_sm(fn, kDecodeThreads, d.smem), 1);
  }
  // One wave of CTAs over the batch; each CTA at least 4 pages of the widest table.
  d.resident = detail::multiprocessor_count() * per_sm;
  const int by_wave = std::max(1, d.resident / std::max(1, p.num_seqs * d.groups));
  const int by_pages = std::max(1, (p.max_blocks + 3) / 4);
  d.splits = std::clamp(detail::env_int("M3RT_INDEXER_SPLITS", std::min(by_wave, by_pages)), 1,
                        std::max(1, p.max_blocks));  // tuning knob for benches
  return d;
}

// The Hopper decode kernel's page stream alone (indexer_decode_read_floor_launch): the same CTAs,
// pages, stages and barriers, no scoring, no scores, no arrival, no selection. Each CTA's threads
// fold one word of every page into a value stored only if it matches a constant it never holds
// (so the loads stay).
template <bool kFp8>
__global__ void __launch_bounds__(kDecodeThreads)
    indexer_decode_read_floor_kernel(const __grid_constant__ IndexerParams p, int num_splits, unsigned* sink) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  extern __shared__ __align__(128) uint8_t dsmem[];
  __shared__ uint64_t full[kDecodeStages];
  constexpr int kPageBytes = decode_sm90_page_bytes<kFp8>();
  const int tid = threadIdx.x;
  const int32_t* table = p.block_table + int64_t(blockIdx.y) * p.block_table_stride;
  int first[kDecodeStages];
  if (tid == 0) decode_first_entries(p, table, num_splits, first);
  Request req;
  if (!load_request(p, blockIdx.y, req)) return;
  const int n_pages = split_page_count(req, num_splits, blockIdx.x);
  const char* cache = static_cast<const char*>(p.index_cache);
  if (tid == 0) decode_start_pages<kPageBytes, false>(p, cache, first, n_pages, dsmem, full, nullptr);
  __syncthreads();
  unsigned acc = 0;
  for (int i = 0; i < n_pages; ++i) {
    const int stage = i % kDecodeStages;
    mbar_wait(&full[stage], uint32_t(i / kDecodeStages) & 1u);
    acc ^= reinterpret_cast<const unsigned*>(dsmem + stage * kPageBytes)[tid];
    __syncthreads();
    if (tid == 0 && i + kDecodeStages < n_pages) {
      fence_proxy_async();
      decode_issue_page<kPageBytes, false>(p, cache, table[split_page(num_splits, i + kDecodeStages)],
                                           i + kDecodeStages, dsmem, full, nullptr);
    }
  }
  if (acc == 0x9e3779b9u) *sink = acc;
#endif
}

}  // namespace

void indexer_decode_launch(const IndexerParams& p, CUstream_st* stream) {
  const DecodeGrid d = decode_grid(p);
  const int splits = d.splits, groups = d.groups, smem = d.smem;
  const dim3 grid(unsigned(splits), unsigned(p.num_seqs), unsigned(groups));
  if (d.sm90) {
    auto sm90_kernel = p.fp8 ? indexer_decode_sm90_kernel<true> : indexer_decode_sm90_kernel<false>;
    // PDL: the CTAs launch while the previous kernel finishes and wait for it before reading. A
    // one-wave grid (every CTA resident at once) lets the next PDL grid launch as soon as all its
    // CTAs run; with more waves, only at its end (waiting CTAs of the next grid would take the
    // slots this grid's later CTAs need).
    IndexerParams call = p;
    call.pdl_trigger = p.pdl && int64_t(splits) * p.num_seqs * groups <= d.resident;
    kernels::launch_kernel(sm90_kernel, grid, unsigned(kDecodeThreads), size_t(smem), 1, p.pdl, stream,
                           "indexer_decode_sm90_kernel", call, splits, groups);
  } else {
    if (p.fp8)
      indexer_decode_kernel<true><<<grid, kDecodeThreads, 0, stream>>>(p, splits, groups);
    else
      indexer_decode_kernel<false><<<grid, kDecodeThreads, 0, stream>>>(p, splits, groups);
    M3RT_LAUNCH_CHECK(stream, "indexer_decode_kernel");
  }
}

bool indexer_decode_read_floor_launch(const IndexerParams& p, unsigned* sink, CUstream_st* stream) {
  const DecodeGrid d = decode_grid(p);
  if (!d.sm90) return false;
  auto fn = p.fp8 ? indexer_decode_read_floor_kernel<true> : indexer_decode_read_floor_kernel<false>;
  detail::raise_smem_limit(reinterpret_cast<const void*>(fn), d.smem);
  fn<<<dim3(unsigned(d.splits), unsigned(p.num_seqs), 1), kDecodeThreads, d.smem, stream>>>(p, d.splits, sink);
  M3RT_LAUNCH_CHECK(stream, "indexer_decode_read_floor_kernel");
  return true;
}

}  // namespace m3rt
