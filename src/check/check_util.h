// Internal: inputs for the checks — a seeded generator, random host tensors, the RoPE table, and
// moving tensors between devices.
#pragma once

#include <cmath>
#include <cstdint>
#include <random>
#include <vector>

#include "m3rt/dtype.h"
#include "m3rt/tensor.h"

namespace m3rt::detail {

class Rng {
 public:
  explicit Rng(uint64_t seed) : gen_(seed) {}
  float uniform(float lo, float hi) { return std::uniform_real_distribution<float>(lo, hi)(gen_); }
  int64_t integer(int64_t lo, int64_t hi) {  // inclusive
    return std::uniform_int_distribution<int64_t>(lo, hi)(gen_);
  }
  std::mt19937_64& gen() { return gen_; }

 private:
  std::mt19937_64 gen_;
};

// Host tensor of bf16 (or fp16) values drawn uniformly from [lo, hi].
Tensor random_half(const std::vector<int64_t>& shape, DType dtype, Rng& rng, float lo, float hi);
// Host fp32 scalar tensor [1].
Tensor scalar_f32(float v);
// Host int64 vector.
Tensor int64_vector(const std::vector<int64_t>& values);
// cos_sin_cache [max_pos, rotary_dim] bf16: [cos(p f_i) | sin(p f_i)], f_i = theta^(-2i/rotary_dim),
// computed in fp32 and rounded to bf16.
Tensor rope_table(int64_t max_pos, int rotary_dim, float theta = 5e6f);
// `count` distinct slots in [0, num_slots), shuffled, with every `pad_every`-th entry -1 (0: none).
std::vector<int64_t> random_slots(int64_t count, int64_t num_slots, int pad_every, Rng& rng);

// A copy of `t` on `device` (always a copy: ops write some inputs in place).
Tensor on(const Tensor& t, Device device);
Tensor to_host(const Tensor& t);

}  // namespace m3rt::detail
