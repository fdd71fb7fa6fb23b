// Internal: an independent plain evaluation of the DSpark draft model, written from
// ../shared/spec/dspark.md (§2.3–§2.7, §5.1, §5.2, §5.5) with its own norm, RoPE, attention,
// SwiGLU and GEMVs over floats — sharing no code with DsparkModel or the ops it is built from.
// The tests (tests/test_dspark_model.cpp) and `m3rt check dspark_draft` compare the model with it.
#pragma once

#include <cstdint>
#include <map>
#include <string>
#include <utility>
#include <vector>

#include "m3rt/dspark_checkpoint.h"

namespace m3rt::detail {

class DsparkOracle {
 public:
  using Vec = std::vector<float>;
  explicit DsparkOracle(const DsparkCheckpoint& ck);

  // One context row of request `req`: the target's concatenated hidden states (bf16 values) at
  // position `pos`; stores every layer's K/V for that position.
  void context(const Vec& hidden_row, int64_t pos, int req);
  // The block of request `req` with its anchor at position p: head_hidden [N][H] and logits
  // [N][V] (bf16 values); stores the block's K/V.
  void block(int req, int32_t anchor, int64_t p, std::vector<Vec>& head, std::vector<Vec>& logits);
  // Greedy Markov drafts from the logits of block(): per step argmax(logits + W2 . W1[prev]), with
  // prev = the anchor, then the previous step's token. A step whose top-2 margin is below
  // `min_margin` is -2 (no clear answer); without `forced_prev` the loop stops there (the rest -2),
  // with it every step runs, taking prev from forced_prev[j - 1] (e.g. the tokens being checked).
  std::vector<int32_t> greedy_drafts(int32_t anchor, const std::vector<Vec>& logits, float min_margin,
                                     const int32_t* forced_prev = nullptr) const;

  const DsparkConfig& config() const { return c_; }

 private:
  const Vec& W(const std::string& n) const { return w_.at(n); }
  std::string lp(int l) const;
  Vec gemv(const Vec& m, const Vec& x) const;
  void gemma(Vec& x, size_t off, size_t n, const Vec& weight, bool round) const;
  void rope(Vec& x, size_t off, int64_t pos) const;

  DsparkConfig c_;
  std::map<std::string, Vec> w_;
  // Per layer, per request: position -> K and V rows [Hkv * 128] as the cache holds them.
  std::vector<std::map<int, std::map<int64_t, std::pair<Vec, Vec>>>> kv_;
};

}  // namespace m3rt::detail
