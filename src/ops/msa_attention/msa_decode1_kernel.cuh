// msa_decode1_kernel and its mixed-grid and read-floor variants: MSA decode with one query token
// per request (decode_query_len 1).
// Part of msa_attention.cu's translation unit (included there only: its names live in that
// file's unnamed namespace, so the kernels and helpers keep internal linkage).
#pragma once

#include "ops/msa_attention/msa_device.cuh"

namespace m3rt {
namespace {

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
  st.clear();
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

}  // namespace
}  // namespace m3rt
