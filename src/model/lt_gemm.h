// Internal: bf16 GEMMs of the draft model through cuBLASLt. Built only with CUDA.
//
// defines: LtGemm.
//
//   y[M, N] = bf16(x[M, K] . w[N, K]^T), fp32 accumulation (the PyTorch linear layout: a weight row
//   per output feature). x and y row-major with any row stride (elements, >= their widths); w
//   contiguous. cuBLASLt is column-major, so the call is y^T = w . x^T with w read transposed.
// Each (M, N, K, strides) shape gets its layouts and one algorithm the first time it runs and keeps
// them, so repeated calls (eager or captured in a graph) use the same kernel and produce the same
// bits; the workspace is allocated once at construction (nothing is allocated in a call). With
// `tune` (and the stream not capturing) the first call times cuBLASLt's top heuristic candidates
// on the call's own operands (3 runs each after a warm-up) and keeps the fastest; otherwise the
// heuristic's first choice. Tuned choices may differ between processes (timing noise), so bits
// are reproducible within a runner, not across runs.
#pragma once

#include <cstdint>
#include <map>
#include <memory>
#include <tuple>

#include "m3rt/tensor.h"

namespace m3rt::detail {

class LtGemm {
 public:
  explicit LtGemm(Device device);
  ~LtGemm();
  LtGemm(const LtGemm&) = delete;
  LtGemm& operator=(const LtGemm&) = delete;

  void run(const TensorView& y, const TensorView& x, const TensorView& w, stream_t stream, bool tune = false);

 private:
  struct Plan;
  using Key = std::tuple<int64_t, int64_t, int64_t, int64_t, int64_t>;  // M, N, K, ldx, ldy
  struct Operands {
    const void *w, *x;
    void* y;
    stream_t stream;
  };
  const Plan& plan(const Key& key, const Operands* tune_on);
  Device device_;
  void* handle_ = nullptr;
  Tensor workspace_;
  std::map<Key, std::unique_ptr<Plan>> plans_;
};

}  // namespace m3rt::detail
