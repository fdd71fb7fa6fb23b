// DSpark draft model on the CPU, built from m3rt's ops. Math and layout: include/m3rt/dspark_model.h.
#include "m3rt/dspark_model.h"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstring>
#include <string>

#include "check/check_util.h"
#include "core/validate.h"
#include "m3rt/dspark_heads.h"
#include "m3rt/error.h"
#include "m3rt/msa_attention.h"

namespace m3rt {

namespace {

constexpr const char* kOp = "DsparkModel";
constexpr int kPage = kMsaPageSize;

// y[T, N] = bf16(x[T, K] . W[N, K]^T), fp32 accumulation over k in order.
Tensor linear(const TensorView& x, const TensorView& w) {
  const int64_t T = x.shape[0], K = x.shape[1], N = w.shape[0];
  Tensor y = Tensor::empty({T, N}, DType::kBFloat16);
  const uint16_t* xs = x.ptr<const uint16_t>();
  const uint16_t* ws = w.ptr<const uint16_t>();
  std::vector<float> xr(static_cast<size_t>(K));
  for (int64_t t = 0; t < T; ++t) {
    for (int64_t k = 0; k < K; ++k) xr[size_t(k)] = bf16_to_float(xs[t * x.stride[0] + k]);
    for (int64_t n = 0; n < N; ++n) {
      float acc = 0.f;
      const uint16_t* row = ws + n * K;
      for (int64_t k = 0; k < K; ++k) acc += xr[size_t(k)] * bf16_to_float(row[k]);
      y.ptr<uint16_t>()[t * N + n] = float_to_bf16(acc);
    }
  }
  return y;
}

// A checkpoint linear as a bf16 [rows, cols] tensor: copied, or dequantized from MXFP8.
Tensor bf16_linear(const DsparkCheckpoint& ck, const std::string& name) {
  const TensorView w = ck.dspark(name + ".weight");
  Tensor out = Tensor::empty(w.sizes(), DType::kBFloat16);
  if (w.dtype == DType::kBFloat16) {
    std::memcpy(out.data(), w.data, size_t(out.nbytes()));
    return out;
  }
  const TensorView s = ck.dspark(name + ".weight_scale_inv");
  const int64_t rows = w.shape[0], cols = w.shape[1], blocks = s.shape[1];
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t c = 0; c < cols; ++c) {
      const float scale = std::ldexp(1.f, int(s.ptr<const uint8_t>()[r * blocks + c / 32]) - 127);
      out.ptr<uint16_t>()[r * cols + c] = float_to_bf16(e4m3_to_float(w.ptr<const uint8_t>()[r * cols + c]) * scale);
    }
  return out;
}

Tensor copy_of(const TensorView& v) {
  Tensor t = Tensor::empty(v.sizes(), v.dtype);
  std::memcpy(t.data(), v.data, size_t(t.nbytes()));
  return t;
}

// Rows of `parts` stacked (all [*, cols] bf16).
Tensor stack_rows(const std::vector<Tensor>& parts) {
  int64_t rows = 0;
  const int64_t cols = parts[0].view().shape[1];
  for (const Tensor& p : parts) rows += p.view().shape[0];
  Tensor out = Tensor::empty({rows, cols}, DType::kBFloat16);
  int64_t at = 0;
  for (const Tensor& p : parts) {
    std::memcpy(out.ptr<uint16_t>() + at * cols, p.data(), size_t(p.nbytes()));
    at += p.view().shape[0];
  }
  return out;
}

struct Layer {
  Tensor in_ln, post_ln, q_norm, k_norm, w_qkv, w_o, w_gate_up, w_down;
};

}  // namespace

struct DsparkModel::Impl {
  DsparkConfig c;
  DsparkModelOptions opt;
  std::vector<Layer> layers;
  Tensor fc, hidden_norm, final_norm, w_kv_all, k_norm_all, conf_w, conf_b;
  TensorView embed, lm_head, w1, w2;  // views into the checkpoint's mapped files (never copied)
  Tensor cos_sin, k_scale, v_scale;
  std::vector<Tensor> caches;
  std::unique_ptr<DsparkContextKvWriter> writer;
  Timings times;
};

namespace {
double ms_since(std::chrono::steady_clock::time_point t0) {
  return std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
}
}  // namespace

DsparkModel::DsparkModel(const DsparkCheckpoint& ck, const DsparkModelOptions& opt) : impl_(std::make_unique<Impl>()) {
  Impl& m = *impl_;
  m.c = ck.config();
  m.opt = opt;
  const DsparkConfig& c = m.c;
  if (opt.num_cache_blocks < 1)
    throw_arg_error(kOp, "options.num_cache_blocks", std::to_string(opt.num_cache_blocks), "must be >= 1");
  const KvCacheDtype kd = opt.kv_cache_dtype;
  if (kd != KvCacheDtype::kAuto && kd != KvCacheDtype::kBFloat16 && kd != KvCacheDtype::kFp8E4M3)
    throw_arg_error(kOp, "options.kv_cache_dtype", kv_cache_dtype_name(kd), "auto/bfloat16 or fp8_e4m3");
  std::vector<Tensor> kv_rows, k_norms;
  for (int l = 0; l < c.num_layers; ++l) {
    const std::string p = "layers." + std::to_string(l) + ".decoder_layer.";
    Layer L;
    L.in_ln = copy_of(ck.dspark(p + "input_layernorm.weight"));
    L.post_ln = copy_of(ck.dspark(p + "post_attention_layernorm.weight"));
    L.q_norm = copy_of(ck.dspark(p + "self_attn.q_norm.weight"));
    L.k_norm = copy_of(ck.dspark(p + "self_attn.k_norm.weight"));
    const Tensor k = bf16_linear(ck, p + "self_attn.k_proj"), v = bf16_linear(ck, p + "self_attn.v_proj");
    L.w_qkv = stack_rows({bf16_linear(ck, p + "self_attn.q_proj"), k, v});
    L.w_o = bf16_linear(ck, p + "self_attn.o_proj");
    L.w_gate_up = stack_rows({bf16_linear(ck, p + "mlp.gate_proj"), bf16_linear(ck, p + "mlp.up_proj")});
    L.w_down = bf16_linear(ck, p + "mlp.down_proj");
    kv_rows.push_back(k);
    kv_rows.push_back(v);
    k_norms.push_back(L.k_norm);
    m.layers.push_back(std::move(L));
  }
  m.w_kv_all = stack_rows(kv_rows);  // [K_0; V_0; K_1; V_1; ...]
  m.k_norm_all = Tensor::empty({c.num_layers, c.head_dim}, DType::kBFloat16);
  for (int l = 0; l < c.num_layers; ++l)
    std::memcpy(m.k_norm_all.ptr<uint16_t>() + l * c.head_dim, k_norms[size_t(l)].data(), size_t(c.head_dim) * 2);
  m.fc = copy_of(ck.dspark("fc.weight"));
  m.hidden_norm = copy_of(ck.dspark("hidden_norm.weight"));
  m.final_norm = copy_of(ck.dspark("final_norm.weight"));
  m.w1 = ck.dspark("markov_head.markov_w1.weight");
  m.w2 = ck.dspark("markov_head.markov_w2.weight");
  if (c.confidence_head) {
    m.conf_w = copy_of(ck.dspark("confidence_head.proj.weight"));
    m.conf_b = copy_of(ck.dspark("confidence_head.proj.bias"));
  }
  m.embed = ck.tensor("language_model.model.embed_tokens.weight");
  m.lm_head = ck.tensor("language_model.lm_head.weight");
  m.cos_sin = detail::rope_table(c.max_position_embeddings, c.rotary_dim, float(c.rope_theta));
  m.k_scale = detail::scalar_f32(1.f);
  m.v_scale = detail::scalar_f32(1.f);
  const bool fp8 = kv_cache_is_fp8(kd);
  std::vector<DsparkDraftLayerKv> kv;
  for (int l = 0; l < c.num_layers; ++l) {
    Tensor cache = Tensor::empty({opt.num_cache_blocks, c.num_kv_heads, kPage, 2 * c.head_dim},
                                 fp8 ? DType::kUInt8 : DType::kBFloat16);
    cache.fill_bytes(0);
    m.caches.push_back(cache);
    kv.push_back({cache, kd, m.k_scale, m.v_scale});
  }
  m.writer = std::make_unique<DsparkContextKvWriter>(kv);
}

DsparkModel::~DsparkModel() = default;

const DsparkConfig& DsparkModel::config() const { return impl_->c; }
const DsparkModel::Timings& DsparkModel::last_timings() const { return impl_->times; }
const Tensor& DsparkModel::kv_cache(int layer) const { return impl_->caches.at(size_t(layer)); }

void DsparkModel::precompute_context(const TensorView& hidden, const TensorView& positions, const TensorView& slots) {
  using namespace detail;
  Impl& m = *impl_;
  const DsparkConfig& c = m.c;
  const int64_t H = c.hidden_size, n = int64_t(c.target_layer_ids.size());
  require_defined(kOp, "target_hidden", hidden);
  require_device(kOp, "target_hidden", hidden, Device::cpu());
  require_dtype(kOp, "target_hidden", hidden, {DType::kBFloat16});
  require_shape(kOp, "target_hidden", hidden, {-1, n * H});
  require_last_dim_contiguous(kOp, "target_hidden", hidden);
  const int64_t T = hidden.shape[0];
  require_index_vector(kOp, "positions", positions, T, Device::cpu());
  require_index_vector(kOp, "slots", slots, T, Device::cpu());
  if (T == 0) return;
  const auto t0 = std::chrono::steady_clock::now();
  const Tensor states = linear(hidden, m.fc);
  Tensor x = Tensor::empty({T, H}, DType::kBFloat16);
  gemma_rms_norm(x, states, m.hidden_norm, c.rms_norm_eps);
  const Tensor all_kv = linear(x, m.w_kv_all);
  const TensorView kv5 =
      TensorView::contiguous(all_kv.data(), DType::kBFloat16, {T, c.num_layers, 2, c.num_kv_heads, c.head_dim});
  (*m.writer)({.all_kv = kv5, .k_norm_weight = m.k_norm_all, .eps = c.rms_norm_eps, .positions = positions,
               .cos_sin_cache = m.cos_sin, .rotary_dim = c.rotary_dim, .slot_mapping = slots});
  m.times.precompute_ms = ms_since(t0);
}

void DsparkModel::draft(const DsparkDraftArgs& a) {
  using namespace detail;
  Impl& m = *impl_;
  const DsparkConfig& c = m.c;
  const Device cpu = Device::cpu();
  const int64_t H = c.hidden_size, N = c.block_size, V = c.vocab_size, D = c.head_dim;
  require_defined(kOp, "anchor_tokens", a.anchor_tokens);
  require_dtype(kOp, "anchor_tokens", a.anchor_tokens, {DType::kInt32});
  require_shape(kOp, "anchor_tokens", a.anchor_tokens, {-1});
  require_device(kOp, "anchor_tokens", a.anchor_tokens, cpu);
  const int64_t R = a.anchor_tokens.shape[0];
  require_index_vector(kOp, "anchor_positions", a.anchor_positions, R, cpu);
  require_defined(kOp, "block_slots", a.block_slots);
  require_device(kOp, "block_slots", a.block_slots, cpu);
  require_dtype(kOp, "block_slots", a.block_slots, {DType::kInt64});
  require_shape(kOp, "block_slots", a.block_slots, {R, N});
  require_contiguous(kOp, "block_slots", a.block_slots);
  require_defined(kOp, "block_table", a.block_table);
  require_device(kOp, "block_table", a.block_table, cpu);
  require_dtype(kOp, "block_table", a.block_table, {DType::kInt32});
  require_shape(kOp, "block_table", a.block_table, {R, -1});
  require_contiguous(kOp, "block_table", a.block_table);
  const int max_blocks = int(a.block_table.shape[1]);
  if (a.confidence.defined() && !c.confidence_head)
    throw_arg_error(kOp, "confidence", a.confidence.shape_str(), "the checkpoint has no confidence head");
  if (R == 0) return;
  const int64_t T = R * N;
  // Block rows: ids, positions, slots, and the attention lengths and block lists.
  Tensor ids = Tensor::empty({T}, DType::kInt32), pos = Tensor::empty({T}, DType::kInt64),
         slots = Tensor::empty({T}, DType::kInt64), lens = Tensor::empty({R}, DType::kInt32);
  constexpr int kTopk = kMsaMaxTopk;
  Tensor lists = Tensor::empty({c.num_kv_heads, T, kTopk}, DType::kInt32);
  std::fill(lists.ptr<int32_t>(), lists.ptr<int32_t>() + lists.numel(), -1);
  for (int64_t r = 0; r < R; ++r) {
    const int32_t anchor = a.anchor_tokens.ptr<const int32_t>()[r];
    const int64_t p = a.anchor_positions.ptr<const int64_t>()[r];
    const bool pad = anchor < 0;
    if (!pad && anchor >= V)
      throw_arg_error(kOp, "anchor_tokens[" + std::to_string(r) + "]", std::to_string(anchor), "must be < vocab_size");
    if (!pad && (p < 0 || p + N > c.max_position_embeddings))
      throw_arg_error(kOp, "anchor_positions[" + std::to_string(r) + "]", std::to_string(p),
                      "the block [p, p + " + std::to_string(N) + ") must lie in [0, max_position_embeddings)");
    const int64_t seq = pad ? 0 : p + N;
    if ((seq + kPage - 1) / kPage > max_blocks)
      throw_arg_error(kOp, "block_table.shape", a.block_table.shape_str(),
                      "request " + std::to_string(r) + " needs " + std::to_string((seq + kPage - 1) / kPage) + " blocks");
    lens.ptr<int32_t>()[r] = int32_t(seq);
    const int64_t first = pad ? 0 : (c.sliding_window > 0 ? std::max<int64_t>(0, p - c.sliding_window + 1) : 0) / kPage;
    const int64_t last = pad ? -1 : (seq - 1) / kPage;
    if (last - first + 1 > kTopk)
      throw_arg_error(kOp, "anchor_positions[" + std::to_string(r) + "]", std::to_string(p),
                      "the block's keys span more than " + std::to_string(kTopk) + " pages (no sliding window)");
    for (int64_t j = 0; j < N; ++j) {
      const int64_t t = r * N + j;
      ids.ptr<int32_t>()[t] = pad ? 0 : (j == 0 ? anchor : c.mask_token_id);
      pos.ptr<int64_t>()[t] = pad ? 0 : p + j;
      slots.ptr<int64_t>()[t] = pad ? -1 : a.block_slots.ptr<const int64_t>()[t];
      for (int g = 0; g < c.num_kv_heads; ++g)
        for (int64_t b = first; b <= last; ++b) lists.ptr<int32_t>()[(g * T + t) * kTopk + (b - first)] = int32_t(b);
    }
  }
  // Embedding rows (the target's table).
  auto t0 = std::chrono::steady_clock::now();
  Tensor h = Tensor::empty({T, H}, DType::kBFloat16);
  for (int64_t t = 0; t < T; ++t)
    std::memcpy(h.ptr<uint16_t>() + t * H, m.embed.ptr<const uint16_t>() + int64_t(ids.ptr<int32_t>()[t]) * H, size_t(H) * 2);
  Tensor residual = Tensor::empty({T, H}, DType::kBFloat16), x = Tensor::empty({T, H}, DType::kBFloat16);
  Tensor q = Tensor::empty({T, int64_t(c.num_heads) * D}, DType::kBFloat16);
  Tensor attn = Tensor::empty({T, c.num_heads, D}, DType::kBFloat16);
  Tensor act = Tensor::empty({T, int64_t(c.ffn_size)}, DType::kBFloat16);
  const KvCacheDtype kd = m.opt.kv_cache_dtype;
  MsaDecodePlan plan({.batch = int(R), .decode_query_len = int(N), .num_heads = c.num_heads,
                      .num_kv_heads = c.num_kv_heads, .topk = kTopk, .max_blocks = max_blocks, .kv_cache_dtype = kd},
                     cpu);
  for (int l = 0; l < c.num_layers; ++l) {
    const Layer& L = m.layers[size_t(l)];
    if (l == 0) {
      std::memcpy(residual.data(), h.data(), size_t(h.nbytes()));
      gemma_rms_norm(x, h, L.in_ln, c.rms_norm_eps);
    } else {
      gemma_fused_add_rms_norm(x, h, residual, L.in_ln, c.rms_norm_eps);
    }
    Tensor qkv = linear(x, L.w_qkv);
    qknorm_rope_kv_insert({.qkv = qkv, .q_norm_weight = L.q_norm, .k_norm_weight = L.k_norm, .cos_sin_cache = m.cos_sin,
                           .positions = pos, .num_heads = c.num_heads, .num_kv_heads = c.num_kv_heads,
                           .rotary_dim = c.rotary_dim, .eps = c.rms_norm_eps, .q_out = q, .slot_mapping = slots,
                           .kv_cache = m.caches[size_t(l)], .kv_cache_dtype = kd, .k_scale = m.k_scale,
                           .v_scale = m.v_scale});
    const TensorView q3 = TensorView::contiguous(q.data(), DType::kBFloat16, {T, c.num_heads, D});
    plan.run({.q = q3, .cache = {m.caches[size_t(l)], kd, m.k_scale, m.v_scale}, .topk = lists, .seq_lens = lens,
              .block_table = a.block_table, .softmax_scale = 1.f / std::sqrt(float(D)),
              .mask = {.causal = m.opt.causal_block, .window_left = c.sliding_window}, .out = attn});
    const Tensor o = linear(TensorView::contiguous(attn.data(), DType::kBFloat16, {T, int64_t(c.num_heads) * D}), L.w_o);
    gemma_fused_add_rms_norm(x, o, residual, L.post_ln, c.rms_norm_eps);
    const Tensor gate_up = linear(x, L.w_gate_up);
    swiglu_oai(act, gate_up, {.alpha = c.swiglu_alpha, .limit = c.swiglu_limit, .beta = c.swiglu_beta});
    h = linear(act, L.w_down);
  }
  m.times.backbone_ms = ms_since(t0);
  t0 = std::chrono::steady_clock::now();
  Tensor head = Tensor::empty({T, H}, DType::kBFloat16);
  gemma_fused_add_rms_norm(head, h, residual, m.final_norm, c.rms_norm_eps);
  const Tensor logits = linear(head, m.lm_head);
  m.times.lm_head_ms = ms_since(t0);
  t0 = std::chrono::steady_clock::now();
  const TensorView logits3 = TensorView::contiguous(logits.data(), DType::kBFloat16, {R, N, V});
  const TensorView head3 = TensorView::contiguous(head.data(), DType::kBFloat16, {R, N, H});
  DsparkHeadsArgs ha{.base_logits = logits3, .w1 = m.w1, .w2 = m.w2, .anchor_tokens = a.anchor_tokens,
                     .anchor_positions = a.anchor_positions, .temperatures = a.temperatures, .seeds = a.seeds,
                     .draft_tokens = a.draft_tokens, .draft_probs = a.draft_probs};
  if (a.confidence.defined()) {
    ha.head_hidden = head3;
    ha.conf_w = m.conf_w;
    ha.conf_b = m.conf_b;
    ha.confidence = a.confidence;
  }
  dspark_markov_heads(ha);
  m.times.heads_ms = ms_since(t0);
  if (a.head_hidden.defined()) {
    require_shape(kOp, "head_hidden", a.head_hidden, {T, H});
    require_dtype(kOp, "head_hidden", a.head_hidden, {DType::kBFloat16});
    require_contiguous(kOp, "head_hidden", a.head_hidden);
    std::memcpy(a.head_hidden.data, head.data(), size_t(head.nbytes()));
  }
  if (a.base_logits.defined()) {
    require_shape(kOp, "base_logits", a.base_logits, {R, N, V});
    require_dtype(kOp, "base_logits", a.base_logits, {DType::kBFloat16});
    require_contiguous(kOp, "base_logits", a.base_logits);
    std::memcpy(a.base_logits.data, logits.data(), size_t(logits.nbytes()));
  }
}

}  // namespace m3rt
