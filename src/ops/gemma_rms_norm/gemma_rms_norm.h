// gemma_rms_norm: params, CPU reference and launcher. Public API: m3rt::gemma_rms_norm and
// m3rt::gemma_fused_add_rms_norm (include/m3rt/ops.h). Math: README.md here.
#pragma once

#include <cstdint>

#include "m3rt/dtype.h"

struct CUstream_st;

namespace m3rt {

// Rows of length d; row r sits at (r / inner) * s0 + (r % inner) * s1 in each tensor (elements),
// which covers [d], [rows, d] and [a, b, d] views.
struct GemmaRmsNormParams {
  void* out;             // rows x d
  const void* x;         // rows x d
  void* residual;        // rows x d, read and written; nullptr for the plain norm
  const void* weight;    // [d]
  int64_t rows, d, inner;
  int64_t x_s0, x_s1, out_s0, out_s1, res_s0, res_s1;
  float eps;
  DType dtype;           // bf16 or fp16 (all tensors)
};

void gemma_rms_norm_ref(const GemmaRmsNormParams& p);
void gemma_rms_norm_launch(const GemmaRmsNormParams& p, CUstream_st* stream);

}  // namespace m3rt
