// The `m3rt check` rows of gemma_rms_norm and gemma_fused_add_rms_norm.
// Shared helpers and the method (poisoned outputs; CPU reference on a GPU, fp64 oracle on the
// CPU): src/check/check_helpers.h.
#include <cmath>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include "check/check_helpers.h"
#include "check/check_util.h"
#include "m3rt/ops.h"

namespace m3rt::detail {

namespace {

// ------------------------------------------------------------------------------------------------
// gemma_rms_norm and gemma_fused_add_rms_norm
void oracle_norm(const TensorView& x, const TensorView* res_in, const TensorView& w, double eps,
                 const TensorView& out, const TensorView* res_out) {
  const bool bf = x.dtype == DType::kBFloat16;
  auto ld = [&](const TensorView& v, int64_t i) {
    const uint16_t b = v.ptr<uint16_t>()[i];
    return double(bf ? bf16_to_float(b) : fp16_to_float(b));
  };
  auto st = [&](const TensorView& v, int64_t i, double y) {
    v.ptr<uint16_t>()[i] = bf ? float_to_bf16(float(y)) : float_to_fp16(float(y));
  };
  const int64_t d = x.shape[x.ndim - 1], inner = x.ndim == 3 ? x.shape[1] : 1;
  const int64_t rows = x.numel() / d;
  auto off = [&](const TensorView& v, int64_t r) {
    return (v.ndim >= 2 ? (r / inner) * v.stride[0] : 0) + (v.ndim == 3 ? (r % inner) * v.stride[1] : 0);
  };
  std::vector<double> s(static_cast<size_t>(d));
  for (int64_t r = 0; r < rows; ++r) {
    double ss = 0;
    for (int64_t i = 0; i < d; ++i) {
      s[i] = ld(x, off(x, r) + i) + (res_in ? ld(*res_in, off(*res_in, r) + i) : 0.0);
      ss += s[i] * s[i];
    }
    const double inv = 1.0 / std::sqrt(ss / double(d) + eps);
    for (int64_t i = 0; i < d; ++i) {
      st(out, off(out, r) + i, s[i] * inv * (1.0 + ld(w, i)));
      if (res_out) st(*res_out, off(*res_out, r) + i, s[i]);
    }
  }
}

void check_gemma_rms_norm_variant(CheckContext& c, DType dt, std::vector<int64_t> shape,
                                  bool per_head_view, bool fused) {
  const float eps = 1e-6f;
  const int64_t d = shape.back();
  c.op = fused ? "gemma_fused_add_rms_norm" : "gemma_rms_norm";
  c.variant = std::string(dt == DType::kBFloat16 ? "bf16" : "fp16") + " " +
              TensorView::contiguous(nullptr, dt, shape).shape_str() + (per_head_view ? " heads-in-qkv" : "");
  // A per-head view reads heads 1..H of a wider row, as the QK norm does inside qkv.
  const int64_t H = per_head_view ? shape[1] : 0, row_w = (H + 2) * d;
  Tensor xbuf = per_head_view ? random_half({shape[0], row_w}, dt, c.rng, -10, 10)
                              : random_half(shape, dt, c.rng, -10, 10);
  Tensor res = random_half(shape, dt, c.rng, -10, 10);
  Tensor w = random_half({d}, dt, c.rng, -1, 1);
  auto xview = [&](const Tensor& buf) {
    if (!per_head_view) return buf.view();
    TensorView v = buf.view();
    v.ndim = 3;
    v.shape[0] = shape[0], v.shape[1] = H, v.shape[2] = d;
    v.stride[0] = row_w, v.stride[1] = d, v.stride[2] = 1;
    v.data = buf.ptr<uint16_t>() + d;
    return v;
  };
  auto run = [&](Device dev) {
    Tensor xb = on(xbuf, dev), r = on(res, dev), wd = on(w, dev);
    Tensor out = poisoned(shape, dt, dev);
    if (fused) {
      gemma_fused_add_rms_norm(out, xview(xb), r, wd, eps);
    } else {
      gemma_rms_norm(out, xview(xb), wd, eps);
    }
    return std::pair{to_host(out), to_host(r)};
  };
  auto [out, r_out] = run(c.device);
  Tensor want_out, want_res;
  if (c.device.is_cuda()) {
    std::tie(want_out, want_res) = run(Device::cpu());
  } else {
    want_out = poisoned(shape, dt, Device::cpu());
    want_res = fused ? poisoned(shape, dt, Device::cpu()) : res;
    oracle_norm(xview(xbuf), fused ? &res.view() : nullptr, w, eps, want_out,
                fused ? &want_res.view() : nullptr);
  }
  add_row(c, "out", out, want_out, dt, 1);
  // The GPU must form the residual exactly like the reference; vs fp64 a double rounding may differ.
  if (fused) add_row(c, "residual", r_out, want_res, dt, c.device.is_cuda() ? 0 : 1);
}

}  // namespace

void check_gemma_rms_norm(CheckContext& c) {
  check_gemma_rms_norm_variant(c, DType::kBFloat16, {9, 6144}, false, false);
  check_gemma_rms_norm_variant(c, DType::kBFloat16, {13, 6, 128}, true, false);
  check_gemma_rms_norm_variant(c, DType::kFloat16, {5, 1000}, false, false);
  check_gemma_rms_norm_variant(c, DType::kBFloat16, {7, 6144}, false, true);
  check_gemma_rms_norm_variant(c, DType::kBFloat16, {3, 300}, false, true);
}

}  // namespace m3rt::detail
