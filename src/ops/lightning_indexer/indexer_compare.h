// Internal: the comparison of a lightning-indexer top-k buffer with reference scores, used by the
// tests and by `m3rt check` (README.md here, "Checking a selection").
//
// A selection is a set: two correct indexers may pick different blocks where scores (nearly) tie,
// and the GPU's tensor-core sums round differently from the reference's plain loop. So a row is
// checked against the contract and against reference scores with error bounds, not bit for bit:
//   (a) contract: exactly min(topk, nb) valid ids, strictly ascending, all in [0, nb), then -1
//       (nb = the token's visible blocks; a token with no position: all -1);
//   (b) every forced block (the first init_blocks, the last local_blocks) is present;
//   (c) ranking: with reference scores s_j and bounds e_j = rel_tol * A_j, where A_j is the largest
//       sum_d |q_d * k_nd| over the block's visible keys n (NaN dots skipped), every selected
//       non-forced block g and every unselected visible block u satisfy s_g >= s_u - (e_g + e_u).
//       NaN ranks below every number: a NaN u never fails, a NaN g fails against a non-NaN u.
// rel_tol: 129 * 2^-24 for the CPU reference against an fp64 oracle (a 128-term fp32 dot lies
// within gamma_128 = 128u / (1 - 128u) < 129u times sum |q k| of the exact value, u = 2^-24: a
// bound, so a correct reference never fails barring fp32 overflow or underflow); ~2^-12 for a GPU
// (tensor-core sums in another order) against the CPU reference's scores.
#pragma once

#include <cmath>
#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "ops/lightning_indexer/lightning_indexer.h"

namespace m3rt::detail {

// Reference scores of one (token, head) row: fills score[j] for the token's visible blocks j < nb
// and returns nb (0 for a token with no position). NaN: a block with no non-NaN visible dot.
using IndexerRowScores = std::function<int(int64_t t, int h, std::vector<double>& score)>;

// The CPU reference's fp32 scores (indexer_row_scores_ref) of the call `p` describes.
IndexerRowScores indexer_ref_row_scores(const IndexerParams& p);

// The spec's scores (msa.md §3.2) in fp64 — products exact, sums in double, NaN dots skipped by the
// max — with its own position logic: an oracle independent of the reference's code, for checking
// the reference. `p` points at host copies of the inputs (which it decodes once, when called).
IndexerRowScores indexer_oracle_row_scores(const IndexerParams& p);

struct IndexerCompareResult {
  int64_t rows_checked = 0;  // (token, head) rows
  int64_t rows_failed = 0;
  // The closest ranking call over every compared (selected g, unselected u) pair:
  // (s_u - s_g) / (e_g + e_u); <= 1 passes, negative means g scored clearly higher. -inf when no
  // pair was compared (every row selected all its visible blocks).
  double worst_ratio = -INFINITY;
  std::string worst_where;     // "token 5 head 2: selected 3 (score 1.25) over 7 (score 1.5)"
  std::string first_failures;  // up to 5 failed rows, one "token t head h: what" per line
  bool pass() const { return rows_failed == 0; }
  std::string summary() const;  // "rows 1536, failed 0, closest call 0.031 of the allowed error"
};

// Checks every (token, head) row of `topk` (host, [num_tokens, num_heads, topk] with rows
// `topk_stride_t` apart, the last two dims contiguous) for the call `p` describes. `p` must point
// at HOST copies of the inputs (index_q, index_cache, seq_lens, cu_seqlens_q, block_table), which
// must be consistent (what indexer_ref accepts); p.topk_out is not read.
IndexerCompareResult compare_indexer_topk(const IndexerParams& p, const int32_t* topk,
                                          int64_t topk_stride_t, const IndexerRowScores& ref,
                                          double rel_tol);

}  // namespace m3rt::detail
