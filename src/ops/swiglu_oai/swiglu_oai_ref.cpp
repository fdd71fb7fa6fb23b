// CPU reference of SwiGLU-OAI (../shared/spec/README.md): split [gate | up] layout.
#include <algorithm>
#include <cmath>

#include "ops/swiglu_oai/swiglu_oai.h"

namespace m3rt {

void swiglu_oai_ref(const SwigluOaiKernelParams& p) {
  const bool bf16 = p.dtype == DType::kBFloat16;
  auto load = [&](int64_t i) {
    const uint16_t v = static_cast<const uint16_t*>(p.gate_up)[i];
    return bf16 ? bf16_to_float(v) : fp16_to_float(v);
  };
  for (int64_t r = 0; r < p.rows; ++r) {
    for (int64_t i = 0; i < p.inner; ++i) {
      const float g = std::min(load(r * p.in_s0 + i), p.limit);
      const float u = std::clamp(load(r * p.in_s0 + p.inner + i), -p.limit, p.limit);
      const float y = g * (1.f / (1.f + std::exp(-(p.alpha * g)))) * (u + p.beta);
      static_cast<uint16_t*>(p.out)[r * p.out_s0 + i] = bf16 ? float_to_bf16(y) : float_to_fp16(y);
    }
  }
}

}  // namespace m3rt
