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
// Files (one translation unit): msa_device.cuh (the pieces the kernels share), msa_sparse_kernel.cuh
// (the kernel above), msa_decode1_kernel.cuh (dql-1 decode), msa_token_tile_kernel.cuh (the
// per-token tile: prefill and unsplit verify), and this file: the launch choices (instance, stages,
// splits, clusters, copy engine) and the entry points.
// Reference: msa_attention_ref.cpp; checks: check_msa_attention.cpp, tests/test_gpu.cu; bench:
// bench_msa_attention.cu; design and numbers: README.md.
#include <cuda.h>

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <initializer_list>
#include <mutex>
#include <string>
#include <vector>

#include "core/cuda_check.h"
#include "m3rt/error.h"
#include "ops/msa_attention/msa_sparse_kernel.cuh"
#include "ops/msa_attention/msa_decode1_kernel.cuh"
#include "ops/msa_attention/msa_token_tile_kernel.cuh"

namespace m3rt {
namespace {

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

// One launch of an MSA kernel (kernels::launch_kernel): as clusters of cluster_z CTAs along z and /
// or as a programmatic dependent, else a plain launch.
void launch_msa(KernelFn fn, dim3 grid, unsigned threads, int smem, unsigned cluster_z, bool pdl, const MsaParams& p,
                int stages, CUstream_st* stream, const char* name) {
  kernels::launch_kernel(fn, grid, threads, size_t(smem), cluster_z, pdl, stream, name, p, stages);
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
  const detail::DeviceLimits dl = detail::device_limits();
  const int64_t sms = dl.sms;
  const int64_t quarters = d1 ? (fp8 ? 9 : 6) : 0;  // the d1 target in quarter CTAs an SM
  int64_t splits = std::clamp<int64_t>(d1 ? (quarters * sms + 2 * pairs) / (4 * pairs) : sms / pairs, 1, cap);
  // bf16 pages: once the pairs alone give (almost) every SM a CTA, one split (no merge) beats
  // filling the second slot (H200, batch 32 = 128 pairs on 132 SMs: 39.2-39.5 us at 1 split
  // against 41.6-41.8 at the rule's 2, three runs; batch 24 keeps 2 splits: 34.8-35.4 against
  // 38.3-38.4). e4m3 keeps the rule: one 4-warp e4m3 CTA per SM does not hide its conversions
  // (batch 32 at 1 split 36.1-36.2 us against 30.4-30.7 at 2; batch 48, session 9: 46.4 against
  // 38.1); two 4-warp groups a CTA do (below).
  if (d1 && !fp8 && 20 * pairs >= 19 * sms) splits = 1;
  // bf16 on a GPU with less DRAM bandwidth an SM than the H200 (DeviceLimits::lean_dram_per_sm:
  // the H100 SXM's 25 GB/s, not the H200's 36): at most one CTA an SM, in a
  // power-of-two cluster (msa_decode1_bf16_lean_splits). H100 80GB HBM3, 32K, every batch 1..64
  // against splits 1..16 (session 49, two rounds, bench/results/h100-s49-d1-split-sweep.txt):
  // within 2% of the best count at every batch, against up to 1.10x slower under the rule above
  // (batch 3-6 1.06x, 20-24 1.10x: one split is already DRAM-bound there, so a second adds only its
  // merge). The H200 keeps the rule above: the same sweep there (h200-s49-d1-split-sweep.txt) puts
  // it within 2.6% of the best at every batch, and this one up to 1.21x off (batch 10).
  if (d1 && !fp8 && dl.lean_dram_per_sm())
    splits = msa_decode1_bf16_lean_splits(pairs, int(cap), int(sms));
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

// The per-token tile (msa_token_tile_kernel) serves prefill and unsplit decode with dql >= 8
// (verify), bf16 and e4m3 pages, at 16 query heads a KV head on the Hopper paths, where its shared
// memory fits the opt-in limit and the request's block bitmap the stage area. M3 shapes, against
// the 64-row (verify: 128-row) wgmma tile in the same call: e4m3 prefill 8K 1.19x, 32K 1.58x, 32K
// shared8 1.08x, verify B32 1.02x (H200, session 35; the ordered union since: 8K 1.22x, verify
// 1.05x); bf16 pages, once 0.98x / 1.05x / 0.90x / 0.88x (H200, session 35, so they kept the wgmma
// tiles until session 42), since the three warpgroups (session 41) prefill 8K 1.20x, 32K 1.42x,
// shared2 1.14x / 1.28x, shared8 1.04x / 1.07x, verify B32 1.04x (p16 1.00x) (H100, session 42);
// verify B32 on the H200 1.07-1.11x over five seeds' lists and the full bench's (session 44; the
// H100's full-bench lists alone gave 0.90-0.91x, session 43).
// M3RT_MSA_TOKEN_TILE=0: never (the wgmma tiles; benchmarks, checks); =2: also unsplit decode
// from dql 2 (benchmarks, tests). Returns the tile's dynamic shared memory, 0 where it does not run.
int token_tile_smem(const MsaParams& p) {
  if (p.num_heads != 16 * p.num_kv_heads || p.num_splits > 1 || p.mixed_whole > 0 ||
      msa_group_tokens(16, 0) != kTtWarps || !kernels::hopper_paths_run())
    return 0;
  const int mode = env_int("M3RT_MSA_TOKEN_TILE", -1);
  if (mode == 0 || (!p.cu_seqlens_q && p.decode_query_len < (mode >= 2 ? 2 : 8)))
    return 0;
  const int smem = tt_layout(p.fp8, p.topk_k, p.max_blocks).total;
  return smem <= detail::device_limits().smem_optin && tt_bitmap_fits(p.fp8, p.topk_k, p.max_blocks) ? smem : 0;
}
// The token tile's instance: e4m3 or bf16 pages, P rounded once or not, stages filled by the copy
// engine (the cache's tensor map) or, with M3RT_MSA_TT_TMA=0 only (benchmarks), by the producer
// warp's cp.async: compute-sanitizer's racecheck reports hazards between those copies and the
// consumers' ldmatrix reads (session 35; the same mbarrier protocol is clean with the copy engine
// and the results pass every check), so without a tensor map the wgmma tiles run instead.
template <bool kTma>
KernelFn token_tile_fn(const MsaParams& p) {
  if (p.fp8) return p.p16 ? msa_token_tile_kernel<true, true, kTma> : msa_token_tile_kernel<true, false, kTma>;
  return p.p16 ? msa_token_tile_kernel<false, true, kTma> : msa_token_tile_kernel<false, false, kTma>;
}
// Returns false, launching nothing, when the cache has no tensor map (and cp.async is not forced).
bool token_tile_launch(const MsaParams& p_in, int64_t groups, int smem, CUstream_st* stream) {
  MsaParams p = p_in;
  const bool forced_cp_async = env_int("M3RT_MSA_TT_TMA", 1) == 0;
  const bool tma = !forced_cp_async && encode_cache_map(p);
  if (!tma && !forced_cp_async) return false;
  const KernelFn fn = tma ? token_tile_fn<true>(p) : token_tile_fn<false>(p);
  detail::raise_smem_limit(reinterpret_cast<const void*>(fn), smem);
  launch_msa(fn, dim3(unsigned(groups), unsigned(p.num_kv_heads)), kTtThreads, smem, 1u, p.pdl, p, tt_stages(p.fp8),
             stream, "msa_token_tile_kernel");
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
  if (const int tt_smem = token_tile_smem(p); tt_smem > 0 && token_tile_launch(p, groups, tt_smem, stream)) return;
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
  launch_msa(cluster ? cfg.cluster_fn : cfg.fn, grid, unsigned(cluster ? cfg.cluster_threads : cfg.threads), cfg.smem,
             cluster ? unsigned(splits) : 1u, pdl, call, cfg.stages, stream,
             d1 ? "msa_decode1_kernel" : "msa_sparse_kernel");
}

}  // namespace m3rt
