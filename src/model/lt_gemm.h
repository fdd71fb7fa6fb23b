// Internal: bf16 GEMMs of the draft model through cuBLASLt. Built only with CUDA.
//
// defines: LtGemm.
//
//   y[M, N] = bf16(x[M, K] . w[N, K]^T), fp32 accumulation (the PyTorch linear layout: a weight row
//   per output feature). x and y row-major with any row stride (elements, >= their widths); w
//   contiguous. cuBLASLt is column-major, so the call is y^T = w . x^T with w read transposed.
// Each (M, N, K, strides) shape gets its layouts and one heuristic algorithm the first time it runs
// and keeps them, so repeated calls (eager or captured in a graph) use the same kernel and produce
// the same bits; the workspace is allocated once at construction (nothing is allocated in a call).
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

  void run(const TensorView& y, const TensorView& x, const TensorView& w, stream_t stream);

 private:
  struct Plan;
  using Key = std::tuple<int64_t, int64_t, int64_t, int64_t, int64_t>;  // M, N, K, ldx, ldy
  const Plan& plan(const Key& key);
  Device device_;
  void* handle_ = nullptr;
  Tensor workspace_;
  std::map<Key, std::unique_ptr<Plan>> plans_;
};

}  // namespace m3rt::detail
