#include "check/check_util.h"

#include <algorithm>
#include <numeric>

namespace m3rt::detail {

Tensor random_half(const std::vector<int64_t>& shape, DType dtype, Rng& rng, float lo, float hi) {
  Tensor t = Tensor::empty(shape, dtype);
  uint16_t* p = t.ptr<uint16_t>();
  for (int64_t i = 0; i < t.numel(); ++i) {
    const float v = rng.uniform(lo, hi);
    p[i] = dtype == DType::kBFloat16 ? float_to_bf16(v) : float_to_fp16(v);
  }
  return t;
}

Tensor scalar_f32(float v) {
  Tensor t = Tensor::empty({1}, DType::kFloat32);
  *t.ptr<float>() = v;
  return t;
}

Tensor int64_vector(const std::vector<int64_t>& values) {
  Tensor t = Tensor::empty({int64_t(values.size())}, DType::kInt64);
  std::copy(values.begin(), values.end(), t.ptr<int64_t>());
  return t;
}

Tensor rope_table(int64_t max_pos, int rotary_dim, float theta) {
  Tensor t = Tensor::empty({max_pos, rotary_dim}, DType::kBFloat16);
  const int half = rotary_dim / 2;
  uint16_t* p = t.ptr<uint16_t>();
  for (int64_t pos = 0; pos < max_pos; ++pos) {
    for (int i = 0; i < half; ++i) {
      const float f = std::pow(theta, -2.0f * float(i) / float(rotary_dim));
      const float a = float(pos) * f;
      p[pos * rotary_dim + i] = float_to_bf16(std::cos(a));
      p[pos * rotary_dim + half + i] = float_to_bf16(std::sin(a));
    }
  }
  return t;
}

std::vector<int64_t> random_slots(int64_t count, int64_t num_slots, int pad_every, Rng& rng) {
  std::vector<int64_t> all(static_cast<size_t>(num_slots));
  std::iota(all.begin(), all.end(), 0);
  std::shuffle(all.begin(), all.end(), rng.gen());
  std::vector<int64_t> s(all.begin(), all.begin() + count);
  if (pad_every > 0)
    for (int64_t i = pad_every - 1; i < count; i += pad_every) s[size_t(i)] = -1;
  return s;
}

Tensor on(const Tensor& t, Device device) { return t.to(device); }

Tensor to_host(const Tensor& t) { return t.to(Device::cpu()); }

}  // namespace m3rt::detail
