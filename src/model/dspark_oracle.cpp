// The plain DSpark draft-model evaluation (see dspark_oracle.h): floats, loops, the spec's rounding
// points (bf16 after every GEMM, the materialized context K norm, one rounding after the draft
// path's norm + RoPE, fp64 softmax sums).
#include "model/dspark_oracle.h"

#include <algorithm>
#include <cmath>

namespace m3rt::detail {

namespace {

float rbf(float x) { return bf16_to_float(float_to_bf16(x)); }

}  // namespace

DsparkOracle::DsparkOracle(const DsparkCheckpoint& ck) : c_(ck.config()), kv_(size_t(c_.num_layers)) {
  auto load = [&](const std::string& name, const TensorView& v) {
    Vec out(static_cast<size_t>(v.numel()));
    for (int64_t i = 0; i < v.numel(); ++i) out[size_t(i)] = bf16_to_float(v.ptr<uint16_t>()[i]);
    w_[name] = out;
  };
  const std::string prefix = "language_model.model.dspark.";
  for (const DsparkTensorSpec& s : dspark_draft_layout(c_)) {
    const TensorView v = ck.tensor(s.name);
    const std::string n = s.name.substr(prefix.size());
    if (s.dtype == DType::kBFloat16) load(n, v);
    if (s.dtype == DType::kFloat8E4M3) {  // MXFP8: code * 2^(scale - 127) per 32 inputs
      const TensorView sc = ck.tensor(s.name + "_scale_inv");
      Vec out(static_cast<size_t>(v.numel()));
      const int64_t cols = v.shape[1];
      for (int64_t i = 0; i < v.numel(); ++i) {
        const int e = sc.ptr<uint8_t>()[(i / cols) * (cols / 32) + (i % cols) / 32];
        out[size_t(i)] = e4m3_to_float(v.ptr<uint8_t>()[i]) * std::pow(2.f, float(e - 127));
      }
      w_[n] = out;
    }
  }
  load("embed", ck.tensor("language_model.model.embed_tokens.weight"));
  load("lm_head", ck.tensor("language_model.lm_head.weight"));
}

std::string DsparkOracle::lp(int l) const { return "layers." + std::to_string(l) + ".decoder_layer."; }

DsparkOracle::Vec DsparkOracle::gemv(const Vec& m, const Vec& x) const {
  const size_t cols = x.size(), rows = m.size() / cols;
  Vec y(rows);
  for (size_t r = 0; r < rows; ++r) {
    float s = 0;
    for (size_t k = 0; k < cols; ++k) s += m[r * cols + k] * x[k];
    y[r] = rbf(s);
  }
  return y;
}

void DsparkOracle::gemma(Vec& x, size_t off, size_t n, const Vec& weight, bool round) const {
  float ss = 0;
  for (size_t i = 0; i < n; ++i) ss += x[off + i] * x[off + i];
  const float inv = 1.f / std::sqrt(ss / float(n) + c_.rms_norm_eps);
  for (size_t i = 0; i < n; ++i) {
    const float y = x[off + i] * inv * (1.f + weight[i]);
    x[off + i] = round ? rbf(y) : y;
  }
}

void DsparkOracle::rope(Vec& x, size_t off, int64_t pos) const {
  const int h = c_.rotary_dim / 2;
  for (int i = 0; i < h; ++i) {
    const float f = std::pow(float(c_.rope_theta), -2.f * float(i) / float(c_.rotary_dim));
    const float cs = rbf(std::cos(float(pos) * f)), sn = rbf(std::sin(float(pos) * f));
    const float a = x[off + size_t(i)], b = x[off + size_t(i + h)];
    x[off + size_t(i)] = a * cs - b * sn;
    x[off + size_t(i + h)] = b * cs + a * sn;
  }
}

void DsparkOracle::context(const Vec& hidden_row, int64_t pos, int req) {
  const size_t H = size_t(c_.hidden_size), D = size_t(c_.head_dim), KV = size_t(c_.num_kv_heads) * D;
  Vec x = gemv(W("fc.weight"), hidden_row);
  gemma(x, 0, H, W("hidden_norm.weight"), true);
  for (int l = 0; l < c_.num_layers; ++l) {
    Vec k = gemv(W(lp(l) + "self_attn.k_proj.weight"), x), v = gemv(W(lp(l) + "self_attn.v_proj.weight"), x);
    for (size_t g = 0; g < KV / D; ++g) {
      gemma(k, g * D, D, W(lp(l) + "self_attn.k_norm.weight"), true);  // materialized in bf16 (§2.4)
      rope(k, g * D, pos);
      for (size_t i = 0; i < D; ++i) k[g * D + i] = rbf(k[g * D + i]);
    }
    kv_[size_t(l)][req][pos] = {k, v};
  }
}

void DsparkOracle::block(int req, int32_t anchor, int64_t p, std::vector<Vec>& head, std::vector<Vec>& logits) {
  const int N = c_.block_size;
  const size_t H = size_t(c_.hidden_size), D = size_t(c_.head_dim), Hq = size_t(c_.num_heads),
               Hkv = size_t(c_.num_kv_heads), G = Hq / Hkv, F = size_t(c_.ffn_size);
  std::vector<Vec> h(static_cast<size_t>(N)), res(static_cast<size_t>(N));
  for (int j = 0; j < N; ++j) {
    const int64_t id = j == 0 ? anchor : c_.mask_token_id;
    h[size_t(j)].assign(W("embed").begin() + id * int64_t(H), W("embed").begin() + (id + 1) * int64_t(H));
  }
  // Pre-norm residual: the first layer norms h itself; later ones s = in + residual (fp32),
  // residual = bf16(s), norm of the fp32 s.
  auto add_norm = [&](int j, const Vec& in, const Vec& weight, bool first) {
    Vec s(H);
    for (size_t i = 0; i < H; ++i) s[i] = first ? in[i] : in[i] + res[size_t(j)][i];
    res[size_t(j)] = s;
    for (float& v : res[size_t(j)]) v = rbf(v);
    if (first) s = res[size_t(j)];
    gemma(s, 0, H, weight, true);
    return s;
  };
  for (int l = 0; l < c_.num_layers; ++l) {
    std::vector<Vec> q(static_cast<size_t>(N));
    for (int j = 0; j < N; ++j) {
      const Vec x = add_norm(j, h[size_t(j)], W(lp(l) + "input_layernorm.weight"), l == 0);
      q[size_t(j)] = gemv(W(lp(l) + "self_attn.q_proj.weight"), x);
      Vec k = gemv(W(lp(l) + "self_attn.k_proj.weight"), x), v = gemv(W(lp(l) + "self_attn.v_proj.weight"), x);
      for (size_t hh = 0; hh < Hq; ++hh) {  // fp32 across norm and RoPE, one rounding (§2.8)
        gemma(q[size_t(j)], hh * D, D, W(lp(l) + "self_attn.q_norm.weight"), false);
        rope(q[size_t(j)], hh * D, p + j);
      }
      for (size_t g = 0; g < Hkv; ++g) {
        gemma(k, g * D, D, W(lp(l) + "self_attn.k_norm.weight"), false);
        rope(k, g * D, p + j);
      }
      for (float& e : q[size_t(j)]) e = rbf(e);
      for (float& e : k) e = rbf(e);
      kv_[size_t(l)][req][p + j] = {k, v};
    }
    for (int j = 0; j < N; ++j) {
      // Attention: non-causal over the request's keys at [max(0, P - W + 1), p + N).
      const int64_t P = p + j, lo = c_.sliding_window > 0 ? std::max<int64_t>(0, P - c_.sliding_window + 1) : 0;
      Vec o(Hq * D);
      for (size_t hh = 0; hh < Hq; ++hh) {
        const size_t g = hh / G;
        std::vector<double> s;
        std::vector<const Vec*> vs;
        for (const auto& [kp, kvp] : kv_[size_t(l)][req]) {
          if (kp < lo || kp >= p + N) continue;
          float dot = 0;
          for (size_t i = 0; i < D; ++i) dot += q[size_t(j)][hh * D + i] * kvp.first[g * D + i];
          s.push_back(double(dot) / std::sqrt(double(D)));
          vs.push_back(&kvp.second);
        }
        const double mx = *std::max_element(s.begin(), s.end());
        double den = 0;
        for (double& e : s) den += e = std::exp(e - mx);
        for (size_t i = 0; i < D; ++i) {
          double acc = 0;
          for (size_t n = 0; n < s.size(); ++n) acc += s[n] * (*vs[n])[g * D + i];
          o[hh * D + i] = rbf(float(acc / den));
        }
      }
      const Vec a = gemv(W(lp(l) + "self_attn.o_proj.weight"), o);
      const Vec x = add_norm(j, a, W(lp(l) + "post_attention_layernorm.weight"), false);
      const Vec gate = gemv(W(lp(l) + "mlp.gate_proj.weight"), x), up = gemv(W(lp(l) + "mlp.up_proj.weight"), x);
      Vec act(F);
      for (size_t i = 0; i < F; ++i) {  // SwiGLU-OAI (§5.5)
        const float gt = std::min(gate[i], c_.swiglu_limit), u = std::clamp(up[i], -c_.swiglu_limit, c_.swiglu_limit);
        act[i] = rbf(gt / (1.f + std::exp(-c_.swiglu_alpha * gt)) * (u + c_.swiglu_beta));
      }
      h[size_t(j)] = gemv(W(lp(l) + "mlp.down_proj.weight"), act);
    }
  }
  head.assign(static_cast<size_t>(N), {});
  logits.assign(static_cast<size_t>(N), {});
  for (int j = 0; j < N; ++j) {
    head[size_t(j)] = add_norm(j, h[size_t(j)], W("final_norm.weight"), false);
    logits[size_t(j)] = gemv(W("lm_head"), head[size_t(j)]);
  }
}

std::vector<int32_t> DsparkOracle::greedy_drafts(int32_t anchor, const std::vector<Vec>& logits, float min_margin,
                                                 const int32_t* forced_prev) const {
  const Vec& w1 = W("markov_head.markov_w1.weight");
  const Vec& w2 = W("markov_head.markov_w2.weight");
  const int64_t rank = c_.markov_rank, V = c_.vocab_size;
  std::vector<int32_t> out(logits.size(), -2);
  int32_t prev = anchor;
  for (size_t j = 0; j < logits.size(); ++j) {
    int32_t best = -1, second = -1;
    std::vector<float> l(static_cast<size_t>(V));
    for (int64_t v = 0; v < V; ++v) {
      float b = 0;
      for (int64_t k = 0; k < rank; ++k) b += w1[size_t(prev * rank + k)] * w2[size_t(v * rank + k)];
      l[size_t(v)] = logits[j][size_t(v)] + b;
      if (best < 0 || l[size_t(v)] > l[size_t(best)]) second = best, best = int32_t(v);
      else if (second < 0 || l[size_t(v)] > l[size_t(second)]) second = int32_t(v);
    }
    const bool clear = l[size_t(best)] - l[size_t(second)] >= min_margin;
    if (clear) out[j] = best;
    if (forced_prev) {
      prev = forced_prev[j];
    } else {
      if (!clear) break;
      prev = best;
    }
  }
  return out;
}

}  // namespace m3rt::detail
