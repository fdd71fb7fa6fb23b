// m3rt/dspark_config.h — the configuration of a MiniMax-M3.1 DSpark draft model, read from the
// draft checkpoint's config.json (../shared/spec/dspark.md §1, §6).
//
// defines: DsparkQuant, DsparkConfig, parse_dspark_config, read_dspark_config, dspark_config_json.
//
// Field names and the alternates accepted for each (first match wins; a field given under two of
// its names with different values is an error):
//   num_layers            num_hidden_layers
//   hidden_size           hidden_size
//   num_heads             num_attention_heads
//   num_kv_heads          num_key_value_heads
//   head_dim              head_dim (default hidden_size / num_attention_heads when absent)
//   ffn_size              dspark_ffn_hidden_size | dense_intermediate_size | intermediate_size
//   vocab_size            vocab_size
//   block_size            dspark_block_size | block_size | dflash_config.block_size
//   mask_token_id         dspark_noise_token_id | mask_token_id | dflash_config.mask_token_id
//   target_layer_ids      dspark_target_layer_ids | target_layer_ids | dflash_config.target_layer_ids
//   markov_rank           dspark_markov_rank | markov_rank
//   markov_head_type      dspark_markov_head_type | markov_head_type (only "vanilla")
//   confidence_head       enable_confidence_head (default false)
//   confidence_with_markov confidence_head_with_markov (default false)
//   sliding_window        sliding_window (0 or absent: none)
//   rms_norm_eps          rms_norm_eps
//   rope_theta            rope_theta
//   rotary_dim            rotary_dim | head_dim * partial_rotary_factor (default factor 1.0)
//   swiglu_alpha/beta/limit swiglu_alpha | swiglu_beta | swiglu_limit (defaults 1.702, 1.0, 7.0)
//   max_position_embeddings max_position_embeddings
//   quantization          quantization_config.quant_method: absent -> bf16, "mxfp8" (requires
//                         weight_block_size [1, 32]); anything else is an error
// Checked as the model needs them: every size > 0; num_heads % num_kv_heads == 0 with the group
// (num_heads / num_kv_heads) in {1, 2, 4, 8, 16}; head_dim == 128; rotary_dim in {16, 32, 64} (the
// kernels' partial rotary dims); block_size in 1..16; target_layer_ids non-empty, non-negative and
// strictly increasing; mask_token_id < vocab_size; markov_rank > 0; rms_norm_eps > 0; rope_theta >
// 0; hidden_act "swigluoai" when present; use_gemma_norm true when present;
// dspark_hybrid_context_fusion false when present; layer_types, when present, has num_layers
// entries, all "sliding_attention" (sliding_window > 0 then) or all "full_attention"; with mxfp8,
// hidden_size and ffn_size multiples of 32 (the scale blocks). Unknown fields are ignored (a
// config.json carries many the drafter does not use). Errors are m3rt::Error naming the document,
// the field (under the name found) and the rule, e.g.
//   "tiny/config.json: num_key_value_heads = 3: must divide num_attention_heads = 16".
#pragma once

#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

namespace m3rt {

enum class DsparkQuant { kBFloat16, kMxfp8 };

struct DsparkConfig {
  int num_layers = 0;
  int hidden_size = 0;
  int num_heads = 0;
  int num_kv_heads = 0;
  int head_dim = 128;
  int ffn_size = 0;
  int vocab_size = 0;
  int block_size = 0;
  int mask_token_id = 0;
  std::vector<int> target_layer_ids;
  int markov_rank = 0;
  std::string markov_head_type = "vanilla";
  bool confidence_head = false;
  bool confidence_with_markov = false;
  int sliding_window = 0;   // 0: no window
  float rms_norm_eps = 1e-6f;
  double rope_theta = 0;
  int rotary_dim = 0;
  float swiglu_alpha = 1.702f, swiglu_beta = 1.0f, swiglu_limit = 7.0f;
  int64_t max_position_embeddings = 0;
  DsparkQuant quant = DsparkQuant::kBFloat16;
};

// Parses and validates config.json text; `what` names the document in errors.
DsparkConfig parse_dspark_config(std::string_view json_text, std::string_view what);
// Reads `path` (a config.json) and parses it.
DsparkConfig read_dspark_config(const std::string& path);
// A config.json text (canonical field names) that parse_dspark_config reads back to `c` (the tiny
// checkpoint generator writes it).
std::string dspark_config_json(const DsparkConfig& c);

}  // namespace m3rt
