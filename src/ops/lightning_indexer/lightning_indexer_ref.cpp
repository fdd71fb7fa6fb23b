// CPU reference of the lightning indexer (../shared/spec/msa.md §3): plain fp32 loops, built with
// -ffp-contract=off. Every dot product is the spec's sum over d = 0..127 in order (sum += q[d] *
// k[d], one rounding per product and per add); the loops run over keys innermost, so the compiler
// may vectorize across keys but never reorders a sum.
#include <algorithm>
#include <cmath>
#include <string>
#include <vector>

#include "m3rt/dtype.h"
#include "m3rt/error.h"
#include "ops/common/ref_common.h"
#include "ops/lightning_indexer/lightning_indexer.h"

namespace m3rt {

namespace {

constexpr const char* kOp = "lightning_indexer";
constexpr int kBs = 128;   // tokens per index-cache page == sparse block size
constexpr int kDim = 128;  // index dim

std::string str(int64_t v) { return std::to_string(v); }

RequestLayout layout(const IndexerParams& p) {
  return {p.cu_seqlens_q, p.seq_lens, p.num_seqs, p.num_tokens, p.decode_query_len, p.max_query_len,
          p.max_blocks};
}

// Rejects lengths and page ids the kernels cannot report (they are device-resident): called before
// anything is written.
void check_indices(const IndexerParams& p) {
  check_request_layout(kOp, layout(p), "the index_q rows");
  for (int b = 0; b < p.num_seqs; ++b) {
    const int64_t len = p.seq_lens[b];
    const int64_t blocks = (len + kBs - 1) / kBs;
    const int32_t* row = p.block_table + b * p.block_table_stride;
    for (int64_t j = 0; j < blocks; ++j)
      if (row[j] < 0 || row[j] >= p.num_cache_blocks)
        throw_arg_error(kOp, "block_table[" + str(b) + "][" + str(j) + "]", str(row[j]),
                        "must lie in [0, num_cache_blocks = " + str(p.num_cache_blocks) +
                            ") (block " + str(j) + " holds keys of request " + str(b) +
                            ", seq_len " + str(len) + ")");
  }
}

// Scores of token t for heads [h0, h0 + nh): score[(h - h0) * nb + j], the arithmetic the spec
// fixes. Returns nb (0 when the token has no position). Each block's keys are decoded once for
// all heads, dim-major, so the per-key sums run side by side in the inner loop.
int token_scores(const IndexerParams& p, int64_t t, int h0, int nh, std::vector<float>& score) {
  int seq = 0;
  int64_t pos = 0;
  if (!indexer_token_position(p, t, &seq, &pos)) {
    score.clear();
    return 0;
  }
  const int nb = int(pos / kBs) + 1;
  score.assign(size_t(nh) * size_t(nb), NAN);
  std::vector<float> q(size_t(nh) * kDim), kt(size_t(kDim) * kBs);
  for (int h = 0; h < nh; ++h)
    for (int d = 0; d < kDim; ++d)
      q[size_t(h * kDim + d)] = load_bf16_or_e4m3(p.index_q, p.fp8, (t * p.num_heads + h0 + h) * kDim + d);
  const int32_t* table_row = p.block_table + seq * p.block_table_stride;
  float dot[kBs];
  for (int j = 0; j < nb; ++j) {
    // A page outside the cache (indexer_ref has thrown before) scores NaN, like on the GPU.
    const int64_t page = j < p.max_blocks ? table_row[j] : -1;
    if (page < 0 || page >= p.num_cache_blocks) continue;
    const int n = int(std::min<int64_t>(kBs, pos + 1 - int64_t(j) * kBs));  // keys <= pos
    for (int i = 0; i < n; ++i)
      for (int d = 0; d < kDim; ++d)
        kt[size_t(d * kBs + i)] = load_bf16_or_e4m3(p.index_cache, p.fp8, ((page * kBs) + i) * kDim + d);
    for (int h = 0; h < nh; ++h) {
      const float* qh = q.data() + h * kDim;
      for (int i = 0; i < n; ++i) dot[i] = 0.f;
      for (int d = 0; d < kDim; ++d) {
        const float qd = qh[d];
        const float* kd = kt.data() + d * kBs;
        for (int i = 0; i < n; ++i) dot[i] += qd * kd[i];
      }
      // The max ignores NaN dots (like fmaxf); no non-NaN dot leaves the block NaN.
      float best = NAN;
      for (int i = 0; i < n; ++i)
        if (!std::isnan(dot[i]) && (std::isnan(best) || dot[i] > best)) best = dot[i];
      score[size_t(h) * nb + j] = best;
    }
  }
  return nb;
}

}  // namespace

bool indexer_token_position(const IndexerParams& p, int64_t t, int* seq, int64_t* position) {
  // Decode padding (seq_len < decode_query_len) has no position here: its rows select nothing.
  return request_token_position(layout(p), t, seq, position) && *position >= 0;
}

int indexer_row_scores_ref(const IndexerParams& p, int64_t t, int h, std::vector<float>& score) {
  return token_scores(p, t, h, 1, score);
}

void indexer_select_ref(const float* score, int nb, int topk, int init_blocks, int local_blocks,
                        int32_t* out) {
  nb = std::max(nb, 0);
  const int k = std::min(topk, nb);
  std::vector<char> chosen(size_t(nb), 0);
  // Forced: the first init_blocks and the last local_blocks visible blocks (init + local <= topk,
  // so they never exceed k).
  const int init_end = std::min(init_blocks, nb), local_begin = std::max(0, nb - local_blocks);
  int taken = 0;
  for (int j = 0; j < nb; ++j)
    if (j < init_end || j >= local_begin) chosen[size_t(j)] = 1, ++taken;
  // The rest by score: descending, ties -> the lower id, NaN below every number.
  std::vector<int> rest;
  for (int j = init_end; j < local_begin; ++j) rest.push_back(j);
  const size_t want = size_t(std::clamp(k - taken, 0, int(rest.size())));
  auto better = [score](int a, int b) {
    const bool na = std::isnan(score[a]), nb_ = std::isnan(score[b]);
    if (na != nb_) return nb_;
    if (!na && score[a] != score[b]) return score[a] > score[b];
    return a < b;
  };
  if (want > 0 && want < rest.size())
    std::nth_element(rest.begin(), rest.begin() + ptrdiff_t(want), rest.end(), better);
  for (size_t i = 0; i < want; ++i) chosen[size_t(rest[i])] = 1;
  // Ascending ids: the local block comes last (the MSA contract); -1 after.
  int w = 0;
  for (int j = 0; j < nb && w < topk; ++j)
    if (chosen[size_t(j)]) out[w++] = j;
  while (w < topk) out[w++] = -1;
}

void indexer_ref(const IndexerParams& p) {
  check_indices(p);
  std::vector<float> score;
  for (int64_t t = 0; t < p.num_tokens; ++t) {
    const int nb = token_scores(p, t, 0, p.num_heads, score);
    for (int h = 0; h < p.num_heads; ++h)
      indexer_select_ref(nb ? score.data() + size_t(h) * nb : nullptr, nb, p.topk, p.init_blocks,
                         p.local_blocks, p.topk_out + t * p.topk_stride_t + h * p.topk);
  }
}

}  // namespace m3rt
