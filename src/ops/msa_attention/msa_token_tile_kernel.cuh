// msa_token_tile_kernel: the per-token tile for prefill and unsplit verify (one token's query
// heads a warp; only the tokens that selected a page compute on it).
// Part of msa_attention.cu's translation unit (included there only: its names live in that
// file's unnamed namespace, so the kernels and helpers keep internal linkage).
#pragma once

#include <climits>
#include <cstring>

#include "ops/msa_attention/msa_device.cuh"

namespace m3rt {
namespace {

// Prefill and unsplit verify at groups of 16 query heads: the per-token tile (README.md, "The
// per-token prefill tile"). A CTA serves a row group (up to 8 tokens of one request) and one KV
// head, as msa_sparse_kernel does, but every MMA row belongs to one token: warp w of kTtWarps
// serves token w. For each 64-key chunk its token selected it computes S^T = K Q^T (m16n8k16:
// M = the chunk's keys, N = the 16 heads), the online softmax over the keys inside the warp (the
// column max over its lanes; no other warp holds the token's scores), P^T into B fragments by
// movmatrix (the value and its residue, or P rounded once under p16) and O^T += V^T P^T. bf16 pages: K and V^T fragments by ldmatrix (.trans for V).
// e4m3 pages (f16 MMAs, as msa_sparse_kernel's): K's bytes by ldmatrix, four codes a register
// converted in place, so a k-step's dims run in the order 4c, 4c+1 | 4c+2, 4c+3 and the queries'
// B fragments follow it (one 8-byte load of f16 queries, scaled into f16's range per head by
// q_rows_to_f16); V^T's by ldmatrix.trans of byte pairs, bytes regrouped by a permute so that a
// thread's rows are dims 2g and 2g + 1: O^T's rows run in that order, which the output undoes.
// A producer warp streams the group's page union, the chunks some token sees, through the stages,
// completing on mbarriers: kTma, as the copy engine's 128-byte-swizzled boxes (keys past seq_len
// land too: in a request's last chunk the producer waits for the boxes, then bulk-copies zeros
// over those keys' V rows and the stage completes with them, so that no unwritten cache row
// reaches an MMA and the consumers carry no masks); else by cp.async into key rows (16-byte piece
// q of key row r at q ^ (r % 8); rows at or past seq_len zero-filled). Every consumer warp
// releases every stage, its token's chunk or not (an empty mbarrier of 8 x 32 arrivals: lane 0
// arrives for its warp, or every lane for itself before a zero copy; see the loop's end).
// Three warpgroups: two of consumers (a token a warp) and the producer's, whose warp kTtWarps
// streams and whose other three leave; past the prologue the producer's gives up registers
// (setmaxnreg, as msa_sparse_kernel's warp-specialized form) and the consumers' take them: 224
// a thread instead of the 168 that nine warps (three to a scheduler) allow (the e4m3 instance's
// highest register is R187, bf16's R202; the cp.async producer spilled at 40).
constexpr int kTtWarps = 8, kTtThreads = (kTtWarps + 4) * 32;
constexpr int kTtProducerRegs = 56, kTtConsumerRegs = 224;  // 128 x 56 + 256 x 224 <= 65536
// The prologue's registers: a thread's top-k ids (at most kTtWarps x kMsaMaxTopk in all) and the
// first kTtTableRegs table entries of its segment of the request's blocks (segments are longer
// past 1,536 blocks a request: the union loads the rest when it needs them).
constexpr int kTtIdRegs = (kTtWarps * kMsaMaxTopk + kTtThreads - 1) / kTtThreads, kTtTableRegs = 4;
// A chunk's worth of zero V rows (64 x 128 bytes), the source of a request's last chunk's rows past
// seq_len (the producer's bulk copies).
__device__ const uint4 kTtZeroRows[kChunkKeys * 8] = {};
// Stages: five 32-KiB bf16 chunks (160 KiB in flight; with topk 16 a sixth would leave no room to
// align the stages) or eleven 16-KiB e4m3 chunks (176 KiB: 215 KiB in all at topk 16; 1.004-1.012x
// over ten on the H200, session 37; topk 64 then fits up to ~469 blocks a request, past that the
// launcher keeps the wgmma tiles). Compile-time counts keep the ring arithmetic cheap.
__host__ __device__ constexpr int tt_stages(bool fp8) { return fp8 ? 11 : 5; }
__host__ __device__ constexpr int tt_chunk_bytes(bool fp8) { return kChunkKeys * cache_row_bytes(fp8); }

struct TtLayout {
  int uniq_off, order_off, key_off, qf_off, q_off, ring_off, total;
};
// From a 1024-aligned base (the launch adds 1024 bytes of slack): [0, 1024) the stages' mbarriers
// (full, empty), scan counts, token ranges; then the union (int4 {id, page, token mask half 0,
// half 1}) in id order, the same in token-balanced order (the stream's) and its sort keys, e4m3:
// the queries' per-row factors; the queries [token][head][256 bytes] and the
// stages, 1024-aligned (the ldmatrix addresses are formed by XOR within a row; the copy engine's
// 128-byte swizzle needs it). Before the loop the stage area holds the raw ids and the union's
// page bitmap. `total` counts the slack.
__host__ __device__ inline TtLayout tt_layout(bool fp8, int topk, int max_blocks) {
  TtLayout l{};
  const int n = kTtWarps * topk, u_cap = n < max_blocks ? n : max_blocks;
  l.uniq_off = 1024;
  l.order_off = l.uniq_off + u_cap * 16;  // the union in token-balanced order
  l.key_off = l.order_off + u_cap * 16;    // its sort keys, to a whole int4
  l.qf_off = l.key_off + (u_cap + 3) / 4 * 16;
  l.q_off = (l.qf_off + (fp8 ? kTtWarps * 16 * 4 : 0) + 1023) / 1024 * 1024;
  l.ring_off = l.q_off + kTtWarps * 16 * 256;
  l.total = l.ring_off + tt_stages(fp8) * tt_chunk_bytes(fp8) + 1024;
  return l;
}
// The raw ids and the bitmap fit the stage area.
__host__ __device__ inline bool tt_bitmap_fits(bool fp8, int topk, int max_blocks) {
  return int64_t(kTtWarps * topk * 4 + 15) / 16 * 16 + int64_t(max_blocks) * 4 <=
         int64_t(tt_stages(fp8)) * tt_chunk_bytes(fp8);
}

template <bool kFp8, bool kP16, bool kTma>
__global__ void __launch_bounds__(kTtThreads, 1)
    msa_token_tile_kernel(const __grid_constant__ MsaParams p, int) {
  kernels::grid_dependency_wait();
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  constexpr int G = 16, kStages = tt_stages(kFp8), kRow = cache_row_bytes(kFp8), kChunk = tt_chunk_bytes(kFp8);
  constexpr int kPieces = kRow / 16;  // 16-byte pieces a key row
  // A stage: kTma, the copy engine's boxes of 64 keys x 128 bytes (bf16: K dims 0-63, 64-127, V
  // 0-63, 64-127; e4m3: K, V), 16-byte piece q of key r's box row at q ^ (r % 8); else key rows of
  // kRow bytes, piece q at q ^ (r % 8). kRs: a key's stride within its box or row.
  constexpr int kRs = kTma ? 128 : kRow, kBox = kChunkKeys * 128;
  extern __shared__ __align__(128) char smem_raw[];
  char* smem = smem_raw + ((1024u - (smem_u32(smem_raw) & 1023u)) & 1023u);
  const int topk = p.topk_k;
  const TtLayout L = tt_layout(kFp8, topk, p.max_blocks);
  uint64_t* full = reinterpret_cast<uint64_t*>(smem);
  uint64_t* empty = full + kStages;
  uint64_t* land = empty + kStages;  // kTma: a request's last chunk lands here first (the producer's)
  int* misc = reinterpret_cast<int*>(smem + 256);  // [0, 12): warp counts, [15]: union size
  int4* tok_range = reinterpret_cast<int4*>(smem + 512);  // per token {lo, hi, nbv, -}
  int4* uniq = reinterpret_cast<int4*>(smem + L.uniq_off);
  char* q_s = smem + L.q_off;
  char* ring = smem + L.ring_off;
  const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32, kv_head = blockIdx.y;
  Group gr;
  if (!resolve_group(p, msa_group_tokens(G, p.decode_query_len), blockIdx.x, gr)) return;  // CTA-uniform
  // Queries (missing tokens zero), the top-k ids (a decode length alongside), the tokens' visible
  // ranges.
  for (int i = tid; i < kTtWarps * G * 16; i += kTtThreads) {
    const int row = i / 16, pc = i % 16;
    const bool live = row / G < gr.tokens;
    const int64_t t = gr.tok0 + (live ? row / G : 0);
    const uint16_t* src = p.q + t * p.q_stride_t + int64_t(kv_head * G + row % G) * p.q_stride_h + pc * 8;
    cp_async_16z(q_s + row * 256 + ((pc ^ (row & 7)) << 4), src, live ? 16 : 0);
  }
  cp_async_commit();
  // The decode length, the ids (into registers: a thread's at most kTtIdRegs) and the thread's
  // table entries all in flight at once: the length first, the ids, then (once the length is
  // known: prefill has it) the entries of the thread's segment of the visible blocks, which the
  // union uses after the bitmap (session 44's stamps: each of these had been a round trip after
  // the other).
  const int dec_len = p.cu_seqlens_q ? 0 : p.seq_lens[gr.b];
  const int n = gr.tokens * topk;
  int* raw = reinterpret_cast<int*>(ring);
  int idv[kTtIdRegs];
#pragma unroll
  for (int k = 0; k < kTtIdRegs; ++k) {
    const int e = tid + k * kTtThreads;
    if (e < n)
      idv[k] = p.topk[int64_t(kv_head) * p.topk_stride_h + (gr.tok0 + e / topk) * p.topk_stride_t +
                      int64_t(e % topk) * p.topk_stride_k];
  }
  if (!p.cu_seqlens_q && !decode_group_length(p, dec_len, gr)) {
    cp_async_wait<0>();  // nothing may land in a finished CTA's shared memory
    return;
  }
  const int nb_all = gr.seq_len > 0 ? (gr.seq_len + kPage - 1) / kPage : 0;
  const int32_t* table = p.block_table + int64_t(gr.b) * p.block_table_stride;
  const int seg = (nb_all + kTtThreads - 1) / kTtThreads, i0 = min(tid * seg, nb_all), i1 = min(i0 + seg, nb_all);
  int tv[kTtTableRegs];  // the segment's first entries (a segment longer than that loads the rest late)
#pragma unroll
  for (int k = 0; k < kTtTableRegs; ++k) tv[k] = i0 + k < i1 ? table[i0 + k] : -1;
  // f(i, table[i]) for each block i of the thread's segment, in order.
  auto for_segment = [&](auto&& f) {
#pragma unroll
    for (int k = 0; k < kTtTableRegs; ++k)
      if (i0 + k < i1) f(i0 + k, tv[k]);
    for (int i = i0 + kTtTableRegs; i < i1; ++i) f(i, table[i]);
  };
#pragma unroll
  for (int k = 0; k < kTtIdRegs; ++k) {
    const int e = tid + k * kTtThreads;
    if (e < n) raw[e] = idv[k];
  }
  if (tid < gr.tokens) tok_range[tid] = token_range(p, gr, tid);
  if (tid == 0) {
    for (int s = 0; s < kStages; ++s)
      kernels::mbar_init(&full[s], kTma ? 1 : 32), kernels::mbar_init(&empty[s], kTtWarps * 32);
    kernels::mbar_init(land, 1);
    kernels::fence_mbarrier_init();
  }
  uint32_t* sel = reinterpret_cast<uint32_t*>(ring + (n * 4 + 15) / 16 * 16);
  for (int i = tid; i < nb_all; i += kTtThreads) sel[i] = 0u;
  __syncthreads();
  // The union in id order with per-token masks (msa_sparse_kernel's bitmap path): every valid entry
  // ORs its token into its id's word; pages outside the cache are dropped; a block scan places the
  // nonzero words; per 64-key half, the tokens that selected the page and see some key of it.
  for (int e = tid; e < n; e += kTtThreads) {
    const int r = e / topk, id = raw[e];
    if (id >= 0 && id < tok_range[r].z) atomicOr(&sel[id], 1u << r);
  }
  __syncthreads();
  int mine = 0;
  for_segment([&](int i, int page) {
    if (sel[i] != 0u) {
      if (page >= 0 && page < p.num_cache_blocks) ++mine;
      else sel[i] = 0u;
    }
  });
  int incl = mine;
#pragma unroll
  for (int o = 1; o < 32; o <<= 1) {
    const int v = __shfl_up_sync(kFull, incl, o);
    if (lane >= o) incl += v;
  }
  if (lane == 31) misc[warp] = incl;
  cp_async_wait<0>();
  __syncthreads();
  int base = incl - mine;
  for (int w = 0; w < warp; ++w) base += misc[w];
  if (tid == kTtThreads - 1) misc[15] = base + mine;
  for_segment([&](int i, int page) {
    if (sel[i] != 0u) uniq[base++] = union_entry(gr, tok_range, i, page, sel[i]);
  });
  // kTma: this thread's accesses to the stage area (the raw ids, the bitmap) ordered before the
  // copy engine's writes there (another proxy), as msa_sparse_kernel's prologue does.
  if constexpr (kTma) kernels::fence_proxy_async();
  __syncthreads();  // the union; the stage area free for the copies
  const int U = misc[15];
  const char* cache = static_cast<const char*>(p.cache);
  // The union in token-balanced order: each page keyed by (its rank in the list of the lowest token
  // that selected it, that token), so the stream hands the tokens their pages in turn and the
  // ring's window of ~5 pages holds work for as many warps as it can (in id order, a window's
  // pages fall on a few tokens while the other warps wait).
  int4* order = reinterpret_cast<int4*>(smem + L.order_off);
  {
    int* key = reinterpret_cast<int*>(smem + L.key_off);
    if (warp < gr.tokens) {
      int run = 0;
      for (int e0 = 0; e0 < U; e0 += 32) {
        const int e = e0 + lane;
        const int4 v = e < U ? uniq[e] : make_int4(0, 0, 0, 0);
        const uint32_t msk = uint32_t(v.z | v.w), bits = __ballot_sync(kFull, (msk >> warp) & 1u);
        const int rank = run + __popc(bits & ((1u << lane) - 1u));
        run += __popc(bits);
        if (e < U && msk != 0u && __ffs(int(msk)) - 1 == warp) key[e] = (rank * 32 + warp) * 1024 + e;
        if (e < U && msk == 0u && warp == 0) key[e] = (1 << 30) + e;
      }
    }
    if (tid < (4 - U % 4) % 4) key[U + tid] = INT_MAX;  // to a whole int4: above every key
    __syncthreads();
    const int4* key4 = reinterpret_cast<const int4*>(key);
    for (int e = tid; e < U; e += kTtThreads) {
      const int k = key[e];
      int pos = 0;
#pragma unroll 4
      for (int j = 0; j < (U + 3) / 4; ++j) {
        const int4 v = key4[j];
        pos += int(v.x < k) + int(v.y < k) + int(v.z < k) + int(v.w < k);
      }
      order[pos] = uniq[e];
    }
    __syncthreads();
  }

  if (warp >= kTtWarps) {  // the producer: piece lane % kPieces of rows lane / kPieces + 32 / kPieces * i
    kernels::setmaxnreg_dec<kTtProducerRegs>();
    if (warp > kTtWarps) return;
    constexpr int kRowsALane = kChunkKeys * kPieces / 32;
    const int pc = lane % kPieces, r0 = lane / kPieces;
    uint32_t land_phase = 0;
    for (int c = 0, used = 0; c < 2 * U; ++c) {
      const int4 e = order[c >> 1];
      if ((c & 1 ? e.w : e.z) == 0) continue;
      const int s = used % kStages;
      if (used >= kStages) kernels::mbar_wait(&empty[s], uint32_t(used / kStages - 1) & 1u);
      char* dst = ring + s * kChunk;
      if constexpr (kTma) {
        const int vis = gr.seq_len - (e.x * kPage + (c & 1) * kChunkKeys);  // keys before seq_len (>= 1)
        if (vis >= kChunkKeys) {
          if (lane == 0)
            tma_chunk_boxes<kFp8>(dst, p.cache_map, (c & 1) * kChunkKeys, kv_head, e.y, uint32_t(kChunk), &full[s]);
        } else {
          // A request's last chunk: its rows past seq_len (unwritten cache, NaN in the tests) land
          // too. Their V rows (each 128 bytes of a V box, whatever the swizzle) are zeroed before
          // the stage is marked full: a weight of 0 times NaN is not 0. Their K rows' scores are
          // masked. Once a group at most.
          if (lane == 0)
            tma_chunk_boxes<kFp8>(dst, p.cache_map, (c & 1) * kChunkKeys, kv_head, e.y, uint32_t(kChunk), land);
          kernels::mbar_wait(land, land_phase);
          land_phase ^= 1u;
          // The zeros come by bulk copy from a zero buffer (the rows past seq_len are contiguous in
          // a box), through the async proxy like the boxes: no generic store to the stages, so no
          // proxy fence, and the stage's full barrier completes when they land.
          constexpr int kVBox0 = kFp8 ? 1 : 2, kVBoxes = kFp8 ? 1 : 2;
          const uint32_t bytes = uint32_t(kChunkKeys - vis) * 128u;  // a V box's rows past seq_len
          if (lane == 0) {
            kernels::mbar_arrive_expect_tx(&full[s], kVBoxes * bytes);
            for (int b = 0; b < kVBoxes; ++b)
              kernels::bulk_copy_to_shared(dst + (kVBox0 + b) * kBox + vis * 128, kTtZeroRows, bytes, &full[s]);
          }
        }
      } else {
        const int64_t key0 = int64_t(e.x) * kPage + (c & 1) * kChunkKeys;
        const char* src =
            cache + ((int64_t(e.y) * p.num_kv_heads + kv_head) * kPage + (c & 1) * kChunkKeys) * kRow + pc * 16;
#pragma unroll 8
        for (int i = 0; i < kRowsALane; ++i) {
          const int r = r0 + i * (32 / kPieces);
          cp_async_16z(dst + r * kRow + ((pc ^ (r & 7)) << 4), src + r * kRow, key0 + r < gr.seq_len ? 16 : 0);
        }
        asm volatile("cp.async.mbarrier.arrive.noinc.shared::cta.b64 [%0];\n" ::"r"(smem_u32(&full[s])) : "memory");
      }
      ++used;
    }
    if constexpr (!kTma) cp_async_wait<0>();
    return;
  }
  kernels::setmaxnreg_inc<kTtConsumerRegs>();
  // e4m3: the warp's token's queries as f16, each head row scaled into f16's range (its factor in
  // qf), converted by the warp itself while the producer's first copies are in flight.
  float* qf = reinterpret_cast<float*>(smem + L.qf_off);
  if constexpr (kFp8) {
    q_rows_to_f16<32, true>(q_s + warp * G * 256, qf + warp * G, G, lane);
    __syncwarp();
  }

  // Consumer warp: token tok0 + warp. O^T fragments [dim tile 8][head tile 2][4] (P's value and
  // residue MMAs accumulate into the same fragments); running max (log2 units) and partial sums of
  // the thread's 4 heads (head tile nt, column e: head 8 nt + 2 (lane % 4) + e).
  const int4 range = tok_range[warp < gr.tokens ? warp : 0];
  const int g = lane / 4, cq = lane % 4;
  // The softmax scale in log2 units of each of the thread's heads (e4m3: with k_scale and the
  // queries' f16 factors). It multiplies a chunk's column max and enters the weights' FMA, which is
  // right for a scale > 0 (masked keys stay -inf). A k_scale <= 0 or NaN, read on the device (the
  // reference defines the results: 0 gives every visible key the same weight), takes the general
  // kernel's order instead: the scores scaled before the mask and the max (scale_first, uniform
  // over the CTA), and 1 here.
  auto true_scale = [&](int nt, int e, float k_scale) {
    return p.softmax_scale * k_scale * kLog2e * (kFp8 ? qf[warp * G + nt * 8 + 2 * cq + e] : 1.f);
  };
  const bool scale_first = kFp8 && !(*p.k_scale > 0.f);
  float col_scale[2][2];
#pragma unroll
  for (int nt = 0; nt < 2; ++nt)
#pragma unroll
    for (int e = 0; e < 2; ++e) col_scale[nt][e] = scale_first ? 1.f : true_scale(nt, e, kFp8 ? *p.k_scale : 1.f);
  float o[8][2][4];
  float m[2][2], l[2][2];
#pragma unroll
  for (int i = 0; i < 8; ++i)
#pragma unroll
    for (int j = 0; j < 2; ++j) o[i][j][0] = o[i][j][1] = o[i][j][2] = o[i][j][3] = 0.f;
  m[0][0] = m[0][1] = m[1][0] = m[1][1] = -FLT_MAX;  // finite: see the running max below
  l[0][0] = l[0][1] = l[1][0] = l[1][1] = 0.f;
  // Shared-memory addresses as a lane base XOR a step constant: a lane's ldmatrix rows all have
  // row % 8 = lane % 8 = x, so piece (2 j + b) ^ x = 2 j ^ (b ^ x) for b < 2, and a row's base has
  // its low 8 (e4m3: 7) bits clear. Bases relative to a stage (K, V) or absolute (Q).
  const int mi = lane / 8, x = lane % 8;
  uint32_t k_lane, v_lane, q_lane;
  if constexpr (kFp8) {
    // K: matrices keys mi * 8 + x (+32), piece j; V^T (.trans): keys (mi & 1) * 8 + x, piece
    // 8 + mt + (mi >> 1) for even mt; Q (8-byte loads): head row g (+8), dims 4 cq + 16 j.
    k_lane = uint32_t((mi * 8 + x) * kRs + (x << 4));
    v_lane = uint32_t((kTma ? kBox : 128) + ((mi & 1) * 8 + x) * kRs + (((mi >> 1) ^ x) << 4));
    q_lane = uint32_t((warp * G + g) * 256 + (((cq >> 1) ^ (g & 7)) << 4) + (cq & 1) * 8);  // from q_s
  } else {
    // K: keys (mi & 1) * 8 + x of a 16-key tile, piece 2 ks + (mi >> 1); V^T (.trans): keys
    // (mi >> 1) * 8 + x of a 16-key step, piece 16 + 2 mt + (mi & 1); Q: heads (mi >> 1) * 8 + x,
    // piece 2 ks + (mi & 1).
    k_lane = uint32_t(((mi & 1) * 8 + x) * kRs + (((mi >> 1) ^ x) << 4));
    v_lane = uint32_t((kTma ? 2 * kBox : 256) + ((mi >> 1) * 8 + x) * kRs + (((mi & 1) ^ x) << 4));
    q_lane = smem_u32(q_s) + uint32_t((warp * G + (mi >> 1) * 8 + x) * 256 + (((mi & 1) ^ x) << 4));
  }

  // kTma: the use (the count of nonempty chunks before it) of the request's last chunk if its
  // rows past seq_len get zeros (seq_len % 64 != 0 and some token sees the chunk), else -1. Every
  // release of that chunk's stage before it is made by all 32 lanes (an arrival each), the others
  // by lane 0 for the warp after __syncwarp (32 at once): the same order (cumulativity), but
  // compute-sanitizer's racecheck follows only the first to the zero copy (session 40: the lane-0
  // form reported the copy against the stage's earlier ldmatrix reads).
  int tail_use = -1;
  if (kTma && gr.seq_len % kChunkKeys != 0) {
    const int tail_id = (gr.seq_len - 1) / kPage, tail_half = (gr.seq_len - 1) % kPage / kChunkKeys;
    for (int e0 = 0, before = 0; e0 < U; e0 += 32) {
      const int4 v = e0 + lane < U ? order[e0 + lane] : make_int4(-1, 0, 0, 0);
      const uint32_t at = __ballot_sync(kFull, v.x == tail_id), nz0 = __ballot_sync(kFull, v.z != 0),
                     nz1 = __ballot_sync(kFull, v.w != 0);
      if (at == 0u) {
        before += __popc(nz0) + __popc(nz1);
        continue;
      }
      const int j = __ffs(int(at)) - 1;
      const uint32_t below = (1u << j) - 1u;
      if (((tail_half ? nz1 : nz0) >> j) & 1u)
        tail_use = before + __popc(nz0 & below) + __popc(nz1 & below) + (tail_half ? int(nz0 >> j & 1u) : 0);
      break;
    }
  }
  // A release of use r by every lane is one of the tail's stage before the tail: r < tail_use and
  // r % kStages == tail_use % kStages (tail_stage; -1 when there is no such use).
  const int tail_stage = tail_use >= 0 ? tail_use % kStages : -1;

  // The stage and its phase advance with each nonempty chunk (no division by kStages a use).
  int s = 0;
  uint32_t phase = 0;
  for (int c = 0, used = 0; c < 2 * U; ++c) {
    const int4 e = order[c >> 1];
    const uint32_t tokens = uint32_t(c & 1 ? e.w : e.z);
    if (tokens == 0) continue;
    kernels::mbar_wait(&full[s], phase);
    ++used;
    if (tokens >> warp & 1) {
      const int key0 = e.x * kPage + (c & 1) * kChunkKeys;
      const uint32_t st = smem_u32(ring + s * kChunk);
      // The query base laundered each chunk, so that ptxas forms the eight k-steps' query addresses
      // from it here instead of holding them across the loop in registers it lacks (session 35: the
      // masked loop's e4m3 instance spilled 4 bytes, its cp.async form 36; with this 0 and 24).
      // The spill has moved with every change since (README: none in the e4m3 instance now).
      uint32_t q_base = q_lane;
      asm volatile("" : "+r"(q_base));
      // S^T = K Q^T: [4 key tiles][2 head tiles][4].
      float sc[4][2][4];
#pragma unroll
      for (int i = 0; i < 4; ++i)
#pragma unroll
        for (int j = 0; j < 2; ++j) sc[i][j][0] = sc[i][j][1] = sc[i][j][2] = sc[i][j][3] = 0.f;
#pragma unroll
      for (int ks = 0; ks < 8; ++ks) {
        uint32_t qb[2][2];  // [head tile][k halves]
        if constexpr (kFp8) {
          const char* qa = q_s + (q_base ^ uint32_t(ks << 5));
          const uint2 q0 = lds64(qa), q1 = lds64(qa + 8 * 256);
          qb[0][0] = q0.x, qb[0][1] = q0.y, qb[1][0] = q1.x, qb[1][1] = q1.y;
#pragma unroll
          for (int half = 0; half < 2; ++half) {  // keys 32 half + (0-7, 8-15, 16-23, 24-31)
            uint32_t r[4];
            kernels::ldsm_x4((st + k_lane + half * 32 * kRs) ^ uint32_t(ks << 4), r[0], r[1], r[2], r[3]);
#pragma unroll
            for (int t2 = 0; t2 < 2; ++t2) {
              uint32_t a0, a1, a2, a3;
              e4m3x4_to_f16x2x2(r[2 * t2], a0, a2);
              e4m3x4_to_f16x2x2(r[2 * t2 + 1], a1, a3);
              mma_16816<true>(sc[half * 2 + t2][0], a0, a1, a2, a3, qb[0][0], qb[0][1]);
              mma_16816<true>(sc[half * 2 + t2][1], a0, a1, a2, a3, qb[1][0], qb[1][1]);
            }
          }
        } else {
          kernels::ldsm_x4(q_lane ^ uint32_t(ks << 5), qb[0][0], qb[0][1], qb[1][0], qb[1][1]);
          // kTma: pieces 2 ks, 2 ks + 1 lie in box ks / 4 at pieces 2 (ks % 4) (+1).
          const uint32_t ka = kTma ? ((st + k_lane) ^ uint32_t((ks & 3) << 5)) + (ks >> 2) * kBox
                                   : (st + k_lane) ^ uint32_t(ks << 5);
#pragma unroll
          for (int mt = 0; mt < 4; ++mt) {
            uint32_t a0, a1, a2, a3;
            kernels::ldsm_x4(ka + mt * 16 * kRs, a0, a1, a2, a3);
            mma_16816<false>(sc[mt][0], a0, a1, a2, a3, qb[0][0], qb[0][1]);
            mma_16816<false>(sc[mt][1], a0, a1, a2, a3, qb[1][0], qb[1][1]);
          }
        }
      }
      if (kFp8 && scale_first) {
        const float k_scale = *p.k_scale;
#pragma unroll
        for (int nt = 0; nt < 2; ++nt)
#pragma unroll
          for (int e = 0; e < 2; ++e) {
            const float cs = true_scale(nt, e, k_scale);
#pragma unroll
            for (int mt = 0; mt < 4; ++mt) sc[mt][nt][e] *= cs, sc[mt][nt][2 + e] *= cs;
          }
      }
      // Keys outside the token's [lo, hi) masked; the column (head) max of the chunk, taken before
      // the scale (> 0; 1 under scale_first) as the weights' FMA applies it.
      if (key0 < range.x || key0 + kChunkKeys > range.y) {
#pragma unroll
        for (int mt = 0; mt < 4; ++mt)
#pragma unroll
          for (int r = 0; r < 4; ++r) {
            const int key = key0 + mt * 16 + g + (r >= 2 ? 8 : 0);
            if (key < range.x || key >= range.y) sc[mt][0][r] = sc[mt][1][r] = -INFINITY;
          }
      }
      float mx[2][2] = {{-INFINITY, -INFINITY}, {-INFINITY, -INFINITY}};
#pragma unroll
      for (int mt = 0; mt < 4; ++mt)
#pragma unroll
        for (int nt = 0; nt < 2; ++nt)
#pragma unroll
          for (int r = 0; r < 4; ++r) mx[nt][r & 1] = fmaxf(mx[nt][r & 1], sc[mt][nt][r]);
      // A 16-key step's weights (this lane's 8, with the running max as it stands) and P^T's B
      // fragments: the S^T accumulator block (keys g (+ 8), heads 2 cq + e) transposed by movmatrix
      // gives keys 2 cq + e, head g: the B layout. Step 0's are made before the vote below, off
      // the chain that leads to the first P V MMA (a chunk that moves the max makes them again).
      auto weights = [&](int ks, float (&pv)[2][4], uint32_t (&pb)[2][2][2]) {
#pragma unroll
        for (int nt = 0; nt < 2; ++nt) {
#pragma unroll
          for (int r = 0; r < 4; ++r) pv[nt][r] = exp2_ftz(fmaf(sc[ks][nt][r], col_scale[nt][r & 1], -m[nt][r & 1]));
          if constexpr (kP16) {
            uint32_t h0, h1;
            if constexpr (kFp8) {
              const __half2 v0 = __floats2half2_rn(pv[nt][0], pv[nt][1]), v1 = __floats2half2_rn(pv[nt][2], pv[nt][3]);
              h0 = *reinterpret_cast<const uint32_t*>(&v0), h1 = *reinterpret_cast<const uint32_t*>(&v1);
            } else {
              h0 = kernels::bf16x2_bits(pv[nt][0], pv[nt][1]), h1 = kernels::bf16x2_bits(pv[nt][2], pv[nt][3]);
            }
            pb[0][nt][0] = kernels::movmatrix_trans(h0), pb[0][nt][1] = kernels::movmatrix_trans(h1);
          } else {
            uint32_t h0, l0, h1, l1;
            split2<kFp8>(pv[nt][0], pv[nt][1], h0, l0);
            split2<kFp8>(pv[nt][2], pv[nt][3], h1, l1);
            pb[0][nt][0] = kernels::movmatrix_trans(h0), pb[0][nt][1] = kernels::movmatrix_trans(h1);
            pb[1][nt][0] = kernels::movmatrix_trans(l0), pb[1][nt][1] = kernels::movmatrix_trans(l1);
          }
        }
      };
      float pv0[2][4];
      uint32_t pb0[2][2][2];
      weights(0, pv0, pb0);
      // The running max moves only when the chunk passes it by more than kLazyMax (advance_max's
      // rule: weights stay <= 2^kLazyMax and O is rarely rescaled). The chunk has a key the token
      // sees (the union's masks), so a head's first chunk with a finite score moves it off its
      // start, -FLT_MAX (alpha = 0). A chunk whose every visible score is -inf (infinite inputs,
      // an overflowing dot) leaves it there, and its weights come out exp2(-inf + FLT_MAX) = 0 (a
      // start of -inf would give NaN: advance_max's m_sub in the general kernel).
      // A column moves iff some lane's part of it does (x -> x * scale is monotone for the scale
      // > 0), so the common chunk, where none moves, needs one vote and no column reduction; a
      // chunk where one does takes the reduction, the new maxima and the rescale as before (the same
      // bits either way: alpha would be 1 in every column that does not move).
      bool over = false;
#pragma unroll
      for (int nt = 0; nt < 2; ++nt)
#pragma unroll
        for (int c2 = 0; c2 < 2; ++c2) over |= mx[nt][c2] * col_scale[nt][c2] > m[nt][c2] + kLazyMax;
      if (__any_sync(kFull, over)) {
        float alpha[2][2];
#pragma unroll
        for (int nt = 0; nt < 2; ++nt)
#pragma unroll
          for (int c2 = 0; c2 < 2; ++c2) {
            const float v =
                kernels::reduce_accumulator_column(mx[nt][c2], [](float x, float y) { return fmaxf(x, y); }) *
                col_scale[nt][c2];
            const bool move = v > m[nt][c2] + kLazyMax;
            alpha[nt][c2] = move ? exp2_ftz(m[nt][c2] - v) : 1.f;
            m[nt][c2] = move ? v : m[nt][c2];
            l[nt][c2] *= alpha[nt][c2];
          }
#pragma unroll
        for (int i = 0; i < 8; ++i)
#pragma unroll
          for (int j = 0; j < 2; ++j) {
            o[i][j][0] *= alpha[j][0], o[i][j][1] *= alpha[j][1];
            o[i][j][2] *= alpha[j][0], o[i][j][3] *= alpha[j][1];
          }
        weights(0, pv0, pb0);
      }
      // O^T += V^T P^T, 16 keys a step.
#pragma unroll
      for (int ks = 0; ks < 4; ++ks) {
        float pv[2][4];
        uint32_t pb[2][2][2];  // [value, residue][head tile][keys +0-7, +8-15]
        if (ks == 0) {  // step 0's, made before the vote
          std::memcpy(pv, pv0, sizeof pv);
          std::memcpy(pb, pb0, sizeof pb);
        } else {
          weights(ks, pv, pb);
        }
#pragma unroll
        for (int nt = 0; nt < 2; ++nt)
#pragma unroll
          for (int r = 0; r < 4; ++r) l[nt][r & 1] += pv[nt][r];
        auto pv_mma = [&](int mt, uint32_t a0, uint32_t a1, uint32_t a2, uint32_t a3) {
          mma_16816<kFp8>(o[mt][0], a0, a1, a2, a3, pb[0][0][0], pb[0][0][1]);
          mma_16816<kFp8>(o[mt][1], a0, a1, a2, a3, pb[0][1][0], pb[0][1][1]);
          if constexpr (!kP16) {
            mma_16816<kFp8>(o[mt][0], a0, a1, a2, a3, pb[1][0][0], pb[1][0][1]);
            mma_16816<kFp8>(o[mt][1], a0, a1, a2, a3, pb[1][1][0], pb[1][1][1]);
          }
        };
        if constexpr (kFp8) {
          // V^T (.trans byte pairs): a register holds (key 2 cq: dims 2g, 2g+1 | key 2 cq + 1: the
          // same dims); the permute makes (dim 2g: both keys | dim 2g + 1: both keys), converted to
          // the A fragment's rows g (dim 2g) and g + 8 (dim 2g + 1).
          const uint32_t va = st + v_lane + ks * 16 * kRs;
#pragma unroll
          for (int mt = 0; mt < 8; mt += 2) {
            uint32_t r[4];  // (keys +0-7, dims of mt), (+8-15, mt), (+0-7, mt + 1), (+8-15, mt + 1)
            kernels::ldsm_x4_trans(va ^ uint32_t(mt << 4), r[0], r[1], r[2], r[3]);
#pragma unroll
            for (int t2 = 0; t2 < 2; ++t2) {
              uint32_t a0, a1, a2, a3;
              e4m3x4_to_f16x2x2(__byte_perm(r[2 * t2], 0, 0x3120), a0, a1);
              e4m3x4_to_f16x2x2(__byte_perm(r[2 * t2 + 1], 0, 0x3120), a2, a3);
              pv_mma(mt + t2, a0, a1, a2, a3);
            }
          }
        } else {
          const uint32_t va = st + v_lane + ks * 16 * kRs;
#pragma unroll
          for (int mt = 0; mt < 8; ++mt) {
            // (keys +0-7, dims +0), (+0-7, +8), (+8-15, +0), (+8-15, +8); kTma: box 2 + mt / 4
            uint32_t a0, a1, a2, a3;
            kernels::ldsm_x4_trans(kTma ? (va ^ uint32_t((mt & 3) << 5)) + (mt >> 2) * kBox : va ^ uint32_t(mt << 5), a0,
                                   a1, a2, a3);
            pv_mma(mt, a0, a1, a2, a3);
          }
        }
      }
    }
    __syncwarp();
    const bool each = used <= tail_use && s == tail_stage;  // this release ends use used - 1
    if (each || lane == 0) kernels::mbar_arrive(&empty[s], each ? 1u : 32u);
    if (++s == kStages) s = 0, phase ^= 1u;
  }
  if (warp >= gr.tokens) return;
  // Output: l over the warp's lanes of a head; O = (O^T)^T / l; a row without keys writes 0 (LSE
  // -inf). bf16: through movmatrix (O^T's block at dims 16 mt + 8 half + g, heads 8 nt + 2 cq + e
  // becomes head 8 nt + g, dims 16 mt + 8 half + 2 cq + e); e4m3: a thread's O^T rows are dims
  // 16 mt + 2 g and + 1 already, so (c0, c2) and (c1, c3) are two heads' dim pairs.
  const int64_t t = gr.tok0 + warp;
  const float v_scale = kFp8 ? *p.v_scale : 1.f;
  float inv[2][2];
#pragma unroll
  for (int nt = 0; nt < 2; ++nt)
#pragma unroll
    for (int c2 = 0; c2 < 2; ++c2) {
      const float v = kernels::reduce_accumulator_column(l[nt][c2], [](float x, float y) { return x + y; });
      l[nt][c2] = v;
      inv[nt][c2] = row_out_scale(v, v_scale);
      if (p.lse && lane < 4) p.lse[t * p.lse_stride_t + kv_head * G + nt * 8 + 2 * lane + c2] = row_lse(m[nt][c2], v);
    }
  uint16_t* out = p.out + t * p.out_stride_t + int64_t(kv_head * G) * p.out_stride_h;
  auto scaled = [&](int nt, int c2, float x) { return l[nt][c2] == 0.f ? 0.f : x * inv[nt][c2]; };
#pragma unroll
  for (int mt = 0; mt < 8; ++mt)
#pragma unroll
    for (int nt = 0; nt < 2; ++nt) {
      if constexpr (kFp8) {
#pragma unroll
        for (int c2 = 0; c2 < 2; ++c2)
          *reinterpret_cast<uint32_t*>(out + int64_t(nt * 8 + 2 * cq + c2) * p.out_stride_h + mt * 16 + 2 * g) =
              kernels::bf16x2_bits(scaled(nt, c2, o[mt][nt][c2]), scaled(nt, c2, o[mt][nt][2 + c2]));
      } else {
#pragma unroll
        for (int half = 0; half < 2; ++half) {
          const uint32_t y = kernels::movmatrix_trans(
              kernels::bf16x2_bits(scaled(nt, 0, o[mt][nt][2 * half]), scaled(nt, 1, o[mt][nt][2 * half + 1])));
          *reinterpret_cast<uint32_t*>(out + int64_t(nt * 8 + g) * p.out_stride_h + mt * 16 + half * 8 + 2 * cq) = y;
        }
      }
    }
#endif
}

}  // namespace
}  // namespace m3rt
