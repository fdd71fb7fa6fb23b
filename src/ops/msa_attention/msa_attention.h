// msa_attention: params, CPU reference and launcher. Public API: m3rt::msa_prefill and
// m3rt::MsaDecodePlan (include/m3rt/msa_attention.h). Math, layout and decisions: README.md here.
#pragma once

#include <cstdint>

#include "m3rt/msa_attention.h"

struct CUstream_st;

// The geometry helpers below are shared by host code and the kernel.
#ifdef __CUDACC__
#define M3RT_HOST_DEVICE __host__ __device__
#else
#define M3RT_HOST_DEVICE
#endif

namespace m3rt {

struct MsaParams {
  const uint16_t* q;            // [T, Hq, 128] bf16: q + t * q_stride_t + h * q_stride_h
  int64_t q_stride_t, q_stride_h;
  const void* cache;            // [num_cache_blocks, Hkv, 128, 256] bf16 or e4m3, contiguous
  bool fp8;
  int64_t num_cache_blocks;     // pages outside [0, num_cache_blocks) are never read
  const float* k_scale;         // fp8 only
  const float* v_scale;
  const int32_t* topk;          // [Hkv, T, topk_k]: topk + g * stride_h + t * stride_t + i * stride_k
  int64_t topk_stride_h, topk_stride_t, topk_stride_k;
  int topk_k;
  const int32_t* cu_seqlens_q;  // prefill: [num_seqs + 1]; decode: nullptr
  const int32_t* seq_lens;      // [num_seqs]
  int num_seqs;
  int64_t num_tokens;
  int decode_query_len;         // decode: 1..32; prefill: 0
  int max_query_len;            // prefill: >= every request's query length
  const int32_t* block_table;   // [num_seqs, max_blocks], rows block_table_stride apart
  int64_t block_table_stride;
  int max_blocks;
  int num_heads, num_kv_heads;  // Hq, Hkv
  float softmax_scale;
  bool causal;
  int window_left;              // > 0: keys at position >= p - window_left + 1; 0: none
  uint16_t* out;                // [T, Hq, 128] bf16: out + t * out_stride_t + h * out_stride_h
  int64_t out_stride_t, out_stride_h;
  float* lse;                   // optional [T, Hq]: lse + t * lse_stride_t + h
  int64_t lse_stride_t;
  // Split decode (set by MsaDecodePlan; prefill and a plan with one split leave them 0 / null):
  // the CTAs of one (row group, KV head) share its pages and the last to finish merges.
  int num_splits;               // 0 or 1: no split
  float* part_o;                // [groups * Hkv * num_splits, msa_group_rows, 128] fp32
  float* part_ml;               // [groups * Hkv * num_splits, msa_group_rows, 2]: running max (log2), sum
  int* counters;                // [groups * Hkv], zero between calls (unused by cluster launches,
                                // whose splits merge through DSMEM)
  bool pdl;                     // launch as a programmatic dependent (MsaDecodeArgs::enable_pdl)
  bool p16;                     // P V may use P rounded once to 16 bits (the args' p_residue false)
  bool pdl_trigger;             // set by the launcher: let the next PDL grid launch after the loop
  int mixed_whole;              // > 0 (set by MsaDecodePlan, dql 1 only): msa_decode1_mixed_kernel, the first
                                // mixed_whole pairs whole, the others in num_splits pieces
  // Set by the launcher, never by callers: the cache as a CUDA tensor map (an opaque CUtensorMap)
  // for the bulk tensor copies of the Hopper wgmma loop.
  alignas(128) unsigned char cache_map[128];
};

// The tensor-core kernel's geometry (shared by the plan, which sizes the split scratch, and the
// launcher). A CTA serves one row group: up to msa_group_tokens query tokens of one request (all
// their G query heads, <= 128 rows) and one KV head.
// Tokens per group: min(32, 128 / G), and at most dql in decode (dql 0: prefill); row masks are
// 32-bit.
M3RT_HOST_DEVICE inline int msa_group_tokens(int group_size, int decode_query_len) {
  const int t = 128 / group_size < 32 ? 128 / group_size : 32;
  return decode_query_len > 0 && decode_query_len < t ? decode_query_len : t;
}
// Rows (token x query head) of a group's tiles, rounded up to the 16-row MMA tile; sizes the
// plan's split scratch.
M3RT_HOST_DEVICE inline int msa_group_rows(int group_size, int group_tokens) {
  return (group_tokens * group_size + 15) / 16 * 16;
}
// Row groups of a decode call: ceil(dql / group tokens) per request.
M3RT_HOST_DEVICE inline int64_t msa_decode_groups(int batch, int decode_query_len, int group_size) {
  const int tg = msa_group_tokens(group_size, decode_query_len);
  return int64_t(batch) * ((decode_query_len + tg - 1) / tg);
}
// Splits per (row group, KV head) for a decode shape on the current device: the CTAs of a row group
// share its pages and the last one merges. About as many CTAs as the SMs hold (the general kernel:
// one per SM; decode_query_len 1: about 1.5 (bf16) or 2.25 (e4m3) per SM, and for bf16 one split
// once the (request, KV head) pairs alone cover >= 95% of the SMs; bf16 on a GPU with less DRAM
// bandwidth an SM than the H200: msa_decode1_bf16_lean_splits), at most 16, never more
// than the pages' 64-key chunks; 1: no split scratch. The environment variable
// M3RT_MSA_SPLITS overrides it (benchmark tuning).
int msa_decode_splits(int batch, int decode_query_len, int num_heads, int num_kv_heads, int topk, int max_blocks,
                      bool fp8);
// The dql-1 bf16 split count msa_decode_splits takes on GPUs with less DRAM bandwidth an SM than
// the H200 (the H100): the largest power of two <= cap (the shape's most splits, <= 16) with
// pairs x splits <= sms (at most one CTA an SM), 8 instead of 16 when the 16-CTA clusters would
// cover more than half the SMs; 1 for empty inputs. Pure (host).
int msa_decode1_bf16_lean_splits(int64_t pairs, int cap, int sms);
// dql-1 decode on a mixed grid (msa_decode1_mixed_kernel) where the split grid (msa_decode_splits'
// count, `splits`) has one CTA a (request, KV head) pair and would leave some SMs a CTA more than
// others: whole rounds of one pair an SM, the remaining pairs in `pieces` pieces each, when that
// lowers the busiest SM's load by >= 10%. whole 0: the split grid. M3RT_MSA_MIXED=0 keeps the split
// grid (benchmarks).
struct MsaDecodeMixed {
  int whole = 0, pieces = 0;
};
MsaDecodeMixed msa_decode_mixed(int batch, int decode_query_len, int num_kv_heads, int topk, int max_blocks, bool fp8,
                                int splits);
// Tests and benches: run the first (CUDA-core) kernel instead of the tensor-core one.
void msa_force_baseline(bool on);
// The baseline kernel's launcher (msa_attention_baseline.cu).
void msa_attention_baseline_launch(const MsaParams& p, CUstream_st* stream);

// The params of one call over its tensors (no checks: the ops validate before they build them;
// checks and tests use this on host tensors). cu_seqlens_q undefined: decode with decode_query_len
// rows per request. Undefined out / lse leave those pointers null.
MsaParams msa_call_params(const TensorView& q, const MsaKvCache& cache, const TensorView& topk,
                          const TensorView& cu_seqlens_q, const TensorView& seq_lens,
                          const TensorView& block_table, int decode_query_len, int max_query_len,
                          float softmax_scale, const MsaMask& mask, const TensorView& out = {},
                          const TensorView& lse = {});

// The request of token t and its position (as the reference and the kernels define them); false
// for a token of no request.
bool msa_token_position(const MsaParams& p, int64_t t, int* seq, int64_t* position);

// The reference: fp32 dot products, fp64 softmax sums (the spec). Throws (before writing anything)
// on inconsistent lengths or page ids, which the GPU cannot report.
void msa_attention_ref(const MsaParams& p);

// One launch for prefill and decode.
void msa_attention_launch(const MsaParams& p, CUstream_st* stream);

// Benchmarks: msa_decode1_kernel's page stream alone for the dql-1 decode call `p` describes (its
// split grid, p.num_splits, and stages): ids -> table -> 64-key chunks by bulk copy, no queries,
// softmax, merge or output (what the call would cost if only its reads remained). `sink`: one
// device word, written only in a case that does not arise. False (nothing launched) for other
// calls (prefill, dql > 1, the mixed grid) or where the Hopper kernels do not run.
bool msa_decode1_read_floor_launch(const MsaParams& p, unsigned* sink, CUstream_st* stream);

}  // namespace m3rt
