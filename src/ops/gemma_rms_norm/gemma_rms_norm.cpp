// gemma_rms_norm / gemma_fused_add_rms_norm: validation and dispatch.
#include "core/dispatch.h"
#include "m3rt/ops.h"
#include "ops/gemma_rms_norm/gemma_rms_norm.h"


namespace m3rt {

namespace {

// Row strides (s0, s1) of a [d], [rows, d] or [a, b, d] view, and the inner row count.
void row_strides(const TensorView& v, int64_t& s0, int64_t& s1) {
  s0 = v.ndim >= 2 ? v.stride[0] : 0;
  s1 = v.ndim == 3 ? v.stride[1] : 0;
}

void run(const char* op, const TensorView& out, const TensorView& x, const TensorView* residual,
         const TensorView& weight, float eps, stream_t stream) {
  using namespace detail;
  require_defined(op, "x", x);
  const Device dev = x.device;
  require_dtype(op, "x", x, {DType::kBFloat16, DType::kFloat16});
  if (x.ndim < 1 || x.ndim > 3)
    throw_arg_error(op, "x.shape", x.shape_str(), "expected [d], [rows, d] or [a, b, d]");
  if (x.shape[x.ndim - 1] < 1) throw_arg_error(op, "x.shape", x.shape_str(), "needs d >= 1");
  require_last_dim_contiguous(op, "x", x);
  std::vector<std::pair<const char*, const TensorView*>> same = {{"out", &out}};
  if (residual) same.push_back({"residual", residual});
  for (const auto& [name, v] : same) {
    require_defined(op, name, *v);
    require_dtype(op, name, *v, {x.dtype});
    if (v->sizes() != x.sizes())
      throw_arg_error(op, std::string(name) + ".shape", v->shape_str(), "must equal x.shape " + x.shape_str());
    require_last_dim_contiguous(op, name, *v);
    require_device(op, name, *v, dev);
  }
  const int64_t d = x.shape[x.ndim - 1];
  require_defined(op, "weight", weight);
  require_dtype(op, "weight", weight, {x.dtype});
  require_shape(op, "weight", weight, {d});
  require_contiguous(op, "weight", weight);
  require_device(op, "weight", weight, dev);
  if (!(eps >= 0.f)) throw_arg_error(op, "eps", std::to_string(eps), "must be >= 0");

  GemmaRmsNormParams p{};
  p.out = out.data;
  p.x = x.data;
  p.residual = residual ? residual->data : nullptr;
  p.weight = weight.data;
  p.d = d;
  p.rows = x.numel() / d;
  p.inner = x.ndim == 3 ? x.shape[1] : 1;
  row_strides(x, p.x_s0, p.x_s1);
  row_strides(out, p.out_s0, p.out_s1);
  if (residual) row_strides(*residual, p.res_s0, p.res_s1);
  p.eps = eps;
  p.dtype = x.dtype;
  if (p.rows == 0) return;
  run_on_device(op, dev, p, gemma_rms_norm_ref, M3RT_LAUNCHER(gemma_rms_norm_launch), stream);
}

}  // namespace

void gemma_rms_norm(const TensorView& out, const TensorView& x, const TensorView& weight, float eps,
                    stream_t stream) {
  run("gemma_rms_norm", out, x, nullptr, weight, eps, stream);
}

void gemma_fused_add_rms_norm(const TensorView& out, const TensorView& x,
                              const TensorView& residual, const TensorView& weight, float eps,
                              stream_t stream) {
  run("gemma_fused_add_rms_norm", out, x, &residual, weight, eps, stream);
}

}  // namespace m3rt
