// m3rt/dspark_checkpoint.h — the tensors of a MiniMax-M3.1 DSpark draft checkpoint: their names,
// dtypes and shapes for a config, loading a checkpoint directory with every tensor checked, and a
// generator of small random checkpoints in the real format (../shared/spec/dspark.md §1, §5.6).
//
// defines: DsparkTensorSpec, dspark_draft_layout, dspark_target_layout, DsparkCheckpoint,
//          TinyDraftOptions, make_tiny_dspark_checkpoint.
//
// Names. Draft tensors carry the prefix "language_model.model.dspark."; decoder layers are
// "layers.{i}.decoder_layer." followed by (MiniMax / Hugging Face module names — the spec gives the
// prefix, the count of 97 tensors and the per-layer parts, not every leaf name; decision recorded in
// src/model/README.md):
//   input_layernorm.weight [H]            post_attention_layernorm.weight [H]
//   self_attn.q_proj.weight [Hq*128, H]   self_attn.k_proj.weight [Hkv*128, H]
//   self_attn.v_proj.weight [Hkv*128, H]  self_attn.o_proj.weight [H, Hq*128]
//   self_attn.q_norm.weight [128]         self_attn.k_norm.weight [128]
//   mlp.gate_proj.weight [F, H]           mlp.up_proj.weight [F, H]      mlp.down_proj.weight [H, F]
// and, with mxfp8, each of the 7 linears' "<linear>.weight_scale_inv" U8 [rows, cols / 32] (E8M0:
// scale 2^(s - 127) per 32 inputs) next to its F8_E4M3 weight. Top level: fc.weight [H, n*H] (n =
// target layers), hidden_norm.weight [H], final_norm.weight [H], markov_head.markov_w1.weight [V, r],
// markov_head.markov_w2.weight [V, r], and with the confidence head confidence_head.proj.weight
// [1, H + r] ([1, H] without Markov input) and confidence_head.proj.bias [1]. Norms, fc, Markov and
// confidence tensors are BF16. From the target: language_model.model.embed_tokens.weight [V, H] and
// language_model.lm_head.weight [V, H], BF16.
#pragma once

#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "m3rt/dspark_config.h"
#include "m3rt/safetensors.h"
#include "m3rt/tensor.h"

namespace m3rt {

struct DsparkTensorSpec {
  std::string name;  // full name, prefix included
  DType dtype;
  std::vector<int64_t> shape;
};

// Every tensor the draft shard must hold for `c` (and nothing else), in a fixed order.
std::vector<DsparkTensorSpec> dspark_draft_layout(const DsparkConfig& c);
// The two tensors taken from the target checkpoint (embedding, LM head).
std::vector<DsparkTensorSpec> dspark_target_layout(const DsparkConfig& c);

// A loaded checkpoint: the config and every tensor as a read-only CPU view into memory-mapped
// files (nothing copied). Layout of the directory: config.json, the draft shard(s) *.safetensors,
// and the target's embedding/LM head in the files given (a target checkpoint's shards; other
// tensors in them are ignored).
class DsparkCheckpoint {
 public:
  // Reads `dir`/config.json and every `dir`/*.safetensors as the draft; `target_files` are the
  // safetensors files holding the embedding and LM head. Throws m3rt::Error naming the tensor and
  // the file for: a missing tensor, an unknown tensor in a draft shard, a tensor in two shards, a
  // wrong dtype or shape.
  DsparkCheckpoint(const std::string& dir, const std::vector<std::string>& target_files);
  ~DsparkCheckpoint();
  DsparkCheckpoint(const DsparkCheckpoint&) = delete;
  DsparkCheckpoint& operator=(const DsparkCheckpoint&) = delete;

  const DsparkConfig& config() const { return config_; }
  // The tensor named `name` (full name); throws m3rt::Error when the layout has no such tensor.
  TensorView tensor(std::string_view name) const;
  // Short form for draft tensors: `dspark("fc.weight")`, `dspark("layers.0.decoder_layer.mlp.up_proj.weight")`.
  TensorView dspark(std::string_view suffix) const;

 private:
  DsparkConfig config_;
  std::vector<std::unique_ptr<SafetensorsFile>> files_;
  std::vector<std::pair<std::string, TensorView>> tensors_;
};

struct TinyDraftOptions {
  DsparkQuant quant = DsparkQuant::kBFloat16;
  uint64_t seed = 1;
};

// A small DSpark config in the real format's shape: 2 layers, hidden 256, 4 query / 2 KV heads
// (head_dim 128), FFN 512, vocab 1000, block 7, mask id 999, target layers [0, 1], Markov rank 32,
// confidence head with Markov input, window 4096, rotary 64.
DsparkConfig tiny_dspark_config(DsparkQuant quant = DsparkQuant::kBFloat16);
// The released MiniMax-M3.1 draft's sizes (dspark.md §1): 5 layers, hidden 6144, 64/4 heads, FFN
// 12288, vocab 200064, Markov rank 256, target layers {3, 17, 31, 45, 59}; the rest as the tiny one
// (block 7, window 4096, rotary 64, theta 5e6, confidence head with Markov input).
DsparkConfig m31_dspark_config(DsparkQuant quant = DsparkQuant::kMxfp8);

// Writes a complete random checkpoint for `c` into `dir` (created if needed): config.json,
// draft.safetensors (the draft layout; mxfp8 linears as e4m3 codes with E8M0 scales) and
// target.safetensors (embedding and LM head). Weights are scaled like a trained model's (norm
// weights near 0, linears ~ 1/sqrt(fan-in)) so that activations stay in range through the layers.
void make_tiny_dspark_checkpoint(const std::string& dir, const DsparkConfig& c, const TinyDraftOptions& opt = {});

}  // namespace m3rt
