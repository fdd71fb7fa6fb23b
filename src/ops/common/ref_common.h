// Helpers shared by the CPU references.
#pragma once

#include <cstdint>
#include <string>

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
