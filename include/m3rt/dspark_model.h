// m3rt/dspark_model.h — the DSpark draft model (../shared/spec/dspark.md §2–§4), built from m3rt's
// ops: context-K/V precompute and the draft step (backbone, LM head, Markov and confidence heads).
// This version runs on the CPU (each op's reference path, GEMMs as plain fp32-accumulating loops);
// the GPU step with cuBLASLt GEMMs and a CUDA graph is the next step of issue 5.
//
// defines: DsparkModelOptions, DsparkDraftArgs, DsparkModel.
//
// One round (§2.1):
//   precompute_context: context_states = fc([h_l0 | h_l1 | ...]) (the target's captured hidden
//     states, concatenated in config order); x = GemmaNorm(context_states; hidden_norm); all_kv =
//     x . [K_0; V_0; K_1; V_1; ...]^T viewed as [T, L, 2, Hkv, 128] (one GEMM for every layer);
//     dspark_context_kv_write: per layer Gemma k_norm, partial NeoX RoPE at the context position,
//     K and V into that layer's cache at the context slot (slot < 0: skipped).
//   draft: per request the block [anchor, mask x (N - 1)] at positions p .. p + N - 1 (p = the
//     anchor's position, N = block_size); embed (the target's table); L MiniMax dense layers (Gemma
//     input norm with the fused residual add, qkv GEMM, qknorm_rope_kv_insert with the block's
//     slots, attention over the request's keys [0, p + N) — the cached context plus the block —
//     non-causal (every block row sees the whole block) with the sliding window, o_proj, fused add +
//     post norm, gate/up GEMM, SwiGLU-OAI, down GEMM); final norm on h + residual; the LM head
//     (the target's); then the Markov loop and confidence head (m3rt/dspark_heads.h).
// GEMMs: y = x . W^T with bf16 inputs, fp32 accumulation over k in order, one rounding to bf16.
// MXFP8 checkpoints: weights dequantized to bf16 at load (e4m3 x 2^(s - 127), exact in bf16 for
// every scale a real checkpoint uses). Attention: the MSA decode op with non-causal rows and
// window_left = sliding_window (keys at position >= p_row - W + 1), each row's list holding every
// block of the request that meets the block's window (at most 64 blocks; without a window the
// context is limited to 64 blocks of 128 keys).
#pragma once

#include <memory>
#include <vector>

#include "m3rt/dspark_checkpoint.h"
#include "m3rt/ops.h"
#include "m3rt/tensor.h"

namespace m3rt {

struct DsparkModelOptions {
  int num_cache_blocks = 0;          // pages of 128 tokens in each layer's KV cache
  KvCacheDtype kv_cache_dtype = KvCacheDtype::kAuto;  // bf16 (auto/bfloat16) or fp8_e4m3 (scales 1)
  bool causal_block = false;         // true: block rows attend causally (spec §2.6's switch)
};

struct DsparkDraftArgs {
  TensorView anchor_tokens;     // [R] int32; < 0 pads the request (no cache writes, tokens -1)
  TensorView anchor_positions;  // [R] int64: p, the anchor's position; context rows [0, p) are cached
  TensorView block_slots;       // [R, N] int64: cache slots of the block's tokens (page * 128 + offset)
  TensorView block_table;       // [R, max_blocks] int32: each request's logical block -> page
  TensorView temperatures;      // [R] fp32: 0 greedy
  TensorView seeds;             // [R] int64
  TensorView draft_tokens;      // out [R, N] int32
  TensorView draft_probs;       // optional out [R, N, V] fp32
  TensorView confidence;        // optional out [R, N] fp32 (the checkpoint must have the head)
  TensorView head_hidden;       // optional out [R * N, H] bf16 (the LM head's input rows)
  TensorView base_logits;       // optional out [R, N, V] bf16 (before the Markov bias)
};

class DsparkModel {
 public:
  // Copies (or dequantizes) the layers' weights into its own layout and keeps views of the
  // embedding, LM head (the target's: shared, never copied) and Markov tables in the checkpoint's
  // mapped files: `ckpt` must outlive the model.
  DsparkModel(const DsparkCheckpoint& ckpt, const DsparkModelOptions& opt);
  ~DsparkModel();
  DsparkModel(const DsparkModel&) = delete;
  DsparkModel& operator=(const DsparkModel&) = delete;

  // target_hidden [T, n * H] bf16 (n = target layers), positions [T] int64, slots [T] int64.
  void precompute_context(const TensorView& target_hidden, const TensorView& positions, const TensorView& slots);
  void draft(const DsparkDraftArgs& args);

  // Wall times of the last calls, in milliseconds (host clock; the CPU model runs synchronously).
  struct Timings {
    double precompute_ms = 0;  // precompute_context: fc, hidden norm, K/V GEMM, cache writes
    double backbone_ms = 0;    // draft: embedding and the decoder layers
    double lm_head_ms = 0;     // draft: final norm and LM head
    double heads_ms = 0;       // draft: Markov loop and confidence head
  };
  const Timings& last_timings() const;

  const DsparkConfig& config() const;
  // Layer l's KV cache [num_cache_blocks, Hkv, 128, 256].
  const Tensor& kv_cache(int layer) const;

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

}  // namespace m3rt
