// msa_attention's device pieces shared by its kernels: constants, the shared-memory layout, row
// groups and their page unions, the chunk loaders, the per-chunk steps (Q K^T, online softmax,
// P V on mma.sync; the wgmma loops on sm_90a: cp.async, tensor-map copies, the e4m3 producer
// warpgroup), the key-part, cluster and global split merges, and the output rows.
// Part of msa_attention.cu's translation unit (included there only: its names live in that
// file's unnamed namespace, so the kernels and helpers keep internal linkage).
#pragma once

#include <cuda.h>
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cooperative_groups.h>
#include <cuda_fp8.h>

#include <cstdint>
#include <type_traits>

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
// kPlainSwz: rows swizzled as piece ^ (row % 8) (msa_token_tile_kernel) instead of swz_bf16.
// The kThreads threads calling it are 0.. kThreads - 1 by `tid` (the CTA, or one warp by its lane
// for rows of its own: q_s and q_factor then point at the warp's first row, a multiple of 8).
template <int kThreads, bool kPlainSwz = false>
__device__ void q_rows_to_f16(char* q_s, float* q_factor, int rows, int tid = int(threadIdx.x)) {
  for (int base = 0; base < rows * 16; base += kThreads) {  // uniform; rows * 16 % 16 == 0
    const int idx = base + tid, row = idx / 16, pc = idx % 16;
    const bool active = idx < rows * 16;  // whole half-warps
    char* piece = q_s + row * 256 + ((pc ^ (kPlainSwz ? row & 7 : swz_bf16(row))) * 16);
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

// Token r of the group: its visible keys [lo, hi) (causal: up to its position; window: from
// p - window_left + 1) and the blocks below hi, as int4 {lo, hi, nbv, -}.
__device__ __forceinline__ int4 token_range(const MsaParams& p, const Group& gr, int r) {
  const int64_t pos = gr.pos0 + r;
  const int64_t hi = p.causal ? min(pos + 1, int64_t(gr.seq_len)) : int64_t(gr.seq_len);
  const int64_t lo = p.window_left > 0 ? max(int64_t(0), pos - p.window_left + 1) : 0;
  const int nbv = hi > 0 ? int((hi + kPage - 1) / kPage) : 0;
  return make_int4(int(lo), int(max(hi, int64_t(0))), nbv, 0);
}

// A page of the group's union: {id, page, per 64-key half the tokens among `tokens` (those that
// selected it) that see some key of the half}.
__device__ __forceinline__ int4 union_entry(const Group& gr, const int4* tok_range, int id, int page,
                                            uint32_t tokens) {
  uint32_t mask[2] = {0, 0};
  for (int h = 0; h < 2; ++h) {
    const int64_t k0 = int64_t(id) * kPage + h * kChunkKeys;
    if (k0 >= gr.seq_len) continue;
    for (uint32_t t = tokens; t; t &= t - 1) {
      const int r = __ffs(t) - 1;
      if (tok_range[r].x < k0 + kChunkKeys && tok_range[r].y > k0) mask[h] |= 1u << r;
    }
  }
  return make_int4(id, page, int(mask[0]), int(mask[1]));
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
  // Before the first chunk: no keys seen.
  __device__ __forceinline__ void clear() {
#pragma unroll
    for (int j = 0; j < 16; ++j)
#pragma unroll
      for (int e = 0; e < 4; ++e) o[j][e] = 0.f;
    m[0] = m[1] = -INFINITY;
    l[0] = l[1] = 0.f;
  }
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

}  // namespace
}  // namespace m3rt
