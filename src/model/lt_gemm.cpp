// bf16 GEMMs through cuBLASLt. Contract: lt_gemm.h.
#include "model/lt_gemm.h"

#include <cublasLt.h>
#include <cuda_runtime_api.h>

#include <cmath>
#include <string>

#include "core/cuda_check.h"
#include "core/validate.h"
#include "m3rt/error.h"

namespace m3rt::detail {

namespace {

constexpr const char* kOp = "LtGemm";
constexpr int64_t kWorkspaceBytes = 32 << 20;

void lt_check(cublasStatus_t st, const char* what) {
  if (st != CUBLAS_STATUS_SUCCESS)
    throw Error(std::string(kOp) + ": " + what + " failed: cuBLASLt status " + std::to_string(int(st)));
}

}  // namespace

struct LtGemm::Plan {
  cublasLtMatmulDesc_t desc = nullptr;
  cublasLtMatrixLayout_t a = nullptr, b = nullptr, c = nullptr;
  cublasLtMatmulAlgo_t algo{};
  ~Plan() {
    if (a) cublasLtMatrixLayoutDestroy(a);
    if (b) cublasLtMatrixLayoutDestroy(b);
    if (c) cublasLtMatrixLayoutDestroy(c);
    if (desc) cublasLtMatmulDescDestroy(desc);
  }
};

LtGemm::LtGemm(Device device) : device_(device) {
  if (!device.is_cuda()) throw_arg_error(kOp, "device", device.str(), "a CUDA device");
  DeviceGuard guard(device.index);
  cublasLtHandle_t h = nullptr;
  lt_check(cublasLtCreate(&h), "cublasLtCreate");
  handle_ = h;
  workspace_ = Tensor::empty({kWorkspaceBytes}, DType::kUInt8, device);
}

LtGemm::~LtGemm() {
  plans_.clear();
  if (handle_) cublasLtDestroy(static_cast<cublasLtHandle_t>(handle_));
}

const LtGemm::Plan& LtGemm::plan(const Key& key, const Operands* tune_on) {
  auto it = plans_.find(key);
  if (it != plans_.end()) return *it->second;
  const auto [M, N, K, ldx, ldy] = key;
  auto p = std::make_unique<Plan>();
  lt_check(cublasLtMatmulDescCreate(&p->desc, CUBLAS_COMPUTE_32F, CUDA_R_32F), "cublasLtMatmulDescCreate");
  const cublasOperation_t ta = CUBLAS_OP_T, tb = CUBLAS_OP_N;
  lt_check(cublasLtMatmulDescSetAttribute(p->desc, CUBLASLT_MATMUL_DESC_TRANSA, &ta, sizeof(ta)), "TRANSA");
  lt_check(cublasLtMatmulDescSetAttribute(p->desc, CUBLASLT_MATMUL_DESC_TRANSB, &tb, sizeof(tb)), "TRANSB");
  // Column-major: A = w as [K, N] (ld K), read transposed; B = x as [K, M] (ld ldx); C = y as [N, M].
  lt_check(cublasLtMatrixLayoutCreate(&p->a, CUDA_R_16BF, uint64_t(K), uint64_t(N), K), "layout A");
  lt_check(cublasLtMatrixLayoutCreate(&p->b, CUDA_R_16BF, uint64_t(K), uint64_t(M), ldx), "layout B");
  lt_check(cublasLtMatrixLayoutCreate(&p->c, CUDA_R_16BF, uint64_t(N), uint64_t(M), ldy), "layout C");
  cublasLtMatmulPreference_t pref = nullptr;
  lt_check(cublasLtMatmulPreferenceCreate(&pref), "cublasLtMatmulPreferenceCreate");
  const uint64_t ws = uint64_t(kWorkspaceBytes);
  cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &ws, sizeof(ws));
  constexpr int kCandidates = 8;
  cublasLtMatmulHeuristicResult_t res[kCandidates] = {};
  int found = 0;
  const auto h = static_cast<cublasLtHandle_t>(handle_);
  const cublasStatus_t st =
      cublasLtMatmulAlgoGetHeuristic(h, p->desc, p->a, p->b, p->c, p->c, pref, tune_on ? kCandidates : 1, res, &found);
  cublasLtMatmulPreferenceDestroy(pref);
  if (st != CUBLAS_STATUS_SUCCESS || found == 0)
    throw Error(std::string(kOp) + ": no cuBLASLt algorithm for M=" + std::to_string(M) + " N=" + std::to_string(N) +
                " K=" + std::to_string(K) + " (status " + std::to_string(int(st)) + ")");
  int best = 0;
  if (tune_on && found > 1) {
    const auto s = reinterpret_cast<cudaStream_t>(tune_on->stream);
    cudaEvent_t e0, e1;
    M3RT_CUDA_CHECK(cudaEventCreate(&e0));
    M3RT_CUDA_CHECK(cudaEventCreate(&e1));
    const float alpha = 1.f, beta = 0.f;
    float best_ms = INFINITY;
    for (int i = 0; i < found; ++i) {
      auto once = [&] {
        return cublasLtMatmul(h, p->desc, &alpha, tune_on->w, p->a, tune_on->x, p->b, &beta, tune_on->y, p->c,
                              tune_on->y, p->c, &res[i].algo, workspace_.data(), size_t(kWorkspaceBytes), s);
      };
      if (once() != CUBLAS_STATUS_SUCCESS) continue;  // a candidate that cannot run is skipped
      M3RT_CUDA_CHECK(cudaEventRecord(e0, s));
      for (int r = 0; r < 3; ++r) once();
      M3RT_CUDA_CHECK(cudaEventRecord(e1, s));
      M3RT_CUDA_CHECK(cudaEventSynchronize(e1));
      float ms = 0.f;
      M3RT_CUDA_CHECK(cudaEventElapsedTime(&ms, e0, e1));
      if (ms < best_ms) best = i, best_ms = ms;
    }
    cudaEventDestroy(e0);
    cudaEventDestroy(e1);
  }
  p->algo = res[best].algo;
  return *plans_.emplace(key, std::move(p)).first->second;
}

void LtGemm::run(const TensorView& y, const TensorView& x, const TensorView& w, stream_t stream, bool tune) {
  for (const auto& [name, t] : {std::pair<const char*, const TensorView*>{"y", &y}, {"x", &x}, {"w", &w}}) {
    require_defined(kOp, name, *t);
    require_device(kOp, name, *t, device_);
    require_dtype(kOp, name, *t, {DType::kBFloat16});
    require_shape(kOp, name, *t, {-1, -1});
    require_last_dim_contiguous(kOp, name, *t);
  }
  require_contiguous(kOp, "w", w);
  const int64_t M = x.shape[0], K = x.shape[1], N = w.shape[0];
  require_shape(kOp, "w", w, {N, K});
  require_shape(kOp, "y", y, {M, N});
  if (M == 0) return;
  DeviceGuard guard(device_.index);
  cudaStreamCaptureStatus capturing = cudaStreamCaptureStatusNone;
  M3RT_CUDA_CHECK(cudaStreamIsCapturing(reinterpret_cast<cudaStream_t>(stream), &capturing));
  const Operands ops{w.data, x.data, y.data, stream};
  const Plan& p = plan({M, N, K, x.stride[0], y.stride[0]},
                       tune && capturing == cudaStreamCaptureStatusNone ? &ops : nullptr);
  const float alpha = 1.f, beta = 0.f;
  lt_check(cublasLtMatmul(static_cast<cublasLtHandle_t>(handle_), p.desc, &alpha, w.data, p.a, x.data, p.b, &beta,
                          y.data, p.c, y.data, p.c, &p.algo, workspace_.data(), size_t(kWorkspaceBytes),
                          reinterpret_cast<cudaStream_t>(stream)),
           "cublasLtMatmul");
}

}  // namespace m3rt::detail
