// msa_sparse_kernel: the general MSA kernel (prefill, verify, decode with dql > 1; the design is
// msa_attention.cu's top comment).
// Part of msa_attention.cu's translation unit (included there only: its names live in that
// file's unnamed namespace, so the kernels and helpers keep internal linkage).
#pragma once

#include "ops/msa_attention/msa_device.cuh"

namespace m3rt {
namespace {

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
  if (tid < gr.tokens) tok_range[tid] = token_range(p, gr, tid);
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
    uniq[slot] = union_entry(gr, tok_range, id, page, tokens);
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
  st.clear();

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

}  // namespace
}  // namespace m3rt
