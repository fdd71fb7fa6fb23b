// lightning_indexer kernels: block scores on tensor cores and top-k block selection.
//
//   index_q      [T, Hidx, 128]          bf16, or e4m3 with an fp8 index cache
//   index_cache  [num_blocks, 128, 128]  bf16 or e4m3: one 128-dim key per token
//   scores       [T, Hidx, max_blocks]   fp32 scratch: score[t, h, j] for j < the token's nb
//   topk_out     [T, Hidx, topk]         int32, ascending ids, -1 after
//
// Dot products run on mma.sync m16n8k16 with fp32 accumulation (bf16 inputs as bf16; e4m3 inputs
// converted exactly to f16). Each lane loads its fragments straight from memory in 16-byte chunks:
// the 128 dims of a row are permuted so that lane c of a quad owns the chunks 4i + c (see
// load_frag_words), and Q and K use the same permutation, so every dot product is over the same
// pairs of dims — only the order of the sum changes.
//
// Decode (indexer_decode_kernel): grid (splits, requests, row groups). A CTA scores the pages
// [split * per, (split + 1) * per) of its request (per = ceil(visible pages / splits), from the
// device-side seq_len, so the grid depends only on shapes); each warp owns a page, with keys as
// the MMA's M dimension and the request's dql x Hidx query rows as N. Scores go to the scratch; the
// last CTA of a request to arrive (a per-request counter, reset by that CTA) selects every row.
// Prefill (indexer_prefill_score_kernel, then indexer_prefill_select_kernel): grid (query tiles x
// page chunks, requests), a CTA holds 256 query rows (256 / Hidx tokens x Hidx heads) as the M dimension in
// registers and streams up to 8 of the request's pages through shared memory (cp.async, two
// stages); each row's running max over a page's visible keys becomes its score.
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
#include "ops/lightning_indexer/lightning_indexer.h"

namespace m3rt {
namespace {

using kernels::cp_async_16;
using kernels::cp_async_commit;
using kernels::cp_async_wait;
using kernels::kFullMask;

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

__device__ __forceinline__ uint32_t e4m3x2_to_f16x2(uint32_t two) {
  const __half2_raw h = __nv_cvt_fp8x2_to_halfraw2(static_cast<__nv_fp8x2_storage_t>(two), __NV_E4M3);
  return uint32_t(h.x) | (uint32_t(h.y) << 16);
}

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

template <bool kFp8>
__device__ __forceinline__ void mma_16816(float (&d)[4], uint32_t a0, uint32_t a1, uint32_t a2,
                                          uint32_t a3, uint32_t b0, uint32_t b1) {
  if constexpr (kFp8) {
    asm("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
        "{%0,%1,%2,%3};\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
  } else {
    asm("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
        "{%0,%1,%2,%3};\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
  }
}

// The max over visible keys: NaN for a masked key, so that fmaxf (which ignores NaN) skips it and a
// block with no non-NaN visible dot stays NaN.
__device__ __forceinline__ float kNaN() { return __int_as_float(0x7fffffff); }

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

// One warp selects one row: forced blocks [0, init) and [nb - local, nb), then the best `need` of
// the candidates [init, nb - local). The threshold T (the need-th largest key) is found bit by bit
// from the top: T keeps a bit when at least `need` keys are >= T with that bit set (each lane
// counts its keys, one warp reduction per bit). Every key above T is taken, and of the keys equal
// to T the lowest ids. Writes the selected ids in ascending order, then -1. Lane l holds the keys
// of blocks l + 32 i: in registers for kIters > 0 (rows of up to 32 kIters blocks; every load
// issued at once), re-read from memory for kIters == 0 (longer rows).
template <int kIters>
__device__ void warp_select_row(const float* scores, int nb, int topk, int init_blocks,
                                int local_blocks, int32_t* out) {
  const int lane = threadIdx.x % 32;
  if (nb <= topk) {
    for (int j = lane; j < topk; j += 32) out[j] = j < nb ? j : -1;
    return;
  }
  const int lo = init_blocks, hi = nb - local_blocks;  // candidates; nb > topk >= init + local
  const int need = topk - init_blocks - local_blocks;
  const int iters = kIters > 0 ? kIters : (nb + 31) / 32;
  auto is_candidate = [&](int i) { return lane + 32 * i >= lo && lane + 32 * i < hi; };
  uint32_t reg_keys[kIters > 0 ? kIters : 1] = {};
  if constexpr (kIters > 0) {
#pragma unroll
    for (int i = 0; i < kIters; ++i) reg_keys[i] = is_candidate(i) ? score_key(__ldcg(scores + lane + 32 * i)) : 0u;
  }
  // Key of slot i, or 0 (below every key that counts: NaN's key is 0 too, but a NaN candidate
  // only matters once T reaches 0, where the lowest-id rule below picks among the zeros).
  auto key_at = [&](int i) -> uint32_t {
    if constexpr (kIters > 0) return reg_keys[i];
    return is_candidate(i) ? score_key(__ldcg(scores + lane + 32 * i)) : 0u;
  };
  auto count_at_least = [&](uint32_t t) {
    unsigned n = 0;
#pragma unroll
    for (int i = 0; i < iters; ++i) n += (is_candidate(i) && key_at(i) >= t) ? 1u : 0u;
    return int(__reduce_add_sync(kFullMask, n));
  };
  uint32_t threshold = 0;
  if (need > 0) {
    for (int bit = 31; bit >= 0; --bit) {
      const uint32_t t = threshold | (1u << bit);
      if (count_at_least(t) >= need) threshold = t;
    }
  }
  // Keys above the threshold are all taken; of those equal to it, the lowest ids up to `need`.
  const int take_equal = need > 0 ? need - (threshold == 0xffffffffu ? 0 : count_at_least(threshold + 1)) : 0;
  const unsigned lt = (1u << lane) - 1u;
  int written = 0, equal_seen = 0;
#pragma unroll
  for (int i = 0; i < iters; ++i) {
    const int j = lane + 32 * i;
    bool sel = false, eq = false;
    if (j < nb) {
      if (!is_candidate(i)) {
        sel = true;
      } else if (need > 0) {
        const uint32_t key = key_at(i);
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

// The row's selection with its keys in registers when it has at most 1024 blocks (128K tokens).
__device__ void select_row(const float* scores, int nb, int topk, int init_blocks, int local_blocks,
                           int32_t* out) {
  if (nb <= 256)
    warp_select_row<8>(scores, nb, topk, init_blocks, local_blocks, out);
  else if (nb <= 1024)
    warp_select_row<32>(scores, nb, topk, init_blocks, local_blocks, out);
  else
    warp_select_row<0>(scores, nb, topk, init_blocks, local_blocks, out);
}

// ------------------------------------------------------------------------------------------------
// Decode.
constexpr int kDecodeWarps = 4;
constexpr int kDecodeThreads = kDecodeWarps * 32;
constexpr int kDecodeMinBlocks = 4;
constexpr int kDecodeRows = 128;  // query rows (dql x Hidx) per CTA; more go to further row groups
constexpr int kDecodeNTiles = kDecodeRows / 8;

template <bool kFp8>
__global__ void __launch_bounds__(kDecodeThreads, kDecodeMinBlocks)
    indexer_decode_kernel(const __grid_constant__ IndexerParams p, int num_splits, int row_groups) {
  __shared__ uint2 q_frag[kDecodeNTiles][8][32];             // [n-tile][k-step][lane]: 32 KB
  __shared__ float page_max[kDecodeWarps][kDecodeRows];      // a warp's page: max per query row
  __shared__ bool last_arrival;
  constexpr int kElemBytes = kFp8 ? 1 : 2;
  const int b = blockIdx.y, split = blockIdx.x, group = blockIdx.z;
  const int H = p.num_heads, dql = p.decode_query_len;
  const int rows_total = dql * H;
  const int row0 = group * kDecodeRows;
  const int rows = min(kDecodeRows, rows_total - row0);
  Request req;
  if (!load_request(p, b, req)) return;  // uniform over the request's CTAs: no arrival either
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, g = lane / 4, c = lane % 4;
  const int n_tiles = (rows + 7) / 8;
  const char* q_base = static_cast<const char*>(p.index_q);
  const char* cache = static_cast<const char*>(p.index_cache);

  // Query fragments of this row group, in shared memory in [n-tile][k-step][lane] order.
  for (int nt = warp; nt < n_tiles; nt += kDecodeWarps) {
    const int r = 8 * nt + g;
    uint32_t w[kWords] = {};
    if (r < rows) {
      uint4 ch[FragChunks<kFp8>::kCount];
      load_row_chunks<kFp8, false>(q_base + (int64_t(b) * rows_total + row0 + r) * 128 * kElemBytes, c, ch);
      chunks_to_words<kFp8>(ch, w);
    }
#pragma unroll
    for (int s = 0; s < 8; ++s) q_frag[nt][s][lane] = make_uint2(w[2 * s], w[2 * s + 1]);
  }
  __syncthreads();

  const int nb_seq = (req.seq_len + kPage - 1) / kPage;
  const int per = (nb_seq + num_splits - 1) / num_splits;
  const int j_end = min(nb_seq, (split + 1) * per);
  const int first_pos = req.seq_len - dql;  // position of the request's row 0
  const int32_t* table = p.block_table + int64_t(b) * p.block_table_stride;
  for (int j = split * per + warp; j < j_end; j += kDecodeWarps) {
    const int page = table[j];
    for (int r = lane; r < rows; r += 32) page_max[warp][r] = kNaN();
    __syncwarp();
    if (page >= 0 && page < p.num_cache_blocks) {  // warp-uniform; else the page scores NaN
      const bool masked = j * kPage + kPage - 1 > first_pos;  // some key lies past some row
      const char* page_base = cache + int64_t(page) * kPage * 128 * kElemBytes;
      for (int sub = 0; sub < kPage / 32; ++sub) {
        // Keys sub*32 + mt*16 + g (+8) as the A operand of two m-tiles.
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
        for (int nt = 0; nt < n_tiles; ++nt) {
          float acc[2][4] = {};
#pragma unroll
          for (int s = 0; s < 8; ++s) {
            const uint2 bq = q_frag[nt][s][lane];
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
                const int key_pos = j * kPage + sub * 32 + mt * 16 + hf * 8 + g;
                const float v = acc[mt][2 * hf + e];
                m[e] = fmaxf(m[e], (!masked || key_pos <= row_pos) ? v : kNaN());
              }
          }
#pragma unroll
          for (int e = 0; e < 2; ++e)
#pragma unroll
            for (int x = 4; x < 32; x *= 2) m[e] = fmaxf(m[e], __shfl_xor_sync(kFullMask, m[e], x));
          if (g == 0) {
#pragma unroll
            for (int e = 0; e < 2; ++e) {
              float& slot = page_max[warp][8 * nt + 2 * c + e];
              slot = fmaxf(slot, m[e]);
            }
          }
        }
      }
    }
    __syncwarp();
    for (int r = lane; r < rows; r += 32)
      p.scores[(int64_t(b) * rows_total + row0 + r) * p.max_blocks + j] = page_max[warp][r];
    __syncwarp();
  }

  // The last CTA of the request to arrive selects its rows.
  __threadfence();
  __syncthreads();
  if (threadIdx.x == 0) {
    const int arrived = atomicAdd(p.counters + b, 1) + 1;
    last_arrival = arrived == num_splits * row_groups;
  }
  __syncthreads();
  if (!last_arrival) return;
  __threadfence();
  for (int row = warp; row < rows_total; row += kDecodeWarps) {
    const int r = row / H, h = row % H;
    const int64_t t = int64_t(b) * dql + r;
    int32_t* out = p.topk_out + t * p.topk_stride_t + int64_t(h) * p.topk;
    const int pos = first_pos + r;
    if (pos < 0) {  // a padded row (seq_len 0) or one before the sequence: nothing visible
      for (int i = lane; i < p.topk; i += 32) out[i] = -1;
      continue;
    }
    select_row(p.scores + (int64_t(b) * rows_total + row) * p.max_blocks, pos / kPage + 1, p.topk,
                    p.init_blocks, p.local_blocks, out);
  }
  if (threadIdx.x == 0) p.counters[b] = 0;  // ready for the next call (or graph replay)
}

// ------------------------------------------------------------------------------------------------
// Prefill scoring.
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
  // blockIdx.x = (query tile, chunk of kPrefillChunkPages pages): a page's scores need no other
  // page, so long causal rows split into equal CTAs and the grid stays balanced.
  const int chunk = int(blockIdx.x) % chunks, tile = int(blockIdx.x) / chunks;
  Request req;
  if (!load_request(p, b, req)) return;
  const int t_begin = tile * tokens_per_tile;
  if (t_begin >= req.q_len) return;
  const int t_end = min(req.q_len, t_begin + tokens_per_tile);
  const int H = p.num_heads;
  const int ctx = req.seq_len - req.q_len;  // position of the request's first query token
  const int lowest_pos = ctx + t_begin;
  const int j_begin = chunk * kPrefillChunkPages;
  const int j_end = min((ctx + t_end - 1) / kPage + 1, j_begin + kPrefillChunkPages);
  if (j_begin >= j_end) return;
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
// Prefill scoring on Hopper (sm_90a): wgmma m64n128k16, one page (128 keys) per instruction chain.
// A CTA holds 2 warpgroups x 64 query rows (two CTAs per SM); the query rows are the A operand in
// registers (natural dim order), the page the B operand in shared memory in the 128-byte-swizzled
// K-major layout (two 64-dim halves of 128 keys x 128 bytes; 16-byte chunk q of key n at
// q ^ (n % 8)). Pages stream through a 3-stage cp.async pipeline; an e4m3 page is converted to f16 in shared memory
// first (exact), so both dtypes accumulate in fp32 like the portable kernel.
constexpr int kSm90WarpGroups = 2;
constexpr int kSm90Threads = kSm90WarpGroups * 128;
constexpr int kSm90Rows = kSm90WarpGroups * 64;
constexpr int kSm90Stages = 3;
constexpr int kSm90MinBlocks = 2;  // two CTAs per SM: one's epilogue overlaps the other's MMAs
constexpr int kSm90ChunkPages = 16;
constexpr int kMmaPageBytes = kPage * 128 * 2;  // a page as the MMA reads it (bf16 or f16)

template <bool kFp8>
__host__ __device__ constexpr int sm90_smem_bytes() {
  return kSm90Stages * kPage * 128 * (kFp8 ? 1 : 2) + (kFp8 ? kMmaPageBytes : 0) + 1024;  // +1024: alignment
}

// Byte offset of 16-byte chunk q (0..15) of key n in a swizzled page image.
[[maybe_unused]] __device__ __forceinline__ int sw128_offset(int n, int q) {
  return (q / 8) * (kPage * 128) + n * 128 + (((q % 8) ^ (n & 7)) * 16);
}

// Shared-memory matrix descriptor: K-major, 128-byte swizzle, 8-row groups 1024 bytes apart.
[[maybe_unused]] __device__ __forceinline__ uint64_t sw128_desc(uint32_t smem_addr) {
  return uint64_t((smem_addr & 0x3FFFF) >> 4) | (uint64_t(1) << 16) | (uint64_t(1024 >> 4) << 32) |
         (uint64_t(1) << 62);
}

[[maybe_unused]] __device__ __forceinline__ void wgmma_fence() { asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory"); }
[[maybe_unused]] __device__ __forceinline__ void wgmma_commit() { asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory"); }
[[maybe_unused]] __device__ __forceinline__ void wgmma_wait_all() { asm volatile("wgmma.wait_group.sync.aligned 0;\n" ::: "memory"); }
[[maybe_unused]] __device__ __forceinline__ void fence_proxy_async() { asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory"); }

#define M3RT_WGMMA_M64N128K16(TYPE) \
  asm volatile( \
      "{\n.reg .pred p;\nsetp.ne.b32 p, %68, 0;\n" \
      "wgmma.mma_async.sync.aligned.m64n128k16.f32." TYPE "." TYPE " " \
      "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63}, " \
      "{%64, %65, %66, %67}, %69, p, 1, 1, 0;\n}\n" \
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), \
          "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), \
          "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), \
          "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]), \
          "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]), \
          "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]), \
          "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]), \
          "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63]) \
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(accumulate), "l"(desc));

template <bool kFp8>
__device__ __forceinline__ void wgmma_m64n128k16(float (&d)[64], const uint32_t (&a)[4], uint64_t desc) {
  constexpr int accumulate = 1;
  if constexpr (kFp8) {
    M3RT_WGMMA_M64N128K16("f16");
  } else {
    M3RT_WGMMA_M64N128K16("bf16");
  }
}

template <bool kFp8>
__global__ void __launch_bounds__(kSm90Threads, kSm90MinBlocks)
    indexer_prefill_score_sm90_kernel(const __grid_constant__ IndexerParams p, int tokens_per_tile, int chunks) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  extern __shared__ uint8_t smem_raw[];
  __shared__ bool page_ok[kSm90Stages];
  constexpr int kElemBytes = kFp8 ? 1 : 2;
  constexpr int kRawPageBytes = kPage * 128 * kElemBytes;
  uint8_t* smem = smem_raw + ((1024 - (static_cast<uint32_t>(__cvta_generic_to_shared(smem_raw)) & 1023)) & 1023);
  uint8_t* mma_page = smem + kSm90Stages * kRawPageBytes;  // e4m3: the page converted to f16
  const int b = blockIdx.y;
  const int chunk = int(blockIdx.x) % chunks, tile = int(blockIdx.x) / chunks;
  Request req;
  if (!load_request(p, b, req)) return;
  const int t_begin = tile * tokens_per_tile;
  if (t_begin >= req.q_len) return;
  const int t_end = min(req.q_len, t_begin + tokens_per_tile);
  const int H = p.num_heads;
  const int ctx = req.seq_len - req.q_len;
  const int lowest_pos = ctx + t_begin;
  const int j_begin = chunk * kSm90ChunkPages;
  const int j_end = min((ctx + t_end - 1) / kPage + 1, j_begin + kSm90ChunkPages);
  if (j_begin >= j_end) return;
  const int tid = threadIdx.x, lane = tid % 32, g = lane / 4, c = lane % 4;
  const int row_base = (tid / 128) * 64 + ((tid / 32) % 4) * 16;  // this warp's 16 rows
  const int32_t* table = p.block_table + int64_t(b) * p.block_table_stride;
  const char* cache = static_cast<const char*>(p.index_cache);

  // A fragments: a[s] = {(row g, k 2c..2c+1), (row g+8, ...), (row g, k 2c+8..), (row g+8, ...)}
  // of k-step s (dims 16 s ..), as bf16x2 or f16x2 words.
  uint32_t a[8][4];
  int row_pos[2];
#pragma unroll
  for (int hf = 0; hf < 2; ++hf) {
    const int r = row_base + hf * 8 + g;
    const int t = t_begin + r / H;
    const bool valid = r < tokens_per_tile * H && t < t_end;
    row_pos[hf] = valid ? ctx + t : -1;
    const char* q = static_cast<const char*>(p.index_q) + ((int64_t(req.q_begin) + t) * H + r % H) * 128 * kElemBytes;
#pragma unroll
    for (int s = 0; s < 8; ++s)
#pragma unroll
      for (int kh = 0; kh < 2; ++kh) {
        const int d = 16 * s + 2 * c + 8 * kh;
        uint32_t w = 0;
        if (valid) {
          if constexpr (kFp8)
            w = e4m3x2_to_f16x2(__ldg(reinterpret_cast<const uint16_t*>(q + d)));
          else
            w = __ldg(reinterpret_cast<const uint32_t*>(q + 2 * d));
        }
        a[s][hf + 2 * kh] = w;
      }
  }

  auto load_page = [&](int j, int stage) {
    const int page = table[j];
    const bool ok = page >= 0 && page < p.num_cache_blocks;
    if (tid == 0) page_ok[stage] = ok;
    if (ok) {
      const uint4* src = reinterpret_cast<const uint4*>(cache + int64_t(page) * kRawPageBytes);
      uint8_t* dst = smem + stage * kRawPageBytes;
      for (int idx = tid; idx < kRawPageBytes / 16; idx += kSm90Threads) {
        if constexpr (kFp8)
          cp_async_16(dst + idx * 16, src + idx);  // raw; converted when consumed
        else
          cp_async_16(dst + sw128_offset(idx / 16, idx % 16), src + idx);
      }
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
    if constexpr (kFp8) {
      __syncthreads();  // the raw page has landed everywhere; the f16 page is free
      if (page_ok[stage]) {
        const uint4* raw = reinterpret_cast<const uint4*>(smem + stage * kRawPageBytes);
        for (int idx = tid; idx < kRawPageBytes / 16; idx += kSm90Threads) {
          const int n = idx / 8, q = idx % 8;  // 16 e4m3 dims 16q .. 16q+15 of key n
          const uint4 v = raw[idx];
          const uint32_t comp[4] = {v.x, v.y, v.z, v.w};
          uint32_t w[8];
#pragma unroll
          for (int e = 0; e < 4; ++e) {
            w[2 * e] = e4m3x2_to_f16x2(comp[e] & 0xffffu);
            w[2 * e + 1] = e4m3x2_to_f16x2(comp[e] >> 16);
          }
          *reinterpret_cast<uint4*>(mma_page + sw128_offset(n, 2 * q)) = make_uint4(w[0], w[1], w[2], w[3]);
          *reinterpret_cast<uint4*>(mma_page + sw128_offset(n, 2 * q + 1)) = make_uint4(w[4], w[5], w[6], w[7]);
        }
      }
    }
    fence_proxy_async();  // this thread's shared-memory writes, visible to the tensor cores
    __syncthreads();
    // The stage read in the previous iteration is free: refill it.
    if (j + kSm90Stages - 1 < j_end)
      load_page(j + kSm90Stages - 1, (it + kSm90Stages - 1) % kSm90Stages);
    else
      cp_async_commit();
    float run[2] = {kNaN(), kNaN()};
    if (page_ok[stage]) {  // block-uniform
      const uint32_t base = static_cast<uint32_t>(__cvta_generic_to_shared(kFp8 ? mma_page : smem + stage * kRawPageBytes));
      float d[64];
#pragma unroll
      for (int i = 0; i < 64; ++i) d[i] = 0.f;
      wgmma_fence();
#pragma unroll
      for (int s = 0; s < 8; ++s) wgmma_m64n128k16<kFp8>(d, a[s], sw128_desc(base + (s / 4) * (kPage * 128) + (s % 4) * 32));
      wgmma_commit();
      wgmma_wait_all();
      // d[4i + e]: row g + 8 (e / 2), key 8 i + 2 c + (e % 2).
      const bool masked = j * kPage + kPage - 1 > lowest_pos;
#pragma unroll
      for (int i = 0; i < 16; ++i)
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          const int key_pos = j * kPage + 8 * i + 2 * c + (e & 1);
          run[e / 2] = fmaxf(run[e / 2], (!masked || key_pos <= row_pos[e / 2]) ? d[4 * i + e] : kNaN());
        }
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

// Prefill selection: one warp per (token, head) row.
constexpr int kSelectWarps = 8;

__global__ void __launch_bounds__(kSelectWarps * 32)
    indexer_prefill_select_kernel(const __grid_constant__ IndexerParams p) {
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
                  p.local_blocks, p.topk_out + t * p.topk_stride_t + int64_t(h) * p.topk);
}

bool g_force_portable_prefill = false;

bool device_is_sm90() {
  int dev = 0, major = 0;
  M3RT_CUDA_CHECK(cudaGetDevice(&dev));
  M3RT_CUDA_CHECK(cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, dev));
  return major == 9;
}

template <bool kFp8>
void launch_prefill_score(const IndexerParams& p, cudaStream_t stream) {
  // Hopper: the wgmma kernel; other GPUs: the portable mma.sync kernel.
  const bool sm90 = !g_force_portable_prefill && device_is_sm90();
  static bool configured[2] = {false, false};  // the smem opt-ins, once per process
  if (!configured[sm90]) {
    if (sm90)
      M3RT_CUDA_CHECK(cudaFuncSetAttribute(indexer_prefill_score_sm90_kernel<kFp8>,
                                           cudaFuncAttributeMaxDynamicSharedMemorySize, sm90_smem_bytes<kFp8>()));
    else
      M3RT_CUDA_CHECK(cudaFuncSetAttribute(indexer_prefill_score_kernel<kFp8>,
                                           cudaFuncAttributeMaxDynamicSharedMemorySize, prefill_smem_bytes<kFp8>()));
    configured[sm90] = true;
  }
  const int rows = sm90 ? kSm90Rows : kPrefillRows;
  const int chunk_pages = sm90 ? kSm90ChunkPages : kPrefillChunkPages;
  const int tokens_per_tile = rows / p.num_heads;
  const int64_t tiles = (p.max_query_len + tokens_per_tile - 1) / tokens_per_tile;
  const int chunks = (p.max_blocks + chunk_pages - 1) / chunk_pages;
  if (tiles == 0) return;
  const dim3 grid(unsigned(tiles * chunks), unsigned(p.num_seqs));
  if (sm90) {
    indexer_prefill_score_sm90_kernel<kFp8>
        <<<grid, kSm90Threads, sm90_smem_bytes<kFp8>(), stream>>>(p, tokens_per_tile, chunks);
    M3RT_LAUNCH_CHECK(stream, "indexer_prefill_score_sm90_kernel");
  } else {
    indexer_prefill_score_kernel<kFp8>
        <<<grid, kPrefillThreads, prefill_smem_bytes<kFp8>(), stream>>>(p, tokens_per_tile, chunks);
    M3RT_LAUNCH_CHECK(stream, "indexer_prefill_score_kernel");
  }
}

void require_grid_y(const IndexerParams& p) {
  if (p.num_seqs > int(kMaxGridY))
    throw_arg_error("lightning_indexer", "seq_lens.shape", "[" + std::to_string(p.num_seqs) + "]",
                    "at most 65535 requests per call on a GPU");
}

}  // namespace

void indexer_force_portable_prefill(bool on) { g_force_portable_prefill = on; }

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

void indexer_decode_launch(const IndexerParams& p, CUstream_st* stream) {
  require_grid_y(p);
  const int rows = p.decode_query_len * p.num_heads;
  const int groups = (rows + kDecodeRows - 1) / kDecodeRows;
  // One wave of CTAs over the batch, each CTA at least 4 pages (one per warp) of the widest table.
  const int resident = detail::multiprocessor_count() * kDecodeMinBlocks;
  const int by_wave = std::max(1, resident / std::max(1, p.num_seqs * groups));
  const int by_pages = std::max(1, (p.max_blocks + kDecodeWarps - 1) / kDecodeWarps);
  const int splits = std::min(by_wave, by_pages);
  const dim3 grid(unsigned(splits), unsigned(p.num_seqs), unsigned(groups));
  if (p.fp8)
    indexer_decode_kernel<true><<<grid, kDecodeThreads, 0, stream>>>(p, splits, groups);
  else
    indexer_decode_kernel<false><<<grid, kDecodeThreads, 0, stream>>>(p, splits, groups);
  M3RT_LAUNCH_CHECK(stream, "indexer_decode_kernel");
}

}  // namespace m3rt
