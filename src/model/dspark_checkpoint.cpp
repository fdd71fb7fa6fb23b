// DSpark draft checkpoint: tensor layout, loading with checks, tiny random checkpoints.
// Names, shapes and rules: include/m3rt/dspark_checkpoint.h; decisions: src/model/README.md.
#include "m3rt/dspark_checkpoint.h"

#include <algorithm>
#include <cmath>
#include <filesystem>
#include <fstream>
#include <map>
#include <random>

#include "m3rt/error.h"

namespace m3rt {

namespace {

namespace fs = std::filesystem;

constexpr const char* kDraftPrefix = "language_model.model.dspark.";
constexpr const char* kEmbedName = "language_model.model.embed_tokens.weight";
constexpr const char* kLmHeadName = "language_model.lm_head.weight";
constexpr int kMxBlock = 32;  // inputs per E8M0 scale

struct Linear {
  const char* name;  // under layers.{i}.decoder_layer.
  int64_t rows, cols;
};

std::vector<Linear> layer_linears(const DsparkConfig& c) {
  const int64_t H = c.hidden_size, Q = int64_t(c.num_heads) * c.head_dim, KV = int64_t(c.num_kv_heads) * c.head_dim,
                F = c.ffn_size;
  return {{"self_attn.q_proj", Q, H},   {"self_attn.k_proj", KV, H}, {"self_attn.v_proj", KV, H},
          {"self_attn.o_proj", H, Q},   {"mlp.gate_proj", F, H},     {"mlp.up_proj", F, H},
          {"mlp.down_proj", H, F}};
}

std::string layer_prefix(int i) { return std::string(kDraftPrefix) + "layers." + std::to_string(i) + ".decoder_layer."; }

std::string shape_str(const std::vector<int64_t>& s) {
  std::string r = "[";
  for (size_t i = 0; i < s.size(); ++i) r += (i ? ", " : "") + std::to_string(s[i]);
  return r + "]";
}

}  // namespace

std::vector<DsparkTensorSpec> dspark_draft_layout(const DsparkConfig& c) {
  const int64_t H = c.hidden_size, V = c.vocab_size, r = c.markov_rank;
  const bool mx = c.quant == DsparkQuant::kMxfp8;
  std::vector<DsparkTensorSpec> out;
  const std::string p = kDraftPrefix;
  out.push_back({p + "fc.weight", DType::kBFloat16, {H, int64_t(c.target_layer_ids.size()) * H}});
  out.push_back({p + "hidden_norm.weight", DType::kBFloat16, {H}});
  for (int i = 0; i < c.num_layers; ++i) {
    const std::string lp = layer_prefix(i);
    out.push_back({lp + "input_layernorm.weight", DType::kBFloat16, {H}});
    out.push_back({lp + "post_attention_layernorm.weight", DType::kBFloat16, {H}});
    out.push_back({lp + "self_attn.q_norm.weight", DType::kBFloat16, {c.head_dim}});
    out.push_back({lp + "self_attn.k_norm.weight", DType::kBFloat16, {c.head_dim}});
    for (const Linear& l : layer_linears(c)) {
      out.push_back({lp + l.name + ".weight", mx ? DType::kFloat8E4M3 : DType::kBFloat16, {l.rows, l.cols}});
      if (mx) out.push_back({lp + l.name + ".weight_scale_inv", DType::kUInt8, {l.rows, l.cols / kMxBlock}});
    }
  }
  out.push_back({p + "final_norm.weight", DType::kBFloat16, {H}});
  out.push_back({p + "markov_head.markov_w1.weight", DType::kBFloat16, {V, r}});
  out.push_back({p + "markov_head.markov_w2.weight", DType::kBFloat16, {V, r}});
  if (c.confidence_head) {
    out.push_back({p + "confidence_head.proj.weight", DType::kBFloat16, {1, H + (c.confidence_with_markov ? r : 0)}});
    out.push_back({p + "confidence_head.proj.bias", DType::kBFloat16, {1}});
  }
  return out;
}

std::vector<DsparkTensorSpec> dspark_target_layout(const DsparkConfig& c) {
  const int64_t H = c.hidden_size, V = c.vocab_size;
  return {{kEmbedName, DType::kBFloat16, {V, H}}, {kLmHeadName, DType::kBFloat16, {V, H}}};
}

DsparkCheckpoint::DsparkCheckpoint(const std::string& dir, const std::vector<std::string>& target_files) {
  config_ = read_dspark_config((fs::path(dir) / "config.json").string());
  // Which layout entry each name is, and where it was found.
  std::map<std::string, std::pair<DsparkTensorSpec, std::string>> want;  // name -> (spec, file found in)
  for (DsparkTensorSpec& s : dspark_draft_layout(config_)) {
    const std::string name = s.name;  // the assignment's right side (the move) is evaluated first
    want[name] = {std::move(s), ""};
  }
  auto check = [&](const SafetensorsFile& f, const SafetensorsTensor& t, const DsparkTensorSpec& spec) {
    if (t.dtype != spec.dtype || t.shape != spec.shape)
      throw Error("dspark checkpoint " + f.path() + ": tensor '" + t.name + "' is " + t.dtype_name + " " +
                  shape_str(t.shape) + ", the config needs " + safetensors_dtype_name(spec.dtype) + " " +
                  shape_str(spec.shape));
  };
  std::vector<std::string> shards;
  std::error_code ec;
  for (const auto& e : fs::directory_iterator(dir, ec))
    if (e.is_regular_file() && e.path().extension() == ".safetensors") shards.push_back(e.path().string());
  if (ec) throw Error("dspark checkpoint " + dir + ": cannot list the directory: " + ec.message());
  if (shards.empty()) throw Error("dspark checkpoint " + dir + ": no *.safetensors file");
  std::sort(shards.begin(), shards.end());
  for (const std::string& path : shards) {
    files_.push_back(std::make_unique<SafetensorsFile>(path));
    const SafetensorsFile& f = *files_.back();
    for (const SafetensorsTensor& t : f.tensors()) {
      auto it = want.find(t.name);
      if (it == want.end())
        throw Error("dspark checkpoint " + path + ": unknown tensor '" + t.name +
                    "' (not in the draft layout of config.json)");
      if (!it->second.second.empty())
        throw Error("dspark checkpoint: tensor '" + t.name + "' is in both " + it->second.second + " and " + path);
      check(f, t, it->second.first);
      it->second.second = path;
      tensors_.emplace_back(t.name, f.view(t));
    }
  }
  for (const auto& [name, entry] : want)
    if (entry.second.empty())
      throw Error("dspark checkpoint " + dir + ": missing tensor '" + name + "' (" +
                  safetensors_dtype_name(entry.first.dtype) + " " + shape_str(entry.first.shape) + ")");
  // The embedding and LM head from the target's files (their other tensors are not ours).
  for (const DsparkTensorSpec& spec : dspark_target_layout(config_)) {
    bool found = false;
    for (const std::string& path : target_files) {
      SafetensorsFile* f = nullptr;
      for (auto& existing : files_)
        if (existing->path() == path) f = existing.get();
      if (!f) {
        files_.push_back(std::make_unique<SafetensorsFile>(path));
        f = files_.back().get();
      }
      if (const SafetensorsTensor* t = f->find(spec.name)) {
        if (found) throw Error("dspark checkpoint: target tensor '" + spec.name + "' is in two of the target files");
        check(*f, *t, spec);
        tensors_.emplace_back(spec.name, f->view(*t));
        found = true;
      }
    }
    if (!found) throw Error("dspark checkpoint: no target file holds '" + spec.name + "'");
  }
}

DsparkCheckpoint::~DsparkCheckpoint() = default;

TensorView DsparkCheckpoint::tensor(std::string_view name) const {
  for (const auto& [n, v] : tensors_)
    if (n == name) return v;
  throw Error("dspark checkpoint: no tensor '" + std::string(name) + "' in the layout");
}

TensorView DsparkCheckpoint::dspark(std::string_view suffix) const {
  return tensor(std::string(kDraftPrefix) + std::string(suffix));
}

DsparkConfig tiny_dspark_config(DsparkQuant quant) {
  DsparkConfig c;
  c.num_layers = 2;
  c.hidden_size = 256;
  c.num_heads = 4;
  c.num_kv_heads = 2;
  c.head_dim = 128;
  c.ffn_size = 512;
  c.vocab_size = 1000;
  c.block_size = 7;
  c.mask_token_id = 999;
  c.target_layer_ids = {0, 1};
  c.markov_rank = 32;
  c.markov_head_type = "vanilla";
  c.confidence_head = true;
  c.confidence_with_markov = true;
  c.sliding_window = 4096;
  c.rms_norm_eps = 1e-6f;
  c.rope_theta = 5e6;
  c.rotary_dim = 64;
  c.max_position_embeddings = 65536;
  c.quant = quant;
  return c;
}

DsparkConfig m31_dspark_config(DsparkQuant quant) {
  DsparkConfig c = tiny_dspark_config(quant);
  c.num_layers = 5;
  c.hidden_size = 6144;
  c.num_heads = 64;
  c.num_kv_heads = 4;
  c.ffn_size = 12288;
  c.vocab_size = 200064;
  c.mask_token_id = 200063;
  c.markov_rank = 256;
  c.target_layer_ids = {3, 17, 31, 45, 59};
  return c;
}

void make_tiny_dspark_checkpoint(const std::string& dir, const DsparkConfig& c, const TinyDraftOptions& opt) {
  std::error_code ec;
  fs::create_directories(fs::path(dir) / "target", ec);
  if (ec) throw Error("make_tiny_dspark_checkpoint: cannot create " + dir + ": " + ec.message());
  std::mt19937_64 rng(opt.seed);
  std::uniform_real_distribution<float> unit(-1.f, 1.f);
  // bf16 values uniform in [-a, a].
  auto bf16_tensor = [&](const std::vector<int64_t>& shape, float a) {
    Tensor t = Tensor::empty(shape, DType::kBFloat16);
    for (int64_t i = 0; i < t.numel(); ++i) t.ptr<uint16_t>()[i] = float_to_bf16(a * unit(rng));
    return t;
  };
  std::vector<Tensor> keep;
  std::vector<SafetensorsWriteItem> draft;
  auto add = [&](std::vector<SafetensorsWriteItem>& items, const std::string& name, Tensor t) {
    keep.push_back(t);
    items.push_back({name, keep.back()});
  };
  // Uniform [-a, a] has variance a^2 / 3: a = sqrt(3 / fan_in) keeps activations at unit scale.
  auto fan = [](int64_t fan_in) { return std::sqrt(3.f / float(fan_in)); };
  for (const DsparkTensorSpec& s : dspark_draft_layout(c)) {
    const bool norm = s.shape.size() == 1 && s.name.find("bias") == std::string::npos;
    if (s.dtype == DType::kUInt8) continue;  // scales come with their weight below
    if (s.dtype == DType::kFloat8E4M3) {
      // MXFP8: each block of 32 inputs shares a power-of-two scale that maps its largest weight
      // into e4m3's range (448); the code is e4m3(w / scale).
      const int64_t rows = s.shape[0], cols = s.shape[1];
      Tensor w = Tensor::empty(s.shape, DType::kFloat8E4M3);
      Tensor sc = Tensor::empty({rows, cols / kMxBlock}, DType::kUInt8);
      const float a = fan(cols);
      std::vector<float> block(kMxBlock);
      for (int64_t r = 0; r < rows; ++r)
        for (int64_t b = 0; b < cols / kMxBlock; ++b) {
          float mx = 0.f;
          for (float& v : block) mx = std::max(mx, std::fabs(v = a * unit(rng)));
          const int e = mx > 0.f ? int(std::ceil(std::log2(mx / 448.f))) : -127;
          const int biased = std::clamp(e + 127, 0, 254);
          sc.ptr<uint8_t>()[r * (cols / kMxBlock) + b] = uint8_t(biased);
          const float inv = std::ldexp(1.f, 127 - biased);
          for (int k = 0; k < kMxBlock; ++k)
            w.ptr<uint8_t>()[r * cols + b * kMxBlock + k] = float_to_e4m3(block[size_t(k)] * inv);
        }
      add(draft, s.name, w);
      add(draft, s.name.substr(0, s.name.size() - std::string("weight").size()) + "weight_scale_inv", sc);
      continue;
    }
    if (norm) add(draft, s.name, bf16_tensor(s.shape, 0.1f));            // Gemma scale 1 + w near 1
    else if (s.name.find("bias") != std::string::npos) add(draft, s.name, bf16_tensor(s.shape, 0.1f));
    else if (s.name.find("markov_w1") != std::string::npos) add(draft, s.name, bf16_tensor(s.shape, 1.f));
    else add(draft, s.name, bf16_tensor(s.shape, fan(s.shape.back())));
  }
  write_safetensors((fs::path(dir) / "draft.safetensors").string(), draft, {{"format", "pt"}});
  std::vector<SafetensorsWriteItem> target;
  for (const DsparkTensorSpec& s : dspark_target_layout(c))
    add(target, s.name, bf16_tensor(s.shape, s.name == kEmbedName ? 1.f : fan(s.shape.back())));
  write_safetensors((fs::path(dir) / "target" / "model.safetensors").string(), target, {{"format", "pt"}});
  std::ofstream cfg(fs::path(dir) / "config.json");
  cfg << dspark_config_json(c) << "\n";
  if (!cfg) throw Error("make_tiny_dspark_checkpoint: cannot write " + (fs::path(dir) / "config.json").string());
}

}  // namespace m3rt
