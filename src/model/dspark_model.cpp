// DSpark draft model on the CPU or a CUDA GPU, built from m3rt's ops. Math and layout:
// include/m3rt/dspark_model.h. The forward (backbone, LM head) is one piece of code for both
// devices; the devices differ in the GEMMs (plain loops / cuBLASLt), the block-row preparation
// (host loop that throws / device kernel that flags), the heads (CPU reference / device kernels)
// and the GPU's static buffers and graphs.
#include "m3rt/dspark_model.h"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstring>
#include <functional>
#include <map>
#include <string>

#include "check/check_util.h"
#include "core/validate.h"
#include "m3rt/dspark_heads.h"
#include "m3rt/error.h"
#include "m3rt/msa_attention.h"
#include "model/dspark_hash.h"

#ifdef M3RT_WITH_CUDA
#include <cuda_runtime_api.h>

#include "core/cuda_check.h"
#include "model/dspark_draft_kernels.h"
#include "model/lt_gemm.h"
#endif

namespace m3rt {

namespace {

constexpr const char* kOp = "DsparkModel";
constexpr int kPage = kMsaPageSize;
constexpr int kTopk = kMsaMaxTopk;

// y[T, N] = bf16(x[T, K] . W[N, K]^T), fp32 accumulation over k in order (host tensors).
void linear_cpu(const TensorView& y, const TensorView& x, const TensorView& w) {
  const int64_t T = x.shape[0], K = x.shape[1], N = w.shape[0];
  const uint16_t* xs = x.ptr<const uint16_t>();
  const uint16_t* ws = w.ptr<const uint16_t>();
  std::vector<float> xr(static_cast<size_t>(K));
  for (int64_t t = 0; t < T; ++t) {
    for (int64_t k = 0; k < K; ++k) xr[size_t(k)] = bf16_to_float(xs[t * x.stride[0] + k]);
    for (int64_t n = 0; n < N; ++n) {
      float acc = 0.f;
      const uint16_t* row = ws + n * K;
      for (int64_t k = 0; k < K; ++k) acc += xr[size_t(k)] * bf16_to_float(row[k]);
      y.ptr<uint16_t>()[t * y.stride[0] + n] = float_to_bf16(acc);
    }
  }
}

// A checkpoint linear as a host bf16 [rows, cols] tensor: copied, or dequantized from MXFP8.
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

// Byte copy between two tensors' memory on one device (host memcpy or cudaMemcpy).
void copy_bytes(void* dst, const void* src, int64_t bytes, Device device) {
  if (!device.is_cuda()) {
    std::memcpy(dst, src, size_t(bytes));
    return;
  }
#ifdef M3RT_WITH_CUDA
  M3RT_CUDA_CHECK(cudaMemcpy(dst, src, size_t(bytes), cudaMemcpyDeviceToDevice));
#endif
}

// `parts` (bf16, each [rows_i, cols] or [cols]) stacked into [sum rows_i, cols], on their device.
Tensor stack_rows(const std::vector<Tensor>& parts, int64_t cols) {
  int64_t rows = 0;
  for (const Tensor& p : parts) rows += p.numel() / cols;
  const Device dev = parts[0].device();
  Tensor out = Tensor::empty({rows, cols}, DType::kBFloat16, dev);
  int64_t at = 0;
  for (const Tensor& p : parts) {
    copy_bytes(static_cast<char*>(out.data()) + at, p.data(), p.nbytes(), dev);
    at += p.nbytes();
  }
  return out;
}

// The first n rows of a contiguous buffer, viewed with `shape` (shape[0] replaced by n).
[[maybe_unused]] TensorView rows(const Tensor& t, int64_t n, std::vector<int64_t> shape = {}) {
  if (shape.empty()) shape = t.view().sizes();
  shape[0] = n;
  return TensorView::contiguous(t.data(), t.view().dtype, shape, t.device());
}

struct Layer {
  Tensor in_ln, post_ln, q_norm, k_norm, w_qkv, w_o, w_gate_up, w_down;
};

// Views of one draft step's buffers (T = R * N block rows).
struct Work {
  int64_t R = 0, T = 0;
  TensorView ids, pos, slots, lens, lists, table;
  TensorView h, residual, x, qkv, q, attn, o, gate_up, act, head, logits;
  TensorView claims;  // the GPU's claim counters (GpuState::claims); none on the CPU
  MsaDecodePlan* plan = nullptr;
};

double ms_since(std::chrono::steady_clock::time_point t0) {
  return std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
}

[[maybe_unused]] int64_t pow2_at_least(int64_t n) {
  int64_t p = 1;
  while (p < n) p *= 2;
  return p;
}

}  // namespace

#ifdef M3RT_WITH_CUDA
// The GPU model's stream, events, GEMM runner, static step buffers and graphs.
struct GpuState {
  explicit GpuState(Device d) : gemm(d) {}
  ~GpuState() {
    for (auto& [p, g] : graphs) cudaGraphExecDestroy(g);
    for (cudaEvent_t e : {ev_in, ev_out, st[0], st[1], st[2], st[3], pre[0], pre[1]})
      if (e) cudaEventDestroy(e);
    if (s) cudaStreamDestroy(s);
  }
  cudaStream_t s = nullptr;
  cudaEvent_t ev_in = nullptr, ev_out = nullptr, st[4] = {}, pre[2] = {};
  bool draft_timed = false, pre_timed = false;
  detail::LtGemm gemm;
  int B = 0, MB = 0;  // max batch, block-table width
  Tensor anchors, apos, bslots, table, temps, seeds;
  Tensor ids, pos, slots, lens, lists, prev, e, errors;
  Tensor h, residual, x, qkv, q, attn, o, gate_up, act, head, logits, bias, mlog, part_key, part_idx, counters, tokens, conf;
  Tensor pre_states, pre_x, pre_kv;  // precompute scratch, grown on demand
  // The context writer's and the QK insert's claim counters (ops.h, claim_counters): zeros that every
  // call leaves zero; one buffer serves them all, as every call runs on stream s (graphs included).
  Tensor claims;
  std::map<int64_t, std::unique_ptr<MsaDecodePlan>> plans;
  std::map<int64_t, cudaGraphExec_t> graphs;
};
#else
struct GpuState {};
#endif

struct DsparkModel::Impl {
  DsparkConfig c;
  DsparkModelOptions opt;
  Device dev;
  std::vector<Layer> layers;
  Tensor fc, hidden_norm, final_norm, w_kv_all, k_norm_all, conf_w, conf_b;
  std::vector<Tensor> owned;          // the embedding, LM head and Markov tables when copied
  TensorView embed, lm_head, w1, w2;  // CPU + checkpoint: views into its mapped files
  Tensor cos_sin, k_scale, v_scale;
  std::vector<Tensor> caches;
  std::unique_ptr<DsparkContextKvWriter> writer;
  Timings times;
  std::chrono::steady_clock::time_point marks[4];  // CPU stage boundaries (record())
  std::unique_ptr<GpuState> gpu;

  bool on_gpu() const { return dev.is_cuda(); }
  void build(const std::function<Tensor(const std::string&, const std::vector<int64_t>&, float)>& get,
             const std::function<TensorView(const std::string&, const std::vector<int64_t>&, float)>& shared);
  // tune: the draft step's fixed shapes pick their fastest cuBLASLt algorithm on first use.
  void linear(const TensorView& y, const TensorView& x, const TensorView& w, stream_t s, bool tune = true);
  void forward(const Work& w, stream_t s);
  void record(int stage, stream_t s);
  void begin(const DsparkConfig& config, const DsparkModelOptions& options);  // checks, stores
  void finish();
#ifdef M3RT_WITH_CUDA
  void init_gpu();
  Work gpu_work(int64_t P);
  void enqueue_gpu_step(int64_t P, cudaStream_t s);
  void draft_gpu(const DsparkDraftArgs& a, int64_t R, stream_t stream);
  void precompute_gpu(const TensorView& hidden, const TensorView& positions, const TensorView& slots, stream_t stream);
#endif
};

// ---- construction -------------------------------------------------------------------------------

void DsparkModel::Impl::build(
    const std::function<Tensor(const std::string&, const std::vector<int64_t>&, float)>& get,
    const std::function<TensorView(const std::string&, const std::vector<int64_t>&, float)>& shared) {
  const DsparkConfig& k = c;
  const int64_t H = k.hidden_size, D = k.head_dim, F = k.ffn_size, nq = k.num_heads, nkv = k.num_kv_heads;
  auto fan = [](int64_t fan_in) { return std::sqrt(3.f / float(fan_in)); };
  std::vector<Tensor> kv_rows, k_norms;
  for (int l = 0; l < k.num_layers; ++l) {
    const std::string p = "layers." + std::to_string(l) + ".decoder_layer.";
    Layer L;
    L.in_ln = get(p + "input_layernorm.weight", {H}, 0.1f);
    L.post_ln = get(p + "post_attention_layernorm.weight", {H}, 0.1f);
    L.q_norm = get(p + "self_attn.q_norm.weight", {D}, 0.1f);
    L.k_norm = get(p + "self_attn.k_norm.weight", {D}, 0.1f);
    const Tensor kw = get(p + "self_attn.k_proj", {nkv * D, H}, fan(H));
    const Tensor vw = get(p + "self_attn.v_proj", {nkv * D, H}, fan(H));
    L.w_qkv = stack_rows({get(p + "self_attn.q_proj", {nq * D, H}, fan(H)), kw, vw}, H);
    L.w_o = get(p + "self_attn.o_proj", {H, nq * D}, fan(nq * D));
    L.w_gate_up = stack_rows({get(p + "mlp.gate_proj", {F, H}, fan(H)), get(p + "mlp.up_proj", {F, H}, fan(H))}, H);
    L.w_down = get(p + "mlp.down_proj", {H, F}, fan(F));
    kv_rows.push_back(kw);
    kv_rows.push_back(vw);
    k_norms.push_back(L.k_norm);
    layers.push_back(std::move(L));
  }
  w_kv_all = stack_rows(kv_rows, H);  // [K_0; V_0; K_1; V_1; ...]
  k_norm_all = stack_rows(k_norms, D);
  const int64_t n_t = int64_t(k.target_layer_ids.size());
  fc = get("fc", {H, n_t * H}, fan(n_t * H));
  hidden_norm = get("hidden_norm.weight", {H}, 0.1f);
  final_norm = get("final_norm.weight", {H}, 0.1f);
  w1 = shared("markov_head.markov_w1.weight", {k.vocab_size, k.markov_rank}, 1.f);
  w2 = shared("markov_head.markov_w2.weight", {k.vocab_size, k.markov_rank}, fan(k.markov_rank));
  if (k.confidence_head) {
    conf_w = get("confidence_head.proj.weight", {1, H + (k.confidence_with_markov ? k.markov_rank : 0)}, fan(H));
    conf_b = get("confidence_head.proj.bias", {1}, 0.1f);
  }
  embed = shared("language_model.model.embed_tokens.weight", {k.vocab_size, H}, 1.f);
  lm_head = shared("language_model.lm_head.weight", {k.vocab_size, H}, fan(H));
}

namespace {
void check_options(const DsparkModelOptions& opt) {
  if (opt.num_cache_blocks < 1)
    throw_arg_error(kOp, "options.num_cache_blocks", std::to_string(opt.num_cache_blocks), "must be >= 1");
  const KvCacheDtype kd = opt.kv_cache_dtype;
  if (kd != KvCacheDtype::kAuto && kd != KvCacheDtype::kBFloat16 && kd != KvCacheDtype::kFp8E4M3)
    throw_arg_error(kOp, "options.kv_cache_dtype", kv_cache_dtype_name(kd), "auto/bfloat16 or fp8_e4m3");
  if (opt.device.is_cuda()) {
    if (!built_with_cuda()) throw_arg_error(kOp, "options.device", opt.device.str(), "cpu (m3rt was built without CUDA)");
    if (opt.device.index < 0 || opt.device.index >= cuda_device_count())
      throw_arg_error(kOp, "options.device", opt.device.str(),
                      "cpu or one of the " + std::to_string(cuda_device_count()) + " CUDA devices");
    if (opt.max_batch < 1 || opt.max_batch > 4096)
      throw_arg_error(kOp, "options.max_batch", std::to_string(opt.max_batch), "1..4096");
    if (opt.max_blocks_per_request < 0)
      throw_arg_error(kOp, "options.max_blocks_per_request", std::to_string(opt.max_blocks_per_request),
                      ">= 0 (0: num_cache_blocks)");
  }
}

// Gemma norm weights and linears; the shape a checkpoint tensor must have was checked by the loader.
Tensor checkpoint_tensor(const DsparkCheckpoint& ck, const std::string& name, Device dev) {
  auto ends = [&](std::string_view suffix) {
    return name.size() >= suffix.size() && name.compare(name.size() - suffix.size(), suffix.size(), suffix) == 0;
  };
  // Names without a .weight / .bias suffix are linears (bf16, or MXFP8 with their scales).
  Tensor t = ends(".weight") || ends(".bias") ? copy_of(ck.dspark(name)) : bf16_linear(ck, name);
  return dev.is_cuda() ? t.to(dev) : t;
}

Tensor random_tensor(const std::vector<int64_t>& shape, float a, uint64_t seed, Device dev) {
  Tensor t = Tensor::empty(shape, DType::kBFloat16, dev);
  if (dev.is_cuda()) {
#ifdef M3RT_WITH_CUDA
    detail::launch_fill_random_bf16(t.ptr<uint16_t>(), t.numel(), seed, a, nullptr);
#endif
  } else {
    for (int64_t i = 0; i < t.numel(); ++i) t.ptr<uint16_t>()[i] = float_to_bf16(a * detail::uniform_pm1(seed, uint64_t(i)));
  }
  return t;
}
}  // namespace

namespace {
// The model's device current for the scope of a constructor (nothing on the CPU).
class DeviceScope {
 public:
  explicit DeviceScope(Device d) {
#ifdef M3RT_WITH_CUDA
    if (d.is_cuda()) guard_ = std::make_unique<detail::DeviceGuard>(d.index);
#else
    (void)d;
#endif
  }

 private:
#ifdef M3RT_WITH_CUDA
  std::unique_ptr<detail::DeviceGuard> guard_;
#endif
};
}  // namespace

void DsparkModel::Impl::begin(const DsparkConfig& config, const DsparkModelOptions& options) {
  check_options(options);
  c = config;
  opt = options;
  dev = options.device;
}

DsparkModel::DsparkModel(const DsparkCheckpoint& ck, const DsparkModelOptions& opt) : impl_(std::make_unique<Impl>()) {
  Impl& m = *impl_;
  m.begin(ck.config(), opt);
  const DeviceScope scope(m.dev);
  m.build([&](const std::string& name, const std::vector<int64_t>&, float) { return checkpoint_tensor(ck, name, m.dev); },
          [&](const std::string& name, const std::vector<int64_t>&, float) -> TensorView {
            const TensorView v = name.rfind("language_model.", 0) == 0 ? ck.tensor(name) : ck.dspark(name);
            if (!m.on_gpu()) return v;  // a view into the mapped file
            m.owned.push_back(copy_of(v).to(m.dev));
            return m.owned.back().view();
          });
  m.finish();
}

DsparkModel::DsparkModel(const DsparkConfig& config, const DsparkModelOptions& opt, uint64_t seed)
    : impl_(std::make_unique<Impl>()) {
  Impl& m = *impl_;
  m.begin(config, opt);
  const DeviceScope scope(m.dev);
  uint64_t n = 0;
  auto next = [&] { return detail::splitmix64(seed + 0x5851f42d4c957f2dull * ++n); };
  m.build([&](const std::string&, const std::vector<int64_t>& shape, float a) { return random_tensor(shape, a, next(), m.dev); },
          [&](const std::string&, const std::vector<int64_t>& shape, float a) -> TensorView {
            m.owned.push_back(random_tensor(shape, a, next(), m.dev));
            return m.owned.back().view();
          });
  m.finish();
}

void DsparkModel::Impl::finish() {
  cos_sin = detail::rope_table(c.max_position_embeddings, c.rotary_dim, float(c.rope_theta));
  k_scale = detail::scalar_f32(1.f);
  v_scale = detail::scalar_f32(1.f);
  if (on_gpu()) cos_sin = cos_sin.to(dev), k_scale = k_scale.to(dev), v_scale = v_scale.to(dev);
  const KvCacheDtype kd = opt.kv_cache_dtype;
  const bool fp8 = kv_cache_is_fp8(kd);
  std::vector<DsparkDraftLayerKv> kv;
  for (int l = 0; l < c.num_layers; ++l) {
    Tensor cache = Tensor::empty({opt.num_cache_blocks, c.num_kv_heads, kPage, 2 * c.head_dim},
                                 fp8 ? DType::kUInt8 : DType::kBFloat16, dev);
    cache.fill_bytes(0);
    caches.push_back(cache);
    kv.push_back({cache, kd, k_scale, v_scale});
  }
  writer = std::make_unique<DsparkContextKvWriter>(kv);
#ifdef M3RT_WITH_CUDA
  if (on_gpu()) init_gpu();
#endif
}

DsparkModel::~DsparkModel() = default;

const DsparkConfig& DsparkModel::config() const { return impl_->c; }
const DsparkModelOptions& DsparkModel::options() const { return impl_->opt; }
const Tensor& DsparkModel::kv_cache(int layer) const { return impl_->caches.at(size_t(layer)); }

int64_t DsparkModel::draft_weight_bytes() const {
  const Impl& m = *impl_;
  int64_t bytes = m.final_norm.nbytes() + m.conf_w.nbytes() + m.conf_b.nbytes();
  for (const Layer& L : m.layers)
    for (const Tensor* t : {&L.in_ln, &L.post_ln, &L.q_norm, &L.k_norm, &L.w_qkv, &L.w_o, &L.w_gate_up, &L.w_down})
      bytes += t->nbytes();
  bytes += m.lm_head.numel() * 2 + int64_t(m.c.block_size) * m.w2.numel() * 2;
  return bytes;
}

int DsparkModel::graphs_captured() const {
#ifdef M3RT_WITH_CUDA
  if (impl_->gpu) return int(impl_->gpu->graphs.size());
#endif
  return 0;
}

// ---- the forward, shared by both devices --------------------------------------------------------

void DsparkModel::Impl::linear(const TensorView& y, const TensorView& x, const TensorView& w,
                               [[maybe_unused]] stream_t s, [[maybe_unused]] bool tune) {
  if (!on_gpu()) return linear_cpu(y, x, w);
#ifdef M3RT_WITH_CUDA
  gpu->gemm.run(y, x, w, s, tune && opt.tune_gemms);
#endif
}

// Stage boundaries of the draft step (0 start, 1 after the layers, 2 after the LM head, 3 end).
// GPU: an event (an event node when captured); CPU: the host clock.
void DsparkModel::Impl::record(int stage, stream_t s) {
#ifdef M3RT_WITH_CUDA
  if (on_gpu()) {
    // Inside a capture the record must be an external event node; outside, a plain record.
    const auto cs = reinterpret_cast<cudaStream_t>(s);
    cudaStreamCaptureStatus capturing = cudaStreamCaptureStatusNone;
    M3RT_CUDA_CHECK(cudaStreamIsCapturing(cs, &capturing));
    if (capturing == cudaStreamCaptureStatusActive)
      M3RT_CUDA_CHECK(cudaEventRecordWithFlags(gpu->st[stage], cs, cudaEventRecordExternal));
    else
      M3RT_CUDA_CHECK(cudaEventRecord(gpu->st[stage], cs));
    return;
  }
#endif
  (void)s;
  marks[stage] = std::chrono::steady_clock::now();
}

void DsparkModel::Impl::forward(const Work& w, stream_t s) {
  const int64_t H = c.hidden_size, D = c.head_dim, T = w.T;
  // The embedding rows, also the first layer's residual.
  if (on_gpu()) {
#ifdef M3RT_WITH_CUDA
    detail::launch_embed_rows(w.h.ptr<uint16_t>(), w.residual.ptr<uint16_t>(), embed.ptr<const uint16_t>(),
                              w.ids.ptr<const int32_t>(), int(T), int(H), s);
#endif
  } else {
    for (int64_t t = 0; t < T; ++t)
      std::memcpy(w.h.ptr<uint16_t>() + t * H, embed.ptr<const uint16_t>() + int64_t(w.ids.ptr<int32_t>()[t]) * H,
                  size_t(H) * 2);
    std::memcpy(w.residual.data, w.h.data, size_t(T * H * 2));
  }
  const KvCacheDtype kd = opt.kv_cache_dtype;
  const float eps = c.rms_norm_eps;
  for (int l = 0; l < c.num_layers; ++l) {
    const Layer& L = layers[size_t(l)];
    if (l == 0) {
      gemma_rms_norm(w.x, w.h, L.in_ln, eps, s);
    } else {
      gemma_fused_add_rms_norm(w.x, w.h, w.residual, L.in_ln, eps, s);
    }
    linear(w.qkv, w.x, L.w_qkv, s);
    qknorm_rope_kv_insert({.qkv = w.qkv, .q_norm_weight = L.q_norm, .k_norm_weight = L.k_norm, .cos_sin_cache = cos_sin,
                           .positions = w.pos, .num_heads = c.num_heads, .num_kv_heads = c.num_kv_heads,
                           .rotary_dim = c.rotary_dim, .eps = eps, .q_out = w.q, .slot_mapping = w.slots,
                           .kv_cache = caches[size_t(l)], .kv_cache_dtype = kd, .k_scale = k_scale, .v_scale = v_scale,
                           .claim_counters = w.claims},
                          s);
    const TensorView q3 = TensorView::contiguous(w.q.data, DType::kBFloat16, {T, c.num_heads, D}, dev);
    w.plan->run({.q = q3, .cache = {caches[size_t(l)], kd, k_scale, v_scale}, .topk = w.lists, .seq_lens = w.lens,
                 .block_table = w.table, .softmax_scale = 1.f / std::sqrt(float(D)),
                 .mask = {.causal = opt.causal_block, .window_left = c.sliding_window}, .out = w.attn},
                s);
    linear(w.o, TensorView::contiguous(w.attn.data, DType::kBFloat16, {T, int64_t(c.num_heads) * D}, dev), L.w_o, s);
    gemma_fused_add_rms_norm(w.x, w.o, w.residual, L.post_ln, eps, s);
    linear(w.gate_up, w.x, L.w_gate_up, s);
    swiglu_oai(w.act, w.gate_up, {.alpha = c.swiglu_alpha, .limit = c.swiglu_limit, .beta = c.swiglu_beta}, s);
    linear(w.h, w.act, L.w_down, s);
  }
  record(1, s);
  gemma_fused_add_rms_norm(w.head, w.h, w.residual, final_norm, eps, s);
  linear(w.logits, w.head, lm_head, s);
  record(2, s);
}

// ---- precompute ---------------------------------------------------------------------------------

void DsparkModel::precompute_context(const TensorView& hidden, const TensorView& positions, const TensorView& slots,
                                     stream_t stream) {
  using namespace detail;
  Impl& m = *impl_;
  const DsparkConfig& c = m.c;
  const int64_t H = c.hidden_size, n = int64_t(c.target_layer_ids.size());
  require_defined(kOp, "target_hidden", hidden);
  require_device(kOp, "target_hidden", hidden, m.dev);
  require_dtype(kOp, "target_hidden", hidden, {DType::kBFloat16});
  require_shape(kOp, "target_hidden", hidden, {-1, n * H});
  require_last_dim_contiguous(kOp, "target_hidden", hidden);
  const int64_t T = hidden.shape[0];
  require_index_vector(kOp, "positions", positions, T, m.dev);
  require_index_vector(kOp, "slots", slots, T, m.dev);
  if (T == 0) return;
#ifdef M3RT_WITH_CUDA
  if (m.on_gpu()) return m.precompute_gpu(hidden, positions, slots, stream);
#endif
  const auto t0 = std::chrono::steady_clock::now();
  Tensor states = Tensor::empty({T, H}, DType::kBFloat16), x = Tensor::empty({T, H}, DType::kBFloat16);
  Tensor all_kv = Tensor::empty({T, m.w_kv_all.view().shape[0]}, DType::kBFloat16);
  m.linear(states, hidden, m.fc, stream);
  gemma_rms_norm(x, states, m.hidden_norm, c.rms_norm_eps);
  m.linear(all_kv, x, m.w_kv_all, stream);
  const TensorView kv5 =
      TensorView::contiguous(all_kv.data(), DType::kBFloat16, {T, c.num_layers, 2, c.num_kv_heads, c.head_dim});
  (*m.writer)({.all_kv = kv5, .k_norm_weight = m.k_norm_all, .eps = c.rms_norm_eps, .positions = positions,
               .cos_sin_cache = m.cos_sin, .rotary_dim = c.rotary_dim, .slot_mapping = slots});
  m.times.precompute_ms = ms_since(t0);
}

// ---- draft --------------------------------------------------------------------------------------

namespace {
// Host-side checks of the draft arguments (shapes, dtypes, devices); returns R.
int64_t check_draft_args(const DsparkDraftArgs& a, const DsparkConfig& c, Device dev) {
  using namespace detail;
  const int64_t N = c.block_size, V = c.vocab_size, H = c.hidden_size;
  require_defined(kOp, "anchor_tokens", a.anchor_tokens);
  require_dtype(kOp, "anchor_tokens", a.anchor_tokens, {DType::kInt32});
  require_shape(kOp, "anchor_tokens", a.anchor_tokens, {-1});
  require_device(kOp, "anchor_tokens", a.anchor_tokens, dev);
  require_contiguous(kOp, "anchor_tokens", a.anchor_tokens);
  const int64_t R = a.anchor_tokens.shape[0];
  require_index_vector(kOp, "anchor_positions", a.anchor_positions, R, dev);
  require_contiguous(kOp, "anchor_positions", a.anchor_positions);
  auto mat = [&](const char* name, const TensorView& t, DType dt, std::initializer_list<int64_t> shape) {
    require_defined(kOp, name, t);
    require_device(kOp, name, t, dev);
    require_dtype(kOp, name, t, {dt});
    require_shape(kOp, name, t, shape);
    require_contiguous(kOp, name, t);
  };
  mat("block_slots", a.block_slots, DType::kInt64, {R, N});
  mat("block_table", a.block_table, DType::kInt32, {R, -1});
  mat("temperatures", a.temperatures, DType::kFloat32, {R});
  mat("seeds", a.seeds, DType::kInt64, {R});
  mat("draft_tokens", a.draft_tokens, DType::kInt32, {R, N});
  if (a.draft_probs.defined()) mat("draft_probs", a.draft_probs, DType::kFloat32, {R, N, V});
  if (a.confidence.defined()) {
    if (!c.confidence_head)
      throw_arg_error(kOp, "confidence", a.confidence.shape_str(), "the checkpoint has no confidence head");
    mat("confidence", a.confidence, DType::kFloat32, {R, N});
  }
  if (a.head_hidden.defined()) mat("head_hidden", a.head_hidden, DType::kBFloat16, {R * N, H});
  if (a.base_logits.defined()) mat("base_logits", a.base_logits, DType::kBFloat16, {R, N, V});
  return R;
}
}  // namespace

void DsparkModel::draft(const DsparkDraftArgs& a, stream_t stream) {
  Impl& m = *impl_;
  const DsparkConfig& c = m.c;
  const int64_t R = check_draft_args(a, c, m.dev);
  if (R == 0) return;
#ifdef M3RT_WITH_CUDA
  if (m.on_gpu()) return m.draft_gpu(a, R, stream);
#endif
  const int64_t H = c.hidden_size, N = c.block_size, V = c.vocab_size;
  const int max_blocks = int(a.block_table.shape[1]);
  const int64_t T = R * N;
  // Block rows: ids, positions, slots, and the attention lengths and block lists.
  Work w;
  w.R = R, w.T = T;
  Tensor ids = Tensor::empty({T}, DType::kInt32), pos = Tensor::empty({T}, DType::kInt64),
         slots = Tensor::empty({T}, DType::kInt64), lens = Tensor::empty({R}, DType::kInt32);
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
    const float temp = a.temperatures.ptr<const float>()[r];
    if (!pad && (!(temp >= 0.f) || !std::isfinite(temp)))
      throw_arg_error(kOp, "temperatures[" + std::to_string(r) + "]", std::to_string(temp), "must be finite and >= 0");
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
    for (int64_t b = first; b <= last; ++b) {
      const int32_t page = a.block_table.ptr<const int32_t>()[r * max_blocks + b];
      if (page < 0 || page >= m.opt.num_cache_blocks)
        throw_arg_error(kOp, "block_table[" + std::to_string(r) + "][" + std::to_string(b) + "]", std::to_string(page),
                        "must be in [0, num_cache_blocks = " + std::to_string(m.opt.num_cache_blocks) + ")");
    }
    for (int64_t j = 0; j < N; ++j) {
      const int64_t t = r * N + j;
      const int64_t slot = a.block_slots.ptr<const int64_t>()[t];
      if (!pad && slot >= int64_t(m.opt.num_cache_blocks) * kPage)
        throw_arg_error(kOp, "block_slots[" + std::to_string(r) + "][" + std::to_string(j) + "]", std::to_string(slot),
                        "must be < num_cache_blocks * 128 (negative: not cached)");
      ids.ptr<int32_t>()[t] = pad ? 0 : (j == 0 ? anchor : c.mask_token_id);
      pos.ptr<int64_t>()[t] = pad ? 0 : p + j;
      slots.ptr<int64_t>()[t] = pad ? -1 : slot;
      for (int g = 0; g < c.num_kv_heads; ++g)
        for (int64_t b = first; b <= last; ++b) lists.ptr<int32_t>()[(g * T + t) * kTopk + (b - first)] = int32_t(b);
    }
  }
  auto bf16 = [](std::initializer_list<int64_t> shape) { return Tensor::empty(shape, DType::kBFloat16); };
  Tensor h = bf16({T, H}), residual = bf16({T, H}), x = bf16({T, H}), o = bf16({T, H}), head = bf16({T, H});
  Tensor qkv = bf16({T, int64_t(c.num_heads + 2 * c.num_kv_heads) * c.head_dim});
  Tensor q = bf16({T, int64_t(c.num_heads) * c.head_dim}), attn = bf16({T, c.num_heads, c.head_dim});
  Tensor gate_up = bf16({T, 2 * int64_t(c.ffn_size)}), act = bf16({T, int64_t(c.ffn_size)}), logits = bf16({T, V});
  MsaDecodePlan plan({.batch = int(R), .decode_query_len = int(N), .num_heads = c.num_heads,
                      .num_kv_heads = c.num_kv_heads, .topk = kTopk, .max_blocks = max_blocks,
                      .kv_cache_dtype = m.opt.kv_cache_dtype},
                     m.dev);
  w.ids = ids, w.pos = pos, w.slots = slots, w.lens = lens, w.lists = lists, w.table = a.block_table;
  w.h = h, w.residual = residual, w.x = x, w.qkv = qkv, w.q = q, w.attn = attn, w.o = o, w.gate_up = gate_up;
  w.act = act, w.head = head, w.logits = logits, w.plan = &plan;
  m.record(0, stream);
  m.forward(w, stream);
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
  m.record(3, stream);
  auto ms = [&](int a, int b) { return std::chrono::duration<double, std::milli>(m.marks[b] - m.marks[a]).count(); };
  m.times.backbone_ms = ms(0, 1), m.times.lm_head_ms = ms(1, 2), m.times.heads_ms = ms(2, 3), m.times.draft_ms = ms(0, 3);
  if (a.head_hidden.defined()) std::memcpy(a.head_hidden.data, head.data(), size_t(head.nbytes()));
  if (a.base_logits.defined()) std::memcpy(a.base_logits.data, logits.data(), size_t(logits.nbytes()));
}

void DsparkModel::check_input_errors() {
#ifdef M3RT_WITH_CUDA
  Impl& m = *impl_;
  if (!m.on_gpu()) return;
  GpuState& g = *m.gpu;
  detail::DeviceGuard guard(m.dev.index);
  M3RT_CUDA_CHECK(cudaStreamSynchronize(g.s));
  const Tensor errs = g.errors.to(Device::cpu());
  g.errors.fill_bytes(0);
  const int64_t* e = errs.ptr<const int64_t>();
  for (int64_t r = 0; r < g.B; ++r) {
    const int64_t code = e[3 * r], value = e[3 * r + 1], at = e[3 * r + 2];
    if (code == detail::kDraftErrorNone) continue;
    const std::string rs = std::to_string(r), v = std::to_string(value), ncb = std::to_string(m.opt.num_cache_blocks);
    switch (code) {
      case detail::kDraftErrorAnchorToken:
        throw_arg_error(kOp, "anchor_tokens[" + rs + "]", v, "must be < vocab_size = " + std::to_string(m.c.vocab_size));
      case detail::kDraftErrorPosition:
        throw_arg_error(kOp, "anchor_positions[" + rs + "]", v,
                        "the block [p, p + " + std::to_string(m.c.block_size) + ") must lie in [0, max_position_embeddings)");
      case detail::kDraftErrorSpan:
        throw_arg_error(kOp, "anchor_positions[" + rs + "]", v,
                        "the block's keys span more than " + std::to_string(kTopk) + " pages (no sliding window)");
      case detail::kDraftErrorTemperature: {
        float t;
        const uint32_t bits = uint32_t(value);
        std::memcpy(&t, &bits, 4);
        throw_arg_error(kOp, "temperatures[" + rs + "]", std::to_string(t), "must be finite and >= 0");
      }
      case detail::kDraftErrorPage:
        throw_arg_error(kOp, "block_table[" + rs + "][" + std::to_string(at) + "]", v,
                        "must be in [0, num_cache_blocks = " + ncb + ") for every block the draft block reads"
                        " (columns past the table passed in read as -1)");
      default:
        throw_arg_error(kOp, "block_slots[" + rs + "][" + std::to_string(at) + "]", v,
                        "must be < num_cache_blocks * 128 = " + std::to_string(int64_t(m.opt.num_cache_blocks) * kPage) +
                            " (negative: not cached)");
    }
  }
#endif
}

const DsparkModel::Timings& DsparkModel::last_timings() const {
#ifdef M3RT_WITH_CUDA
  Impl& m = *impl_;
  if (m.on_gpu()) {
    GpuState& g = *m.gpu;
    auto ms = [](cudaEvent_t a, cudaEvent_t b) {
      M3RT_CUDA_CHECK(cudaEventSynchronize(b));
      float t = 0;
      M3RT_CUDA_CHECK(cudaEventElapsedTime(&t, a, b));
      return double(t);
    };
    if (g.draft_timed) {
      m.times.backbone_ms = ms(g.st[0], g.st[1]);
      m.times.lm_head_ms = ms(g.st[1], g.st[2]);
      m.times.heads_ms = ms(g.st[2], g.st[3]);
      m.times.draft_ms = ms(g.st[0], g.st[3]);
      g.draft_timed = false;
    }
    if (g.pre_timed) {
      m.times.precompute_ms = ms(g.pre[0], g.pre[1]);
      g.pre_timed = false;
    }
  }
#endif
  return impl_->times;
}

// ---- the GPU step -------------------------------------------------------------------------------
#ifdef M3RT_WITH_CUDA

void DsparkModel::Impl::init_gpu() {
  // The device kernels move rows in 16-byte pieces.
  if (c.hidden_size % 8 != 0 || c.markov_rank % 8 != 0)
    throw_arg_error(kOp, "config", "hidden_size " + std::to_string(c.hidden_size) + ", markov_rank " +
                    std::to_string(c.markov_rank), "multiples of 8 on a GPU");
  gpu = std::make_unique<GpuState>(dev);
  GpuState& g = *gpu;
  M3RT_CUDA_CHECK(cudaStreamCreateWithFlags(&g.s, cudaStreamNonBlocking));
  for (cudaEvent_t* e : {&g.ev_in, &g.ev_out}) M3RT_CUDA_CHECK(cudaEventCreateWithFlags(e, cudaEventDisableTiming));
  for (cudaEvent_t* e : {&g.st[0], &g.st[1], &g.st[2], &g.st[3], &g.pre[0], &g.pre[1]})
    M3RT_CUDA_CHECK(cudaEventCreate(e));
  g.B = opt.max_batch;
  g.MB = opt.max_blocks_per_request > 0 ? opt.max_blocks_per_request : opt.num_cache_blocks;
  const int64_t B = g.B, N = c.block_size, T = B * N, H = c.hidden_size, V = c.vocab_size, D = c.head_dim;
  auto make = [&](std::vector<int64_t> shape, DType dt) {
    Tensor t = Tensor::empty(shape, dt, dev);
    t.fill_bytes(0);
    return t;
  };
  const DType bf = DType::kBFloat16, i32 = DType::kInt32, i64 = DType::kInt64;
  g.anchors = make({B}, i32), g.apos = make({B}, i64), g.bslots = make({B, N}, i64), g.table = make({B, g.MB}, i32);
  g.temps = make({B}, DType::kFloat32), g.seeds = make({B}, i64);
  g.ids = make({T}, i32), g.pos = make({T}, i64), g.slots = make({T}, i64), g.lens = make({B}, i32);
  g.lists = make({int64_t(c.num_kv_heads) * T * kTopk}, i32), g.prev = make({B}, i32);
  g.e = make({B, int64_t(c.markov_rank)}, bf), g.errors = make({B, 3}, i64);
  g.h = make({T, H}, bf), g.residual = make({T, H}, bf), g.x = make({T, H}, bf), g.o = make({T, H}, bf);
  g.head = make({T, H}, bf), g.qkv = make({T, int64_t(c.num_heads + 2 * c.num_kv_heads) * D}, bf);
  g.q = make({T, int64_t(c.num_heads) * D}, bf), g.attn = make({T, c.num_heads, D}, bf);
  g.gate_up = make({T, 2 * int64_t(c.ffn_size)}, bf), g.act = make({T, int64_t(c.ffn_size)}, bf);
  g.logits = make({T, V}, bf), g.mlog = make({T, V}, bf), g.bias = make({B, V}, bf);
  const int chunks = detail::markov_partials(int(V));
  g.part_key = make({B, chunks}, i64)  /* doubles */, g.part_idx = make({B, chunks}, i32);
  g.counters = make({B}, i32);
  g.tokens = make({B, N}, i32), g.conf = make({B, N}, DType::kFloat32);
  g.claims = make({kClaimCounterInts}, i32);
  // The zeros above were set on the legacy stream, which a non-blocking stream does not wait for.
  M3RT_CUDA_CHECK(cudaDeviceSynchronize());
}

Work DsparkModel::Impl::gpu_work(int64_t P) {
  GpuState& g = *gpu;
  const int64_t N = c.block_size, T = P * N;
  auto& plan = g.plans[P];
  if (!plan)
    plan = std::make_unique<MsaDecodePlan>(MsaDecodeShape{.batch = int(P), .decode_query_len = int(N),
                                                          .num_heads = c.num_heads, .num_kv_heads = c.num_kv_heads,
                                                          .topk = kTopk, .max_blocks = g.MB,
                                                          .kv_cache_dtype = opt.kv_cache_dtype},
                                           dev);
  Work w;
  w.R = P, w.T = T, w.plan = plan.get();
  w.ids = rows(g.ids, T), w.pos = rows(g.pos, T), w.slots = rows(g.slots, T), w.lens = rows(g.lens, P);
  w.lists = TensorView::contiguous(g.lists.data(), DType::kInt32, {c.num_kv_heads, T, kTopk}, dev);
  w.table = rows(g.table, P);
  w.h = rows(g.h, T), w.residual = rows(g.residual, T), w.x = rows(g.x, T), w.qkv = rows(g.qkv, T);
  w.q = rows(g.q, T), w.attn = rows(g.attn, T), w.o = rows(g.o, T), w.gate_up = rows(g.gate_up, T);
  w.act = rows(g.act, T), w.head = rows(g.head, T), w.logits = rows(g.logits, T);
  w.claims = g.claims;
  return w;
}

// The whole draft step for P (padded) requests from the static input buffers: what the graph holds.
void DsparkModel::Impl::enqueue_gpu_step(int64_t P, cudaStream_t s) {
  GpuState& g = *gpu;
  const Work w = gpu_work(P);
  const int64_t N = c.block_size, V = c.vocab_size;
  record(0, s);
  detail::launch_draft_prep({.anchors = g.anchors.ptr<int32_t>(), .anchor_pos = g.apos.ptr<int64_t>(),
                             .block_slots = g.bslots.ptr<int64_t>(), .block_table = g.table.ptr<int32_t>(),
                             .temperatures = g.temps.ptr<float>(), .table_width = g.MB, .R = int(P), .N = int(N),
                             .vocab = int(V), .mask_token = c.mask_token_id, .num_kv_heads = c.num_kv_heads,
                             .topk = kTopk, .page = kPage, .sliding_window = c.sliding_window,
                             .max_pos = c.max_position_embeddings, .num_cache_blocks = opt.num_cache_blocks,
                             .w1 = w1.ptr<const uint16_t>(), .rank = c.markov_rank, .ids = g.ids.ptr<int32_t>(),
                             .positions = g.pos.ptr<int64_t>(), .slots = g.slots.ptr<int64_t>(),
                             .seq_lens = g.lens.ptr<int32_t>(), .lists = g.lists.ptr<int32_t>(),
                             .prev = g.prev.ptr<int32_t>(), .e = g.e.ptr<uint16_t>(), .errors = g.errors.ptr<int64_t>()},
                            s);
  forward(w, s);
  detail::MarkovStepParams mp{.R = int(P), .N = int(N), .V = int(V), .step = 0, .base = g.logits.ptr<uint16_t>(),
                              .bias = g.bias.ptr<uint16_t>(), .logits = g.mlog.ptr<uint16_t>(),
                              .prev = g.prev.ptr<int32_t>(), .temperatures = g.temps.ptr<float>(),
                              .seeds = g.seeds.ptr<int64_t>(), .anchor_pos = g.apos.ptr<int64_t>(),
                              .part_key = static_cast<double*>(g.part_key.data()), .part_idx = g.part_idx.ptr<int32_t>(),
                              .counters = g.counters.ptr<int32_t>(), .tokens = g.tokens.ptr<int32_t>(), .prev_out = g.prev.ptr<int32_t>(),
                              .e = g.e.ptr<uint16_t>(), .w1 = w1.ptr<const uint16_t>(), .rank = c.markov_rank};
  for (int i = 0; i < N; ++i) {
    mp.step = i;
    linear(rows(g.bias, P), rows(g.e, P), w2, s);  // bias = W2 . W1[prev]
    detail::launch_markov_step(mp, s);
  }
  if (c.confidence_head)
    detail::launch_confidence({.R = int(P), .N = int(N), .H = c.hidden_size, .rank = c.markov_rank,
                               .with_markov = c.confidence_with_markov, .head = g.head.ptr<uint16_t>(),
                               .w = conf_w.ptr<uint16_t>(), .b = conf_b.ptr<uint16_t>(), .w1 = w1.ptr<const uint16_t>(),
                               .anchors = g.anchors.ptr<int32_t>(), .tokens = g.tokens.ptr<int32_t>(),
                               .out = g.conf.ptr<float>()},
                              s);
  record(3, s);
}

void DsparkModel::Impl::draft_gpu(const DsparkDraftArgs& a, int64_t R, stream_t stream) {
  GpuState& g = *gpu;
  detail::DeviceGuard guard(dev.index);
  if (R > g.B)
    throw_arg_error(kOp, "anchor_tokens.shape", a.anchor_tokens.shape_str(),
                    "at most options.max_batch = " + std::to_string(g.B) + " requests");
  const int64_t W = a.block_table.shape[1];
  if (W > g.MB)
    throw_arg_error(kOp, "block_table.shape", a.block_table.shape_str(),
                    "at most options.max_blocks_per_request = " + std::to_string(g.MB) + " columns");
  const int64_t N = c.block_size, V = c.vocab_size, H = c.hidden_size;
  const int64_t P = std::min<int64_t>(pow2_at_least(R), g.B);
  cudaStream_t s = g.s;
  const auto user = reinterpret_cast<cudaStream_t>(stream);
  M3RT_CUDA_CHECK(cudaEventRecord(g.ev_in, user));
  M3RT_CUDA_CHECK(cudaStreamWaitEvent(s, g.ev_in, 0));
  // Inputs into the static buffers (one launch); padded requests and table columns read as -1.
  detail::launch_draft_inputs(
      {.R = int(R), .P = int(P), .N = int(N), .W = int(W), .MB = g.MB, .anchors = a.anchor_tokens.ptr<const int32_t>(),
       .positions = a.anchor_positions.ptr<const int64_t>(), .slots = a.block_slots.ptr<const int64_t>(),
       .table = a.block_table.ptr<const int32_t>(), .temps = a.temperatures.ptr<const float>(),
       .seeds = a.seeds.ptr<const int64_t>(), .s_anchors = g.anchors.ptr<int32_t>(), .s_positions = g.apos.ptr<int64_t>(),
       .s_slots = g.bslots.ptr<int64_t>(), .s_table = g.table.ptr<int32_t>(), .s_temps = g.temps.ptr<float>(),
       .s_seeds = g.seeds.ptr<int64_t>()},
      s);
  gpu_work(P);  // the attention plan for P, built outside any capture
  if (opt.use_graphs) {
    auto it = g.graphs.find(P);
    if (it == g.graphs.end()) {
      // First call at this size: run eagerly (the GEMMs pick their algorithms), then capture the
      // graph the next calls replay (the same kernels: replays equal this run bit for bit).
      enqueue_gpu_step(P, s);
      cudaGraph_t graph = nullptr;
      M3RT_CUDA_CHECK(cudaStreamBeginCapture(s, cudaStreamCaptureModeThreadLocal));
      try {
        enqueue_gpu_step(P, s);
      } catch (...) {
        cudaStreamEndCapture(s, &graph);
        if (graph) cudaGraphDestroy(graph);
        throw;
      }
      M3RT_CUDA_CHECK(cudaStreamEndCapture(s, &graph));
      cudaGraphExec_t exec = nullptr;
      const cudaError_t err = cudaGraphInstantiate(&exec, graph, 0);
      cudaGraphDestroy(graph);
      M3RT_CUDA_CHECK(err);
      g.graphs.emplace(P, exec);
    } else {
      M3RT_CUDA_CHECK(cudaGraphLaunch(it->second, s));
    }
  } else {
    enqueue_gpu_step(P, s);
  }
  g.draft_timed = true;
  // Outputs.
  auto d2d = [&](void* dst, const void* src, int64_t bytes) {
    M3RT_CUDA_CHECK(cudaMemcpyAsync(dst, src, size_t(bytes), cudaMemcpyDeviceToDevice, s));
  };
  detail::launch_draft_outputs(a.draft_tokens.ptr<int32_t>(), g.tokens.ptr<int32_t>(),
                               a.confidence.defined() ? a.confidence.ptr<float>() : nullptr, g.conf.ptr<float>(),
                               int(R * N), s);
  if (a.head_hidden.defined()) d2d(a.head_hidden.data, g.head.data(), R * N * H * 2);
  if (a.base_logits.defined()) d2d(a.base_logits.data, g.logits.data(), R * N * V * 2);
  if (a.draft_probs.defined())
    detail::launch_draft_probs({.R = int(R), .N = int(N), .V = int(V), .logits = g.mlog.ptr<uint16_t>(),
                                .tokens = g.tokens.ptr<int32_t>(), .temperatures = g.temps.ptr<float>(),
                                .out = a.draft_probs.ptr<float>()},
                               s);
  M3RT_CUDA_CHECK(cudaEventRecord(g.ev_out, s));
  M3RT_CUDA_CHECK(cudaStreamWaitEvent(user, g.ev_out, 0));
}

void DsparkModel::Impl::precompute_gpu(const TensorView& hidden, const TensorView& positions, const TensorView& slots,
                                       stream_t stream) {
  GpuState& g = *gpu;
  detail::DeviceGuard guard(dev.index);
  const int64_t T = hidden.shape[0], H = c.hidden_size, KV = w_kv_all.view().shape[0];
  if (!g.pre_states.view().defined() || g.pre_states.view().shape[0] < T) {
    M3RT_CUDA_CHECK(cudaStreamSynchronize(g.s));  // the old scratch may still be in use
    g.pre_states = Tensor::empty({T, H}, DType::kBFloat16, dev);
    g.pre_x = Tensor::empty({T, H}, DType::kBFloat16, dev);
    g.pre_kv = Tensor::empty({T, KV}, DType::kBFloat16, dev);
    // Every element is written before it is read; zeroing once keeps compute-sanitizer's initcheck
    // quiet, which does not see the GEMMs' TMA (bulk-copy) stores as initializing.
    for (Tensor* t : {&g.pre_states, &g.pre_x, &g.pre_kv}) t->fill_bytes(0);
  }
  cudaStream_t s = g.s;
  const auto user = reinterpret_cast<cudaStream_t>(stream);
  M3RT_CUDA_CHECK(cudaEventRecord(g.ev_in, user));
  M3RT_CUDA_CHECK(cudaStreamWaitEvent(s, g.ev_in, 0));
  M3RT_CUDA_CHECK(cudaEventRecord(g.pre[0], s));
  const TensorView states = rows(g.pre_states, T), x = rows(g.pre_x, T), all_kv = rows(g.pre_kv, T);
  // Row counts vary per call: the heuristic's algorithm, no tuning.
  linear(states, hidden, fc, s, false);
  gemma_rms_norm(x, states, hidden_norm, c.rms_norm_eps, s);
  linear(all_kv, x, w_kv_all, s, false);
  const TensorView kv5 =
      TensorView::contiguous(all_kv.data, DType::kBFloat16, {T, c.num_layers, 2, c.num_kv_heads, c.head_dim}, dev);
  (*writer)({.all_kv = kv5, .k_norm_weight = k_norm_all, .eps = c.rms_norm_eps, .positions = positions,
             .cos_sin_cache = cos_sin, .rotary_dim = c.rotary_dim, .slot_mapping = slots, .claim_counters = g.claims},
            s);
  M3RT_CUDA_CHECK(cudaEventRecord(g.pre[1], s));
  g.pre_timed = true;
  M3RT_CUDA_CHECK(cudaEventRecord(g.ev_out, s));
  M3RT_CUDA_CHECK(cudaStreamWaitEvent(user, g.ev_out, 0));
}

#endif  // M3RT_WITH_CUDA

}  // namespace m3rt
