// Helpers shared by the CPU references.
#pragma once

#include <cstdint>
#include <string>

#include "m3rt/dtype.h"
#include "m3rt/error.h"

namespace m3rt {

// Device-resident indices, checked by the CPU path before anything is written.
inline void check_slot_and_position(const char* op, int64_t t, int64_t slot, int64_t num_slots,
                                    int64_t pos, int64_t max_pos) {
  if (slot >= num_slots) {
    throw_arg_error(op, "slot_mapping[" + std::to_string(t) + "]", std::to_string(slot),
                    "must be < num_blocks * block_size = " + std::to_string(num_slots));
  }
  if (max_pos >= 0 && (pos < 0 || pos >= max_pos)) {
    throw_arg_error(op, "positions[" + std::to_string(t) + "]", std::to_string(pos),
                    "must lie in [0, max_pos = " + std::to_string(max_pos) + ")");
  }
}

}  // namespace m3rt

namespace m3rt {

// The fp32 sum of squares of one 128-dim head in m3rt's canonical order, the one the per-head
// kernels use (src/ops/common/head_math.cuh): 16 partial sums over 8 consecutive dims each, then a
// butterfly over the partials (xor 8, 4, 2, 1). Every reference that norms a 128-dim head uses it,
// so a normed head rounded to bf16 matches the kernels bit for bit — which matters where RoPE
// follows a bf16 rounding: one ulp moved there can become several after the rotation.
inline float head_sum_of_squares(const float* x) {
  float part[16];
  for (int j = 0; j < 16; ++j) {
    float s = 0.f;
    for (int i = 0; i < 8; ++i) s += x[8 * j + i] * x[8 * j + i];
    part[j] = s;
  }
  for (int m = 8; m > 0; m /= 2) {
    float next[16];
    for (int j = 0; j < 16; ++j) next[j] = part[j] + part[j ^ m];
    for (int j = 0; j < 16; ++j) part[j] = next[j];
  }
  return part[0];
}

}  // namespace m3rt

namespace m3rt {

// The batch layout the MSA ops (lightning indexer, sparse attention) read from device memory:
// prefill requests by cu_seqlens_q, or decode requests of decode_query_len rows each.
struct RequestLayout {
  const int32_t* cu_seqlens_q;  // prefill: [num_seqs + 1]; decode: nullptr
  const int32_t* seq_lens;      // [num_seqs]
  int num_seqs;
  int64_t num_tokens;           // query rows
  int decode_query_len;         // decode: 1..32; prefill: 0
  int max_query_len;            // prefill
  int max_blocks;               // block_table width, in 128-token blocks
};

// e4m3 code -> float, exact, through a 256-entry table (references decode every key per row).
float e4m3_code_to_float(uint8_t code);

// Element i of a bf16 or e4m3 array, as float (exact).
inline float load_bf16_or_e4m3(const void* base, bool fp8, int64_t i) {
  if (fp8) return e4m3_code_to_float(static_cast<const uint8_t*>(base)[i]);
  return bf16_to_float(static_cast<const uint16_t*>(base)[i]);
}

// Throws, naming the entry, its value and the rule, unless: cu_seqlens_q[0] == 0, non-decreasing,
// cu_seqlens_q[B] == num_tokens (`rows`: what the tokens are, e.g. "the q rows"), every query
// length <= max_query_len, 0 <= seq_lens[b] (prefill: >= its query length), and
// ceil(seq_lens[b] / 128) <= max_blocks.
void check_request_layout(const char* op, const RequestLayout& r, const char* rows);

// The request of token t and its position: prefill, the request b with cu[b] <= t < cu[b + 1] at
// seq_lens[b] - query_len_b + (t - cu[b]); decode, b = t / dql at seq_lens[b] - dql + t % dql
// (negative when seq_len < dql). False for a token of no request.
bool request_token_position(const RequestLayout& r, int64_t t, int* seq, int64_t* position);

}  // namespace m3rt
