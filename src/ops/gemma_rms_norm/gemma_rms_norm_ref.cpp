// CPU reference of the Gemma RMSNorm (and its fused residual-add form): plain fp32 loops.
#include <cmath>
#include <vector>

#include "ops/common/ref_common.h"
#include "ops/gemma_rms_norm/gemma_rms_norm.h"

namespace m3rt {

namespace {
float load(DType dt, const void* base, int64_t i) {
  const uint16_t v = static_cast<const uint16_t*>(base)[i];
  return dt == DType::kBFloat16 ? bf16_to_float(v) : fp16_to_float(v);
}
void store(DType dt, void* base, int64_t i, float x) {
  static_cast<uint16_t*>(base)[i] = dt == DType::kBFloat16 ? float_to_bf16(x) : float_to_fp16(x);
}
}  // namespace

void gemma_rms_norm_ref(const GemmaRmsNormParams& p) {
  std::vector<float> s(static_cast<size_t>(p.d));
  for (int64_t r = 0; r < p.rows; ++r) {
    const int64_t a = r / p.inner, b = r % p.inner;
    const int64_t xo = a * p.x_s0 + b * p.x_s1, oo = a * p.out_s0 + b * p.out_s1,
                  ro = a * p.res_s0 + b * p.res_s1;
    float ss = 0.f;
    for (int64_t i = 0; i < p.d; ++i) {
      s[i] = load(p.dtype, p.x, xo + i);
      if (p.residual) s[i] = s[i] + load(p.dtype, p.residual, ro + i);
      ss += s[i] * s[i];
    }
    // A plain 128-dim head norm sums in the per-head kernels' canonical order (ref_common.h).
    if (p.d == 128 && !p.residual) ss = head_sum_of_squares(s.data());
    const float inv_rms = 1.f / std::sqrt(ss / float(p.d) + p.eps);
    for (int64_t i = 0; i < p.d; ++i) {
      if (p.residual) store(p.dtype, p.residual, ro + i, s[i]);
      store(p.dtype, p.out, oo + i, s[i] * inv_rms * (1.f + load(p.dtype, p.weight, i)));
    }
  }
}

}  // namespace m3rt
