// lightning_indexer: params, CPU reference and launchers. Public API: m3rt::LightningIndexer
// (include/m3rt/lightning_indexer.h). Math, layout and decisions: README.md here.
#pragma once

#include <cstdint>
#include <vector>

#include "m3rt/lightning_indexer.h"

struct CUstream_st;

namespace m3rt {

struct IndexerParams {
  // Inputs.
  const void* index_q;          // [num_tokens, num_heads, 128] bf16 or e4m3 (fp8), contiguous
  const void* index_cache;      // [num_cache_blocks, 128, 128] bf16 or e4m3 (fp8), contiguous
  bool fp8;                     // both index_q and index_cache hold e4m3 codes
  int64_t num_cache_blocks;     // pages outside [0, num_cache_blocks) are never read
  const int32_t* block_table;   // [num_seqs, max_blocks], rows block_table_stride apart
  int64_t block_table_stride;
  int max_blocks;
  const int32_t* seq_lens;      // [num_seqs]
  const int32_t* cu_seqlens_q;  // [num_seqs + 1], prefill only (nullptr for decode)
  int num_seqs;
  int64_t num_tokens;           // index_q rows
  int decode_query_len;         // decode: 1..32; prefill: 0
  int max_query_len;            // prefill: >= every request's query length
  int num_heads;                // Hidx
  int topk, init_blocks, local_blocks;
  // Output.
  int32_t* topk_out;            // [num_tokens, num_heads, topk] rows topk_stride_t apart
  int64_t topk_stride_t;
  // GPU scratch (unused by the reference).
  float* scores;                // [scratch_rows, num_heads, max_blocks] fp32
  int* counters;                // [num_seqs] arrival counters of the decode kernel, zero between calls
  bool pdl;                     // decode: launch as a programmatic dependent (IndexerDecodeArgs::enable_pdl)
  bool pdl_trigger;             // set by the launcher: let the next PDL grid launch once every CTA runs
};

// The params of one call over its tensors (no checks: the op validates before it builds them;
// tests, checks and benchmarks use this on host or device tensors they built). Decode when
// decode_query_len > 0, else prefill through cu_seqlens_q. An undefined topk_out gives a null
// output and the dense row stride; scratch pointers are left null.
IndexerParams indexer_call_params(const IndexerConfig& cfg, const TensorView& index_q,
                                  const TensorView& index_cache, const TensorView& seq_lens,
                                  const TensorView& block_table, const TensorView& topk_out,
                                  const TensorView& cu_seqlens_q, int decode_query_len,
                                  int max_query_len);

// The request of token t and its position, as the reference and the kernels define them; returns
// false for a token that belongs to no request or sits at a negative position (decode padding).
bool indexer_token_position(const IndexerParams& p, int64_t t, int* seq, int64_t* position);

// The reference: every token's block scores (fp32, in the spec's order: a plain loop over the 128
// dims) and selection, written to topk_out. Throws (before writing) on inconsistent lengths or
// page ids, which the GPU cannot report.
void indexer_ref(const IndexerParams& p);

// Scores of one (token, head) row: score[j] for the token's visible blocks j < nb (returns nb;
// 0 when the token has no visible key). Same arithmetic as indexer_ref.
int indexer_row_scores_ref(const IndexerParams& p, int64_t t, int h, std::vector<float>& score);

// Selection of one row from its scores (the spec's rule; ascending ids): writes min(topk, nb) ids
// then -1 up to topk.
void indexer_select_ref(const float* score, int nb, int topk, int init_blocks, int local_blocks,
                        int32_t* out);

// Scoring + selection kernels; `p.scores` and `p.counters` must be sized for the call.
// indexer_prefill_launch = indexer_prefill_score_launch, then indexer_prefill_select_launch (the
// two halves are separate for the benchmark's time split).
void indexer_prefill_launch(const IndexerParams& p, CUstream_st* stream);
void indexer_prefill_score_launch(const IndexerParams& p, CUstream_st* stream);
void indexer_prefill_select_launch(const IndexerParams& p, CUstream_st* stream);
void indexer_decode_launch(const IndexerParams& p, CUstream_st* stream);
// Benchmarks: the Hopper decode kernel's page stream alone, for the call `p` describes (dql 1):
// the same grid, pages, stages and barriers, without scoring, scores, arrival or selection (what
// the call would cost if only its reads remained). `sink`: one device word, written only in a
// case that does not arise. False (nothing launched) where the Hopper kernels do not run.
bool indexer_decode_read_floor_launch(const IndexerParams& p, unsigned* sink, CUstream_st* stream);
// Tests and benchmarks: run the portable kernels (decode: pages through registers; prefill scoring:
// mma.sync) even on Hopper, where the sm_90a kernels are the default (process-wide; not
// thread-safe).
void indexer_force_portable(bool on);

}  // namespace m3rt
