// swiglu_oai: validation and dispatch.
#include <cmath>

#include "core/dispatch.h"
#include "m3rt/ops.h"
#include "ops/swiglu_oai/swiglu_oai.h"


namespace m3rt {

void swiglu_oai(const TensorView& out, const TensorView& gate_up, const SwigluOaiParams& params,
                stream_t stream) {
  using namespace detail;
  constexpr const char* kOp = "swiglu_oai";
  require_defined(kOp, "gate_up", gate_up);
  const Device dev = gate_up.device;
  require_dtype(kOp, "gate_up", gate_up, {DType::kBFloat16, DType::kFloat16});
  require_shape(kOp, "gate_up", gate_up, {-1, -1});
  require_last_dim_contiguous(kOp, "gate_up", gate_up);
  if (gate_up.shape[1] % 2 != 0 || gate_up.shape[1] == 0)
    throw_arg_error(kOp, "gate_up.shape", gate_up.shape_str(), "the last dim must be 2*I with I >= 1");
  const int64_t T = gate_up.shape[0], I = gate_up.shape[1] / 2;
  require_defined(kOp, "out", out);
  require_dtype(kOp, "out", out, {gate_up.dtype});
  require_shape(kOp, "out", out, {T, I});
  require_last_dim_contiguous(kOp, "out", out);
  require_device(kOp, "out", out, dev);
  if (!std::isfinite(params.alpha))
    throw_arg_error(kOp, "alpha", std::to_string(params.alpha), "must be finite");
  if (!(params.limit > 0.f))
    throw_arg_error(kOp, "limit", std::to_string(params.limit), "must be > 0 (use +inf for no clamp)");
  if (!std::isfinite(params.beta))
    throw_arg_error(kOp, "beta", std::to_string(params.beta), "must be finite");
  SwigluOaiKernelParams p{};
  p.out = out.data;
  p.gate_up = gate_up.data;
  p.rows = T;
  p.inner = I;
  p.in_s0 = gate_up.stride[0];
  p.out_s0 = out.stride[0];
  p.alpha = params.alpha;
  p.limit = params.limit;
  p.beta = params.beta;
  p.dtype = gate_up.dtype;
  if (T == 0) return;
  run_on_device(kOp, dev, p, swiglu_oai_ref, M3RT_LAUNCHER(swiglu_oai_launch), stream);
}

}  // namespace m3rt
