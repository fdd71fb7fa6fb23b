// Internal: the DSpark draft step's own CUDA kernels (everything that is not an m3rt op or a GEMM):
// the call's input gather and output copy, block-row preparation with device-side checks,
// embedding rows, the Markov loop's step (logits, keys, last-CTA reduce), the confidence head, the
// draft distributions, random weights. Raw pointers and params structs only; the model
// (dspark_model.cpp) owns the buffers. Math: include/m3rt/dspark_heads.h and
// include/m3rt/dspark_model.h. Built only with CUDA.
//
// defines: DraftInputsParams, DraftPrepParams, MarkovStepParams, ConfidenceParams, ProbsParams,
//          kDraftError*, launch_draft_inputs, launch_draft_outputs, launch_draft_prep,
//          launch_embed_rows, launch_markov_step, launch_confidence, launch_draft_probs,
//          launch_fill_random_bf16, markov_partials.
#pragma once

#include <cstdint>

#include "m3rt/tensor.h"

namespace m3rt::detail {

// Per-request input errors found on the device (the request is then drafted as padding). Sticky:
// the prep kernel only sets them; the host reads and clears them (DsparkModel::check_input_errors).
enum : int64_t {
  kDraftErrorNone = 0,
  kDraftErrorAnchorToken = 1,  // anchor token >= vocab size
  kDraftErrorPosition = 2,     // block [p, p + N) outside [0, max_position_embeddings)
  kDraftErrorSpan = 3,         // the keys the block attends span more than topk pages
  kDraftErrorPage = 4,         // a block-table entry the block reads is outside [0, num_cache_blocks)
                               // (value: the entry, at: the column)
  kDraftErrorSlot = 5,         // a block slot >= num_cache_blocks * 128 (at: the block row)
  kDraftErrorTemperature = 6,  // temperature negative or not finite (value: its fp32 bits)
};

struct DraftPrepParams {
  // Inputs, [R] / [R, N] / [R, table_width].
  const int32_t* anchors;
  const int64_t* anchor_pos;
  const int64_t* block_slots;
  const int32_t* block_table;  // [R, table_width]: columns the caller did not supply hold -1
  const float* temperatures;
  int table_width;
  int R, N, vocab, mask_token, num_kv_heads, topk, page, sliding_window;
  int64_t max_pos, num_cache_blocks;
  // Markov embedding table (for E_0 = W1[anchor]).
  const uint16_t* w1;
  int rank;
  // Outputs.
  int32_t* ids;         // [R * N]
  int64_t* positions;   // [R * N]
  int64_t* slots;       // [R * N]: -1 for padding
  int32_t* seq_lens;    // [R]
  int32_t* lists;       // [nkv, R * N, topk]
  int32_t* prev;        // [R]: the anchor, or -1 for padding
  uint16_t* e;          // [R, rank]: W1[anchor] (0 for padding)
  int64_t* errors;      // [R, 3]: (code, value, at), sticky
};
void launch_draft_prep(const DraftPrepParams& p, stream_t stream);

// A call's inputs into the step's static buffers in one launch: request rows r < R are copied,
// rows R <= r < P are padding (anchor -1); block-table columns past the caller's W read -1.
struct DraftInputsParams {
  int R, P, N, W, MB;
  const int32_t* anchors;  const int64_t* positions;  const int64_t* slots;  const int32_t* table;
  const float* temps;      const int64_t* seeds;
  int32_t* s_anchors;      int64_t* s_positions;      int64_t* s_slots;      int32_t* s_table;
  float* s_temps;          int64_t* s_seeds;
};
void launch_draft_inputs(const DraftInputsParams& p, stream_t stream);

// The step's tokens (and confidences, when `conf` is set) for the first n = R * N rows.
void launch_draft_outputs(int32_t* tokens, const int32_t* s_tokens, float* conf, const float* s_conf, int n,
                          stream_t stream);

// h[t] = table[ids[t]] for t < rows (rows of H bf16), and the same rows into `copy` when set (the
// first layer's residual).
void launch_embed_rows(uint16_t* h, uint16_t* copy, const uint16_t* table, const int32_t* ids, int rows, int H,
                       stream_t stream);

struct MarkovStepParams {
  int R, N, V, step;              // step i in [0, N)
  const uint16_t* base;           // [R * N, V] bf16: base logits
  const uint16_t* bias;           // [R, V] bf16: W2 . W1[prev]
  uint16_t* logits;               // [R, N, V] bf16 out: bf16(base + bias)
  const int32_t* prev;            // [R]: < 0 padding
  const float* temperatures;      // [R]
  const int64_t* seeds;           // [R]
  const int64_t* anchor_pos;      // [R]
  double* part_key;               // [R, chunks]
  int32_t* part_idx;              // [R, chunks]
  int32_t* counters;              // [R]: arrivals, zero between steps (the last CTA resets them)
  int32_t* tokens;                // [R, N]: token of step i
  int32_t* prev_out;              // [R]: next step's previous token (== prev: updated in place)
  uint16_t* e;                    // [R, rank]: W1[token]
  const uint16_t* w1;
  int rank;
};
// One Markov step after the GEMM bias = W2 . W1[prev]: markov_partials(V) CTAs per request.
int markov_partials(int V);
void launch_markov_step(const MarkovStepParams& p, stream_t stream);

struct ConfidenceParams {
  int R, N, H, rank;
  bool with_markov;
  const uint16_t* head;     // [R * N, H]
  const uint16_t* w;        // [H (+ rank)]
  const uint16_t* b;        // [1]
  const uint16_t* w1;
  const int32_t* anchors;   // [R]: < 0 padding
  const int32_t* tokens;    // [R, N]
  float* out;               // [R, N]
};
void launch_confidence(const ConfidenceParams& p, stream_t stream);

struct ProbsParams {
  int R, N, V;
  const uint16_t* logits;   // [R, N, V]
  const int32_t* tokens;    // [R, N]
  const float* temperatures;
  float* out;               // [R, N, V]
};
void launch_draft_probs(const ProbsParams& p, stream_t stream);

// x[i] = bf16(a * u(seed, i)), u uniform in [-1, 1) from a counter hash (same on host and device).
void launch_fill_random_bf16(uint16_t* x, int64_t n, uint64_t seed, float a, stream_t stream);

}  // namespace m3rt::detail
