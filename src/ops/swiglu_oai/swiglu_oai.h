// swiglu_oai: params, CPU reference and launcher. Public API: m3rt::swiglu_oai.
#pragma once

#include <cstdint>

#include "m3rt/dtype.h"

struct CUstream_st;

namespace m3rt {

struct SwigluOaiKernelParams {
  void* out;            // [T, I], row stride out_s0
  const void* gate_up;  // [T, 2I] = [gate | up], row stride in_s0
  int64_t rows, inner;  // T, I
  int64_t in_s0, out_s0;
  float alpha, limit, beta;
  DType dtype;          // bf16 or fp16
};

void swiglu_oai_ref(const SwigluOaiKernelParams& p);
void swiglu_oai_launch(const SwigluOaiKernelParams& p, CUstream_st* stream);

}  // namespace m3rt
