// m3rt/dspark_model.h — the DSpark draft model (../shared/spec/dspark.md §2–§4), built from m3rt's
// ops: context-K/V precompute and the draft step (backbone, LM head, Markov and confidence heads).
// One model runs on one device: the CPU (each op's reference path, GEMMs as plain fp32-accumulating
// loops: the reference) or a CUDA GPU (the ops' kernels, bf16 GEMMs through cuBLASLt, the Markov
// loop on the device, the draft step captured in a CUDA graph per padded batch size).
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
  Device device = Device::cpu();     // where the weights, caches and every call's tensors live
  // GPU only. The draft step's buffers are sized for max_batch requests and block tables of
  // max_blocks_per_request columns (0: num_cache_blocks); a call with R requests runs the graph of
  // the padded size P = the next power of two >= R (capped at max_batch), captured on first use.
  int max_batch = 64;
  int max_blocks_per_request = 0;
  bool use_graphs = true;            // false: every step runs eagerly (same kernels, same bits)
  // GPU: the first call at each padded size times cuBLASLt's candidate algorithms for the step's
  // GEMMs and keeps the fastest (timing noise may pick differently in another process, so the
  // last bits may differ between runs); false: cuBLASLt's heuristic choice (reproducible).
  bool tune_gemms = true;
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

// Calls on a GPU model take CUDA tensors on its device and enqueue their work on `stream` (the
// model orders its own stream after it and `stream` after the work); they never synchronize the
// host. Shapes, dtypes and devices are checked on the host (m3rt::Error); the values of device-side
// inputs cannot be, so a draft request whose anchor token, position, block-table entries or slots
// are invalid is drafted as padding (tokens -1, nothing written to the caches) and recorded;
// check_input_errors() synchronizes and throws naming the first such request, field and value.
// The CPU model throws those errors from draft() itself.
class DsparkModel {
 public:
  // Copies (or dequantizes) the layers' weights into its own layout. On the CPU it keeps views of
  // the embedding, LM head (the target's: shared, never copied) and Markov tables in the
  // checkpoint's mapped files, so `ckpt` must outlive the model; on a GPU every weight is uploaded
  // once (the embedding and LM head too: one copy in GPU memory) and `ckpt` may be dropped.
  DsparkModel(const DsparkCheckpoint& ckpt, const DsparkModelOptions& opt);
  // Random weights at the config's sizes (benchmarks at the real M3.1 dimensions without a
  // checkpoint): uniform in [-a, a] with a = sqrt(3 / fan_in) for linears and the LM head, 1 for the
  // embedding and W1, 0.1 for norms and the confidence head's bias, from a counter hash of `seed`.
  DsparkModel(const DsparkConfig& config, const DsparkModelOptions& opt, uint64_t seed);
  ~DsparkModel();
  DsparkModel(const DsparkModel&) = delete;
  DsparkModel& operator=(const DsparkModel&) = delete;

  // target_hidden [T, n * H] bf16 (n = target layers), positions [T] int64, slots [T] int64.
  // Runs eagerly (its row count varies). On a GPU the model passes its own claim counters
  // (ops.h, claim_counters) to the context writer and the QK insert, so long contexts take
  // their run-time claims by the ops' rules (ops.h; the writer's from 8192 rows into bf16 caches
  // on an H100, 16384 on an H200).
  void precompute_context(const TensorView& target_hidden, const TensorView& positions, const TensorView& slots,
                          stream_t stream = nullptr);
  void draft(const DsparkDraftArgs& args, stream_t stream = nullptr);
  // GPU: waits for the model's work, then throws m3rt::Error for the first request a draft call
  // since the last check drafted as padding because of an invalid input (and forgets them all).
  // CPU: nothing to do.
  void check_input_errors();

  // Times of the last calls, in milliseconds: host clock on the CPU; on a GPU, CUDA events between
  // the stages (recorded inside the graph too), read when this is called (it waits for them).
  struct Timings {
    double precompute_ms = 0;  // precompute_context: fc, hidden norm, K/V GEMM, cache writes
    double backbone_ms = 0;    // draft: embedding and the decoder layers
    double lm_head_ms = 0;     // draft: final norm and LM head
    double heads_ms = 0;       // draft: Markov loop and confidence head
    double draft_ms = 0;       // draft: the whole step (GPU: graph launch to the last head kernel)
  };
  const Timings& last_timings() const;

  const DsparkConfig& config() const;
  const DsparkModelOptions& options() const;
  // Layer l's KV cache [num_cache_blocks, Hkv, 128, 256].
  const Tensor& kv_cache(int layer) const;
  // Bytes of weights one draft step reads (each layer's, the LM head, W2 once per Markov step;
  // the embedding, W1 and confidence rows it gathers are not counted): the benchmarks' floor.
  int64_t draft_weight_bytes() const;
  // Padded sizes whose draft graph has been captured so far (GPU with graphs).
  int graphs_captured() const;

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

}  // namespace m3rt
