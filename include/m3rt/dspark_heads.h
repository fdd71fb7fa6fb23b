// m3rt/dspark_heads.h — the DSpark drafter's Markov head loop and confidence head, CPU reference
// (../shared/spec/dspark.md §3). The GPU version (captured with the backbone in the draft step's
// graph) will follow this contract.
//
// defines: DsparkHeadsArgs, dspark_markov_heads, dspark_gumbel.
//
// For request r with anchor token x_{-1} = anchor_tokens[r] and draft step i = 0..N-1:
//   e_i       = W1[x_{i-1}]                                          [r_markov]
//   bias_i[v] = bf16( sum_k e_i[k] * W2[v][k] )   (fp32 sum over k in order, rounded once)
//   logits_i  = bf16( base_logits[r][i][v] + bias_i[v] )            (the sum rounded once)
//   greedy (temperature 0): x_i = argmax_v logits_i (ties: the lower id); its distribution is
//     one-hot at x_i
//   sampled (temperature T > 0): p_i = softmax(logits_i / T) and x_i = argmax_v (logits_i[v] / T +
//     g(seed_r, anchor_positions[r] + i, v)), a Gumbel-max draw from exactly p_i, where g is the
//     Gumbel noise of dspark_gumbel keyed by the request's seed, the position Q - 1 of the token it
//     predicts (Q = anchor position + 1 + i) and the token id — so draws are reproducible and
//     independent across requests, steps and tokens
//   confidence: z_i = w . [head_hidden[r][i] ; e_i] + b (w . head_hidden only when the head has no
//     Markov input), computed in fp32 from the bf16 values; c_i = sigmoid(z_i), the estimated
//     probability that x_i is accepted given that x_0..x_{i-1} were
// A request with anchor token < 0 is padding: its tokens are -1 and its probabilities and
// confidences 0.
#pragma once

#include <cstdint>

#include "m3rt/tensor.h"

namespace m3rt {

struct DsparkHeadsArgs {
  TensorView base_logits;       // [R, N, V] bf16: the LM head on the block's query rows
  TensorView w1, w2;            // [V, r] bf16 each (markov_head.markov_w1 / markov_w2)
  TensorView anchor_tokens;     // [R] int32
  TensorView anchor_positions;  // [R] int64: the anchor's position in its sequence
  TensorView temperatures;      // [R] fp32: 0 greedy, > 0 sampled
  TensorView seeds;             // [R] int64
  // Confidence head (optional: leave conf_w undefined to skip it and `confidence`).
  TensorView head_hidden;       // [R, N, H] bf16: the final-normed rows the LM head read
  TensorView conf_w;            // [1, H + r] bf16 (with Markov input) or [1, H]
  TensorView conf_b;            // [1] bf16
  // Outputs.
  TensorView draft_tokens;      // [R, N] int32
  TensorView draft_probs;       // optional [R, N, V] fp32: the distribution each token was drawn from
  TensorView confidence;        // [R, N] fp32 (required with conf_w)
};

// CPU tensors only (the reference). Throws m3rt::Error naming the argument on bad shapes, dtypes,
// devices, a token id outside [0, V) (the anchor), a negative or non-finite temperature.
void dspark_markov_heads(const DsparkHeadsArgs& args);

// The Gumbel noise -log(-log(u)) of the draw for (seed, position, token): u in (0, 1) from a
// counter-based 64-bit hash of the three (splitmix64 rounds), so the CPU and a GPU kernel can
// produce the same noise without shared state.
double dspark_gumbel(uint64_t seed, int64_t position, int64_t token);

}  // namespace m3rt
