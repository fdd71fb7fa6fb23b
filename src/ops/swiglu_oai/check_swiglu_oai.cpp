// The `m3rt check` rows of swiglu_oai.
// Shared helpers and the method (poisoned outputs; CPU reference on a GPU, fp64 oracle on the
// CPU): src/check/check_helpers.h.
#include <algorithm>
#include <cmath>
#include <string>

#include "check/check_helpers.h"
#include "check/check_util.h"
#include "m3rt/ops.h"

namespace m3rt::detail {

namespace {

// ------------------------------------------------------------------------------------------------
// swiglu_oai
void check_swiglu_variant(CheckContext& c, DType dt, int64_t T, int64_t I) {
  const SwigluOaiParams sp{};
  c.variant = std::string(dt == DType::kBFloat16 ? "bf16" : "fp16") + " T" + std::to_string(T) +
              " I" + std::to_string(I);
  Tensor in = random_half({T, 2 * I}, dt, c.rng, -12, 12);  // past both clamps
  auto run = [&](Device dev) {
    Tensor x = on(in, dev);
    Tensor out = poisoned({T, I}, dt, dev);
    swiglu_oai(out, x, sp);
    return to_host(out);
  };
  Tensor got = run(c.device), want;
  if (c.device.is_cuda()) {
    want = run(Device::cpu());
  } else {
    want = poisoned({T, I}, dt, Device::cpu());
    const bool bf = dt == DType::kBFloat16;
    auto ld = [&](int64_t i) {
      const uint16_t b = in.ptr<uint16_t>()[i];
      return double(bf ? bf16_to_float(b) : fp16_to_float(b));
    };
    for (int64_t t = 0; t < T; ++t)
      for (int64_t i = 0; i < I; ++i) {
        const double g = std::min(ld(t * 2 * I + i), double(sp.limit));
        const double u = std::clamp(ld(t * 2 * I + I + i), -double(sp.limit), double(sp.limit));
        const double y = g / (1.0 + std::exp(-double(sp.alpha) * g)) * (u + sp.beta);
        want.ptr<uint16_t>()[t * I + i] = bf ? float_to_bf16(float(y)) : float_to_fp16(float(y));
      }
  }
  add_row(c, "out", got, want, dt, 1);
}

}  // namespace

void check_swiglu_oai(CheckContext& c) {
  check_swiglu_variant(c, DType::kBFloat16, 33, 1536);
  check_swiglu_variant(c, DType::kFloat16, 5, 100);
}

}  // namespace m3rt::detail
