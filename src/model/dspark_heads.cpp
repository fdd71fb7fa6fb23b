// DSpark Markov head loop and confidence head, CPU reference. Math: include/m3rt/dspark_heads.h.
#include "m3rt/dspark_heads.h"

#include <cmath>
#include <string>
#include <vector>

#include "core/validate.h"
#include "model/dspark_hash.h"
#include "m3rt/error.h"

namespace m3rt {

namespace {

constexpr const char* kOp = "dspark_markov_heads";

float bf16(const TensorView& t, int64_t i) { return bf16_to_float(t.ptr<const uint16_t>()[i]); }

}  // namespace

double dspark_gumbel(uint64_t seed, int64_t position, int64_t token) {
  return detail::gumbel_noise(seed, position, token);
}

void dspark_markov_heads(const DsparkHeadsArgs& a) {
  using namespace detail;
  const Device cpu = Device::cpu();
  require_defined(kOp, "base_logits", a.base_logits);
  require_device(kOp, "base_logits", a.base_logits, cpu);
  require_dtype(kOp, "base_logits", a.base_logits, {DType::kBFloat16});
  require_shape(kOp, "base_logits", a.base_logits, {-1, -1, -1});
  require_contiguous(kOp, "base_logits", a.base_logits);
  const int64_t R = a.base_logits.shape[0], N = a.base_logits.shape[1], V = a.base_logits.shape[2];
  for (const auto& [name, w] : {std::pair<const char*, const TensorView*>{"w1", &a.w1}, {"w2", &a.w2}}) {
    require_defined(kOp, name, *w);
    require_device(kOp, name, *w, cpu);
    require_dtype(kOp, name, *w, {DType::kBFloat16});
    require_shape(kOp, name, *w, {V, -1});
    require_contiguous(kOp, name, *w);
  }
  const int64_t rank = a.w1.shape[1];
  require_shape(kOp, "w2", a.w2, {V, rank});
  auto vec = [&](const char* name, const TensorView& t, DType dt) {
    require_defined(kOp, name, t);
    require_device(kOp, name, t, cpu);
    require_dtype(kOp, name, t, {dt});
    require_shape(kOp, name, t, {R});
    require_contiguous(kOp, name, t);
  };
  vec("anchor_tokens", a.anchor_tokens, DType::kInt32);
  vec("anchor_positions", a.anchor_positions, DType::kInt64);
  vec("temperatures", a.temperatures, DType::kFloat32);
  vec("seeds", a.seeds, DType::kInt64);
  require_defined(kOp, "draft_tokens", a.draft_tokens);
  require_device(kOp, "draft_tokens", a.draft_tokens, cpu);
  require_dtype(kOp, "draft_tokens", a.draft_tokens, {DType::kInt32});
  require_shape(kOp, "draft_tokens", a.draft_tokens, {R, N});
  require_contiguous(kOp, "draft_tokens", a.draft_tokens);
  if (a.draft_probs.defined()) {
    require_device(kOp, "draft_probs", a.draft_probs, cpu);
    require_dtype(kOp, "draft_probs", a.draft_probs, {DType::kFloat32});
    require_shape(kOp, "draft_probs", a.draft_probs, {R, N, V});
    require_contiguous(kOp, "draft_probs", a.draft_probs);
  }
  const bool conf = a.conf_w.defined();
  int64_t H = 0;
  bool conf_markov = false;
  if (conf) {
    require_device(kOp, "head_hidden", a.head_hidden, cpu);
    require_dtype(kOp, "head_hidden", a.head_hidden, {DType::kBFloat16});
    require_shape(kOp, "head_hidden", a.head_hidden, {R, N, -1});
    require_contiguous(kOp, "head_hidden", a.head_hidden);
    H = a.head_hidden.shape[2];
    require_device(kOp, "conf_w", a.conf_w, cpu);
    require_dtype(kOp, "conf_w", a.conf_w, {DType::kBFloat16});
    require_shape(kOp, "conf_w", a.conf_w, {1, -1});
    require_contiguous(kOp, "conf_w", a.conf_w);
    if (a.conf_w.shape[1] != H && a.conf_w.shape[1] != H + rank)
      throw_arg_error(kOp, "conf_w.shape", a.conf_w.shape_str(),
                      "must be [1, H] or [1, H + r] with H = " + std::to_string(H) + ", r = " + std::to_string(rank));
    conf_markov = a.conf_w.shape[1] == H + rank;
    require_defined(kOp, "conf_b", a.conf_b);
    require_device(kOp, "conf_b", a.conf_b, cpu);
    require_dtype(kOp, "conf_b", a.conf_b, {DType::kBFloat16});
    require_shape(kOp, "conf_b", a.conf_b, {1});
    require_defined(kOp, "confidence", a.confidence);
    require_device(kOp, "confidence", a.confidence, cpu);
    require_dtype(kOp, "confidence", a.confidence, {DType::kFloat32});
    require_shape(kOp, "confidence", a.confidence, {R, N});
    require_contiguous(kOp, "confidence", a.confidence);
  }
  // Index and value checks before anything is written.
  for (int64_t r = 0; r < R; ++r) {
    const int32_t tok = a.anchor_tokens.ptr<const int32_t>()[r];
    if (tok >= V)
      throw_arg_error(kOp, "anchor_tokens[" + std::to_string(r) + "]", std::to_string(tok),
                      "must be < V = " + std::to_string(V) + " (negative: a padding request)");
    const float T = a.temperatures.ptr<const float>()[r];
    if (!(T >= 0.f) || !std::isfinite(T))
      throw_arg_error(kOp, "temperatures[" + std::to_string(r) + "]", std::to_string(T), "must be finite and >= 0");
  }

  std::vector<float> logits(static_cast<size_t>(V));
  std::vector<double> p(static_cast<size_t>(V));
  for (int64_t r = 0; r < R; ++r) {
    int32_t prev = a.anchor_tokens.ptr<const int32_t>()[r];
    const float T = a.temperatures.ptr<const float>()[r];
    const uint64_t seed = uint64_t(a.seeds.ptr<const int64_t>()[r]);
    const int64_t pos0 = a.anchor_positions.ptr<const int64_t>()[r];
    for (int64_t i = 0; i < N; ++i) {
      int32_t* tok_out = a.draft_tokens.ptr<int32_t>() + r * N + i;
      float* prob_out = a.draft_probs.defined() ? a.draft_probs.ptr<float>() + (r * N + i) * V : nullptr;
      if (prev < 0) {  // padding
        *tok_out = -1;
        if (prob_out) std::fill(prob_out, prob_out + V, 0.f);
        if (conf) a.confidence.ptr<float>()[r * N + i] = 0.f;
        continue;
      }
      // Confidence of this step: the hidden row and the Markov embedding of the previous token.
      if (conf) {
        float z = bf16(a.conf_b, 0);
        for (int64_t k = 0; k < H; ++k) z += bf16(a.conf_w, k) * bf16(a.head_hidden, (r * N + i) * H + k);
        if (conf_markov)
          for (int64_t k = 0; k < rank; ++k) z += bf16(a.conf_w, H + k) * bf16(a.w1, int64_t(prev) * rank + k);
        a.confidence.ptr<float>()[r * N + i] = 1.f / (1.f + std::exp(-z));
      }
      // logits = bf16(base + bf16(W2 . W1[prev])).
      for (int64_t v = 0; v < V; ++v) {
        float bias = 0.f;
        for (int64_t k = 0; k < rank; ++k) bias += bf16(a.w1, int64_t(prev) * rank + k) * bf16(a.w2, v * rank + k);
        logits[size_t(v)] = round_bf16(bf16(a.base_logits, (r * N + i) * V + v) + round_bf16(bias));
      }
      int32_t best = 0;
      if (T == 0.f) {
        for (int64_t v = 1; v < V; ++v)
          if (logits[size_t(v)] > logits[size_t(best)]) best = int32_t(v);
        if (prob_out) {
          std::fill(prob_out, prob_out + V, 0.f);
          prob_out[best] = 1.f;
        }
      } else {
        double best_key = -INFINITY, mx = -INFINITY;
        for (int64_t v = 0; v < V; ++v) {
          const double x = double(logits[size_t(v)]) / double(T);
          mx = std::max(mx, x);
          const double key = x + dspark_gumbel(seed, pos0 + i, v);
          if (key > best_key) best_key = key, best = int32_t(v);
        }
        if (prob_out) {
          double sum = 0;
          for (int64_t v = 0; v < V; ++v) sum += p[size_t(v)] = std::exp(double(logits[size_t(v)]) / double(T) - mx);
          for (int64_t v = 0; v < V; ++v) prob_out[v] = float(p[size_t(v)] / sum);
        }
      }
      *tok_out = best;
      prev = best;
    }
  }
}

}  // namespace m3rt
