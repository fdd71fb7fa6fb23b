// DSpark Markov head loop and confidence head (CPU reference): greedy drafts equal a step-by-step
// argmax(base + W2 . W1[prev]) computed here independently; sampled drafts return exactly the
// softmax they were drawn from (1e-5) and the draws follow it; seeds reproduce; padding requests
// write nothing but -1 / 0; the confidence is sigmoid(w . [h ; W1[prev]] + b); bad arguments throw.
#include <gtest/gtest.h>

#include <cmath>
#include <algorithm>
#include <random>
#include <vector>

#include "m3rt/dspark_heads.h"
#include "m3rt/error.h"

namespace {

using namespace m3rt;

struct Case {
  int64_t R = 3, N = 7, V = 97, rank = 8, H = 24;
  Tensor base, w1, w2, anchors, positions, temps, seeds, hidden, conf_w, conf_b, tokens, probs, conf;

  explicit Case(uint64_t seed, bool conf_markov = true) {
    std::mt19937_64 rng(seed);
    std::normal_distribution<float> n01(0.f, 1.f);
    auto bf = [&](std::vector<int64_t> shape, float scale) {
      Tensor t = Tensor::empty(shape, DType::kBFloat16);
      for (int64_t i = 0; i < t.numel(); ++i) t.ptr<uint16_t>()[i] = float_to_bf16(scale * n01(rng));
      return t;
    };
    base = bf({R, N, V}, 2.f);
    w1 = bf({V, rank}, 1.f);
    w2 = bf({V, rank}, 0.7f);
    hidden = bf({R, N, H}, 1.f);
    conf_w = bf({1, H + (conf_markov ? rank : 0)}, 0.3f);
    conf_b = bf({1}, 0.5f);
    anchors = Tensor::empty({R}, DType::kInt32);
    positions = Tensor::empty({R}, DType::kInt64);
    temps = Tensor::empty({R}, DType::kFloat32);
    seeds = Tensor::empty({R}, DType::kInt64);
    for (int64_t r = 0; r < R; ++r) {
      anchors.ptr<int32_t>()[r] = int32_t(rng() % uint64_t(V));
      positions.ptr<int64_t>()[r] = 100 + 37 * r;
      temps.ptr<float>()[r] = 0.f;
      seeds.ptr<int64_t>()[r] = int64_t(rng() >> 1);
    }
    tokens = Tensor::empty({R, N}, DType::kInt32);
    probs = Tensor::empty({R, N, V}, DType::kFloat32);
    conf = Tensor::empty({R, N}, DType::kFloat32);
  }
  DsparkHeadsArgs args() const {
    return {.base_logits = base, .w1 = w1, .w2 = w2, .anchor_tokens = anchors, .anchor_positions = positions,
            .temperatures = temps, .seeds = seeds, .head_hidden = hidden, .conf_w = conf_w, .conf_b = conf_b,
            .draft_tokens = tokens, .draft_probs = probs, .confidence = conf};
  }
  float at(const Tensor& t, int64_t i) const { return bf16_to_float(t.ptr<uint16_t>()[i]); }
  // The corrected logits of request r, step i after `prev`, per the documented roundings, written
  // here without the op's code.
  std::vector<float> logits(int64_t r, int64_t i, int32_t prev) const {
    std::vector<float> out(static_cast<size_t>(V));
    for (int64_t v = 0; v < V; ++v) {
      float dot = 0.f;
      for (int64_t k = 0; k < rank; ++k) dot += at(w1, prev * rank + k) * at(w2, v * rank + k);
      out[size_t(v)] = round_bf16(at(base, (r * N + i) * V + v) + round_bf16(dot));
    }
    return out;
  }
};

TEST(DsparkHeads, GreedyEqualsStepByStepArgmax) {
  for (uint64_t seed = 1; seed <= 5; ++seed) {
    Case c(seed);
    dspark_markov_heads(c.args());
    for (int64_t r = 0; r < c.R; ++r) {
      int32_t prev = c.anchors.ptr<int32_t>()[r];
      for (int64_t i = 0; i < c.N; ++i) {
        const std::vector<float> l = c.logits(r, i, prev);
        int32_t best = 0;
        for (int32_t v = 1; v < int32_t(c.V); ++v)
          if (l[size_t(v)] > l[size_t(best)]) best = v;
        ASSERT_EQ(c.tokens.ptr<int32_t>()[r * c.N + i], best) << "seed " << seed << " r " << r << " i " << i;
        for (int64_t v = 0; v < c.V; ++v)  // greedy drafts are one-hot
          ASSERT_EQ(c.probs.ptr<float>()[(r * c.N + i) * c.V + v], v == best ? 1.f : 0.f);
        prev = best;
      }
    }
  }
}

TEST(DsparkHeads, SampledDraftsReturnTheSoftmaxTheyWereDrawnFrom) {
  Case c(11);
  const float T[3] = {0.7f, 1.f, 2.5f};
  for (int64_t r = 0; r < c.R; ++r) c.temps.ptr<float>()[r] = T[r];
  dspark_markov_heads(c.args());
  for (int64_t r = 0; r < c.R; ++r) {
    int32_t prev = c.anchors.ptr<int32_t>()[r];
    for (int64_t i = 0; i < c.N; ++i) {
      const std::vector<float> l = c.logits(r, i, prev);
      double mx = -INFINITY, sum = 0;
      for (float x : l) mx = std::max(mx, double(x) / T[r]);
      for (float x : l) sum += std::exp(double(x) / T[r] - mx);
      for (int64_t v = 0; v < c.V; ++v)
        ASSERT_NEAR(c.probs.ptr<float>()[(r * c.N + i) * c.V + v], std::exp(double(l[size_t(v)]) / T[r] - mx) / sum,
                    1e-5);
      prev = c.tokens.ptr<int32_t>()[r * c.N + i];
      ASSERT_GE(prev, 0);
      ASSERT_LT(prev, c.V);
    }
  }
}

TEST(DsparkHeads, DrawsFollowTheDistributionAndSeedsReproduce) {
  // One step, one request, many seeds: the empirical distribution of the first draft token is
  // close to the returned probabilities (total variation; 20000 draws over 97 tokens).
  Case c(3);
  Tensor base = Tensor::empty({1, 1, c.V}, DType::kBFloat16);
  std::copy(c.base.ptr<uint16_t>(), c.base.ptr<uint16_t>() + c.V, base.ptr<uint16_t>());  // row (0, 0)
  Tensor anchors = Tensor::empty({1}, DType::kInt32), pos = Tensor::empty({1}, DType::kInt64);
  Tensor temps = Tensor::empty({1}, DType::kFloat32), seeds = Tensor::empty({1}, DType::kInt64);
  Tensor tokens = Tensor::empty({1, 1}, DType::kInt32), probs = Tensor::empty({1, 1, c.V}, DType::kFloat32);
  anchors.ptr<int32_t>()[0] = 5;
  pos.ptr<int64_t>()[0] = 1000;
  temps.ptr<float>()[0] = 1.5f;
  std::vector<double> freq(static_cast<size_t>(c.V), 0.0);
  const int draws = 20000;
  DsparkHeadsArgs a{.base_logits = base, .w1 = c.w1, .w2 = c.w2, .anchor_tokens = anchors, .anchor_positions = pos,
                    .temperatures = temps, .seeds = seeds, .draft_tokens = tokens, .draft_probs = probs};
  for (int s = 0; s < draws; ++s) {
    seeds.ptr<int64_t>()[0] = s;
    dspark_markov_heads(a);
    freq[size_t(tokens.ptr<int32_t>()[0])] += 1.0 / draws;
  }
  double tv = 0;
  for (int64_t v = 0; v < c.V; ++v) tv += 0.5 * std::fabs(freq[size_t(v)] - probs.ptr<float>()[v]);
  EXPECT_LT(tv, 0.04);  // sampling noise alone is ~0.02 here
  // Same seed, same draws; the draws depend on the seed.
  seeds.ptr<int64_t>()[0] = 77;
  dspark_markov_heads(a);
  const int32_t first = tokens.ptr<int32_t>()[0];
  dspark_markov_heads(a);
  EXPECT_EQ(tokens.ptr<int32_t>()[0], first);
  int differ = 0;
  for (int s = 0; s < 50; ++s) {
    seeds.ptr<int64_t>()[0] = 1000 + s;
    dspark_markov_heads(a);
    differ += tokens.ptr<int32_t>()[0] != first;
  }
  EXPECT_GT(differ, 0);
}

TEST(DsparkHeads, PaddingRequestsAndMixedTemperatures) {
  Case c(5);
  c.anchors.ptr<int32_t>()[1] = -1;  // padding
  c.temps.ptr<float>()[2] = 1.f;     // sampled next to greedy request 0
  dspark_markov_heads(c.args());
  for (int64_t i = 0; i < c.N; ++i) {
    EXPECT_EQ(c.tokens.ptr<int32_t>()[1 * c.N + i], -1);
    EXPECT_EQ(c.conf.ptr<float>()[1 * c.N + i], 0.f);
    for (int64_t v = 0; v < c.V; ++v) EXPECT_EQ(c.probs.ptr<float>()[(1 * c.N + i) * c.V + v], 0.f);
  }
  // Request 0 is still greedy: its tokens match a greedy-only run.
  Case g(5);
  dspark_markov_heads(g.args());
  for (int64_t i = 0; i < c.N; ++i) EXPECT_EQ(c.tokens.ptr<int32_t>()[i], g.tokens.ptr<int32_t>()[i]);
}

TEST(DsparkHeads, ConfidenceIsSigmoidOfHiddenAndMarkovEmbedding) {
  for (bool markov : {true, false}) {
    Case c(9, markov);
    dspark_markov_heads(c.args());
    for (int64_t r = 0; r < c.R; ++r) {
      int32_t prev = c.anchors.ptr<int32_t>()[r];
      for (int64_t i = 0; i < c.N; ++i) {
        double z = c.at(c.conf_b, 0);
        for (int64_t k = 0; k < c.H; ++k) z += double(c.at(c.conf_w, k)) * c.at(c.hidden, (r * c.N + i) * c.H + k);
        if (markov)
          for (int64_t k = 0; k < c.rank; ++k) z += double(c.at(c.conf_w, c.H + k)) * c.at(c.w1, prev * c.rank + k);
        EXPECT_NEAR(c.conf.ptr<float>()[r * c.N + i], 1.0 / (1.0 + std::exp(-z)), 1e-5) << markov;
        prev = c.tokens.ptr<int32_t>()[r * c.N + i];
      }
    }
  }
}

TEST(DsparkHeads, BadArgumentsThrowBeforeWriting) {
  Case c(2);
  c.tokens.fill_bytes(0xAB);
  auto untouched = [&] {
    for (int64_t i = 0; i < c.tokens.numel(); ++i)
      if (c.tokens.ptr<uint32_t>()[i] != 0xABABABABu) return false;
    return true;
  };
  c.anchors.ptr<int32_t>()[0] = int32_t(c.V);
  EXPECT_THROW(dspark_markov_heads(c.args()), Error);
  c.anchors.ptr<int32_t>()[0] = 1;
  c.temps.ptr<float>()[1] = -1.f;
  EXPECT_THROW(dspark_markov_heads(c.args()), Error);
  c.temps.ptr<float>()[1] = NAN;
  EXPECT_THROW(dspark_markov_heads(c.args()), Error);
  c.temps.ptr<float>()[1] = 0.f;
  EXPECT_TRUE(untouched());
  DsparkHeadsArgs a = c.args();
  Tensor w2bad = Tensor::empty({c.V, c.rank + 1}, DType::kBFloat16);
  a.w2 = w2bad;
  EXPECT_THROW(dspark_markov_heads(a), Error);
  a = c.args();
  Tensor f32 = Tensor::empty({c.R, c.N, c.V}, DType::kFloat32);
  a.base_logits = f32;
  EXPECT_THROW(dspark_markov_heads(a), Error);
  a = c.args();
  Tensor cw = Tensor::empty({1, c.H + 3}, DType::kBFloat16);
  a.conf_w = cw;
  EXPECT_THROW(dspark_markov_heads(a), Error);
  a = c.args();
  a.confidence = TensorView{};
  EXPECT_THROW(dspark_markov_heads(a), Error);
  EXPECT_TRUE(untouched());
  // Without the confidence head and probabilities, tokens alone.
  a = c.args();
  a.conf_w = TensorView{};
  a.confidence = TensorView{};
  a.draft_probs = TensorView{};
  dspark_markov_heads(a);
  EXPECT_FALSE(untouched());
}

}  // namespace
