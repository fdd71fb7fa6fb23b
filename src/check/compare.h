// Internal: the one comparison function every check and test uses.
//
// Elements are compared as codes of their dtype: the distance between two bf16 (fp16, e4m3)
// values is how many representable values apart they are (ordered-code distance, so +0 and -0 are
// 0 apart, 1.0 and its successor 1). NaN matches only NaN; any other non-finite must match exactly.
// Integer and raw byte tensors compare exactly. With abs_tol > 0 an element also passes when the
// decoded values differ by at most abs_tol (for fp64-oracle comparisons, where fp32 cancellation
// in RoPE leaves tiny results many ulps apart while their absolute error is ~1e-7).
#pragma once

#include <cstdint>
#include <string>

#include "m3rt/check.h"
#include "m3rt/tensor.h"

namespace m3rt::detail {

struct CompareResult {
  double worst = 0;
  std::string where;  // "[i, j, ...]" of the worst element
  int64_t checked = 0;
  int64_t failed = 0;
  std::string first_failures;  // up to 5 "[coords] got a want b"
};

// `actual` and `expected` are host views of one shape and dtype (any strides). `code_dtype` says
// how to read the elements: bf16, fp16 or e4m3 codes (a uint8 tensor read as e4m3), or exact.
CompareResult compare_codes(const TensorView& actual, const TensorView& expected, DType code_dtype,
                            double tolerance, double abs_tol = 0);

const char* code_unit(DType code_dtype);

// Fills a CheckRow's result fields from a comparison.
void fill_row(CheckRow& row, const CompareResult& r, DType code_dtype, double tolerance);

}  // namespace m3rt::detail
