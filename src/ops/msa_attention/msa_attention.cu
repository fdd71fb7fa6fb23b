// msa_attention tensor-core kernel (sm_80+, with a wgmma loop on sm_90a; tuned on the H200): one
// kernel for prefill, decode and speculative verify.
//
//   q      [T, Hq, 128] bf16            out [T, Hq, 128] bf16, lse [T, Hq] fp32 (natural log)
//   cache  [num_blocks, Hkv, 128, 256]  bf16 or e4m3: K in [..., :128], V in [..., 128:]
//   topk   [Hkv, T, K] int32 (strided)  logical block ids of the token's request
//
// A CTA serves a *row group* (up to msa_group_tokens consecutive query tokens of one request, with
// all G query heads of one KV head: at most 128 rows, token-major) and, in split decode, one slice
// of the group's pages:
//  1. Resolve the group's request, each token's position and visible key range [lo, hi).
//  2. Gather the tokens' top-k entries; drop the skipped ones (-1, past the token's visible blocks,
//     a page outside the cache); the union of pages is the unique ids in order, each with a bitmask
//     of the tokens that selected it. While the request's ids fit a word-per-id table in shared
//     memory, each entry ORs its token into its id's word and a block scan compacts the nonzero
//     words (two barriers); otherwise (id, token, page) keys go through a bitonic sort. So each
//     (request, KV head, page) is read once per group however many tokens chose it.
//  3. Pages go through the pipeline as 64-key chunks (cp.async, 128-byte XOR swizzle, keys at or
//     past seq_len zero-filled so a garbage V never meets a zero weight); a chunk no token sees is
//     not loaded.
//  4. Four warps: each 16-row MMA tile of the group is owned by a warp; when there are fewer than 4
//     tiles the warps split a chunk's keys instead (KS = 4, 2 or 1 key parts). Per 16 keys: S = Q K^T
//     on m16n8k16 (bf16; e4m3 keys converted exactly to bf16), masked (token not in the page's mask,
//     key outside [lo, hi)), online softmax in base 2, O += P V with P split into a 16-bit value and
//     its 16-bit residue (bf16 for bf16 V; f16 and exact f16 V for e4m3). Tiles whose tokens did not
//     select the chunk are skipped.
//     On sm_90, groups of more than 64 rows run this step on wgmma instead: two warpgroups of 64
//     rows, the chunk in the 128-byte swizzle both operands read (wg_chunks, the kWg instances);
//     the chunks there come by tensor-map copies, paced by mbarriers (wg_chunks_tma, kTma; e4m3
//     chunks converted once into f16 images both warpgroups read; for unsplit e4m3 groups by a
//     producer warpgroup of their own, ws_produce_e4m3 / wg_chunks_ws, kWs).
//  5. Key parts merge through shared memory in a fixed order; the group's (O, max, sum) either
//     becomes the output (one split) or a partial in the plan's scratch, and the last split to
//     arrive (a per-(group, KV head) counter that it resets) merges the splits in split order; on
//     Hopper the splits of a group run as one cluster instead and merge through DSMEM
//     (cluster_merge, in the kCluster instances only).
// Everything is deterministic: replays give the same bits.
// decode_query_len 1 runs msa_decode1_kernel instead (below): one 16-row tile per (request, KV
// head), no union of pages, small enough for two or three CTAs per SM.
//
// Fragment maps (g = lane / 4, c = lane % 4). The dot product over the 128 dims and the sum over
// keys do not depend on order, so the kernel picks maps that make every shared-memory read a
// plain vector load:
//  - QK^T k-step s: logical k (2c, 2c+1 | 2c+8, 2c+9) = physical dims 16s + 4c + (0, 1 | 2, 3), for
//    Q (A) and K (B) alike: one 8-byte load (bf16) or 4-byte load (e4m3) per fragment.
//  - P V n-tile j: logical column n = physical dim 16n + j, so lane g reads dims 16g..16g+15 of its
//    four key rows with 16-byte loads; its accumulators hold row dims 32c + j and 32c + 16 + j.
//
// Reference: msa_attention_ref.cpp; checks: check_msa_attention.cpp, tests/test_gpu.cu; bench:
// bench_msa_attention.cu; design and numbers: README.md.
#include <cuda.h>
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cooperative_groups.h>
#include <cuda_fp8.h>

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <initializer_list>
#include <mutex>
#include <string>
#include <type_traits>
#include <vector>

#include "core/cuda_check.h"
#include "m3rt/error.h"
#include "ops/common/head_math.cuh"
#include "ops/common/mma.cuh"
#include "ops/common/sm90.cuh"
#include "ops/msa_attention/msa_attention.h"

namespace m3rt {
namespace {

using kernels::cp_async_16z;
using kernels::cp_async_commit;
using kernels::cp_async_wait;
using kernels::e4m3x4_to_f16x2x2;
using kernels::mma_16816;
using kernels::smem_u32;

constexpr int kPage = 128;
constexpr int kChunkKeys = 64;  // keys per pipeline stage
// Bytes of a cache row (one key's K and V of a KV head): bf16 512, e4m3 256.
__host__ __device__ constexpr int cache_row_bytes(bool fp8) { return fp8 ? 256 : 512; }
constexpr int kWgImageBytes = kChunkKeys * 512;  // a chunk as the wgmma loop reads it (bf16 / f16)
constexpr int kWgImages = 3;                     // e4m3 wgmma loop: converted chunks in flight
// The copy-engine loop's mbarriers: per stage `full` and `empty`; e4m3 also per image.
__host__ __device__ constexpr int tma_bars(bool fp8, int stages) { return 2 * stages + (fp8 ? 2 * kWgImages : 0); }
constexpr int kMaxTokens = 32;  // tokens per group (32-bit token masks)
constexpr int kMaxSplits = 16;
constexpr unsigned kFull = 0xffffffffu;
constexpr uint64_t kNoEntry = ~uint64_t(0);
constexpr float kLog2e = 1.4426950408889634f;
constexpr float kLn2 = 0.6931471805599453f;

// ------------------------------------------------------------------------------------------------
// Shared memory. `area` holds the chunk stages and, after the loop, the group's fp32 output rows
// (one plane per key part: KS x tiles <= 4, or 8 tiles of the 8-warp kernel, fit in it).
struct SmemLayout {
  int stage_bytes, stages, rows, n_pad, u_cap;
  int q_off, keys_off, uniq_off, tok_off, ml_off, misc_off, qf_off, bar_off, total;
};

__host__ __device__ inline int next_pow2(int n) {
  int p = 1;
  while (p < n) p <<= 1;
  return p;
}

// image_bytes: the e4m3 wgmma loop's converted chunks, after the stages. bars: the mbarriers of
// the copy-engine loop (two a stage), last.
__host__ __device__ inline SmemLayout smem_layout(bool fp8, int stages, int group_tokens, int group_size, int topk,
                                                  int max_blocks, int warps, int image_bytes = 0, int bars = 0) {
  SmemLayout l{};
  l.stage_bytes = kChunkKeys * cache_row_bytes(fp8);
  l.stages = stages;
  l.rows = msa_group_rows(group_size, group_tokens);
  const int n = group_tokens * topk;
  l.n_pad = next_pow2(n);
  l.u_cap = n < max_blocks ? n : max_blocks;
  // The output planes need KS x tile rows x 512 bytes with KS x tiles <= warps.
  const int pipe = stages * l.stage_bytes + image_bytes;
  int area = pipe > l.rows * 512 ? pipe : l.rows * 512;
  area = area > warps * 16 * 512 ? area : warps * 16 * 512;
  l.q_off = area;
  l.keys_off = l.q_off + l.rows * 256;
  l.uniq_off = l.keys_off + ((l.n_pad * 8 + 15) / 16) * 16;
  l.tok_off = l.uniq_off + l.u_cap * 16;                  // int4 {id, page, mask half 0, mask half 1}
  l.ml_off = l.tok_off + kMaxTokens * 16;                 // per token: int4 {lo, hi, nbv, -}
  // key-part (m, l) [warps][rows], merged (m, l) [rows], split weights [kMaxSplits][rows]
  l.misc_off = l.ml_off + warps * l.rows * 8 + l.rows * 8 + kMaxSplits * l.rows * 4;
  l.qf_off = l.misc_off + 64;                             // e4m3: per row, the f16 queries' factor
  l.bar_off = ((l.qf_off + (fp8 ? l.rows * 4 : 0) + 7) / 8) * 8;
  l.total = l.bar_off + bars * 8;
  return l;
}

// XOR swizzle of the 16-byte pieces of a row (see the bank analysis in README.md): bf16 rows (K, V,
// Q; 512 or 256 bytes) and e4m3 rows (256 bytes).
__device__ __forceinline__ int swz_bf16(int r) {
  return ((r >> 1) & 1) | ((r & 1) << 1) | ((((r >> 1) ^ (r >> 2)) & 1) << 2);
}
__device__ __forceinline__ int swz_e4m3(int r) { return r & 7; }



__device__ __forceinline__ void cp_async_wait_dyn(int pending) {
  switch (pending) {
    case 0: cp_async_wait<0>(); break;
    case 1: cp_async_wait<1>(); break;
    case 2: cp_async_wait<2>(); break;
    case 3: cp_async_wait<3>(); break;
    case 4: cp_async_wait<4>(); break;
    case 5: cp_async_wait<5>(); break;
    case 6: cp_async_wait<6>(); break;
    default: cp_async_wait<7>(); break;
  }
}

__device__ __forceinline__ uint2 lds64(const char* p) { return *reinterpret_cast<const uint2*>(p); }
__device__ __forceinline__ uint32_t lds32(const char* p) { return *reinterpret_cast<const uint32_t*>(p); }
__device__ __forceinline__ uint4 lds128(const char* p) { return *reinterpret_cast<const uint4*>(p); }

// e4m3 pages: Q K^T runs on f16. Every e4m3 value is an f16 value (one conversion instruction per
// pair; to bf16 it takes four), and each query row is scaled into f16's range by a power of two
// 2^-e (exact for every bf16 value of the row down to 2^-28 of its largest; smaller ones lose bits
// or flush, terms under 2^-28 of the row's largest term) with 2^e folded into that row's softmax
// scale. 16 threads a row:
// the row's max |q| by shuffles, then each thread rewrites its 16-byte piece in place; q_factor
// gets 2^e. A row with no finite nonzero max keeps e = 0.
template <int kThreads>
__device__ void q_rows_to_f16(char* q_s, float* q_factor, int rows) {
  for (int base = 0; base < rows * 16; base += kThreads) {  // block-uniform; rows * 16 % 16 == 0
    const int idx = base + int(threadIdx.x), row = idx / 16, pc = idx % 16;
    const bool active = idx < rows * 16;  // whole half-warps
    char* piece = q_s + row * 256 + ((pc ^ swz_bf16(row)) * 16);
    float x[8];
    kernels::unpack_bf16x8(active ? lds128(piece) : make_uint4(0, 0, 0, 0), x);
    float m = 0.f;
#pragma unroll
    for (int i = 0; i < 8; ++i) m = fmaxf(m, fabsf(x[i]));
#pragma unroll
    for (int d = 8; d > 0; d >>= 1) m = fmaxf(m, __shfl_xor_sync(kFull, m, d));
    const int ex = m > 0.f && m <= 3.4028235e38f ? int(__float_as_uint(m) >> 23) - 127 : 14;
    const int e = min(max(ex - 14, -100), 100);  // m 2^-e in [2^14, 2^15)
    const float down = __uint_as_float(uint32_t(127 - e) << 23);
    uint32_t h[4];
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const __half2 v = __floats2half2_rn(x[2 * i] * down, x[2 * i + 1] * down);
      h[i] = *reinterpret_cast<const uint32_t*>(&v);
    }
    if (active) {
      *reinterpret_cast<uint4*>(piece) = make_uint4(h[0], h[1], h[2], h[3]);
      if (pc == 0) q_factor[row] = __uint_as_float(uint32_t(127 + e) << 23);
    }
  }
}


// Two weights as a 16-bit pair plus the pair of their rounding residues (hi + lo carries about 16
// bits: P V through one bf16 P would lose up to 2^-8 of each weight, more than the output tolerance
// allows for rows with a few keys of very different values).
template <bool kF16>
__device__ __forceinline__ void split2(float x0, float x1, uint32_t& hi, uint32_t& lo) {
  if constexpr (kF16) {
    const __half2 h = __floats2half2_rn(x0, x1);
    const float2 f = __half22float2(h);
    const __half2 l = __floats2half2_rn(x0 - f.x, x1 - f.y);
    hi = *reinterpret_cast<const uint32_t*>(&h);
    lo = *reinterpret_cast<const uint32_t*>(&l);
  } else {
    const __nv_bfloat162 h = __floats2bfloat162_rn(x0, x1);
    hi = *reinterpret_cast<const uint32_t*>(&h);
    // The two values back in fp32 by bit operations (bf16 is fp32's upper half; one instruction
    // each, where __bfloat1622float2 took three for the pair's upper value).
    const __nv_bfloat162 l =
        __floats2bfloat162_rn(x0 - __uint_as_float(hi << 16), x1 - __uint_as_float(hi & 0xffff0000u));
    lo = *reinterpret_cast<const uint32_t*>(&l);
  }
}

// ------------------------------------------------------------------------------------------------
// The group a CTA serves.
struct Group {
  int b;          // request
  int tokens;     // query tokens in the group (<= kMaxTokens)
  int64_t tok0;   // first token
  int64_t pos0;   // its position
  int seq_len;
};

// The group's request and tokens. Prefill: request b's groups start at W(b) = cu[b] / TG + b
// (strictly increasing, and wide enough for ceil(query_len / TG) groups), so the grid (T / TG + B
// groups) depends only on shapes; the lengths are checked here. Decode: from the grid alone; the
// length comes later (decode_group_length), so that it loads together with the top-k ids.
__device__ __forceinline__ bool resolve_group(const MsaParams& p, int tg, int64_t x, Group& gr) {
  if (p.cu_seqlens_q) {
    int lo = 0, hi = p.num_seqs - 1;
    while (lo < hi) {
      const int mid = (lo + hi + 1) / 2;
      if (int64_t(p.cu_seqlens_q[mid] / tg) + mid <= x) lo = mid; else hi = mid - 1;
    }
    const int b = lo;
    const int64_t q0 = p.cu_seqlens_q[b], ql = int64_t(p.cu_seqlens_q[b + 1]) - q0;
    const int64_t first = (x - (q0 / tg + b)) * tg;
    if (first < 0 || first >= ql) return false;
    const int sl = p.seq_lens[b];
    if (ql > p.max_query_len || sl < ql) return false;
    gr.b = b;
    gr.tokens = int(min(int64_t(tg), ql - first));
    gr.tok0 = q0 + first;
    gr.pos0 = sl - ql + first;
    gr.seq_len = sl;
    return (int64_t(sl) + kPage - 1) / kPage <= p.max_blocks;
  }
  const int dql = p.decode_query_len, rg = (dql + tg - 1) / tg;
  gr.b = int(x / rg);
  const int first = int(x % rg) * tg;
  gr.tokens = min(tg, dql - first);
  gr.tok0 = int64_t(gr.b) * dql + first;
  return true;
}

__device__ __forceinline__ bool decode_group_length(const MsaParams& p, int seq_len, Group& gr) {
  if (seq_len < 0 || (int64_t(seq_len) + kPage - 1) / kPage > p.max_blocks) return false;
  gr.seq_len = seq_len;
  gr.pos0 = int64_t(seq_len) - p.decode_query_len + (gr.tok0 - int64_t(gr.b) * p.decode_query_len);
  return true;
}

// Shared-memory byte offsets a lane uses for the whole kernel. Every row a lane reads has a fixed
// row & 7 (Q and K rows g, g + 8 of 16-aligned blocks; V rows 2c + e of 8-aligned pairs), so its
// XOR swizzles are fixed too; k-steps s and s + 4 differ by 128 bytes. kBoxed (e4m3): the chunk as
// the copy engine's two boxes (tma_chunk_boxes: K then V, 64 rows of 128 bytes each, 16-byte piece
// q of row r at q ^ (r % 8)), the same swizzle within each half of a 256-byte row, so the same banks.
struct LaneOffsets {
  int q[4];    // Q row (tile * 16 + g), k-steps j (+ 4): piece (2j + c/2) ^ swz(g), half (c & 1)
  int k[8];    // K row g: bf16 like Q (j < 4 used); e4m3 k-step s: piece s ^ g, word c
  int v[4];    // V row 2c + e: bf16 pieces (16 + 2g + h) ^ swz(2c + e) at [2e + h]; e4m3 (8 + g) ^ (2c + e) at [e]
};

// Bytes between two key rows of a stage.
template <bool kFp8, bool kBoxed>
constexpr int kKeyRowBytes = kBoxed ? 128 : cache_row_bytes(kFp8);

// The 16-byte piece (swizzled) of a bf16 row g mod 8 that k-steps j and j + 4 read in lane quad
// position c, and the lane's 8 bytes in it: its offset within the row.
__device__ __forceinline__ int row_piece_offset(int g, int c, int j) {
  return ((2 * j + (c >> 1)) ^ swz_bf16(g)) * 16 + (c & 1) * 8;
}

template <bool kFp8, bool kBoxed = false>
__device__ __forceinline__ LaneOffsets lane_offsets(int tile) {
  static_assert(kFp8 || !kBoxed, "boxed chunks hold e4m3 rows");
  const int lane = threadIdx.x % 32, g = lane / 4, c = lane % 4;
  constexpr int kRow = kKeyRowBytes<kFp8, kBoxed>;
  LaneOffsets o;
#pragma unroll
  for (int j = 0; j < 4; ++j) {
    const int at = row_piece_offset(g, c, j);
    o.q[j] = (tile * 16 + g) * 256 + at;
    if constexpr (!kFp8) o.k[j] = g * kRow + at;
  }
  if constexpr (kFp8) {
#pragma unroll
    for (int s = 0; s < 8; ++s) o.k[s] = g * kRow + (s ^ swz_e4m3(g)) * 16 + c * 4;
#pragma unroll
    for (int e = 0; e < 2; ++e)  // boxed: V's region, kChunkKeys rows of 128 bytes after K's
      o.v[e] = kBoxed ? kChunkKeys * 128 + (2 * c + e) * kRow + ((g ^ (2 * c + e)) * 16)
                      : (2 * c + e) * kRow + ((8 + g) ^ swz_e4m3(2 * c + e)) * 16;
  } else {
#pragma unroll
    for (int e = 0; e < 2; ++e)
#pragma unroll
      for (int h = 0; h < 2; ++h) o.v[2 * e + h] = (2 * c + e) * kRow + ((16 + 2 * g + h) ^ swz_bf16(2 * c + e)) * 16;
  }
  return o;
}

// 2^x on the MUFU unit alone (subnormal results flush to 0: weights below 2^-126 of the row max).
[[maybe_unused]] __device__ __forceinline__ float exp2_ftz(float x) {
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;\n" : "=f"(y) : "f"(x));
  return y;
}

// One online-softmax step's running max (log2 units) for a lane's rows g, g + 8. mx: the step's
// largest visible score of each row before the factor sc (> 0), this lane's part; reduced here over
// the row's four lanes. The max moves only when the step passes it by more than kLazyMax, so after
// a row's first few steps O is rarely rescaled; the weights 2^(s - m) stay <= 2^kLazyMax (far
// inside f16, bf16 and fp32) and every merge takes (m, l) as a pair, so any m is as good as the
// true max. alpha: the factor for O and l (exactly 1 for a row whose max stays). m_sub: what the
// weights subtract (0 for a row with no visible key yet, whose -inf scores then weigh 0).
constexpr float kLazyMax = 8.f;
__device__ __forceinline__ void advance_max(float (&m)[2], float (&mx)[2], float sc, float (&alpha)[2],
                                            float (&m_sub)[2]) {
#pragma unroll
  for (int rs = 0; rs < 2; ++rs) {
    mx[rs] = fmaxf(mx[rs], __shfl_xor_sync(kFull, mx[rs], 1));
    mx[rs] = fmaxf(mx[rs], __shfl_xor_sync(kFull, mx[rs], 2));
    const float cand = mx[rs] * sc;
    const bool move = cand > m[rs] + kLazyMax;  // false while the row has seen only -inf (-inf > -inf)
    alpha[rs] = move ? exp2_ftz(m[rs] - cand) : 1.f;
    m[rs] = move ? cand : m[rs];
    m_sub[rs] = m[rs] == -INFINITY ? 0.f : m[rs];
  }
}

// One warp's work on 16 keys of a chunk for one 16-row tile: S = Q K^T, mask, online softmax,
// O += P V. `keys` = stage + key0 * row bytes; a lane's rows see the chunk keys [lo[rs], hi[rs])
// (an empty range for a row that does not see the chunk).
struct TileState {
  float o[16][4];
  float m[2], l[2];  // rows g, g + 8: running max (log2 units) and this lane's partial sum
};

// The 16-row query tile at q_s (rows of 256 bytes, the bf16 swizzle; bf16, or f16 for e4m3 pages)
// rewritten in place as MMA A fragments: k-step ks of lane l at (ks * 32 + l) * 16, the four
// registers tile_keys16 otherwise assembles from two 8-byte loads (lane_offsets' q of tile 0) —
// the same values, one 16-byte load a k-step and no register moves. Every thread of the CTA calls
// it.
template <int kThreads>
__device__ __forceinline__ void q_to_fragments(char* q_s) {
  constexpr int kPerWarp = 8 / (kThreads / 32);
  static_assert(kPerWarp * (kThreads / 32) == 8, "8 k-steps over the warps");
  const int warp = int(threadIdx.x) / 32, lane = int(threadIdx.x) % 32, g = lane / 4, c = lane % 4;
  uint4 f[kPerWarp];
#pragma unroll
  for (int i = 0; i < kPerWarp; ++i) {
    const int ks = warp * kPerWarp + i, j = ks & 3, hi128 = (ks >> 2) * 128;
    const int at = g * 256 + row_piece_offset(g, c, j) + hi128;  // lane_offsets' q[j] of tile 0
    const uint2 qa = lds64(q_s + at), qb = lds64(q_s + at + 8 * 256);
    f[i] = make_uint4(qa.x, qb.x, qa.y, qb.y);
  }
  __syncthreads();
#pragma unroll
  for (int i = 0; i < kPerWarp; ++i)
    *reinterpret_cast<uint4*>(q_s + ((warp * kPerWarp + i) * 32 + lane) * 16) = f[i];
  __syncthreads();
}

// row_scale: e4m3, the scale of the thread's rows g, g + 8 (scale_log2 times the rows' Q factors).
// kQFrag: q_s holds the tile as A fragments (q_to_fragments), one 16-byte load a k-step.
template <bool kFp8, bool kBoxed = false, bool kQFrag = false>
__device__ __forceinline__ void tile_keys16(TileState& st, const char* q_s, const char* keys, const LaneOffsets& off,
                                            int key0, const int (&lo)[2], const int (&hi)[2], float scale_log2,
                                            float2 row_scale) {
  constexpr int kRow = kKeyRowBytes<kFp8, kBoxed>;
  const int c = threadIdx.x % 4;
  float s[2][4] = {};
#pragma unroll
  for (int ks = 0; ks < 8; ++ks) {
    const int j = ks & 3, hi128 = (ks >> 2) * 128;
    uint4 qf;  // the k-step's A fragment in register order
    if constexpr (kQFrag) {
      qf = lds128(q_s + (ks * 32 + int(threadIdx.x) % 32) * 16);
    } else {
      const uint2 qa = lds64(q_s + off.q[j] + hi128), qb = lds64(q_s + off.q[j] + hi128 + 8 * 256);
      qf = make_uint4(qa.x, qb.x, qa.y, qb.y);
    }
#pragma unroll
    for (int nt = 0; nt < 2; ++nt) {
      uint32_t b0, b1;
      if constexpr (kFp8) {
        e4m3x4_to_f16x2x2(lds32(keys + off.k[ks] + nt * 8 * kRow), b0, b1);
      } else {
        const uint2 w = lds64(keys + off.k[j] + hi128 + nt * 8 * kRow);
        b0 = w.x;
        b1 = w.y;
      }
      mma_16816<kFp8>(s[nt], qf.x, qf.y, qf.z, qf.w, b0, b1);
    }
  }
  // Mask and online softmax (base 2). A masked key is -inf; a NaN score never becomes the max
  // (fmaxf) and turns its row NaN through its weight.
  // bf16: the scale is > 0 (validated), so the max is taken before scaling and the scale folds
  // into the exponent's FMA (as the wgmma loop); e4m3 (per-row scales) scales first.
  // Steps whose 16 keys every row of the lane sees (every full chunk's; in dql-1 decode a
  // warp-uniform test) skip the per-key mask (a compare and a select a score).
  float mx[2] = {-INFINITY, -INFINITY};
  auto scale_mask = [&](auto masked) {
#pragma unroll
    for (int nt = 0; nt < 2; ++nt)
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int rs = e >> 1, key = key0 + nt * 8 + 2 * c + (e & 1);
        if constexpr (kFp8) s[nt][e] *= rs ? row_scale.y : row_scale.x;
        if constexpr (decltype(masked)::value) {
          const bool vis = unsigned(key - lo[rs]) < unsigned(hi[rs] - lo[rs]);
          s[nt][e] = vis ? s[nt][e] : -INFINITY;
        }
        mx[rs] = fmaxf(mx[rs], s[nt][e]);
      }
  };
  if (lo[0] <= key0 && hi[0] >= key0 + 16 && lo[1] <= key0 && hi[1] >= key0 + 16) scale_mask(std::false_type{});
  else scale_mask(std::true_type{});
  const float sc = kFp8 ? 1.f : scale_log2;
  float alpha[2], m_sub[2];
  advance_max(st.m, mx, sc, alpha, m_sub);
  float sum[2] = {0.f, 0.f};
#pragma unroll
  for (int nt = 0; nt < 2; ++nt)
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      const int rs = e >> 1;
      s[nt][e] = exp2_ftz(fmaf(s[nt][e], sc, -m_sub[rs]));
      sum[rs] += s[nt][e];
    }
#pragma unroll
  for (int rs = 0; rs < 2; ++rs) st.l[rs] = st.l[rs] * alpha[rs] + sum[rs];
  if (__any_sync(kFull, alpha[0] != 1.f || alpha[1] != 1.f)) {  // the max moved for some row
#pragma unroll
    for (int j = 0; j < 16; ++j) {
      st.o[j][0] *= alpha[0];
      st.o[j][1] *= alpha[0];
      st.o[j][2] *= alpha[1];
      st.o[j][3] *= alpha[1];
    }
  }
  // O += P V over these 16 keys: P as A (rows g, g+8; keys 2c.., 2c+8..), V rows 2c, 2c+1, 2c+8, 2c+9.
  uint32_t a[4], r[4];  // P (hi) and its residue (lo) as A fragments
  split2<kFp8>(s[0][0], s[0][1], a[0], r[0]);
  split2<kFp8>(s[0][2], s[0][3], a[1], r[1]);
  split2<kFp8>(s[1][0], s[1][1], a[2], r[2]);
  split2<kFp8>(s[1][2], s[1][3], a[3], r[3]);
  if constexpr (kFp8) {
    uint4 v[4];  // dims 16g..16g+15 of key rows 2c, 2c+1, 2c+8, 2c+9, e4m3
#pragma unroll
    for (int i = 0; i < 4; ++i) v[i] = lds128(keys + off.v[i & 1] + (i >> 1) * 8 * kRow);
    // n-tiles j and j + 1 (dims 16g + j, 16g + j + 1): one byte permute gathers both pairs of
    // key rows (bytes j % 4 and j % 4 + 1 of rows 2c and 2c + 1, resp. 2c + 8 and 2c + 9).
#pragma unroll
    for (int j = 0; j < 16; j += 2) {
      const uint32_t sel = uint32_t(j & 3) | (uint32_t(4 + (j & 3)) << 4) | (uint32_t((j & 3) + 1) << 8) |
                           (uint32_t(5 + (j & 3)) << 12);
      const uint32_t w0 = (&v[0].x)[j >> 2], w1 = (&v[1].x)[j >> 2], w2 = (&v[2].x)[j >> 2], w3 = (&v[3].x)[j >> 2];
      uint32_t b0[2], b1[2];
      e4m3x4_to_f16x2x2(__byte_perm(w0, w1, sel), b0[0], b0[1]);
      e4m3x4_to_f16x2x2(__byte_perm(w2, w3, sel), b1[0], b1[1]);
#pragma unroll
      for (int e = 0; e < 2; ++e) {
        mma_16816<true>(st.o[j + e], a[0], a[1], a[2], a[3], b0[e], b1[e]);
        mma_16816<true>(st.o[j + e], r[0], r[1], r[2], r[3], b0[e], b1[e]);
      }
    }
  } else {
    uint4 v[4][2];  // dims 16g..16g+15 of key rows 2c, 2c+1, 2c+8, 2c+9, bf16
#pragma unroll
    for (int i = 0; i < 4; ++i)
#pragma unroll
      for (int h = 0; h < 2; ++h) v[i][h] = lds128(keys + off.v[2 * (i & 1) + h] + (i >> 1) * 8 * kRow);
#pragma unroll
    for (int j = 0; j < 16; ++j) {
      const uint32_t sel = (j & 1) ? 0x7632u : 0x5410u;
      const int w = (j >> 1) & 3, h = j >> 3;
      const uint32_t b0 = __byte_perm((&v[0][h].x)[w], (&v[1][h].x)[w], sel);
      const uint32_t b1 = __byte_perm((&v[2][h].x)[w], (&v[3][h].x)[w], sel);
      mma_16816<false>(st.o[j], a[0], a[1], a[2], a[3], b0, b1);
      mma_16816<false>(st.o[j], r[0], r[1], r[2], r[3], b0, b1);
    }
  }
}

// Chunk c of the page union (64-key half c % 2 of page uniq[c / 2]): the tokens that selected it.
__device__ __forceinline__ uint32_t chunk_mask(const int4* uniq, int c) {
  return uint32_t(c & 1 ? uniq[c >> 1].w : uniq[c >> 1].z);
}

// The chunk keys [lo, hi) each of a lane's two rows sees in a chunk starting at key position
// chunk_pos (empty when the row's token did not select it); row_lo / row_hi: the rows' visible
// key ranges, row_token: their tokens (-1: a padding row).
__device__ __forceinline__ void chunk_row_ranges(uint32_t mask, int chunk_pos, const int (&row_token)[2],
                                                 const int (&row_lo)[2], const int (&row_hi)[2], int (&lo)[2],
                                                 int (&hi)[2]) {
#pragma unroll
  for (int rs = 0; rs < 2; ++rs) {
    const bool ok = row_token[rs] >= 0 && ((mask >> row_token[rs]) & 1);
    lo[rs] = ok ? min(max(row_lo[rs] - chunk_pos, 0), kChunkKeys) : 0;
    hi[rs] = ok ? min(max(row_hi[rs] - chunk_pos, lo[rs]), kChunkKeys) : 0;
  }
}

// A thread's part of loading one chunk (64 key rows of 16-byte pieces): pieces pc = tid % P of rows
// tid / P + k * (threads / P). Its shared offsets repeat with period 2 in k (the swizzle of row
// r depends on r & 7), so they are computed once. kSw128 (bf16, the wgmma kernel): the chunk as
// four 64-key x 128-byte regions (K dims 0-63, K 64-127, V 0-63, V 64-127), 128-byte swizzle
// (16-byte chunk q of key n at q ^ (n % 8)), the layout both wgmma operands read.
template <bool kFp8, int kThreads, bool kSw128 = false>
struct ChunkLoader {
  static constexpr int kRow = cache_row_bytes(kFp8), kPieces = kRow / 16;
  static constexpr int kRowsPerPass = kThreads / kPieces, kPasses = kChunkKeys / kRowsPerPass;
  static constexpr int kDstRow = kSw128 ? 128 : kRow;  // bytes between a region's key rows
  static_assert(!kSw128 || (!kFp8 && kRowsPerPass % 8 == 0), "the swizzled layout holds bf16 rows");
  int row0, src0, dst[2];

  __device__ __forceinline__ ChunkLoader() {
    const int pc = threadIdx.x % kPieces;
    row0 = threadIdx.x / kPieces;
    src0 = row0 * kRow + pc * 16;
#pragma unroll
    for (int k = 0; k < 2; ++k) {
      const int row = row0 + k * kRowsPerPass;
      if constexpr (kSw128)
        dst[k] = (pc / 8) * (kChunkKeys * 128) + row0 * 128 + (((pc % 8) ^ (row & 7)) * 16);
      else
        dst[k] = row0 * kRow + ((pc ^ (kFp8 ? swz_e4m3(row) : swz_bf16(row))) * 16);
    }
  }
  // Keys at or past valid_keys are zero-filled (a full chunk takes no per-row predicate).
  __device__ __forceinline__ void issue(char* stage, const char* chunk, int valid_keys) const {
    if (valid_keys >= kChunkKeys) {
#pragma unroll
      for (int k = 0; k < kPasses; ++k)
        cp_async_16z(stage + dst[k & 1] + k * kRowsPerPass * kDstRow, chunk + src0 + k * kRowsPerPass * kRow, 16);
      return;
    }
#pragma unroll
    for (int k = 0; k < kPasses; ++k)
      cp_async_16z(stage + dst[k & 1] + k * kRowsPerPass * kDstRow, chunk + src0 + k * kRowsPerPass * kRow,
                   row0 + k * kRowsPerPass < valid_keys ? 16 : 0);
  }
};

// Final output of one row: o (fp32, 128 dims, swizzled), its max (log2 units) and sum.
__device__ __forceinline__ int fin_index(int row, int col) {
  return row * 128 + (col ^ ((row & 7) | (((col >> 5) & 3) << 3)));
}

// A row's output factor and LSE (natural log) from its merged (m, l), m in log2 units: a row
// without keys (l == 0) writes 0 and LSE -inf.
__device__ __forceinline__ float row_out_scale(float l, float v_scale) { return l == 0.f ? 0.f : v_scale / l; }
__device__ __forceinline__ float row_lse(float m, float l) { return l == 0.f ? -INFINITY : (m + log2f(l)) * kLn2; }

// Four floats as bf16 (round to nearest), packed for one 8-byte store.
__device__ __forceinline__ uint2 bf16x4(float x0, float x1, float x2, float x3) {
  const __nv_bfloat162 lo = __floats2bfloat162_rn(x0, x1), hi = __floats2bfloat162_rn(x2, x3);
  return make_uint2(*reinterpret_cast<const uint32_t*>(&lo), *reinterpret_cast<const uint32_t*>(&hi));
}

// The dql-1 decode's key-part planes (d1_share): row `row`'s float4 of columns 4 q.. (q < 32) at this
// float offset. A lane holding columns 32 c.. of a row writes its eight float4 with the 16-byte
// slot k ^ ((2 c + row) & 7), so the eight lanes of a quarter warp (rows of both parities, c 0..3)
// hit eight different bank quads, as do eight consecutive q of one row read back.
__device__ __forceinline__ int d1_plane_at(int row, int q) {
  const int c = q >> 3;
  return row * 128 + 32 * c + 4 * ((q & 7) ^ ((2 * c + row) & 7));
}

#if __CUDA_ARCH__ >= 900
// The split merge of a cluster (split decode on Hopper): CTA `split` merges rows [split * rows / S,
// (split + 1) * rows / S) reading every split's (m, l) and weighted output plane (plane 0 of `fin`)
// from its shared memory (DSMEM), in split order: the same arithmetic as the global merge. Every
// split's piece of an output float4 is in flight at once (one DSMEM round trip per row slice, not
// one per split). Only the kernel instances launched as clusters contain it: the others keep the
// register allocation and schedule they have without it (with this code inlined into every
// instance, the 8-warp kernel measured 16-20% slower on verify and prefill).
struct ClusterMergeArgs {
  const float2* row_ml;  // [rows] this CTA's (m, l) per row, read by every CTA of the cluster
  float2* merged;        // [rows] local scratch: the merged (m, l)
  const float* fin;      // this CTA's weighted output rows (fin_index layout)
  float* split_w;        // [kMaxSplits][rows_cap] local scratch: each split's weight per row
  uint16_t* out;
  int64_t out_stride_t, out_stride_h;
  float* lse;
  int64_t lse_stride_t, tok0;
  int rows, rows_cap, splits, split, G, head0;
  float v_scale;
};

// kD1Planes: `fin` in d1_plane_at's layout (the dql-1 decode) instead of fin_index's.
template <int kThreads, bool kD1Planes = false>
__device__ __forceinline__ void cluster_merge(const ClusterMergeArgs& a) {
  namespace cg = cooperative_groups;
  cg::cluster_group cl = cg::this_cluster();
  const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32;
  cl.sync();
  const int r0 = int(int64_t(a.split) * a.rows / a.splits), r1 = int(int64_t(a.split + 1) * a.rows / a.splits);
  for (int row = r0 + warp; row < r1; row += kThreads / 32) {
    // Lane s holds split s's (m, l) and weight.
    const float2 ml = lane < a.splits ? cl.map_shared_rank(a.row_ml, lane)[row] : make_float2(-INFINITY, 0.f);
    float m = ml.x;
    for (int o = 16; o > 0; o >>= 1) m = fmaxf(m, __shfl_xor_sync(kFull, m, o));
    const float w = lane < a.splits && ml.x != -INFINITY ? exp2f(ml.x - m) : 0.f;
    float l = 0.f;
    for (int s = 0; s < a.splits; ++s) l += __shfl_sync(kFull, w, s) * __shfl_sync(kFull, ml.y, s);
    if (lane < a.splits) a.split_w[lane * a.rows_cap + row] = w;
    if (lane == 0) a.merged[row] = make_float2(m, l);
  }
  __syncthreads();
  for (int it = tid; it < (r1 - r0) * 32; it += kThreads) {
    const int row = r0 + it / 32, c4 = (it % 32) * 4;
    int at, sw = 0;  // the float4 of columns c4.. and the permutation of its elements
    if constexpr (kD1Planes) {
      at = d1_plane_at(row, c4 >> 2);
    } else {
      // fin_index keeps an aligned group of 4 columns together, permuted by the low 2 bits of its
      // XOR: column c4 + e sits at element e ^ (x & 3) of the float4.
      const int x = (row & 7) | (((c4 >> 5) & 3) << 3);
      at = row * 128 + ((c4 ^ x) & ~3);
      sw = x & 3;
    }
    float4 v[kMaxSplits];
#pragma unroll
    for (int s = 0; s < kMaxSplits; ++s)
      if (s < a.splits) v[s] = *reinterpret_cast<const float4*>(cl.map_shared_rank(a.fin, s) + at);
    float acc[4] = {0.f, 0.f, 0.f, 0.f};
#pragma unroll
    for (int s = 0; s < kMaxSplits; ++s) {
      const float ws = s < a.splits ? a.split_w[s * a.rows_cap + row] : 0.f;
      if (ws != 0.f) {  // an empty split (weight 0) adds nothing
        acc[0] += v[s].x * ws;
        acc[1] += v[s].y * ws;
        acc[2] += v[s].z * ws;
        acc[3] += v[s].w * ws;
      }
    }
    const float2 ml = a.merged[row];
    const int64_t t = a.tok0 + row / a.G;
    const int h = a.head0 + row % a.G;
    const float inv = row_out_scale(ml.y, a.v_scale);  // a row without keys writes 0
    float o[4];
#pragma unroll
    for (int e = 0; e < 4; ++e) {  // selects, not an index: acc stays in registers
      const int j = e ^ sw;
      const float val = j == 0 ? acc[0] : j == 1 ? acc[1] : j == 2 ? acc[2] : acc[3];
      o[e] = ml.y == 0.f ? 0.f : val * inv;
    }
    *reinterpret_cast<uint2*>(a.out + t * a.out_stride_t + int64_t(h) * a.out_stride_h + c4) =
        bf16x4(o[0], o[1], o[2], o[3]);
    if (a.lse && c4 == 0) a.lse[t * a.lse_stride_t + h] = row_lse(ml.x, ml.y);
  }
  cl.sync();  // every CTA's planes stay alive until all have read them
}
#endif

// The loop over a CTA's chunks on Hopper tensor cores (the kWg instances: bf16 or e4m3 pages, groups of
// more than 64 rows). Warpgroup wg owns rows [64 wg, 64 wg + 64); warp w of the CTA the 16 rows
// 16 w.., as in the mma.sync loop, so the row ranges, masks and epilogue are shared. Per 64-key
// chunk and warpgroup: S = Q K^T as 8 wgmma m64n64k16 (Q, natural dim order, in registers; K from
// the swizzled stage, K-major), the mask and online softmax of tile_keys16, then O += P V as 4 x 2
// wgmma m64n128k16 (P as the bf16 value + residue pair of tile_keys16, from registers; V from the
// same stage, MN-major; f16 P and V for e4m3). P V is left running into the next chunk's Q K^T,
// whose wait covers it. bf16: the chunk is the stage itself, refilled two iterations after its
// last read (D = stages - 2 chunks in flight ahead). e4m3: every raw stage is in flight; at the end
// of iteration i the CTA converts chunk i + 1 into image (i + 1) % 3 (wg_convert_e4m3), which
// chunk i - 2 last read; chunk i's raw stage is refilled after iteration i's barrier. A warpgroup
// none of whose tokens selected a chunk skips it.
// Tried and dropped (H200, verify dql 8 B32, bf16): the chunk as two 32-key halves (wgmma
// m64n32k16), each half's softmax under the other's MMAs: 162 vs 125 us; a chunk's P V issued
// after the next chunk's Q K^T, so the softmax runs under it: 149 vs 123 us; no CTA barrier per
// chunk (mbarriers per stage, the warpgroups taking turns to issue so one's softmax runs under the
// other's MMAs): 204 vs 156 us — the softmax is latency-bound, and in turns it has half the warps
// per scheduler.
// S layout (per thread): s[4 j + e] = row g + 8 (e / 2), key 8 j + 2 c + (e % 2); O the same with
// dims 8 j + 2 c + (e % 2), j < 16.
// V as the MN-major B operand: 64-dim regions kChunkKeys * 128 bytes apart (the descriptor's
// leading offset), 8-key atoms 1024 bytes apart (its stride offset).
[[maybe_unused]] constexpr uint32_t kWgVLeading = kChunkKeys * 128, kWgVStride = 1024;

// An e4m3 chunk as the image the wgmma loop reads: K and V as f16 (exact), 128-byte swizzle. The
// raw stage: 64 rows of 256 bytes, 16-byte piece pc of row r at pc ^ (r % 8) (cp.async), or
// (kBoxes, the copy-engine loop) two tensor-map boxes of 64 rows x 128 bytes, K bytes then V
// bytes, piece q of row r at q ^ (r % 8); there V rows at or past `valid` become zeros (stale rows
// of a partial chunk). Threads t = 0 .. kThreads - 1 share the work.
template <int kThreads, bool kBoxes = false>
__device__ __forceinline__ void wg_convert_e4m3(const char* raw, char* image, int valid = kChunkKeys,
                                                int t = int(threadIdx.x)) {
#pragma unroll
  for (int k = 0; k < kChunkKeys * 16 / kThreads; ++k) {
    const int piece = t + kThreads * k, r = piece / 16, pc = piece % 16;
    const uint4 v = kBoxes ? lds128(raw + (pc / 8) * (kChunkKeys * 128) + r * 128 + (((pc % 8) ^ (r & 7)) * 16))
                           : lds128(raw + r * 256 + ((pc ^ swz_e4m3(r)) * 16));
    const uint32_t w[4] = {v.x, v.y, v.z, v.w};
    uint32_t h[8];  // dims 16 (pc % 8) .. + 15 of K (pc < 8) or V, as f16 pairs
#pragma unroll
    for (int e = 0; e < 4; ++e) e4m3x4_to_f16x2x2(w[e], h[2 * e], h[2 * e + 1]);
    if (kBoxes && pc >= 8 && r >= valid)
#pragma unroll
      for (int e = 0; e < 8; ++e) h[e] = 0u;
    const int region = pc / 4, q = 2 * (pc % 4);  // K 0-63, K 64-127, V 0-63, V 64-127
    char* row = image + region * (kChunkKeys * 128) + r * 128;
    *reinterpret_cast<uint4*>(row + ((q ^ (r & 7)) * 16)) = make_uint4(h[0], h[1], h[2], h[3]);
    *reinterpret_cast<uint4*>(row + (((q + 1) ^ (r & 7)) * 16)) = make_uint4(h[4], h[5], h[6], h[7]);
  }
}

// Pieces of both wgmma loops (wg_chunks, wg_chunks_tma). The tokens of warpgroup wg's rows.
[[maybe_unused]] __device__ __forceinline__ uint32_t wg_token_mask(int wg, int rows, int G) {
  if (wg * 64 >= rows) return 0u;
  const int t0 = wg * 64 / G, t1 = min(wg * 64 + 63, rows - 1) / G;
  return (t1 - t0 == 31 ? kFull : ((2u << (t1 - t0)) - 1)) << t0;
}
// Q's A fragments: qa[s] = {(row g, dims 16 s + 2 c ..), (row g + 8, ..), (row g, 16 s + 8 + 2 c ..), (row g + 8, ..)}.
[[maybe_unused]] __device__ __forceinline__ void wg_load_q(uint32_t (&qa)[8][4], const char* q_s, int warp, int lane) {
#pragma unroll
  for (int rs = 0; rs < 2; ++rs) {
    const int row = warp * 16 + lane / 4 + 8 * rs;
#pragma unroll
    for (int ks = 0; ks < 8; ++ks)
#pragma unroll
      for (int kh = 0; kh < 2; ++kh)
        qa[ks][rs + 2 * kh] = lds32(q_s + row * 256 + (((2 * ks + kh) ^ swz_bf16(row)) * 16) + 4 * (lane % 4));
  }
}
// A chunk's S (64 keys of rows g, g + 8): e4m3 scaled per row first; keys outside a row's
// [lo, hi) masked unless all_visible; mx = the rows' maxima over this lane's keys.
template <bool kFp8>
__device__ __forceinline__ void wg_mask_max(float (&s)[32], bool all_visible, const int (&lo)[2], const int (&hi)[2],
                                            int c, float2 row_scale, float (&mx)[2]) {
  mx[0] = mx[1] = -INFINITY;
  if (all_visible) {
#pragma unroll
    for (int k = 0; k < 32; ++k) {
      if constexpr (kFp8) s[k] *= (k >> 1) & 1 ? row_scale.y : row_scale.x;
      mx[(k >> 1) & 1] = fmaxf(mx[(k >> 1) & 1], s[k]);
    }
  } else {
#pragma unroll
    for (int k = 0; k < 32; ++k) {
      const int rs = (k >> 1) & 1, key = 8 * (k >> 2) + 2 * c + (k & 1);
      if constexpr (kFp8) s[k] *= rs ? row_scale.y : row_scale.x;
      if (unsigned(key - lo[rs]) >= unsigned(hi[rs] - lo[rs])) s[k] = -INFINITY;
      mx[rs] = fmaxf(mx[rs], s[k]);
    }
  }
}
// The weights 2^(s sc - m_sub) in place and their sums per row.
[[maybe_unused]] __device__ __forceinline__ void wg_exp_sum(float (&s)[32], float sc, const float (&m_sub)[2], float (&sum)[2]) {
  sum[0] = sum[1] = 0.f;
#pragma unroll
  for (int k = 0; k < 32; ++k) {
    const int rs = (k >> 1) & 1;
    s[k] = exp2_ftz(fmaf(s[k], sc, -m_sub[rs]));
    sum[rs] += s[k];
  }
}
// O and l by alpha (O only when a row's max moved), then P's A fragments per 16-key step.
template <bool kF16>
__device__ __forceinline__ void wg_rescale_form_p(TileState& st, float (&o)[64], const float (&s)[32],
                                                  const float (&alpha)[2], const float (&sum)[2],
                                                  uint32_t (&ph)[4][4], uint32_t (&pl)[4][4]) {
#pragma unroll
  for (int rs = 0; rs < 2; ++rs) st.l[rs] = st.l[rs] * alpha[rs] + sum[rs];
  if (alpha[0] != 1.f || alpha[1] != 1.f) {
#pragma unroll
    for (int k = 0; k < 64; ++k) o[k] *= alpha[(k >> 1) & 1];
  }
#pragma unroll
  for (int t = 0; t < 4; ++t)
#pragma unroll
    for (int q = 0; q < 4; ++q) split2<kF16>(s[8 * t + 2 * q], s[8 * t + 2 * q + 1], ph[t][q], pl[t][q]);
}
// Whether none of the warp's rows sees a key of the chunk (lo >= hi: its tokens did not select the
// chunk, or see none of its keys): then its P is 0 and its state (m, l, O) stays, with no mask,
// max or exponentials. With M3's 16 heads a group, a warp's 16 rows are one token's: in a prefill
// group with independent lists most warps of a warpgroup sit out most of its chunks.
[[maybe_unused]] __device__ __forceinline__ bool wg_warp_sees_none(const int (&lo)[2], const int (&hi)[2]) {
  return __all_sync(kFull, lo[0] >= hi[0] && lo[1] >= hi[1]);
}
[[maybe_unused]] __device__ __forceinline__ void wg_zero_p(uint32_t (&ph)[4][4], uint32_t (&pl)[4][4]) {
#pragma unroll
  for (int t = 0; t < 4; ++t)
#pragma unroll
    for (int q = 0; q < 4; ++q) ph[t][q] = pl[t][q] = 0u;
}
// The chunk's mask, max and weights (the online softmax before O is touched): bf16 takes the max
// before scaling (the scale is > 0, validated) and folds the scale into the exponent's FMA; e4m3
// (its scale includes the k descale, read on the device) scales first.
template <bool kFp8>
__device__ __forceinline__ void wg_softmax(TileState& st, float (&s)[32], const int (&lo)[2], const int (&hi)[2], int c,
                                           float scale_log2, float2 row_scale, float (&alpha)[2], float (&sum)[2]) {
  const bool all_visible = lo[0] == 0 && hi[0] == kChunkKeys && lo[1] == 0 && hi[1] == kChunkKeys;
  const float sc = kFp8 ? 1.f : scale_log2;
  float mx[2], m_sub[2];
  wg_mask_max<kFp8>(s, all_visible, lo, hi, c, row_scale, mx);
  advance_max(st.m, mx, sc, alpha, m_sub);
  wg_exp_sum(s, sc, m_sub, sum);
}

// The wgmma loops' page order (one warp): the pages both warpgroups' tokens selected (or neither's:
// a page no row sees, which both skip) first, in id order, then the pages of one warpgroup's tokens
// alone, the two warpgroups' alternating (the rest of the longer list last). In id order a
// warpgroup meets runs of the other's pages, skips them, and then waits for stages that its
// partner, still on those pages, holds. tmp: U entries of scratch (the stage area, free after the
// union is built).
[[maybe_unused]] __device__ __forceinline__ void wg_page_order(int4* uniq, int U, uint32_t tok_a, uint32_t tok_b,
                                                               int4* tmp) {
  const int lane = threadIdx.x % 32;
  const uint32_t below = (1u << lane) - 1u;
  int n_both = 0, n_a = 0, n_b = 0;
  for (int base = 0; base < U; base += 32) {
    const int e = base + lane;
    uint32_t m = 0;
    if (e < U) {
      const int4 u = uniq[e];
      tmp[e] = u;
      m = uint32_t(u.z) | uint32_t(u.w);
    }
    const bool a = (m & tok_a) != 0, b = (m & tok_b) != 0;
    n_both += __popc(__ballot_sync(kFull, e < U && a == b));
    n_a += __popc(__ballot_sync(kFull, a && !b));
    n_b += __popc(__ballot_sync(kFull, b && !a));
  }
  __syncwarp();
  const int pairs = min(n_a, n_b);
  int r_both = 0, r_a = 0, r_b = 0;
  for (int base = 0; base < U; base += 32) {
    const int e = base + lane;
    const int4 u = e < U ? tmp[e] : make_int4(0, 0, 0, 0);
    const uint32_t m = uint32_t(u.z) | uint32_t(u.w);
    const bool a = (m & tok_a) != 0, b = (m & tok_b) != 0;
    const uint32_t both_bits = __ballot_sync(kFull, e < U && a == b), a_bits = __ballot_sync(kFull, a && !b),
                   b_bits = __ballot_sync(kFull, b && !a);
    if (e < U) {
      int pos;
      if (a == b) {
        pos = r_both + __popc(both_bits & below);
      } else {
        const int j = (a ? r_a + __popc(a_bits & below) : r_b + __popc(b_bits & below));
        pos = n_both + (j < pairs ? 2 * j + (a ? 0 : 1) : pairs + j);
      }
      uniq[pos] = u;
    }
    r_both += __popc(both_bits);
    r_a += __popc(a_bits);
    r_b += __popc(b_bits);
  }
}

template <bool kFp8, class Issue>
__device__ __forceinline__ void wg_chunks(TileState& st, float (&o)[64], const int4* uniq, const char* q_s,
                                          char* area, int stage_bytes, int stages, int c_begin, int c_end,
                                          int rows, int G, const int (&row_token)[2], const int (&row_lo)[2],
                                          const int (&row_hi)[2], float scale_log2, float2 row_scale,
                                          Issue&& issue) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  using namespace kernels;
  constexpr int kThreads = 256;
  const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32, c = lane % 4, wg = warp / 4;
  const uint32_t wg_tokens = wg_token_mask(wg, rows, G);
#pragma unroll
  for (int i = 0; i < 64; ++i) o[i] = 0.f;
  const int n = c_end - c_begin;
  // bf16: D = stages - 2 chunks in flight ahead (a stage is read up to the iteration after its
  // own). e4m3: every raw stage in flight; chunk i + 1 is converted at the end of iteration i
  // into image (i + 1) % 3, which chunk i - 2 last read in iteration i - 1.
  const int D = kFp8 ? stages : stages - 2;
  char* images = area + stages * stage_bytes;
  for (int i = 0; i < D; ++i) issue(c_begin + i, i);  // one cp.async group each, empty past c_end
  cp_async_wait_dyn(kFp8 ? D - 1 : D);                // the queries (the first group); e4m3: chunk 0 too
  __syncthreads();
  if constexpr (kFp8) {
    if (n > 0) wg_convert_e4m3<kThreads>(area, images);
    fence_proxy_async();  // this thread's image writes, visible to the tensor cores
  }
  uint32_t qa[8][4];
  wg_load_q(qa, q_s, warp, lane);
  for (int cc = c_begin; cc < c_end; ++cc) {
    const int i = cc - c_begin;
    uint32_t sa;  // the chunk's image
    if constexpr (kFp8) {
      cp_async_wait_dyn(D - 2);  // chunk i + 1's raw stage, converted at the end of this iteration
      __syncthreads();           // ... and chunk i's image, converted in the last one
      issue(cc + D, i % stages);  // chunk i's raw stage is free (converted)
      sa = smem_u32(images + (i % kWgImages) * kWgImageBytes);
    } else {
      issue(cc + D, (i + D) % stages);
      cp_async_wait_dyn(D);
      fence_proxy_async();  // this thread's landed copies, visible to the tensor cores
      __syncthreads();
      sa = smem_u32(area + (i % stages) * stage_bytes);
    }
    const int4 u = uniq[cc >> 1];  // {id, page, mask of half 0, mask of half 1}
    const uint32_t mask = uint32_t(cc & 1 ? u.w : u.z);
    if ((mask & wg_tokens) == 0) {
      wgmma_wait<0>();  // the previous P V: its stage is refilled soon
    } else {
      float s[32];
      wgmma_fence();
      wgmma_k128<64, kFp8>(s, qa, sa, kChunkKeys * 128);
      wgmma_commit();
      // The chunk keys each row sees (empty when its token did not select the chunk).
      const int chunk_pos = u.x * kPage + (cc & 1) * kChunkKeys;
      int lo[2], hi[2];
      chunk_row_ranges(mask, chunk_pos, row_token, row_lo, row_hi, lo, hi);
      wgmma_wait<0>();  // also the previous chunk's P V: o may be rescaled now
      // Mask and online softmax (base 2), as tile_keys16. (The copy-engine loop's skip of warps
      // whose rows see none of the chunk made ptxas serialize this loop's wgmmas, C7513.)
      float alpha[2], sum[2];
      wg_softmax<kFp8>(st, s, lo, hi, c, scale_log2, row_scale, alpha, sum);
      uint32_t ph[4][4], pl[4][4];  // P's A fragments per 16-key step: value and residue
      wg_rescale_form_p<kFp8>(st, o, s, alpha, sum, ph, pl);
      wgmma_fence();
#pragma unroll
      for (int t = 0; t < 4; ++t) {
        // V: keys 16 t .. 16 t + 15 (two 8-key atoms), dims in two 64-dim regions 8 KB apart.
        const uint64_t desc = sw128_desc(sa + 2 * (kChunkKeys * 128) + t * 2048, kWgVLeading, kWgVStride);
        wgmma_m64k16<128, kFp8, true>(o, ph[t], desc);
        wgmma_m64k16<128, kFp8, true>(o, pl[t], desc);
      }
      wgmma_commit();  // left running into the next chunk's Q K^T, whose wait covers it
    }
    if constexpr (kFp8) {
      const int next = cc + 1;
      if (next < c_end && chunk_mask(uniq, next) != 0)
        wg_convert_e4m3<kThreads>(area + ((i + 1) % stages) * stage_bytes, images + ((i + 1) % kWgImages) * kWgImageBytes);
      fence_proxy_async();  // this thread's image writes, visible to the tensor cores
    } else {
      __syncthreads();  // every warpgroup is done with the stages refilled next
    }
  }
  wgmma_wait<0>();
#elif defined(__CUDA_ARCH__)
  __trap();  // launched only by sm_90a builds on sm_90 devices (kernel_config)
#endif
}

// The copy-engine loops' step over one chunk (wg_chunks_tma, wg_chunks_ws), one warpgroup. The
// previous chunk's P (ph, pl) and its K V at sa_prev wait for their P V (have_p). `between` runs
// right after the MMAs are issued (the refill, the next chunk's conversion, or the wait for the
// chunk's image); `release_prev` once the previous chunk's P V has completed.
// O += P V of the previous chunk (value and residue; kP16: the value alone).
template <bool kFp8, bool kP16>
__device__ __forceinline__ void wg_pv(float (&o)[64], const uint32_t (&ph)[4][4], const uint32_t (&pl)[4][4],
                                      uint32_t sa_prev) {
  using namespace kernels;
#pragma unroll
  for (int t = 0; t < 4; ++t) {
    const uint64_t desc = sw128_desc(sa_prev + 2 * (kChunkKeys * 128) + t * 2048, kWgVLeading, kWgVStride);
    wgmma_m64k16<128, kFp8, true>(o, ph[t], desc);
    if constexpr (!kP16) wgmma_m64k16<128, kFp8, true>(o, pl[t], desc);
  }
}
// After the last chunk: its P V (if a chunk left one), and every MMA complete.
template <bool kFp8, bool kP16>
__device__ __forceinline__ void wg_last_pv(float (&o)[64], const uint32_t (&ph)[4][4], const uint32_t (&pl)[4][4],
                                           uint32_t sa_prev, bool have_p) {
  using namespace kernels;
  if (have_p) {
    wgmma_fence();
    wg_pv<kFp8, kP16>(o, ph, pl, sa_prev);
    wgmma_commit();
  }
  wgmma_wait<0>();
}
// A chunk none of the warpgroup's tokens selected: the previous chunk's P V alone; release_both
// (after it completes) gives back the previous chunk and this one.
template <bool kFp8, bool kP16, class Between, class ReleaseBoth>
__device__ __forceinline__ void wg_skip_step(float (&o)[64], const uint32_t (&ph)[4][4], const uint32_t (&pl)[4][4],
                                             uint32_t sa_prev, bool& have_p, Between&& between,
                                             ReleaseBoth&& release_both) {
  using namespace kernels;
  if (have_p) {
    wgmma_fence();
    wg_pv<kFp8, kP16>(o, ph, pl, sa_prev);
    wgmma_commit();
  }
  between();
  wgmma_wait<0>();
  release_both();
  have_p = false;
}
// A chunk the warpgroup's tokens selected (mask): this chunk's Q K^T, then (a second commit
// group, empty without one) the previous chunk's P V, which runs under `between` and this chunk's
// softmax until O is rescaled; a warp none of whose rows sees a key of the chunk keeps its state
// (P = 0).
template <bool kFp8, bool kP16, class Between, class ReleasePrev>
__device__ __forceinline__ void wg_chunk_step(TileState& st, float (&o)[64], const uint32_t (&qa)[8][4], uint32_t sa,
                                              uint32_t& sa_prev, bool& have_p, uint32_t (&ph)[4][4],
                                              uint32_t (&pl)[4][4], uint32_t mask, int chunk_pos,
                                              const int (&row_token)[2], const int (&row_lo)[2],
                                              const int (&row_hi)[2], float scale_log2, float2 row_scale,
                                              Between&& between, ReleasePrev&& release_prev) {
  using namespace kernels;
  const int c = threadIdx.x % 4;
  float s[32];
  if (have_p) {
    wgmma_fence();
    wgmma_k128<64, kFp8>(s, qa, sa, kChunkKeys * 128);
    wgmma_commit();
    wg_pv<kFp8, kP16>(o, ph, pl, sa_prev);
    wgmma_commit();
  } else {
    wgmma_fence();
    wgmma_k128<64, kFp8>(s, qa, sa, kChunkKeys * 128);
    wgmma_commit();
    wgmma_commit();
  }
  between();
  wgmma_wait<1>();  // this chunk's S
  int lo[2], hi[2];
  chunk_row_ranges(mask, chunk_pos, row_token, row_lo, row_hi, lo, hi);
  const bool sees_none = wg_warp_sees_none(lo, hi);  // then P = 0, the state stays
  float alpha[2], sum[2];
  if (!sees_none) wg_softmax<kFp8>(st, s, lo, hi, c, scale_log2, row_scale, alpha, sum);
  wgmma_wait<0>();  // the previous chunk's P V: o may be rescaled, its stage or image reused
  release_prev();
  have_p = true;
  if (sees_none) {
    wg_zero_p(ph, pl);
  } else {
    wg_rescale_form_p<kFp8>(st, o, s, alpha, sum, ph, pl);
  }
  sa_prev = sa;
}

// The wgmma loop on the copy engine (kTma). One thread fills the stages with tensor-map boxes
// (fill(c, slot, bar): the chunk's boxes on the stage's `full` barrier, or an arrival alone for a
// chunk none of the group's tokens sees); the two warpgroups run free of each other, paced by
// mbarriers only. Per chunk a warpgroup issues this chunk's Q K^T and the previous chunk's P V as
// two commit groups, waits for the first, and runs the mask, max and exponentials while the P V
// still runs; then it waits for that, rescales O and forms P.
// bf16: the MMAs read the stage itself; a warp releases it (`empty`: one arrival a warp, 8 a
// stage) after the P V that read it (iteration i + 1), so chunk i + stages is filled D = stages - 2
// iterations ahead. A chunk with keys past seq_len has its V rows there zeroed (stale cache rows
// may hold anything, and 0 x NaN would reach O) before either warpgroup reads it (a barrier of all
// 256 threads: at most one such chunk a CTA, reached by every thread in the same iteration).
// e4m3: the stage holds the raw chunk (two boxes, K bytes and V bytes). All 256 threads convert
// chunk i + 1 into f16 image (i + 1) % 3 (V rows past seq_len zeroed) while this chunk's MMAs run,
// and release its stage at once; an image is `img_full` when every warp has written its share
// and `img_empty` when every warp is done with it (its P V complete, or the chunk not its
// warpgroup's), so the warpgroups may drift up to about an iteration apart. Chunk i + stages
// refills chunk i's stage (converted in iteration i - 1).
template <bool kFp8, bool kP16, class Fill>
__device__ __forceinline__ void wg_chunks_tma(TileState& st, float (&o)[64], const int4* uniq, const char* q_s,
                                              char* area, int stage_bytes, int stages, int c_begin, int c_end,
                                              int rows, int G, const int (&row_token)[2], const int (&row_lo)[2],
                                              const int (&row_hi)[2], float scale_log2, float2 row_scale,
                                              int seq_len, uint64_t* bars, Fill&& fill) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  using namespace kernels;
  const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32, wg = warp / 4;
  const uint32_t wg_tokens = wg_token_mask(wg, rows, G);
#pragma unroll
  for (int i = 0; i < 64; ++i) o[i] = 0.f;
  const int n = c_end - c_begin, D = kFp8 ? stages : stages - 2;
  uint64_t* full = bars;
  uint64_t* empty = bars + stages;
  uint64_t* img_full = bars + 2 * stages;  // e4m3
  uint64_t* img_empty = img_full + kWgImages;
  char* images = area + stages * stage_bytes;
  if (tid == 0) {
    for (int s = 0; s < stages; ++s) {
      mbar_init(&full[s], 1);
      mbar_init(&empty[s], 8);  // every warp of both warpgroups
    }
    if (kFp8)
      for (int s = 0; s < kWgImages; ++s) {
        mbar_init(&img_full[s], 8);
        mbar_init(&img_empty[s], 8);
      }
    fence_mbarrier_init();
  }
  fence_proxy_async();  // the prologue's shared-memory accesses to the stage area, before the copies
  cp_async_wait<0>();   // the queries
  __syncthreads();
  if (tid == 0)
    for (int j = 0; j < min(D, n); ++j) fill(c_begin + j, j, &full[j]);
  // e4m3: chunk k (< n) into its image, this thread's share; the raw stage and its parity advance.
  int cs = 0, cph = 0;
  auto convert = [&](int k) {
    const int cc = c_begin + k, img = k % kWgImages;
    const int4 u = uniq[cc >> 1];
    if (k >= kWgImages) mbar_wait(&img_empty[img], ((k / kWgImages) - 1) & 1);
    mbar_wait(&full[cs], cph);
    if ((cc & 1 ? u.w : u.z) != 0) {
      wg_convert_e4m3<256, true>(area + cs * stage_bytes, images + img * kWgImageBytes,
                                 seq_len - (u.x * kPage + (cc & 1) * kChunkKeys));
      fence_proxy_async();  // this thread's image writes, visible to the tensor cores
    }
    __syncwarp();
    if (lane == 0) {
      mbar_arrive(&empty[cs]);
      mbar_arrive(&img_full[img]);
    }
    if (++cs == stages) cs = 0, cph ^= 1;
  };
  if (kFp8 && n > 0) convert(0);
  uint32_t qa[8][4];
  wg_load_q(qa, q_s, warp, lane);
  uint32_t ph[4][4], pl[4][4];  // the previous chunk's P (value and residue)
  uint32_t sa_prev = 0;         // the previous chunk's K and V (bf16: its stage; e4m3: its image)
  bool have_p = false;
  // Chunk i's stage and the parity of its use; the fill's (chunk i + D, into chunk i + D -
  // stages' stage) the same, one use behind.
  int slot = 0, phase = 0, fslot = kFp8 ? 0 : D, fphase = kFp8 ? 0 : 1;
  // Chunk i + D into its stage once chunk i + D - stages is released (thread 0). bf16: issued
  // after this iteration's MMAs, which then no longer wait behind it (~600 cycles a chunk in warp
  // 0's timeline at the top of the iteration; H200, same call: prefill 8K / 32K 1.01x / 1.02x, p16
  // 1.03x, verify and the drafter's blocks within 1%). e4m3 keeps it at the top: after the MMAs it
  // lost (H200, same call, session 19: verify 0.975x, prefill 8K 0.986x, 8K shared8 0.980x, 32K
  // 0.993x), its raw stages refill one chunk later there while the conversion already waits on them.
  auto refill = [&](int i) {
    if (tid == 0 && i + D < n) {
      if (i + D >= stages) mbar_wait(&empty[fslot], fphase);
      fill(c_begin + i + D, fslot, &full[fslot]);
    }
    if (++fslot == stages) fslot = 0, fphase ^= 1;
  };
  for (int i = 0; i < n; ++i) {
    const int cc = c_begin + i;
    if constexpr (kFp8) refill(i);
    const int4 u = uniq[cc >> 1];  // {id, page, mask of half 0, mask of half 1}
    const uint32_t mask = uint32_t(cc & 1 ? u.w : u.z);
    const bool mine = (mask & wg_tokens) != 0;
    const int img = i % kWgImages, prev_img = img == 0 ? kWgImages - 1 : img - 1;
    char* stage = area + slot * stage_bytes;
    const uint32_t sa = kFp8 ? smem_u32(images + img * kWgImageBytes) : smem_u32(stage);
    const int chunk_pos = u.x * kPage + (cc & 1) * kChunkKeys;
    if constexpr (kFp8) {
      if (mine) mbar_wait(&img_full[img], (i / kWgImages) & 1);
    } else {
      mbar_wait(&full[slot], phase);
      if (mask != 0 && seq_len - chunk_pos < kChunkKeys) {  // uniform over the CTA
        const int valid = seq_len - chunk_pos, pieces = (kChunkKeys - valid) * 16;  // V rows x 16-byte pieces
        for (int k = tid; k < pieces; k += 256) {
          const int r = valid + k / 16, pc = k % 16;
          *reinterpret_cast<uint4*>(stage + (2 + pc / 8) * (kChunkKeys * 128) + r * 128 + (pc % 8) * 16) =
              make_uint4(0, 0, 0, 0);
        }
        fence_proxy_async();  // the zeros, visible to the tensor cores
        __syncthreads();
      }
    }
    const int prev_slot = slot == 0 ? stages - 1 : slot - 1;
    const int this_slot = slot;
    if (++slot == stages) slot = 0, phase ^= 1;
    // Between the MMA issue and the S wait: bf16 the refill, e4m3 the next chunk's conversion.
    auto between = [&] {
      if constexpr (!kFp8) refill(i);
      if (kFp8 && i + 1 < n) convert(i + 1);
    };
    // A warp is done with chunk i - 1 (bf16: its stage; e4m3: its image) once its P V completed.
    if (!mine) {
      wg_skip_step<kFp8, kP16>(o, ph, pl, sa_prev, have_p, between, [&] {
        if (lane == 0) {  // chunk i - 1 done with, chunk i not needed
          if (have_p) mbar_arrive(kFp8 ? &img_empty[prev_img] : &empty[prev_slot]);
          mbar_arrive(kFp8 ? &img_empty[img] : &empty[this_slot]);
        }
      });
      continue;
    }
    wg_chunk_step<kFp8, kP16>(st, o, qa, sa, sa_prev, have_p, ph, pl, mask, chunk_pos, row_token, row_lo, row_hi,
                              scale_log2, row_scale, between, [&] {
                                if (lane == 0 && have_p) mbar_arrive(kFp8 ? &img_empty[prev_img] : &empty[prev_slot]);
                              });
  }
  wg_last_pv<kFp8, kP16>(o, ph, pl, sa_prev, have_p);
#elif defined(__CUDA_ARCH__)
  __trap();  // launched only by sm_90a builds on sm_90 devices (kernel_config)
#endif
}

// The 64 keys from `key` (0 or 64) of page `page`, KV head kv_head, as the copy-engine loops load
// them: boxes of 64 keys x 128 bytes (bf16: K dims 0-63, K 64-127, V 0-63, V 64-127; e4m3: K, V)
// of the cache's tensor map {row element, key, KV head, page}, each one 128-byte-swizzled region
// of `dst` (1024-byte aligned), completing `bytes` on `bar`.
template <bool kFp8>
__device__ __forceinline__ void tma_chunk_boxes(char* dst, const void* map, int key, int kv_head, int page,
                                                uint32_t bytes, uint64_t* bar) {
  kernels::mbar_arrive_expect_tx(bar, bytes);
  constexpr int kBoxes = kFp8 ? 2 : 4, kBoxElems = kFp8 ? 128 : 64;
#pragma unroll
  for (int r = 0; r < kBoxes; ++r)
    kernels::tma_load_4d(dst + r * (kChunkKeys * 128), map, kBoxElems * r, key, kv_head, page, bar);
}
// Chunk c of the page union (64-key half c % 2 of page uniq[c / 2].y).
template <bool kFp8>
__device__ __forceinline__ void load_chunk_boxes(char* dst, const void* map, const int4* uniq, int c, int kv_head,
                                                 uint32_t bytes, uint64_t* bar) {
  tma_chunk_boxes<kFp8>(dst, map, (c & 1) * kChunkKeys, kv_head, uniq[c >> 1].y, bytes, bar);
}

// The warp-specialized e4m3 loop (kWs instances: 384 threads, unsplit groups of more than 64
// rows). A third warpgroup, the producer, keeps the copy engine and the conversions off the
// consumers' path: its thread 0 loads the chunks any token sees (live chunks, in order) into the
// raw stages, and its 128 threads convert live chunk q into f16 image q % 3 once that image is free
// (img_empty: every consumer warp done with live chunk q - 3), then mark it img_full (one arrival a
// producer warp); a raw stage is refilled with live chunk q + stages as soon as the producer has
// converted chunk q out of it. The two consumer warpgroups run the copy-engine loop's Q K^T,
// softmax and P V on the images, with no conversion, refill or CTA barrier of their own; a
// warpgroup none of whose tokens selected a live chunk still waits for its image before releasing
// it (its arrivals may not count toward an older use of the image).
[[maybe_unused]] constexpr int kWsProducerRegs = 40, kWsConsumerRegs = 232;  // 128 x 40 + 256 x 232 <= 65536
// The producer warpgroup's whole part (threads 256..383 of a kWs CTA). It finds out by itself
// whether the group has work (the row threads' own tests on the same inputs), lowers its register
// budget (the row warps' raise waits for it), waits for the row threads' prologue (named barrier 2;
// misc[8]: the union's size), then loads and converts.
__device__ __forceinline__ void ws_produce_e4m3(const MsaParams& p, int tg, const SmemLayout& L, char* area,
                                                const int4* uniq, const int* misc, uint64_t* bars, int stages,
                                                int kv_head) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  using namespace kernels;
  Group gr;
  const bool work =
      resolve_group(p, tg, blockIdx.x, gr) && (p.cu_seqlens_q || decode_group_length(p, p.seq_lens[gr.b], gr));
  setmaxnreg_dec<kWsProducerRegs>();
  if (!work) return;
  named_bar_sync(2, 256 + 128);
  const int c_end = 2 * misc[8], seq_len = gr.seq_len;  // unsplit: every chunk of the union
  char* images = area + stages * L.stage_bytes;
  uint64_t* full = bars;
  uint64_t* img_full = bars + 2 * stages;
  uint64_t* img_empty = img_full + kWgImages;
  const int pt = int(threadIdx.x) % 128, lane = pt % 32;
  int fill_c = 0, fills = 0;  // thread 0's next chunk to consider, live chunks filled
  auto next_fill = [&] {
    while (fill_c < c_end && chunk_mask(uniq, fill_c) == 0) ++fill_c;
    if (fill_c < c_end) {
      const int slot = fills % stages;
      load_chunk_boxes<true>(area + slot * L.stage_bytes, p.cache_map, uniq, fill_c, kv_head,
                             uint32_t(L.stage_bytes), &full[slot]);
      ++fills;
      ++fill_c;
    }
  };
  if (pt == 0)
    for (int j = 0; j < stages; ++j) next_fill();
  int q = 0;
  for (int cc = 0; cc < c_end; ++cc) {
    const int4 u = uniq[cc >> 1];
    if ((cc & 1 ? u.w : u.z) == 0) continue;  // no token sees it: never loaded
    const int slot = q % stages, img = q % kWgImages;
    mbar_wait(&full[slot], (q / stages) & 1);
    if (q >= kWgImages) mbar_wait(&img_empty[img], ((q / kWgImages) - 1) & 1);
    int tid_now;  // the thread index read again: its piece addresses recomputed, not held across chunks
    asm volatile("mov.u32 %0, %%tid.x;\n" : "=r"(tid_now));
    wg_convert_e4m3<128, true>(area + slot * L.stage_bytes, images + img * kWgImageBytes,
                               seq_len - (u.x * kPage + (cc & 1) * kChunkKeys), tid_now % 128);
    fence_proxy_async();  // this thread's image writes, visible to the tensor cores
    __syncwarp();
    if (lane == 0) mbar_arrive(&img_full[img]);
    named_bar_sync(3, 128);  // every producer thread is done reading the raw stage
    if (pt == 0) next_fill();
    ++q;
  }
#elif defined(__CUDA_ARCH__)
  __trap();  // launched only by sm_90a builds on sm_90 devices (kernel_config)
#endif
}

// The row warps' part (threads 0..255): the mbarriers set up and the producer released (named
// barrier 2), then the copy-engine loop's step (wg_chunk_step, wg_skip_step) on the images.
template <bool kP16>
__device__ __forceinline__ void wg_chunks_ws(TileState& st, float (&o)[64], const int4* uniq, const char* q_s,
                                             char* images, int c_begin, int c_end, int rows, int G,
                                             const int (&row_token)[2], const int (&row_lo)[2],
                                             const int (&row_hi)[2], float scale_log2, float2 row_scale,
                                             uint64_t* bars, int stages) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  using namespace kernels;
  const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32, wg = warp / 4;
  const uint32_t wg_tokens = wg_token_mask(wg, rows, G);
  uint64_t* img_full = bars + 2 * stages;  // full [stages], (unused) [stages], img_full, img_empty
  uint64_t* img_empty = img_full + kWgImages;
  if (tid == 0) {
    for (int s = 0; s < stages; ++s) mbar_init(&bars[s], 1);
    for (int s = 0; s < kWgImages; ++s) {
      mbar_init(&img_full[s], 4);   // every producer warp
      mbar_init(&img_empty[s], 8);  // every row warp
    }
    fence_mbarrier_init();
  }
  fence_proxy_async();  // the prologue's shared-memory accesses to the stage area, before the copies
  named_bar_sync(1, 256);
  named_bar_arrive(2, 256 + 128);  // the producer may start
#pragma unroll
  for (int i = 0; i < 64; ++i) o[i] = 0.f;
  uint32_t qa[8][4];
  wg_load_q(qa, q_s, warp, lane);
  uint32_t ph[4][4], pl[4][4];  // the previous chunk's P (value and residue)
  uint32_t sa_prev = 0;         // the previous chunk's image
  int prev_img = 0, q = 0;      // q: live chunks so far
  bool have_p = false;
  for (int cc = c_begin; cc < c_end; ++cc) {
    const int4 u = uniq[cc >> 1];  // {id, page, mask of half 0, mask of half 1}
    const uint32_t mask = uint32_t(cc & 1 ? u.w : u.z);
    if (mask == 0) continue;  // no token sees it: never loaded
    const int img = q % kWgImages;
    const uint32_t parity = (q / kWgImages) & 1;
    ++q;
    const uint32_t sa = smem_u32(images + img * kWgImageBytes);
    if ((mask & wg_tokens) == 0) {
      wg_skip_step<true, kP16>(o, ph, pl, sa_prev, have_p, [&] { mbar_wait(&img_full[img], parity); }, [&] {
        if (lane == 0) {  // the previous chunk done with, this one not needed
          if (have_p) mbar_arrive(&img_empty[prev_img]);
          mbar_arrive(&img_empty[img]);
        }
      });
      continue;
    }
    mbar_wait(&img_full[img], parity);
    wg_chunk_step<true, kP16>(st, o, qa, sa, sa_prev, have_p, ph, pl, mask, u.x * kPage + (cc & 1) * kChunkKeys,
                              row_token, row_lo, row_hi, scale_log2, row_scale, [] {}, [&] {
                                if (lane == 0 && have_p) mbar_arrive(&img_empty[prev_img]);
                              });
    prev_img = img;
  }
  wg_last_pv<true, kP16>(o, ph, pl, sa_prev, have_p);
#elif defined(__CUDA_ARCH__)
  __trap();  // launched only by sm_90a builds on sm_90 devices (kernel_config)
#endif
}

// The split merge through global memory (split decode without clusters): each split stores its
// rows' (m, l) and weighted output (summed(row, col)) in the plan's scratch (the pair's splits at
// slots pair x slot_stride + split), the last to arrive (a per-(group, KV head) counter that it
// resets) merges them in split order and writes the rows (write_row(row, m, l, value)).
template <int kThreads, class Summed, class WriteRow>
__device__ __forceinline__ void global_split_merge(const MsaParams& p, int64_t pair, int slot_stride, int split,
                                                   int splits, int rows, int rows_cap, float2* row_ml, float* split_w,
                                                   float* fin, int* last, Summed&& summed, WriteRow&& write_row) {
  const int tid = threadIdx.x;
  const int64_t slot0 = pair * slot_stride;
  {
    float4* po = reinterpret_cast<float4*>(p.part_o + (slot0 + split) * rows_cap * 128);
    float2* pml = reinterpret_cast<float2*>(p.part_ml) + (slot0 + split) * rows_cap;
    for (int it = tid; it < rows * 32; it += kThreads) {
      const int row = it / 32, c0 = (it % 32) * 4;
      po[it] = make_float4(summed(row, c0), summed(row, c0 + 1), summed(row, c0 + 2), summed(row, c0 + 3));
    }
    if (tid < rows) pml[tid] = row_ml[tid];
  }
  __threadfence();
  __syncthreads();
  if (tid == 0) *last = atomicAdd(p.counters + pair, 1) + 1 == splits;
  __syncthreads();
  if (!*last) return;
  __threadfence();
  // The last split: merge the splits' partials in split order.
  const float* po = p.part_o + slot0 * rows_cap * 128;
  const float2* pml = reinterpret_cast<const float2*>(p.part_ml) + slot0 * rows_cap;
  if (tid < rows) {
    float2 ml[kMaxSplits];
    float m = -INFINITY;
#pragma unroll
    for (int s = 0; s < kMaxSplits; ++s) {
      ml[s] = s < splits ? __ldcg(&pml[s * rows_cap + tid]) : make_float2(-INFINITY, 0.f);
      m = fmaxf(m, ml[s].x);
    }
    float l = 0.f;
#pragma unroll
    for (int s = 0; s < kMaxSplits; ++s) {
      const float w = ml[s].x == -INFINITY ? 0.f : exp2f(ml[s].x - m);
      if (s < splits) split_w[s * rows_cap + tid] = w;
      l += w * ml[s].y;
    }
    row_ml[tid] = make_float2(m, l);
  }
  __syncthreads();
  // Every split's piece of an output float4 in flight at once.
  for (int it = tid; it < rows * 32; it += kThreads) {
    const int row = it / 32, c0 = (it % 32) * 4;
    float4 v[kMaxSplits];
#pragma unroll
    for (int s = 0; s < kMaxSplits; ++s)
      if (s < splits) v[s] = __ldcg(reinterpret_cast<const float4*>(po + (int64_t(s) * rows_cap + row) * 128 + c0));
    float acc[4] = {0.f, 0.f, 0.f, 0.f};
#pragma unroll
    for (int s = 0; s < kMaxSplits; ++s) {
      const float w = s < splits ? split_w[s * rows_cap + row] : 0.f;
      if (w != 0.f) {  // an empty split (weight 0) adds nothing
        acc[0] += v[s].x * w;
        acc[1] += v[s].y * w;
        acc[2] += v[s].z * w;
        acc[3] += v[s].w * w;
      }
    }
#pragma unroll
    for (int e = 0; e < 4; ++e) fin[fin_index(row, c0 + e)] = acc[e];
  }
  __syncthreads();
  for (int row = tid / 32; row < rows; row += kThreads / 32) {
    const float2 ml = row_ml[row];
    write_row(row, ml.x, ml.y, [&](int col) { return fin[fin_index(row, col)]; });
  }
  if (tid == 0) p.counters[pair] = 0;
}

// One output row, by a warp: bf16 of value(col) * v_scale / l (0 for a row without keys; NaN stays
// NaN) and its LSE (natural log; -inf without keys).
template <class Value>
__device__ __forceinline__ void store_row(const MsaParams& p, int64_t t, int h, float m, float l, float v_scale,
                                          Value&& value) {
  const int lane = threadIdx.x % 32;
  const float inv = row_out_scale(l, v_scale);
  uint16_t* out = p.out + t * p.out_stride_t + int64_t(h) * p.out_stride_h;
  for (int cp = lane; cp < 64; cp += 32) {
    const float x0 = l == 0.f ? 0.f : value(2 * cp) * inv, x1 = l == 0.f ? 0.f : value(2 * cp + 1) * inv;
    *reinterpret_cast<__nv_bfloat162*>(out + 2 * cp) = __floats2bfloat162_rn(x0, x1);
  }
  if (p.lse && lane == 0) p.lse[t * p.lse_stride_t + h] = row_lse(m, l);
}

// kWarps: 4 (two CTAs per SM) for groups of at most 64 rows, else 8 (one 16-row tile per warp).
// kCluster: launched as clusters of the splits, which merge through DSMEM (split decode on sm_90+).
// kWg (sm_90a, 8 warps): the loop over chunks on wgmma, two warpgroups of 64 rows (wg_chunks);
// kTma (with kWg, bf16): that loop fed by the copy engine, the warpgroups free of each other
// (wg_chunks_tma). kWs (with kTma, e4m3, unsplit): 128 more threads, a producer warpgroup that
// loads and converts the chunks (ws_produce_e4m3; the row warps: wg_chunks_ws). Everything before
// and after the loop is the same code.
template <bool kFp8, int kWarps, bool kCluster, bool kWg = false, bool kTma = false, bool kP16 = false,
          bool kWs = false>
__global__ void __launch_bounds__(kWarps * 32 + (kWs ? 128 : 0), kWs ? 1 : 8 / kWarps)
    msa_sparse_kernel(const __grid_constant__ MsaParams p, int stages) {
  kernels::grid_dependency_wait();  // launched with PDL (p.pdl): nothing is read before this
  constexpr int kThreads = kWarps * 32;  // the threads that serve the rows (kWs: the producer's 128 on top)
  static_assert(!kWg || kWarps == 8, "the wgmma loop runs on two warpgroups");
  static_assert(!kTma || kWg, "the copy-engine loop is a form of the wgmma loop");
  static_assert(!kWs || (kTma && kFp8 && !kCluster), "the producer warpgroup serves unsplit e4m3 copy-engine loops");
  // The row threads' barrier: the whole CTA, or (kWs) named barrier 1 without the producer.
  auto csync = [] {
    if constexpr (kWs)
      kernels::named_bar_sync(1, kThreads);
    else
      __syncthreads();
  };
  extern __shared__ __align__(128) char smem_raw[];
  // The wgmma instances' stages start on a 1024-byte boundary (the swizzle atom): their shared
  // memory has 1024 bytes of slack for it.
  char* smem = kWg ? smem_raw + ((1024u - (smem_u32(smem_raw) & 1023u)) & 1023u) : smem_raw;
  const int G = p.num_heads / p.num_kv_heads;
  const int tg = msa_group_tokens(G, p.decode_query_len);
  const SmemLayout L =
      smem_layout(kFp8, stages, tg, G, p.topk_k, p.max_blocks, kWarps, kWg && kFp8 ? kWgImages * kWgImageBytes : 0,
                  kTma ? tma_bars(kFp8, stages) : 0);
  char* area = smem;
  char* q_s = smem + L.q_off;
  uint64_t* keys = reinterpret_cast<uint64_t*>(smem + L.keys_off);
  int4* uniq = reinterpret_cast<int4*>(smem + L.uniq_off);
  int4* tok_range = reinterpret_cast<int4*>(smem + L.tok_off);  // {lo, hi, nbv, -}
  float2* part_ml = reinterpret_cast<float2*>(smem + L.ml_off);  // [kWarps][rows]
  float2* row_ml = part_ml + kWarps * L.rows;                    // [rows]
  float* split_w = reinterpret_cast<float*>(row_ml + L.rows);    // [splits][rows]
  int* misc = reinterpret_cast<int*>(smem + L.misc_off);         // [0..7] warp counts, [8] U, [9] last
  const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32;
  const int kv_head = blockIdx.y, split = blockIdx.z;
  const int splits = p.num_splits > 1 ? p.num_splits : 1;
  if constexpr (kWs) {
    if (tid >= kThreads) {  // the producer warpgroup
      ws_produce_e4m3(p, tg, L, area, uniq, misc, reinterpret_cast<uint64_t*>(smem + L.bar_off), stages, kv_head);
      return;
    }
    kernels::setmaxnreg_inc<kWsConsumerRegs>();
  }

  Group gr;
  if (!resolve_group(p, tg, blockIdx.x, gr)) return;  // uniform over the group's splits
  const int rows = gr.tokens * G;
  // Queries: every row of the group (bf16, swizzled 16-byte pieces); the first cp.async group.
  for (int idx = tid; idx < rows * 16; idx += kThreads) {
    const int row = idx / 16, pc = idx % 16;
    const int64_t t = gr.tok0 + row / G;
    const uint16_t* src = p.q + t * p.q_stride_t + int64_t(kv_head * G + row % G) * p.q_stride_h + pc * 8;
    cp_async_16z(q_s + row * 256 + ((pc ^ swz_bf16(row)) * 16), src, 16);
  }
  cp_async_commit();
  // Raw top-k ids into the (still unused) stage area; a decode length loads alongside.
  const int K = p.topk_k, n = gr.tokens * K;
  int* raw = reinterpret_cast<int*>(area);
  const int decode_len = p.cu_seqlens_q ? 0 : p.seq_lens[gr.b];
  for (int e = tid; e < n; e += kThreads)
    raw[e] = p.topk[int64_t(kv_head) * p.topk_stride_h + (gr.tok0 + e / K) * p.topk_stride_t +
                    int64_t(e % K) * p.topk_stride_k];
  if (!p.cu_seqlens_q && !decode_group_length(p, decode_len, gr)) {
    cp_async_wait<0>();  // nothing may land in a finished CTA's shared memory
    return;
  }
  // Tokens: positions and visible ranges.
  if (tid < gr.tokens) {
    const int64_t pos = gr.pos0 + tid;
    const int64_t hi = p.causal ? min(pos + 1, int64_t(gr.seq_len)) : int64_t(gr.seq_len);
    const int64_t lo = p.window_left > 0 ? max(int64_t(0), pos - p.window_left + 1) : 0;
    const int nbv = hi > 0 ? int((hi + kPage - 1) / kPage) : 0;
    tok_range[tid] = make_int4(int(lo), int(max(hi, int64_t(0))), nbv, 0);
  }
  // The union of pages in id order with per-token masks. While the request's ids fit a table of
  // token masks (one word per id, after the raw ids in the stage area), every entry ORs its token
  // into its id's word and the nonzero words are compacted in order: no sort. Otherwise the
  // entries are sorted (bitonic, in shared memory) and the first of each id's run is kept. Both
  // give the same list.
  const int nb_all = gr.seq_len > 0 ? (gr.seq_len + kPage - 1) / kPage : 0;
  const int raw_bytes = ((n * 4 + 15) / 16) * 16;
  uint32_t* sel = reinterpret_cast<uint32_t*>(area + raw_bytes);
  const bool bitmap = raw_bytes + int64_t(nb_all) * 4 <= L.q_off;
  if (bitmap)
    for (int i = tid; i < nb_all; i += kThreads) sel[i] = 0u;
  csync();

  const int32_t* table = p.block_table + int64_t(gr.b) * p.block_table_stride;
  // Exclusive block-wide scan of per-thread counts; misc[8] = the total.
  auto block_scan = [&](int mine) {
    int incl = mine;
#pragma unroll
    for (int o = 1; o < 32; o <<= 1) {
      const int v = __shfl_up_sync(kFull, incl, o);
      if (lane >= o) incl += v;
    }
    if (lane == 31) misc[warp] = incl;
    csync();
    int base = incl - mine;
    for (int w = 0; w < warp; ++w) base += misc[w];
    if (tid == kThreads - 1) misc[8] = base + mine;
    return base;
  };
  // One unique page: per 64-key half, the tokens that selected it and see some key of the half.
  auto emit = [&](int slot, int id, int page, uint32_t tokens) {
    uint32_t mask[2] = {0, 0};
    for (int h = 0; h < 2; ++h) {
      const int64_t k0 = int64_t(id) * kPage + h * kChunkKeys;
      if (k0 >= gr.seq_len) continue;
      for (uint32_t t = tokens; t; t &= t - 1) {
        const int r = __ffs(t) - 1;
        if (tok_range[r].x < k0 + kChunkKeys && tok_range[r].y > k0) mask[h] |= 1u << r;
      }
    }
    uniq[slot] = make_int4(id, page, int(mask[0]), int(mask[1]));
  };
  auto page_ok = [&](int page) { return page >= 0 && page < p.num_cache_blocks; };
  if (bitmap) {
    for (int e = tid; e < n; e += kThreads) {
      const int r = e / K, id = raw[e];
      if (id >= 0 && id < tok_range[r].z) atomicOr(&sel[id], 1u << r);
    }
    csync();
    const int seg = (nb_all + kThreads - 1) / kThreads, i0 = min(tid * seg, nb_all), i1 = min(i0 + seg, nb_all);
    int mine = 0;
    for (int i = i0; i < i1; ++i)
      if (sel[i] != 0u) {
        if (page_ok(table[i])) ++mine;
        else sel[i] = 0u;  // a page outside the cache: skipped, as the sort path skips its entries
      }
    int base = block_scan(mine);
    for (int i = i0; i < i1; ++i)
      if (sel[i] != 0u) emit(base++, i, table[i], sel[i]);
  } else {
    // Entries -> sort keys (id << 37 | token << 32 | page), skipped ones (kNoEntry) last.
    for (int e = tid; e < L.n_pad; e += kThreads) {
      uint64_t key = kNoEntry;
      if (e < n) {
        const int r = e / K, id = raw[e];
        if (id >= 0 && id < tok_range[r].z) {
          const int page = table[id];
          if (page_ok(page)) key = (uint64_t(id) << 37) | (uint64_t(r) << 32) | uint64_t(uint32_t(page));
        }
      }
      keys[e] = key;
    }
    csync();
    for (int k = 2; k <= L.n_pad; k <<= 1)
      for (int j = k >> 1; j > 0; j >>= 1) {
        for (int i = tid; i < L.n_pad; i += kThreads) {
          const int ixj = i ^ j;
          if (ixj > i) {
            const uint64_t a = keys[i], bb = keys[ixj];
            if ((a > bb) == ((i & k) == 0)) {
              keys[i] = bb;
              keys[ixj] = a;
            }
          }
        }
        csync();
      }
    // Unique ids in order: each thread counts the first occurrences in its segment, a scan over
    // the segments gives their slots.
    const int seg = (L.n_pad + kThreads - 1) / kThreads, e0 = tid * seg;
    auto is_first = [&](int e) {
      return e < L.n_pad && keys[e] != kNoEntry && (e == 0 || (keys[e] >> 37) != (keys[e - 1] >> 37));
    };
    int mine = 0;
    for (int e = e0; e < e0 + seg; ++e) mine += is_first(e);
    int base = block_scan(mine);
    for (int e = e0; e < e0 + seg; ++e) {
      if (!is_first(e)) continue;
      const uint64_t id = keys[e] >> 37;
      uint32_t tokens = 0;
      for (int f = e; f < L.n_pad && keys[f] != kNoEntry && (keys[f] >> 37) == id; ++f)
        tokens |= 1u << ((keys[f] >> 32) & 31);
      emit(base++, int(id), int(uint32_t(keys[e])), tokens);
    }
  }
  csync();
  const int U = misc[8], C = 2 * U;
  // e4m3 on the wgmma loops: the two warpgroups' pages interleaved (wg_page_order). H200, against id
  // order in the same call: verify dql 8 B32 1.02x, prefill 8K / 32K 1.01x / 1.02x (shared8 32K
  // 1.01x); bf16 lost with it (verify p16 0.96x, prefill 32K and the drafter's blocks 0.98x) and
  // keeps id order.
  if constexpr (kWg && kFp8) {
    if (warp == 0)
      wg_page_order(uniq, U, wg_token_mask(0, rows, G), wg_token_mask(1, rows, G), reinterpret_cast<int4*>(area));
    csync();
  }
  const int c_begin = int(int64_t(split) * C / splits), c_end = int(int64_t(split + 1) * C / splits);

  // Work split: a 16-row tile per warp; with 4 warps and fewer than 3 tiles the warps of a tile
  // split each chunk's keys into KS parts instead.
  // The 8-warp kernel with at most 4 tiles runs two chunk lanes: warps 0-3 take the even chunks of
  // an iteration's pair, warps 4-7 the odd ones (more independent work per SM when one CTA holds it).
  const int R = (rows + 15) / 16;
  const int CL = !kWg && kWarps == 8 && R <= 4 ? 2 : 1;  // chunks per iteration
  const int lane_warps = kWarps / CL, lg = warp / lane_warps, w = warp % lane_warps;
  const int KSg = lane_warps == 8 || R >= 3 ? 1 : (R == 2 ? 2 : 4);
  const int tile = w / KSg;
  const int KS = CL * KSg, kp = lg * KSg + w % KSg;  // output planes (key parts) and this warp's
  const int keys_per_part = kChunkKeys / KSg, key_base = (w % KSg) * keys_per_part;
  const float k_scale = p.fp8 ? *p.k_scale : 1.f, v_scale = p.fp8 ? *p.v_scale : 1.f;
  const float scale_log2 = p.softmax_scale * k_scale * kLog2e;
  const int g = lane / 4;

  TileState st;
#pragma unroll
  for (int j = 0; j < 16; ++j)
#pragma unroll
    for (int e = 0; e < 4; ++e) st.o[j][e] = 0.f;
  st.m[0] = st.m[1] = -INFINITY;
  st.l[0] = st.l[1] = 0.f;

  // Fixed per warp and lane: the tile's tokens, each lane row's token and visible key range.
  const int t_first = tile * 16 / G, t_last = min(tile * 16 + 15, max(rows - 1, 0)) / G;
  const uint32_t tile_tokens =
      tile < R ? (t_last - t_first == 31 ? kFull : ((2u << (t_last - t_first)) - 1)) << t_first : 0u;
  int row_token[2], row_lo[2], row_hi[2];
#pragma unroll
  for (int rs = 0; rs < 2; ++rs) {
    const int row = tile * 16 + g + rs * 8;
    row_token[rs] = row < rows ? row / G : -1;
    const int4 tr = tok_range[row < rows ? row / G : 0];
    row_lo[rs] = tr.x;
    row_hi[rs] = tr.y;
  }
  const LaneOffsets off = lane_offsets<kFp8>(tile);
  const ChunkLoader<kFp8, kThreads, kWg && !kFp8> loader;
  const char* cache = static_cast<const char*>(p.cache);
  constexpr int64_t kRowBytes = cache_row_bytes(kFp8);

  auto issue = [&](int c, int slot) {
    if (c < c_end && chunk_mask(uniq, c) != 0) {
      const int4 u = uniq[c >> 1];
      const int k0 = u.x * kPage + (c & 1) * kChunkKeys;
      const int64_t first_row = (int64_t(u.y) * p.num_kv_heads + kv_head) * kPage + (c & 1) * kChunkKeys;
      const char* chunk = cache + first_row * kRowBytes;
      loader.issue(area + slot * L.stage_bytes, chunk, min(kChunkKeys, gr.seq_len - k0));
    }
    cp_async_commit();
  };
  float2 row_scale = make_float2(scale_log2, scale_log2);  // e4m3: the thread's rows' scales
  if constexpr (kFp8) {
    float* q_factor = reinterpret_cast<float*>(smem + L.qf_off);
    cp_async_wait<0>();  // the queries (no chunk is in flight yet)
    csync();
    q_rows_to_f16<kThreads>(q_s, q_factor, rows);
    csync();
    const int r0 = (kWg ? warp : tile) * 16 + g;  // the thread's rows r0, r0 + 8
    row_scale.x = scale_log2 * (r0 < rows ? q_factor[r0] : 1.f);
    row_scale.y = scale_log2 * (r0 + 8 < rows ? q_factor[r0 + 8] : 1.f);
  }
  float wo[kWg ? 64 : 1];  // the wgmma loop's O accumulator (rows g, g + 8; dims 8 i + 2 c + e)
  if constexpr (kWs) {
    wg_chunks_ws<kP16>(st, wo, uniq, q_s, area + stages * L.stage_bytes, c_begin, c_end, rows, G, row_token, row_lo,
                       row_hi, scale_log2, row_scale, reinterpret_cast<uint64_t*>(smem + L.bar_off), stages);
  } else if constexpr (kTma) {
    auto fill = [&](int c, int slot, uint64_t* bar) {  // or an arrival alone for a chunk no token sees
      if (chunk_mask(uniq, c) == 0) {
        kernels::mbar_arrive(bar);
        return;
      }
      load_chunk_boxes<kFp8>(area + slot * L.stage_bytes, p.cache_map, uniq, c, kv_head, uint32_t(L.stage_bytes), bar);
    };
    wg_chunks_tma<kFp8, kP16>(st, wo, uniq, q_s, area, L.stage_bytes, stages, c_begin, c_end, rows, G, row_token,
                              row_lo, row_hi, scale_log2, row_scale, gr.seq_len,
                              reinterpret_cast<uint64_t*>(smem + L.bar_off), fill);
  } else if constexpr (kWg) {
    wg_chunks<kFp8>(st, wo, uniq, q_s, area, L.stage_bytes, stages, c_begin, c_end, rows, G, row_token, row_lo,
                    row_hi, scale_log2, row_scale, issue);
  } else {
    // One cp.async group per chunk (empty past the split's end). Before the iteration over chunks
    // [c, c + CL): 1 + (stages - CL) + (c - c_begin + CL) groups committed, of which the first
    // 1 + (c - c_begin + CL) must be complete.
    for (int i = 0; i < stages - CL; ++i) issue(c_begin + i, i);
    for (int c = c_begin; c < c_end; c += CL) {
      const int i = c - c_begin;
      for (int q = 0; q < CL; ++q) issue(c + stages - CL + q, (i + stages - CL + q) % stages);
      cp_async_wait_dyn(stages - CL);
      csync();
      const int cc = c + lg;
      const uint32_t mask = cc < c_end ? chunk_mask(uniq, cc) : 0u;
      if ((mask & tile_tokens) != 0) {  // some token of this warp's tile selected the chunk
        const char* stage = area + ((i + lg) % stages) * L.stage_bytes;
        const int chunk_pos = uniq[cc >> 1].x * kPage + (cc & 1) * kChunkKeys;
        int lo[2], hi[2];
        chunk_row_ranges(mask, chunk_pos, row_token, row_lo, row_hi, lo, hi);
        for (int sub = 0; sub < keys_per_part / 16; ++sub) {
          const int key0 = key_base + sub * 16;
          tile_keys16<kFp8>(st, q_s, stage + key0 * kRowBytes, off, key0, lo, hi, scale_log2, row_scale);
        }
      }
      csync();  // the stages are refilled next iteration
    }
  }
  cp_async_wait<0>();
  csync();

  // Merge the key parts: per row, max and weight of each part, then sums in part order.
  float* fin = reinterpret_cast<float*>(area);
  if (tile < R) {
#pragma unroll
    for (int rs = 0; rs < 2; ++rs) {
      float l = st.l[rs];
      l += __shfl_xor_sync(kFull, l, 1);
      l += __shfl_xor_sync(kFull, l, 2);
      if (lane % 4 == 0) part_ml[kp * L.rows + tile * 16 + g + rs * 8] = make_float2(st.m[rs], l);
    }
  }
  csync();
  if (tid < R * 16) {
    float m = -INFINITY;
    for (int k = 0; k < KS; ++k) m = fmaxf(m, part_ml[k * L.rows + tid].x);
    float l = 0.f;
    for (int k = 0; k < KS; ++k) {
      const float2 v = part_ml[k * L.rows + tid];
      l += v.x == -INFINITY ? 0.f : v.y * exp2f(v.x - m);
    }
    row_ml[tid] = make_float2(m, l);
  }
  csync();
  // Each key part's O, weighted, in its own plane of `fin` (no read-modify-write); readers sum
  // the planes in part order.
  const int plane = R * 16 * 128;  // this group's tile rows: KS x R <= warps planes fit the area
  if (tile < R) {
#pragma unroll
    for (int rs = 0; rs < 2; ++rs) {
      const int row = tile * 16 + g + rs * 8;
      const float m = row_ml[row].x, mk = st.m[rs];
      const float w = mk == -INFINITY ? 0.f : exp2f(mk - m);
#pragma unroll
      for (int j = 0; j < 16; ++j)
#pragma unroll
        for (int hh = 0; hh < 2; ++hh) {
          if constexpr (kWg)  // wo[4 j + 2 rs + hh]: dim 8 j + 2 c + hh
            fin[fin_index(row, 8 * j + 2 * (lane % 4) + hh)] = wo[4 * j + 2 * rs + hh] * w;
          else
            fin[kp * plane + fin_index(row, 32 * (lane % 4) + 16 * hh + j)] = st.o[j][rs * 2 + hh] * w;
        }
    }
  }
  csync();
  auto summed = [&](int row, int col) {
    const int i = fin_index(row, col);
    float v = fin[i];
    for (int k = 1; k < KS; ++k) v += fin[k * plane + i];
    return v;
  };

  // Output: one split writes the rows; otherwise a partial, and the last split merges.
  auto write_row = [&](int row, float m, float l, auto&& value) {
    const int64_t t = gr.tok0 + row / G;
    const int h = kv_head * G + row % G;
    const float inv = row_out_scale(l, v_scale);  // a row without keys writes 0; NaN stays NaN
    uint16_t* out = p.out + t * p.out_stride_t + int64_t(h) * p.out_stride_h;
    for (int cp = lane; cp < 64; cp += 32) {
      const float x0 = l == 0.f ? 0.f : value(2 * cp) * inv, x1 = l == 0.f ? 0.f : value(2 * cp + 1) * inv;
      *reinterpret_cast<__nv_bfloat162*>(out + 2 * cp) = __floats2bfloat162_rn(x0, x1);
    }
    if (p.lse && lane == 0) p.lse[t * p.lse_stride_t + h] = row_lse(m, l);
  };
  if (splits == 1) {
    for (int row = warp; row < rows; row += kWarps) {
      const float2 ml = row_ml[row];
      write_row(row, ml.x, ml.y, [&](int col) { return summed(row, col); });
    }
    return;
  }
#if __CUDA_ARCH__ >= 900
  if constexpr (kCluster) {
    if (KS > 1) {  // the key parts' planes summed into plane 0 first (in part order, as `summed`)
      for (int i = tid; i < R * 16 * 128; i += kThreads) {
        float v = fin[i];
        for (int k = 1; k < KS; ++k) v += fin[k * plane + i];
        fin[i] = v;
      }
    }
    ClusterMergeArgs m{.row_ml = row_ml, .merged = part_ml, .fin = fin, .split_w = split_w, .out = p.out,
                       .out_stride_t = p.out_stride_t, .out_stride_h = p.out_stride_h, .lse = p.lse,
                       .lse_stride_t = p.lse_stride_t, .tok0 = gr.tok0, .rows = rows, .rows_cap = L.rows,
                       .splits = splits, .split = split, .G = G, .head0 = kv_head * G, .v_scale = v_scale};
    cluster_merge<kThreads>(m);
    return;
  }
#endif
  // The steps of global_split_merge (which msa_decode1_kernel calls), spelled out here: calling it
  // from this kernel changed its register allocation (the 8-warp mma.sync instances 225 -> 199
  // registers, as the inlined cluster code once did when verify and prefill got 16-20% slower), so
  // this copy stays until a GPU run shows the call costs nothing.
  const int64_t pair = int64_t(blockIdx.x) * p.num_kv_heads + kv_head;
  const int64_t slot0 = pair * splits;
  {
    float4* po = reinterpret_cast<float4*>(p.part_o + (slot0 + split) * L.rows * 128);
    float2* pml = reinterpret_cast<float2*>(p.part_ml) + (slot0 + split) * L.rows;
    for (int it = tid; it < rows * 32; it += kThreads) {
      const int row = it / 32, c0 = (it % 32) * 4;
      po[it] = make_float4(summed(row, c0), summed(row, c0 + 1), summed(row, c0 + 2), summed(row, c0 + 3));
    }
    if (tid < rows) pml[tid] = row_ml[tid];
  }
  __threadfence();
  csync();
  if (tid == 0) misc[9] = atomicAdd(p.counters + pair, 1) + 1 == splits;
  csync();
  if (!misc[9]) return;
  __threadfence();
  // The last split: merge the splits' partials in split order.
  const float* po = p.part_o + slot0 * L.rows * 128;
  const float2* pml = reinterpret_cast<const float2*>(p.part_ml) + slot0 * L.rows;
  if (tid < rows) {
    float2 ml[kMaxSplits];
    float m = -INFINITY;
#pragma unroll
    for (int s = 0; s < kMaxSplits; ++s) {
      ml[s] = s < splits ? __ldcg(&pml[s * L.rows + tid]) : make_float2(-INFINITY, 0.f);
      m = fmaxf(m, ml[s].x);
    }
    float l = 0.f;
#pragma unroll
    for (int s = 0; s < kMaxSplits; ++s) {
      const float w = ml[s].x == -INFINITY ? 0.f : exp2f(ml[s].x - m);
      if (s < splits) split_w[s * L.rows + tid] = w;
      l += w * ml[s].y;
    }
    row_ml[tid] = make_float2(m, l);
  }
  csync();
  // Every split's piece of an output float4 in flight at once.
  for (int it = tid; it < rows * 32; it += kThreads) {
    const int row = it / 32, c0 = (it % 32) * 4;
    float4 v[kMaxSplits];
#pragma unroll
    for (int s = 0; s < kMaxSplits; ++s)
      if (s < splits) v[s] = __ldcg(reinterpret_cast<const float4*>(po + (int64_t(s) * L.rows + row) * 128 + c0));
    float acc[4] = {0.f, 0.f, 0.f, 0.f};
#pragma unroll
    for (int s = 0; s < kMaxSplits; ++s) {
      const float w = s < splits ? split_w[s * L.rows + row] : 0.f;
      if (w != 0.f) {  // an empty split (weight 0) adds nothing
        acc[0] += v[s].x * w;
        acc[1] += v[s].y * w;
        acc[2] += v[s].z * w;
        acc[3] += v[s].w * w;
      }
    }
#pragma unroll
    for (int e = 0; e < 4; ++e) fin[fin_index(row, c0 + e)] = acc[e];
  }
  csync();
  for (int row = warp; row < rows; row += kWarps) {
    const float2 ml = row_ml[row];
    write_row(row, ml.x, ml.y, [&](int col) { return fin[fin_index(row, col)]; });
  }
  if (tid == 0) p.counters[pair] = 0;
}

// ------------------------------------------------------------------------------------------------
// Decode with one query token per request (decode_query_len 1): msa_decode1_kernel. A CTA serves
// (token t, KV head, split): the G <= 16 query heads of the group are one 16-row MMA tile (rows
// past G zero queries, never stored), and its four warps take 16 keys each of every 64-key chunk
// (tile_keys16, as the general kernel's key parts). What the general kernel spends on row groups
// (a union of pages over tokens, per-token masks, tiles) is gone: warp 0 reads the token's ids,
// keeps each visible id's first entry (one match per 32 entries), reads its page and lists the
// entry's visible 64-key halves in list order; split s of S takes list chunks [s C / S,
// (s + 1) C / S). Small shared memory (bf16: 3 stages of 32 KiB, two CTAs an SM, or 2 stages and
// three CTAs for grids of two to three CTAs an SM; e4m3: 2 of 16 KiB, four CTAs an SM) and few
// registers (bf16 168, e4m3 128) let CTAs share an SM, so small
// batches split into enough CTAs to fill the GPU and one CTA's dependent chain overlaps the
// others'. Splits merge in a cluster (Hopper, cluster_merge) or through global memory
// (global_split_merge), the general kernel's arithmetic. e4m3 grids of 3/4 to one pair an SM run
// unsplit with two 4-warp groups a CTA instead, those of 3/8 to 1/2 at two splits (d1_two_groups).
// Stages x CTAs per SM measured on the H200 (M3 shapes, 32K; bench rows decode B32 / B128):
// bf16 2 x 3: 45.3 / 159.4 us, 3 x 2: 42.7 (2 splits) / 137.0 us, 4 x 1: 61.6 / 165.0 us (session
// 8). e4m3 3 x 3, 4 x 3 and 6 x 2 within 32-45 / 96-98 us (session 8); then at 128 registers
// (session 16, the splits of msa_decode_splits): 2 x 4 28.9-29.0 / 76.1-76.4 us against 4 x 3's
// 29.6-30.0 / 91.4-91.5 built beside it (batch 128: 512 CTAs, one wave in 528 slots instead of
// 1.3 in 396), and in another call 2 x 4 28.7 / 75.8 against 3 x 4 29.1 / 76.9.
constexpr int kD1Threads = 128, kD1Rows = 16, kD1Parts = kD1Threads / 32;
// The register cap: three CTAs an SM (168) for bf16, 128 (four) for e4m3 (no spills but 8 bytes in
// the mixed instances, outside the loop). Stages and CTAs an SM: decode1_config.
__host__ __device__ constexpr int d1_register_ctas(bool fp8) { return fp8 ? 4 : 3; }
// The two-group e4m3 CTAs (256 threads, d1_two_groups) an SM at the same 128 registers.
constexpr int kD1TwoGroupCtas = 2;

struct D1Layout {
  int stage_bytes, stages, q_off, list_off, ml_off, misc_off, qf_off, bar_off, total;
};
// stages: the CTA's stages in all (its groups' together); groups: 4-warp groups (msa_decode1_kernel's
// kGroups), four key parts each.
__host__ __device__ inline D1Layout d1_layout(bool fp8, int stages, int groups = 1) {
  D1Layout l{};
  l.stage_bytes = kChunkKeys * cache_row_bytes(fp8);
  l.stages = stages;
  const int parts = kD1Parts * groups;
  const int planes = parts * kD1Rows * 512;  // the key parts' fp32 output rows, after the loop
  l.q_off = stages * l.stage_bytes > planes ? stages * l.stage_bytes : planes;
  l.list_off = l.q_off + kD1Rows * 256;                    // bf16 (e4m3 pages: f16) queries
  l.ml_off = l.list_off + 2 * kMsaMaxTopk * 8;             // int2 {key position, page} per chunk
  // (m, l): key parts [parts][16], rows [16], merged [16]; split weights [kMaxSplits][16]
  l.misc_off = l.ml_off + (parts + 2) * kD1Rows * 8 + kMaxSplits * kD1Rows * 4;
  l.qf_off = l.misc_off + 16;                              // [0] chunks, [1] last split
  l.bar_off = l.qf_off + (fp8 ? kD1Rows * 4 : 0);          // e4m3: the rows' query factors
  l.total = l.bar_off + 8 * 8;                             // the copy engine's stages: an mbarrier each
  return l;
}

// Lane `lane` of a dql-1 CTA's warp 0: token t's top-k entries lane and lane + 32 of KV head
// kv_head (raw; -1 past topk_k) and, for those inside the table row, their table entries (raw_page;
// -1 otherwise). Not checked against the length: the caller does that.
__device__ __forceinline__ void d1_load_ids(const MsaParams& p, int64_t t, int kv_head, int lane, int (&raw)[2],
                                            int (&raw_page)[2]) {
  const int32_t* ids = p.topk + int64_t(kv_head) * p.topk_stride_h + t * p.topk_stride_t;
  const int32_t* table = p.block_table + t * p.block_table_stride;
#pragma unroll
  for (int h = 0; h < 2; ++h)
    if (lane + 32 * h < p.topk_k) raw[h] = ids[int64_t(lane + 32 * h) * p.topk_stride_k];
#pragma unroll
  for (int h = 0; h < 2; ++h)
    if (unsigned(raw[h]) < unsigned(p.max_blocks)) raw_page[h] = table[raw[h]];
}

// The first key a dql-1 token (at position seq_len - 1) sees: 0, or the left window's start.
__device__ __forceinline__ int d1_window_lo(const MsaParams& p, int seq_len) {
  return p.window_left > 0 ? max(0, seq_len - p.window_left) : 0;
}

// Lane `lane` of warp 0 (every lane calls it): the visible 64-key chunks of the token's entries
// (raw, raw_page from d1_load_ids; keys [lo, hi) visible) listed in entry order as {key position,
// page}, each page once (an entry repeated, invisible or outside the cache skipped); returns
// their count on every lane.
__device__ __forceinline__ int d1_page_list(const MsaParams& p, int lane, const int (&raw)[2], const int (&raw_page)[2],
                                            int lo, int hi, int2* list) {
  const uint32_t before = (1u << lane) - 1u;
  int id[2];
#pragma unroll
  for (int h = 0; h < 2; ++h) {  // a skipped entry gets a unique negative id
    const int v = raw[h];
    const bool vis = v >= 0 && int64_t(v) * kPage < hi && int64_t(v) * kPage + kPage > lo;
    id[h] = vis ? v : -1 - (lane + 32 * h);
  }
  // Every lane runs the warp-wide matches and shuffles (no short-circuit around them).
  const uint32_t same0 = __match_any_sync(kFull, id[0]);
  bool first[2];
  first[0] = id[0] >= 0 && (same0 & before) == 0u;
  first[1] = false;
  if (p.topk_k > 32) {
    const uint32_t same1 = __match_any_sync(kFull, id[1]);
    bool dup = false;
    for (int j = 0; j < 32; ++j) dup |= __shfl_sync(kFull, id[0], j) == id[1];
    first[1] = id[1] >= 0 && (same1 & before) == 0u && !dup;
  }
  int page[2], n[2];
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    page[h] = first[h] ? raw_page[h] : -1;  // a visible id is < ceil(seq_len / 128) <= max_blocks
    const bool ok = first[h] && page[h] >= 0 && page[h] < p.num_cache_blocks;
    const int k0 = ok ? id[h] * kPage : 0;
    n[h] = ok ? int(k0 < hi && k0 + kChunkKeys > lo) + int(k0 + kChunkKeys < hi && k0 + kPage > lo) : 0;
  }
  int base = 0;
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    int incl = n[h];
#pragma unroll
    for (int o = 1; o < 32; o <<= 1) {
      const int v = __shfl_up_sync(kFull, incl, o);
      if (lane >= o) incl += v;
    }
    int at = base + incl - n[h];
    const int k0 = id[h] * kPage;
    for (int half = 0; half < 2 && n[h] > 0; ++half) {
      const int pos = k0 + half * kChunkKeys;
      if (pos < hi && pos + kChunkKeys > lo) list[at++] = make_int2(pos, page[h]);
    }
    base += __shfl_sync(kFull, incl, 31);
  }
  return base;
}

// The first byte of chunk e ({key position, page} from d1_page_list) of KV head kv_head in the cache.
template <bool kFp8>
__device__ __forceinline__ const char* d1_chunk(const MsaParams& p, int2 e, int kv_head) {
  const int half = (e.x / kChunkKeys) & 1;
  return static_cast<const char*>(p.cache) +
         ((int64_t(e.y) * p.num_kv_heads + kv_head) * kPage + half * kChunkKeys) * cache_row_bytes(kFp8);
}

// One (request t, KV head) pair's share of a dql-1 decode: chunks [from C / den, to C / den) of the
// pair's C, merged with the pair's other shares (`splits` in all, this one `split`, the pair's
// partials slot_stride slots apart) through a cluster (kCluster) or global memory, or written
// directly (splits 1). `trigger`: let the next PDL grid launch once the chunk loop is done. Every
// return is uniform over the CTA. kTma (sm_90a, p.cache_map encoded): thread 0 loads each chunk as
// the copy engine's boxes (tma_chunk_boxes) completing on its stage's mbarrier, in place of every
// thread's cp.async pieces; the boxes read a partial chunk's stale rows too, so before its P V each
// warp zeroes the V rows of its keys at or past seq_len. `smem` is then 1024 bytes longer than
// d1_layout's total (the stages start on the swizzle atom). e4m3 only: bf16 chunks as four boxes
// ran slower than by cp.async at every batch (H200, session 25).
// kGroups 2 (copy-engine form only): 8 warps as two 4-warp groups; group i takes the share's chunks
// i, i + 2, ... through its own `stages` stages and mbarriers, the groups stepping together, so
// that one CTA keeps two chunks' dependent chains in flight; the eight key parts merge as four do.
template <bool kFp8, bool kCluster, bool kTma = false, int kGroups = 1>
__device__ __forceinline__ void d1_share(const MsaParams& p, int stages, char* smem_raw, int64_t t, int kv_head,
                                         int split, int splits, int from, int to, int den, int slot_stride,
                                         bool trigger) {
  static_assert(kFp8 || !kTma, "the copy-engine form is e4m3's");
  static_assert(kGroups == 1 || (kGroups == 2 && kTma), "two warp groups: the copy-engine form only");
  constexpr int kThreads = kD1Threads * kGroups, kParts = kD1Parts * kGroups;
  const D1Layout L = d1_layout(kFp8, kGroups * stages, kGroups);
  char* smem = kTma ? smem_raw + ((1024u - (smem_u32(smem_raw) & 1023u)) & 1023u) : smem_raw;
  char* area = smem;
  char* q_s = smem + L.q_off;
  int2* list = reinterpret_cast<int2*>(smem + L.list_off);
  float2* part_ml = reinterpret_cast<float2*>(smem + L.ml_off);  // [kParts][16]
  float2* row_ml = part_ml + kParts * kD1Rows;
  float2* merged = row_ml + kD1Rows;
  float* split_w = reinterpret_cast<float*>(merged + kD1Rows);
  int* misc = reinterpret_cast<int*>(smem + L.misc_off);
  const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32, g = lane / 4;
  const int grp = kGroups == 1 ? 0 : warp / kD1Parts;  // the warp's group
  const int G = p.num_heads / p.num_kv_heads;

  // Queries: the first cp.async group (rows past G zero-filled).
  for (int idx = tid; idx < kD1Rows * 16; idx += kThreads) {
    const int row = idx / 16, pc = idx % 16;
    const uint16_t* src = p.q + t * p.q_stride_t + int64_t(kv_head * G + min(row, G - 1)) * p.q_stride_h + pc * 8;
    cp_async_16z(q_s + row * 256 + ((pc ^ swz_bf16(row)) * 16), src, row < G ? 16 : 0);
  }
  cp_async_commit();
  // Warp 0: the token's ids and their pages, loaded before the length is known so that the three
  // loads overlap (page ids are checked below).
  int raw[2] = {-1, -1}, raw_page[2] = {-1, -1};
  if (warp == 0) d1_load_ids(p, t, kv_head, lane, raw, raw_page);
  const int seq_len = p.seq_lens[t];
  if (seq_len < 0 || (int64_t(seq_len) + kPage - 1) / kPage > p.max_blocks) {  // uniform over the splits
    cp_async_wait<0>();
    return;
  }
  // The token at position seq_len - 1 sees keys [lo, hi) (causal or not: hi = seq_len).
  const int hi = seq_len, lo = d1_window_lo(p, seq_len);
  uint64_t* full = reinterpret_cast<uint64_t*>(smem + L.bar_off);  // kTma: stage s's chunk landed
  if (warp == 0) {
    const int base = d1_page_list(p, lane, raw, raw_page, lo, hi, list);
    if (lane == 0) misc[0] = base;
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
    if (kTma && lane == 0) {
      for (int s = 0; s < kGroups * stages; ++s) kernels::mbar_init(&full[s], 1);
      kernels::fence_mbarrier_init();
    }
#endif
  }
  __syncthreads();
  const int C = misc[0];
  const int c_begin = int(int64_t(from) * C / den), c_end = int(int64_t(to) * C / den);
  const float k_scale = kFp8 ? *p.k_scale : 1.f, v_scale = kFp8 ? *p.v_scale : 1.f;
  const float scale_log2 = p.softmax_scale * k_scale * kLog2e;
  const ChunkLoader<kFp8, kD1Threads> loader;
  // The group's stages: slots grp * stages + [0, stages), with their mbarriers.
  char* const group_area = area + grp * stages * L.stage_bytes;
  uint64_t* const group_full = full + grp * stages;
  auto issue = [&](int c, int slot) {
    if constexpr (kTma) {  // the group's thread 0: the chunk's boxes, nothing past the split's end
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
      if ((kGroups == 1 ? tid : tid % kD1Threads) == 0 && c < c_end) {
        const int2 e = list[c];
        tma_chunk_boxes<kFp8>(group_area + slot * L.stage_bytes, p.cache_map, e.x & kChunkKeys, kv_head, e.y,
                              uint32_t(L.stage_bytes), &group_full[slot]);
      }
#endif
    } else {  // one cp.async group per chunk, empty past the split's end
      if (c < c_end) {
        const int2 e = list[c];
        loader.issue(area + slot * L.stage_bytes, d1_chunk<kFp8>(p, e, kv_head), min(kChunkKeys, seq_len - e.x));
      }
      cp_async_commit();
    }
  };
  for (int i = 0; i < stages - 1; ++i) issue(c_begin + grp + i * kGroups, i);
  float2 row_scale = make_float2(scale_log2, scale_log2);
  if constexpr (kTma) cp_async_wait<0>();  // the queries (the only cp.async group)
  else cp_async_wait_dyn(stages - 1);      // the queries (the oldest group)
  __syncthreads();
  if constexpr (kFp8) {
    float* q_factor = reinterpret_cast<float*>(smem + L.qf_off);
    q_rows_to_f16<kThreads>(q_s, q_factor, G);
    __syncthreads();
    row_scale.x = scale_log2 * (g < G ? q_factor[g] : 1.f);
    row_scale.y = scale_log2 * (g + 8 < G ? q_factor[g + 8] : 1.f);
  }
  q_to_fragments<kThreads>(q_s);  // the loop's queries as A fragments (tile_keys16's kQFrag)
  TileState st;
#pragma unroll
  for (int j = 0; j < 16; ++j)
#pragma unroll
    for (int e = 0; e < 4; ++e) st.o[j][e] = 0.f;
  st.m[0] = st.m[1] = -INFINITY;
  st.l[0] = st.l[1] = 0.f;
  const LaneOffsets off = lane_offsets<kFp8, kTma>(0);
  const int key0 = (kGroups == 1 ? warp : warp % kD1Parts) * 16;  // this warp's keys of every chunk
  int slot = 0, fill = stages - 1;  // the stage read and the stage refilled this iteration
  uint32_t phase = 0;               // kTma: the parity of the read stage's current fill
  // kGroups 2: the groups step together (one CTA barrier an iteration), the second group's last
  // chunk past the end when the share has an odd count.
  for (int c0 = c_begin; c0 < c_end; c0 += kGroups) {
    const int c = c0 + grp;
    issue(c + stages * kGroups - kGroups, fill);
    fill = fill + 1 == stages ? 0 : fill + 1;
    char* stage = group_area + slot * L.stage_bytes;
    const bool here = kGroups == 1 || c < c_end;
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
    if constexpr (kTma) {
      if (here) kernels::mbar_wait(&group_full[slot], phase);
    }
#endif
    if constexpr (!kTma) {
      cp_async_wait_dyn(stages - 1);
      __syncthreads();
    }
    const int pos = here ? list[c].x : hi;  // past the end: no key of the chunk is seen
    const int clo = min(max(lo - pos, 0), kChunkKeys), chi = min(max(hi - pos, clo), kChunkKeys);
    if (chi > key0 && clo < key0 + 16) {
      if (kTma && chi < key0 + 16) {  // a partial chunk: this warp's V rows past seq_len, zeroed
        const int r0 = max(chi, key0);  // V's region: kChunkKeys rows of 8 pieces after K's
        for (int x = lane; x < (key0 + 16 - r0) * 8; x += 32)
          *reinterpret_cast<uint4*>(stage + (kChunkKeys + r0 + x / 8) * 128 + (x % 8) * 16) = make_uint4(0, 0, 0, 0);
        __syncwarp();
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
        kernels::fence_proxy_async();  // these writes before the stage's next copy
#endif
      }
      const int rlo[2] = {clo, clo}, rhi[2] = {chi, chi};
      tile_keys16<kFp8, kTma, true>(st, q_s, stage + key0 * kKeyRowBytes<kFp8, kTma>, off, key0, rlo, rhi,
                                    scale_log2, row_scale);
    }
    __syncthreads();  // the stage is refilled next iteration
    if (++slot == stages) {
      slot = 0;
      phase ^= 1u;
    }
  }
  cp_async_wait<0>();
  __syncthreads();
  // The next PDL grid may launch once every CTA is here (or done).
  if (trigger) kernels::launch_dependents();

  // Merge the key parts (the general kernel's arithmetic, in part order): each lane merges its two
  // rows' (m, l) over the parts itself, writes its weighted rows into its part's plane (float4s,
  // d1_plane_at), and the planes are summed float4 by float4 straight into the output (one split)
  // or back into plane 0 (the split merge's input): two CTA barriers.
  float* fin = reinterpret_cast<float*>(area);
  constexpr int kPlane = kD1Rows * 128;
#pragma unroll
  for (int rs = 0; rs < 2; ++rs) {
    float l = st.l[rs];
    l += __shfl_xor_sync(kFull, l, 1);
    l += __shfl_xor_sync(kFull, l, 2);
    if (lane % 4 == 0) part_ml[warp * kD1Rows + g + rs * 8] = make_float2(st.m[rs], l);
  }
  __syncthreads();
  const int c = lane % 4;
#pragma unroll
  for (int rs = 0; rs < 2; ++rs) {
    const int row = g + rs * 8;
    float m = -INFINITY;
#pragma unroll
    for (int k = 0; k < kParts; ++k) m = fmaxf(m, part_ml[k * kD1Rows + row].x);
    float l = 0.f;
#pragma unroll
    for (int k = 0; k < kParts; ++k) {
      const float2 v = part_ml[k * kD1Rows + row];
      l += v.x == -INFINITY ? 0.f : v.y * exp2f(v.x - m);
    }
    if (warp == 0 && c == 0) row_ml[row] = make_float2(m, l);
    const float w = st.m[rs] == -INFINITY ? 0.f : exp2f(st.m[rs] - m);
    // Lane c holds columns 32 c + 16 hh + j of the row in o[j][2 rs + hh].
    float* plane = fin + warp * kPlane;
#pragma unroll
    for (int k = 0; k < 8; ++k) {
      const int hh = k >> 2, j = 4 * (k & 3);
      *reinterpret_cast<float4*>(plane + d1_plane_at(row, 8 * c + k)) =
          make_float4(st.o[j][2 * rs + hh] * w, st.o[j + 1][2 * rs + hh] * w, st.o[j + 2][2 * rs + hh] * w,
                      st.o[j + 3][2 * rs + hh] * w);
    }
  }
  __syncthreads();
  for (int it = tid; it < G * 32; it += kThreads) {
    const int row = it / 32, q = it % 32, at = d1_plane_at(row, q);
    float4 v = *reinterpret_cast<const float4*>(fin + at);
#pragma unroll
    for (int k = 1; k < kParts; ++k) {
      const float4 u = *reinterpret_cast<const float4*>(fin + k * kPlane + at);
      v.x += u.x;
      v.y += u.y;
      v.z += u.z;
      v.w += u.w;
    }
    if (splits == 1) {  // bf16 of v * v_scale / l (0 for a row without keys; NaN stays NaN), its LSE
      const float2 ml = row_ml[row];
      const float inv = row_out_scale(ml.y, v_scale);
      const bool none = ml.y == 0.f;
      *reinterpret_cast<uint2*>(p.out + t * p.out_stride_t + int64_t(kv_head * G + row) * p.out_stride_h + 4 * q) =
          bf16x4(none ? 0.f : v.x * inv, none ? 0.f : v.y * inv, none ? 0.f : v.z * inv, none ? 0.f : v.w * inv);
      if (p.lse && q == 0)
        p.lse[t * p.lse_stride_t + kv_head * G + row] = row_lse(ml.x, ml.y);
    } else {
      *reinterpret_cast<float4*>(fin + at) = v;  // the thread's own float4 of plane 0
    }
  }
  if (splits == 1) return;
#if __CUDA_ARCH__ >= 900
  if constexpr (kCluster) {
    ClusterMergeArgs m{.row_ml = row_ml, .merged = merged, .fin = fin, .split_w = split_w, .out = p.out,
                       .out_stride_t = p.out_stride_t, .out_stride_h = p.out_stride_h, .lse = p.lse,
                       .lse_stride_t = p.lse_stride_t, .tok0 = t, .rows = G, .rows_cap = kD1Rows,
                       .splits = splits, .split = split, .G = G, .head0 = kv_head * G, .v_scale = v_scale};
    cluster_merge<kThreads, true>(m);  // its first cluster barrier orders plane 0's writes
    return;
  }
#endif
  __syncthreads();  // plane 0 whole before global_split_merge reads it
  auto write_row = [&](int row, float m, float l, auto&& value) {
    store_row(p, t, kv_head * G + row, m, l, v_scale, value);
  };
  global_split_merge<kThreads>(p, t * p.num_kv_heads + kv_head, slot_stride, split, splits, G, kD1Rows, row_ml,
                                 split_w, fin, misc + 1,
                                 [&](int row, int col) { return fin[d1_plane_at(row, col / 4) + col % 4]; },
                                 write_row);
}

// dql-1 decode, a CTA per (request t = blockIdx.x, KV head, split): split z of the pair's chunks.
// kGroups 2 (8 warps, d1_two_groups): two CTAs an SM at the one-group e4m3 instances' 128 registers.
template <bool kFp8, bool kCluster, bool kTma, int kGroups = 1>
__global__ void __launch_bounds__(kD1Threads* kGroups, kGroups == 1 ? d1_register_ctas(kFp8) : kD1TwoGroupCtas)
    msa_decode1_kernel(const __grid_constant__ MsaParams p, int stages) {
  kernels::grid_dependency_wait();  // launched with PDL (p.pdl): nothing is read before this
  extern __shared__ __align__(128) char smem[];
  const int64_t t = blockIdx.x;  // dql 1: token t is request t's only one
  const int kv_head = blockIdx.y, split = blockIdx.z;
  const int splits = p.num_splits > 1 ? p.num_splits : 1;
  d1_share<kFp8, kCluster, kTma, kGroups>(p, stages, smem, t, kv_head, split, splits, split, split + 1, splits,
                                          splits, p.pdl_trigger);
}

// Benchmarks (msa_decode1_read_floor_launch): msa_decode1_kernel's page stream alone on its split
// grid. Warp 0 loads the token's ids, their table entries and the length and lists the visible
// 64-key chunks as the kernel does (d1_load_ids, d1_page_list); the CTA
// then streams its split's chunks through `stages` shared-memory stages, a bulk copy each, and
// its threads fold one word of every chunk into a value stored only if it matches a constant it
// never holds. No queries, scores, softmax, merge or output.
template <bool kFp8>
__global__ void __launch_bounds__(kD1Threads)
    msa_decode1_read_floor_kernel(const __grid_constant__ MsaParams p, int stages, unsigned* sink) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  extern __shared__ __align__(128) char smem[];
  __shared__ uint64_t full[8];
  __shared__ int2 list[2 * kMsaMaxTopk];
  __shared__ int count;
  constexpr int kRowBytes = cache_row_bytes(kFp8);
  const int64_t t = blockIdx.x;
  const int kv_head = blockIdx.y, split = blockIdx.z, splits = p.num_splits > 1 ? p.num_splits : 1;
  const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32;
  int raw[2] = {-1, -1}, raw_page[2] = {-1, -1};
  if (warp == 0) d1_load_ids(p, t, kv_head, lane, raw, raw_page);
  const int seq_len = p.seq_lens[t];
  if (warp == 0) {
    const int base = d1_page_list(p, lane, raw, raw_page, d1_window_lo(p, seq_len), seq_len, list);
    if (lane == 0) {
      count = base;
      for (int s = 0; s < stages; ++s) kernels::mbar_init(&full[s], 1);
      kernels::fence_mbarrier_init();
    }
  }
  __syncthreads();
  const int C = count, c_begin = split * C / splits, c_end = (split + 1) * C / splits, n = c_end - c_begin;
  const int stage_bytes = d1_layout(kFp8, 0).stage_bytes;
  auto issue = [&](int i) {  // thread 0: chunk c_begin + i into stage i % stages
    const int2 e = list[c_begin + i];
    const uint32_t bytes = uint32_t(min(kChunkKeys, seq_len - e.x) * kRowBytes);
    uint64_t* bar = &full[i % stages];
    kernels::mbar_arrive_expect_tx(bar, bytes);
    kernels::bulk_copy_to_shared(smem + (i % stages) * stage_bytes, d1_chunk<kFp8>(p, e, kv_head), bytes, bar);
  };
  if (tid == 0)
    for (int i = 0; i < min(stages, n); ++i) issue(i);
  unsigned acc = 0;
  for (int i = 0; i < n; ++i) {
    kernels::mbar_wait(&full[i % stages], uint32_t(i / stages) & 1u);
    acc ^= reinterpret_cast<const unsigned*>(smem + (i % stages) * stage_bytes)[tid];
    __syncthreads();
    if (tid == 0 && i + stages < n) {
      kernels::fence_proxy_async();
      issue(i + stages);
    }
  }
  if (acc == 0x9e3779b9u) *sink = acc;
#endif
}

// dql-1 decode on the mixed grid (p.mixed_whole > 0: MsaDecodePlan's choice where one CTA a pair
// would leave some SMs a CTA more than others): CTA i < mixed_whole serves pair i whole (pair =
// request x Hkv + KV head); the remaining pairs come in num_splits pieces, CTA mixed_whole + j piece
// j % num_splits of pair mixed_whole + j / num_splits, merged through global memory. mixed_whole is
// a whole number of rounds of one CTA an SM, so that (CTAs filling the SMs breadth-first in index
// order) each SM gets the same whole pairs and the pieces spread the rest.
template <bool kFp8, bool kTma>
__global__ void __launch_bounds__(kD1Threads, d1_register_ctas(kFp8))
    msa_decode1_mixed_kernel(const __grid_constant__ MsaParams p, int stages) {
  kernels::grid_dependency_wait();  // launched with PDL (p.pdl): nothing is read before this
  extern __shared__ __align__(128) char smem[];
  const int i = blockIdx.x, whole = p.mixed_whole, q = p.num_splits;
  const bool piece = i >= whole;
  const int pair = piece ? whole + (i - whole) / q : i, s = piece ? (i - whole) % q : 0;
  d1_share<kFp8, false, kTma>(p, stages, smem, pair / p.num_kv_heads, pair % p.num_kv_heads, s, piece ? q : 1, s,
                              s + 1, piece ? q : 1, q, p.pdl_trigger);
}

bool g_force_baseline = false;

using detail::env_int;
using detail::switched_off;

// The kernel instance and its shared memory for a call. A grid no larger than the GPU (one CTA per
// SM) or groups of more than 64 rows: 8 warps, one CTA per SM, as many 64-key stages as fit (at
// most 8); with at most 4 tiles those 8 warps work on two chunks at a time. Otherwise 4 warps and
// two CTAs per SM, their stages split accordingly (at least 2). On sm_90, groups
// of more than 64 rows run the wgmma loop (kWg; M3RT_MSA_WGMMA=0 keeps mma.sync, for benchmarks).
using KernelFn = void (*)(MsaParams, int);
struct KernelConfig {
  KernelFn fn;          // plain launches
  KernelFn cluster_fn;  // the same kernel launched as clusters of the splits (merge through DSMEM)
  int threads, stages, smem;
  int cluster_threads;  // cluster_fn's (fn's, but for the e4m3 producer warpgroup: 128 more)
  int ctas_per_sm;      // dql-1 decode (decode1_config): the CTAs an SM holds (the PDL trigger's rule)
};

bool use_wgmma(int rows) {
  if (rows <= 64 || !kernels::hopper_paths_run()) return false;
  return !switched_off("M3RT_MSA_WGMMA");
}

// Both launch forms' dynamic shared memory limits (detail::raise_smem_limit: per device).
void raise_smem_limit(std::initializer_list<KernelFn> fns, int smem) {
  for (KernelFn fn : fns) detail::raise_smem_limit(reinterpret_cast<const void*>(fn), smem);
}

// The cache [num_cache_blocks, Hkv, 128, 256] as a tensor map {row element, key, KV head, page}
// with boxes of 128 bytes x 64 keys (bf16: 64 dims; e4m3: 128; one 128-byte-swizzled region of a
// stage), written into
// p.cache_map; false when the driver has no encoder or refuses the shape (then the cp.async wgmma
// loop runs). Host arithmetic only: no device call, no sync. The map depends only on the cache's
// address, dtype, Hkv and block count, so the last few encoded are kept per host thread and an
// eager call on the same cache copies its map instead of encoding it again.
bool encode_cache_map(MsaParams& p) {
  static_assert(sizeof(CUtensorMap) == sizeof(p.cache_map) && alignof(CUtensorMap) <= alignof(MsaParams),
                "CUtensorMap size");
  using Encode = decltype(&cuTensorMapEncodeTiled);
  static const Encode encode = [] {
    void* fn = nullptr;
    cudaDriverEntryPointQueryResult found{};
    if (cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", &fn, 12000, cudaEnableDefault, &found) !=
            cudaSuccess ||
        found != cudaDriverEntryPointSuccess)
      fn = nullptr;
    (void)cudaGetLastError();
    return reinterpret_cast<Encode>(fn);
  }();
  if (encode == nullptr || p.num_cache_blocks <= 0 || p.num_cache_blocks > 0x7fffffff) return false;
  struct Encoded {
    const void* cache = nullptr;
    bool fp8 = false;
    int num_kv_heads = 0;
    int64_t num_cache_blocks = 0;
    alignas(128) unsigned char map[sizeof(p.cache_map)];
  };
  constexpr int kKept = 4;
  thread_local Encoded kept[kKept];
  thread_local int next_slot = 0;
  for (const Encoded& e : kept) {
    if (e.cache == p.cache && e.fp8 == p.fp8 && e.num_kv_heads == p.num_kv_heads &&
        e.num_cache_blocks == p.num_cache_blocks) {
      std::memcpy(p.cache_map, e.map, sizeof(e.map));
      return true;
    }
  }
  const cuuint64_t row = cuuint64_t(cache_row_bytes(p.fp8));
  const cuuint64_t dims[4] = {256, cuuint64_t(kPage), cuuint64_t(p.num_kv_heads), cuuint64_t(p.num_cache_blocks)};
  const cuuint64_t strides[3] = {row, kPage * row, cuuint64_t(p.num_kv_heads) * kPage * row};  // bytes
  const cuuint32_t box[4] = {p.fp8 ? 128u : 64u, cuuint32_t(kChunkKeys), 1, 1}, unit[4] = {1, 1, 1, 1};
  CUtensorMap map;
  const CUresult r = encode(&map, p.fp8 ? CU_TENSOR_MAP_DATA_TYPE_UINT8 : CU_TENSOR_MAP_DATA_TYPE_BFLOAT16, 4,
                            const_cast<void*>(p.cache), dims, strides, box,
                            unit, CU_TENSOR_MAP_INTERLEAVE_NONE, CU_TENSOR_MAP_SWIZZLE_128B,
                            CU_TENSOR_MAP_L2_PROMOTION_L2_256B, CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
  if (r != CUDA_SUCCESS) return false;
  std::memcpy(p.cache_map, &map, sizeof(map));
  Encoded& e = kept[next_slot];
  next_slot = (next_slot + 1) % kKept;
  e = {p.cache, p.fp8, p.num_kv_heads, p.num_cache_blocks, {}};
  std::memcpy(e.map, &map, sizeof(map));
  return true;
}

// The copy-engine instances (the wgmma loop on tensor-map copies), plain and clustered.
// The copy-engine instances; e4m3's unsplit launches with the producer warpgroup (kWs, 128 more
// threads) unless M3RT_MSA_WS=0 (benchmarks: the copy-engine loop that converts in the row warps).
// Returns whether fn carries the producer warpgroup.
template <bool kFp8, bool kP16>
bool tma_instances(KernelConfig& cfg) {
  const bool ws = kFp8 && !switched_off("M3RT_MSA_WS");
  cfg.fn = ws ? msa_sparse_kernel<kFp8, 8, false, true, true, kP16, kFp8> : msa_sparse_kernel<kFp8, 8, false, true, true, kP16>;
  cfg.cluster_fn = msa_sparse_kernel<kFp8, 8, true, true, true, kP16>;
  return ws;
}

// tma: the wgmma loop on the copy engine (p.cache_map encoded; the caller passes it only for groups
// on the wgmma loop); p16: there, P V with P rounded once to 16 bits (MsaParams::p16).
KernelConfig kernel_config(bool fp8, int tg, int G, int topk, int max_blocks, int64_t ctas, bool tma, bool p16) {
  const detail::DeviceLimits dl = detail::device_limits();
  const int per_sm = dl.smem_per_sm, optin = dl.smem_optin;
  const bool lone = msa_group_rows(G, tg) > 64 || ctas <= dl.sms;
  const bool wg = use_wgmma(msa_group_rows(G, tg));
  const int warps = lone ? 8 : 4;
  KernelConfig cfg{};
  bool producer = false;
  if (tma) {
    if (fp8)
      producer = p16 ? tma_instances<true, true>(cfg) : tma_instances<true, false>(cfg);
    else
      producer = p16 ? tma_instances<false, true>(cfg) : tma_instances<false, false>(cfg);
  } else if (wg) {
    cfg.fn = fp8 ? msa_sparse_kernel<true, 8, false, true> : msa_sparse_kernel<false, 8, false, true>;
    cfg.cluster_fn = fp8 ? msa_sparse_kernel<true, 8, true, true> : msa_sparse_kernel<false, 8, true, true>;
  } else if (fp8) {
    cfg.fn = lone ? msa_sparse_kernel<true, 8, false> : msa_sparse_kernel<true, 4, false>;
    cfg.cluster_fn = lone ? msa_sparse_kernel<true, 8, true> : msa_sparse_kernel<true, 4, true>;
  } else {
    cfg.fn = lone ? msa_sparse_kernel<false, 8, false> : msa_sparse_kernel<false, 4, false>;
    cfg.cluster_fn = lone ? msa_sparse_kernel<false, 8, true> : msa_sparse_kernel<false, 4, true>;
  }
  cfg.cluster_threads = warps * 32;
  cfg.threads = cfg.cluster_threads + (producer ? 128 : 0);
  const int images = wg && fp8 ? kWgImages * kWgImageBytes : 0;
  const SmemLayout base = smem_layout(fp8, 0, tg, G, topk, max_blocks, warps, images, tma ? tma_bars(fp8, 8) : 0);
  const int slack = wg ? 1024 : 0;  // wgmma: the stages' 1024-byte alignment
  const int fixed = base.total - base.q_off + slack + images;
  int stages = ((lone ? optin : per_sm / 2 - 1024) - fixed) / base.stage_bytes;
  const int min_stages = wg ? 3 : 2;  // wgmma: a stage is refilled two iterations after its last read
  if (stages < min_stages) stages = (optin - fixed) / base.stage_bytes;
  if (stages < min_stages)
    throw Error("msa_attention: a group of " + std::to_string(tg) + " tokens x topk " + std::to_string(topk) +
                " needs more shared memory than this GPU has");
  cfg.stages = std::min(stages, 8);
  const int bars = tma ? tma_bars(fp8, cfg.stages) : 0;
  cfg.smem = smem_layout(fp8, cfg.stages, tg, G, topk, max_blocks, warps, images, bars).total + slack;
  raise_smem_limit({cfg.fn, cfg.cluster_fn}, cfg.smem);
  return cfg;
}

// decode_query_len 1 runs msa_decode1_kernel unless M3RT_MSA_DECODE1=0 (benchmarks: the general
// kernel on the same shapes).
bool use_decode1(int decode_query_len) {
  if (decode_query_len != 1) return false;
  return !switched_off("M3RT_MSA_DECODE1");
}

// CTAs an SM the mixed grid's plan (msa_decode_mixed) counts on: e4m3 four; bf16 two, or three for
// grids that fit one wave of three but not of two.
int d1_ctas_per_sm(bool fp8, int64_t ctas) {
  if (fp8) return 4;
  const int64_t sms = detail::multiprocessor_count();
  return ctas > 2 * sms && ctas <= 3 * sms ? 3 : 2;
}

// Whether a bf16 dql-1 grid of `ctas` CTAs (pairs in `splits` splits or pieces) takes as many
// stages as fit a half SM (3 on an H200; two CTAs an SM) instead of two (three CTAs an SM fit): a
// grid of more than three CTAs an SM, which two-stage CTAs would run as 1.3 waves (batch 128, 512
// CTAs: 148.9 vs 131.4 us), and an unsplit grid of at most one CTA an SM, whose lone CTA streams a
// whole pair (batch 32, 128 CTAs: 38.56 vs 37.96). Elsewhere two stages ran as fast or faster (H200,
// 32K, session 29, same call, two runs each: batch 1 1.012x, 8 (192 CTAs) 1.025x, 48 (mixed grid)
// 1.010x, 64 (256) 1.007x; session 16 had measured batch 64 69.0 vs 70.2 us and left it at three).
bool d1_bf16_three_stages(int64_t ctas, int splits) {
  const int64_t sms = detail::multiprocessor_count();
  return ctas > 3 * sms || (ctas <= sms && splits == 1);
}

// msa_decode1_kernel's instance and shared memory for a grid of `ctas` CTAs: e4m3 two 64-key stages
// (four CTAs an SM: fewer bytes queued in a saturated memory system; 2 stages ran every batch
// 1..128 as fast or faster than 3, H200, session 16); bf16 as many as fit a half SM (3 on an H200,
// at most 8) where d1_bf16_three_stages says so, two otherwise. bf16 at 2 stages x 3 CTAs against
// 3 x 2 (H200, session 16, one split): batch 80 (320 CTAs) 88.8 vs 108.8 us, 96 99.2 vs 115.1 —
// three CTAs an SM pay where they remove a partial second wave.
// Whether an e4m3 dql-1 decode grid of `ctas` CTAs, each pair in `splits` splits or pieces, takes
// the copy-engine form (kTma). By default (M3RT_MSA_D1_TMA unset or 1): split grids of up to 3 CTAs
// an SM, unsplit ones of up to 2, and at most kD1TmaMaxSplits splits; =2 for every e4m3 grid
// (tests, benchmarks), =0 never. H200, M3 shapes, 32K, against the cp.async form in the same call
// (sessions 25 and 27, two runs each): split grids batch 8 (288 CTAs) 1.025x, 32 (256)
// 1.046-1.054x, 48 (384) 1.041-1.045x, 80 (376, mixed) 1.035-1.036x, but 112 (500, mixed) 0.994x;
// unsplit 64 (256) 1.019-1.020x, 96 (384) 0.987-1.005x, 128 (512) 0.942x (msa_decode_splits turns
// an e4m3 count of 9 into 8 to take it). More than 8 splits (clusters of 9-16 CTAs) keep cp.async:
// there compute-sanitizer synccheck reports "Missing wait" at the first arrive.expect_tx, as it
// does for a minimal kernel whose mbarrier protocol is plainly correct (one barrier: init, fence,
// arrive.expect_tx, every thread waiting) in clusters of 9, 12, 15 or 16 CTAs with two CTAs on an
// SM, and not in clusters of 8 or with one CTA an SM (session 27, docs/perf.md): the tool cannot
// vouch for the form there.
constexpr int kD1TmaMaxSplits = 8;
bool d1_use_tma(bool fp8, int64_t ctas, int splits) {
  if (!fp8 || !kernels::hopper_paths_run()) return false;
  const int mode = env_int("M3RT_MSA_D1_TMA", 1);
  const int64_t per_sm = splits > 1 ? 3 : 2;
  return mode >= 2 ||
         (mode == 1 && ctas <= per_sm * detail::multiprocessor_count() && splits <= kD1TmaMaxSplits);
}

// Whether an e4m3 dql-1 grid takes two 4-warp groups a CTA (msa_decode1_kernel's kGroups): a
// copy-engine grid of one or two splits and at least 3/4 and at most one CTA an SM
// (msa_decode_splits then leaves such pairs unsplit, or at two splits merged in a cluster of two),
// where one 4-warp CTA an SM cannot keep up with its chunks and more splits cost a wider merge.
// H200, M3 shapes, 32K, same call, two runs each (session 31): batch 28 (112 pairs) 24.10-24.13 us
// against 25.20-25.21 at the rule's three splits (1.045x), 32 (128) 25.01-25.04 against 26.48-26.51
// at two (1.059x), 33 (132) 25.22-25.30 against 26.75-26.76; one group unsplit had run batch 32 in
// 30.90-31.05, and batch 24 (96 pairs) unsplit with two groups 23.41-23.50 against 23.79-23.96 at
// three splits (the session-29 form on 2f0d886, so left out). Beside a second split (256 CTAs, 16
// warps an SM) the two groups had run 0.97x, at batch 8 (256 CTAs of 8 splits) 0.85x (session 29).
// At two splits (session 32, same call, two runs each, against the rule's 4-5 splits): batch 13
// (104 CTAs) 17.15-17.39 vs 17.15 us (0.99-1.00x), 14 17.40-17.52 vs 17.60-17.66 (1.01x), 15
// 17.76-17.78 vs 18.00-18.02 (1.013x), 16 17.93-17.98 vs 18.43-18.44 (1.026x). Each group paced by
// its own named barrier instead of the shared CTA barrier ran 1.00-1.02x, but racecheck reports
// hazards on the key-part merge after the loop there (a minimal kernel of the same barrier pattern
// is clean), so the groups step together.
// M3RT_MSA_D1_GROUPS=1: never; =2: on every plain copy-engine e4m3 grid of one or two splits
// (tests; msa_decode_splits then leaves every such grid unsplit, M3RT_MSA_SPLITS=2 splits it).
bool d1_two_groups(bool fp8, int64_t ctas, bool mixed, bool tma, int splits) {
  if (!fp8 || mixed || !tma || splits > 2) return false;
  const int mode = env_int("M3RT_MSA_D1_GROUPS", 0);
  if (mode == 1 || mode == 2) return mode == 2;
  const int64_t sms = detail::multiprocessor_count();
  return 4 * ctas >= 3 * sms && ctas <= sms;
}

// tma: the kTma instances (e4m3; chunks by the copy engine; 1024 bytes more shared memory).
// splits: the pairs' splits (the mixed grid's pieces). Two groups (d1_two_groups): 256 threads,
// two stages each.
KernelConfig decode1_config(bool fp8, int64_t ctas, bool mixed, bool tma, int splits) {
  if (d1_two_groups(fp8, ctas, mixed, tma, splits)) {
    KernelConfig cfg{};
    cfg.fn = msa_decode1_kernel<true, false, true, 2>;
    cfg.cluster_fn = msa_decode1_kernel<true, true, true, 2>;  // two splits: a cluster of two
    cfg.threads = cfg.cluster_threads = 2 * kD1Threads;
    cfg.stages = 2;  // a group's
    cfg.ctas_per_sm = kD1TwoGroupCtas;
    cfg.smem = d1_layout(fp8, 2 * cfg.stages, 2).total + 1024;
    raise_smem_limit({cfg.fn, cfg.cluster_fn}, cfg.smem);
    return cfg;
  }
  const detail::DeviceLimits dl = detail::device_limits();
  const int per_sm = dl.smem_per_sm, optin = dl.smem_optin;
  const D1Layout base = d1_layout(fp8, 0);
  const int fixed = base.total - base.q_off;
  const int most = std::min(8, (optin - fixed) / base.stage_bytes);  // 2 fit any sm_80+ GPU
  const int fit = std::clamp((per_sm / 2 - 1024 - fixed) / base.stage_bytes, 2, most);
  int stages = fp8 || !d1_bf16_three_stages(ctas, splits) ? 2 : fit;
  stages = std::clamp(env_int("M3RT_MSA_D1_STAGES", stages), 2, most);  // tuning knob for benches
  KernelConfig cfg{};
  if (tma) {
    cfg.fn = mixed ? msa_decode1_mixed_kernel<true, true> : msa_decode1_kernel<true, false, true>;
    cfg.cluster_fn = msa_decode1_kernel<true, true, true>;
  } else {
    cfg.fn = mixed ? (fp8 ? msa_decode1_mixed_kernel<true, false> : msa_decode1_mixed_kernel<false, false>)
                   : (fp8 ? msa_decode1_kernel<true, false, false> : msa_decode1_kernel<false, false, false>);
    cfg.cluster_fn = fp8 ? msa_decode1_kernel<true, true, false> : msa_decode1_kernel<false, true, false>;
  }
  cfg.threads = cfg.cluster_threads = kD1Threads;
  cfg.stages = stages;
  cfg.ctas_per_sm = fp8 ? d1_register_ctas(true) : stages == 2 ? 3 : 2;  // bf16: three at two stages
  cfg.smem = d1_layout(fp8, stages).total + (tma ? 1024 : 0);
  raise_smem_limit({cfg.fn, cfg.cluster_fn}, cfg.smem);
  return cfg;
}

// Whether a split decode merges through a cluster: a Hopper GPU and sm_90a code in the build
// (hopper_paths_run), at most 16 splits, and every group's cluster resident at once (clusters of 1
// CTA per SM pack into GPCs: more than fit would run in a second wave). With every split's piece
// in flight at once the cluster merge beats the global one at every group size measured (H200,
// batch 1, 16 rows, 16 splits: 12.3 vs 15.7 us; it lost, 26.6 vs 15.8 us, while it read the
// splits one after another). Cached per (device, kernel, smem, splits, clusters).
// M3RT_MSA_CLUSTER=0 keeps the global-memory merge (benchmarks).
bool cluster_merge_fits(const KernelConfig& cfg, dim3 grid, int splits) {
  if (switched_off("M3RT_MSA_CLUSTER")) return false;
  if (splits > 16) return false;
  if (!kernels::hopper_paths_run()) return false;  // the cluster code is sm_90 code
  int dev = 0;
  M3RT_CUDA_CHECK(cudaGetDevice(&dev));
  struct Known {
    int dev;
    KernelFn fn;
    int smem, splits;
    int64_t clusters;
    bool fits;
  };
  const int64_t needed = int64_t(grid.x) * grid.y;
  static std::mutex mu;
  static std::vector<Known> known;
  const std::lock_guard<std::mutex> lock(mu);
  for (const Known& k : known)
    if (k.dev == dev && k.fn == cfg.cluster_fn && k.smem == cfg.smem && k.splits == splits && k.clusters == needed)
      return k.fits;
  bool fits = true;
  if (splits > 8 &&
      cudaFuncSetAttribute(cfg.cluster_fn, cudaFuncAttributeNonPortableClusterSizeAllowed, 1) != cudaSuccess)
    fits = false;
  if (fits) {
    const detail::LaunchEx ex(grid, dim3(unsigned(cfg.cluster_threads)), size_t(cfg.smem), nullptr, unsigned(splits),
                              false);
    int clusters = 0;
    fits = cudaOccupancyMaxActiveClusters(&clusters, cfg.cluster_fn, &ex.lc) == cudaSuccess && clusters >= needed;
  }
  (void)cudaGetLastError();  // a refused query is an answer, not an error for the next launch
  known.push_back({dev, cfg.cluster_fn, cfg.smem, splits, needed, fits});
  return fits;
}

}  // namespace

void msa_force_baseline(bool on) { g_force_baseline = on; }

MsaDecodeMixed msa_decode_mixed(int batch, int dql, int num_kv_heads, int topk, int max_blocks, bool fp8,
                                int splits) {
  if (batch < 1 || splits != 1 || !use_decode1(dql)) return {};
  const int64_t pairs = int64_t(batch) * num_kv_heads, sms = detail::multiprocessor_count();
  const int chunks = 2 * std::min(topk, max_blocks);
  if (pairs <= sms) return {};
  // The split grid: one CTA a pair, ceil(pairs / SMs) on the busiest SMs. The mixed grid: `rounds`
  // whole rounds, the rest in q pieces filling the per-SM slots left (at least 2 64-key chunks a
  // piece; at most 4 pieces for bf16, 2 for e4m3): its busiest SMs hold rounds + ceil(rest q / SMs)
  // / q pairs. H200, M3 shapes, 32K, against the split grid in the same call: bf16 batch 40
  // (quarters) 1.06-1.08x, 48 and 80 (halves) 1.04-1.05x; e4m3 batch 112 (halves) 1.08x, but e4m3
  // quarters lost (batch 56 0.81x, 80 0.90x).
  const int64_t per_sm = d1_ctas_per_sm(fp8, pairs), rounds = pairs / sms, rest = pairs - rounds * sms;
  if (rest == 0 || rounds >= per_sm) return {};
  const int64_t q = std::min<int64_t>({(per_sm - rounds) * sms / rest, fp8 ? 2 : 4, chunks / 2});
  MsaDecodeMixed m{};
  if (q >= 2) {
    const double split_load = double(rounds + 1), mixed_load = double(rounds) + double((rest * q + sms - 1) / sms) / q;
    if (mixed_load * 1.1 <= split_load) m = {int(rounds * sms), int(q)};
  }
  if (switched_off("M3RT_MSA_MIXED")) return {};  // benchmarks: the split grid
  return m;
}

int msa_decode_splits(int batch, int dql, int num_heads, int num_kv_heads, int topk, int max_blocks, bool fp8) {
  const int G = num_heads / num_kv_heads, tg = msa_group_tokens(G, dql);
  const int64_t pairs = msa_decode_groups(batch, dql, G) * num_kv_heads;
  if (pairs == 0) return 1;
  // The general kernel, one CTA per SM: more splits add a merge and a per-CTA start-up cost that
  // outweigh the second CTA an SM could hold (H200, M3 shapes: batch 32 at 1 split 47 us vs 2
  // splits 51 us; batch 1 at 16 splits 19 us vs 1 split 45 us).
  // msa_decode1_kernel: splits for about 1.5 (bf16) or 2.25 (e4m3) CTAs per SM, rounded (an extra
  // split adds a merge and a CTA's start-up cost; a co-resident CTA hides latency). H200, M3
  // shapes, 32K, every batch 1..64 against splits 1..16 (docs/perf.md; sessions 9 and 16): within
  // 7.5% of the best split count everywhere (1.2% on average in session 9; e4m3 at four CTAs an SM
  // in session 16 within 5.5%, worst at batch 24); filling every slot was up to 23% off (bf16 batch
  // 4, e4m3 batch 8). Batch 1 16 splits, 32 2 (e4m3; bf16 1, below), 64 and more 1. (These targets
  // are 3/4 of the 2 and 3 CTAs an SM the kernel held when they were set; e4m3 holds 4 since.)
  const int64_t chunks = 2 * int64_t(std::min(tg * topk, max_blocks));
  const int64_t cap = std::min<int64_t>(chunks, kMaxSplits);
  const bool d1 = use_decode1(dql);
  const int64_t sms = detail::multiprocessor_count();
  const int64_t quarters = d1 ? (fp8 ? 9 : 6) : 0;  // the d1 target in quarter CTAs an SM
  int64_t splits = std::clamp<int64_t>(d1 ? (quarters * sms + 2 * pairs) / (4 * pairs) : sms / pairs, 1, cap);
  // bf16 pages: once the pairs alone give (almost) every SM a CTA, one split (no merge) beats
  // filling the second slot (H200, batch 32 = 128 pairs on 132 SMs: 39.2-39.5 us at 1 split
  // against 41.6-41.8 at the rule's 2, three runs; batch 24 keeps 2 splits: 34.8-35.4 against
  // 38.3-38.4). e4m3 keeps the rule: one 4-warp e4m3 CTA per SM does not hide its conversions
  // (batch 32 at 1 split 36.1-36.2 us against 30.4-30.7 at 2; batch 48, session 9: 46.4 against
  // 38.1); two 4-warp groups a CTA do (below).
  if (d1 && !fp8 && 20 * pairs >= 19 * sms) splits = 1;
  // e4m3 grids that two 4-warp groups a CTA take (d1_two_groups): unsplit at 3/4 to one pair an SM,
  // else at two splits at 3/8 to 1/2 (batch 13-16 at Hkv 4 on 132 SMs: 4-5 splits by the rule).
  if (d1 && fp8 && d1_two_groups(true, pairs, false, d1_use_tma(true, pairs, 1), 1)) splits = 1;
  else if (d1 && fp8 && d1_two_groups(true, 2 * pairs, false, d1_use_tma(true, 2 * pairs, 2), 2)) splits = 2;
  // e4m3: one split fewer where that brings the pairs into the copy-engine form's 8 splits
  // (d1_use_tma). H200, batch 8 = 32 pairs, same call, two runs: 8 splits 15.38-15.43 us against
  // the rule's 9 (cp.async) 16.09-16.11, 1.046x (session 27).
  if (d1 && fp8 && splits == kD1TmaMaxSplits + 1 && d1_use_tma(true, pairs * kD1TmaMaxSplits, kD1TmaMaxSplits))
    splits = kD1TmaMaxSplits;
  splits = std::clamp<int64_t>(env_int("M3RT_MSA_SPLITS", int(splits)), 1, cap);  // tuning knob for benches
  return int(splits);
}

bool msa_decode1_read_floor_launch(const MsaParams& p, unsigned* sink, CUstream_st* stream) {
  if (p.cu_seqlens_q || !use_decode1(p.decode_query_len) || p.mixed_whole > 0 || !kernels::hopper_paths_run())
    return false;
  const int splits = std::max(1, p.num_splits);
  const int64_t ctas = p.num_seqs * int64_t(p.num_kv_heads) * splits;
  const int stages = std::min(8, decode1_config(p.fp8, ctas, false, false, splits).stages);
  const int smem = stages * d1_layout(p.fp8, 0).stage_bytes;
  auto fn = p.fp8 ? msa_decode1_read_floor_kernel<true> : msa_decode1_read_floor_kernel<false>;
  detail::raise_smem_limit(reinterpret_cast<const void*>(fn), smem);
  fn<<<dim3(unsigned(p.num_seqs), unsigned(p.num_kv_heads), unsigned(splits)), kD1Threads, smem, stream>>>(p, stages,
                                                                                                         sink);
  M3RT_LAUNCH_CHECK(stream, "msa_decode1_read_floor_kernel");
  return true;
}

void msa_attention_launch(const MsaParams& p, CUstream_st* stream) {
  if (p.num_tokens == 0) return;
  if (g_force_baseline) return msa_attention_baseline_launch(p, stream);
  const int G = p.num_heads / p.num_kv_heads, tg = msa_group_tokens(G, p.decode_query_len);
  const int64_t groups =
      p.cu_seqlens_q ? p.num_tokens / tg + p.num_seqs : msa_decode_groups(p.num_seqs, p.decode_query_len, G);
  const int splits = std::max(1, p.num_splits);
  if (groups > 0x7fffffff || p.num_kv_heads > 65535)
    throw_arg_error("msa_attention", "q.shape", std::to_string(p.num_tokens) + " tokens",
                    "at most 2^31 row groups and 65535 KV heads on a GPU");
  if (splits > kMaxSplits || (splits > 1 && (p.part_o == nullptr || p.part_ml == nullptr || p.counters == nullptr)))
    throw Error("msa_attention: split decode without its scratch (internal)");
  const bool d1 = !p.cu_seqlens_q && use_decode1(p.decode_query_len);
  MsaParams call = p;
  const bool mixed = d1 && p.mixed_whole > 0;
  const int64_t pairs = groups * p.num_kv_heads;
  const int64_t ctas = mixed ? p.mixed_whole + (pairs - p.mixed_whole) * splits : pairs * splits;
  // Groups on the wgmma loop take its copy-engine form (M3RT_MSA_WG_TMA=0: the cp.async form, for
  // benchmarks); so does e4m3 dql-1 decode where d1_use_tma says.
  const bool tma = d1 ? d1_use_tma(p.fp8, ctas, splits) && encode_cache_map(call)
                      : use_wgmma(msa_group_rows(G, tg)) && !switched_off("M3RT_MSA_WG_TMA") && encode_cache_map(call);
  KernelConfig cfg = d1 ? decode1_config(p.fp8, ctas, mixed, tma, splits)
                        : kernel_config(p.fp8, tg, G, p.topk_k, p.max_blocks, ctas, tma, p.p16);
  const dim3 grid = mixed ? dim3(unsigned(ctas)) : dim3(unsigned(groups), unsigned(p.num_kv_heads), unsigned(splits));
  // Split decode on Hopper: each group's splits form one cluster and merge through DSMEM (not the
  // mixed grid's pieces). PDL only where the kernels carry their griddepcontrol.wait (sm_90 code on
  // a Hopper GPU).
  bool cluster = !mixed && splits > 1 && cluster_merge_fits(cfg, grid, splits);
  // Splits that merge through global memory keep the cp.async loop: the copy-engine instance ran
  // those launches slower (H200, c22c943, the drafter's 112-row blocks: batch 8, 4 splits, 64.8 vs
  // 63.3 us; batch 1, 16 splits, 53.6 vs 41.7 us), while it won unsplit (verify, prefill: 1.22-1.32x)
  // and cluster-merged launches (batch 1, 16 splits: 21.6 vs 22.6 us).
  if (!d1 && tma && splits > 1 && !cluster) {
    cfg = kernel_config(p.fp8, tg, G, p.topk_k, p.max_blocks, ctas, false, false);
    cluster = cluster_merge_fits(cfg, grid, splits);
  }
  const bool pdl = p.pdl && kernels::hopper_paths_run();
  // msa_decode1_kernel lets the next PDL grid launch after its chunk loop when that grid's waiting
  // CTAs cannot crowd SMs unevenly: when they all find SMs this grid leaves idle, or when there are
  // (almost) no free slots. Between those (H200, e4m3 batch 32: 256 CTAs in 396 slots; bf16 batch
  // 32 at one split: 128 CTAs on 132 SMs) they took the free slots first, doubled up on a few SMs,
  // and the call ran 0.86x; batch 1 (64 CTAs) and bf16 batch 32 at two splits (256 in 264) gained
  // 1.04x / 1.02x, and without the trigger every row ran as without PDL (H200, c8ea3ab, bd77f90).
  // The general kernel never triggers (its grid ends at its exit, as without PDL).
  if (pdl && d1) {
    const int64_t sms = detail::multiprocessor_count(), slots = sms * cfg.ctas_per_sm;
    call.pdl_trigger = 2 * ctas <= sms || 20 * ctas >= 19 * slots;
  }
  if (cluster || pdl) {
    const detail::LaunchEx ex(grid, dim3(unsigned(cluster ? cfg.cluster_threads : cfg.threads)), size_t(cfg.smem),
                              stream, cluster ? unsigned(splits) : 1u, pdl);
    M3RT_CUDA_CHECK(cudaLaunchKernelEx(&ex.lc, cluster ? cfg.cluster_fn : cfg.fn, call, cfg.stages));
  } else {
    cfg.fn<<<grid, cfg.threads, cfg.smem, stream>>>(call, cfg.stages);
  }
  M3RT_LAUNCH_CHECK(stream, d1 ? "msa_decode1_kernel" : "msa_sparse_kernel");
}

}  // namespace m3rt
