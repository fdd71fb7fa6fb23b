#include "check/compare.h"

#include <cmath>
#include <cstring>
#include <sstream>

#include "m3rt/error.h"

namespace m3rt::detail {

namespace {

// Maps a code to a signed integer whose order is the order of the values it encodes.
int64_t ordered(uint32_t bits, int width) {
  const uint32_t sign = 1u << (width - 1);
  const int64_t mag = int64_t(bits & (sign - 1));
  return (bits & sign) ? -mag : mag;
}

bool is_nan_code(uint32_t bits, DType dt) {
  switch (dt) {
    case DType::kBFloat16: return (bits & 0x7fff) > 0x7f80;
    case DType::kFloat16: return (bits & 0x7fff) > 0x7c00;
    case DType::kFloat8E4M3: return (bits & 0x7f) == 0x7f;
    case DType::kFloat32: return (bits & 0x7fffffffu) > 0x7f800000u;
    default: return false;
  }
}
bool is_inf_code(uint32_t bits, DType dt) {
  switch (dt) {
    case DType::kBFloat16: return (bits & 0x7fff) == 0x7f80;
    case DType::kFloat16: return (bits & 0x7fff) == 0x7c00;
    case DType::kFloat32: return (bits & 0x7fffffffu) == 0x7f800000u;
    default: return false;
  }
}
int code_width(DType dt) {
  switch (dt) {
    case DType::kFloat8E4M3: return 8;
    case DType::kBFloat16:
    case DType::kFloat16: return 16;
    default: return 32;
  }
}

uint64_t load_bits(const TensorView& v, int64_t offset) {
  const char* p = static_cast<const char*>(v.data) + offset * dtype_size(v.dtype);
  uint64_t b = 0;
  std::memcpy(&b, p, size_t(dtype_size(v.dtype)));
  return b;
}

std::string coords(const int64_t* idx, int n) {
  std::ostringstream os;
  os << "[";
  for (int i = 0; i < n; ++i) os << (i ? ", " : "") << idx[i];
  os << "]";
  return os.str();
}

}  // namespace

const char* code_unit(DType code_dtype) {
  switch (code_dtype) {
    case DType::kBFloat16: return "bf16 ulp";
    case DType::kFloat16: return "fp16 ulp";
    case DType::kFloat8E4M3: return "e4m3 code";
    case DType::kFloat32: return "fp32 ulp";
    default: return "exact";
  }
}

double decode(uint64_t bits, DType dt) {
  switch (dt) {
    case DType::kBFloat16: return bf16_to_float(uint16_t(bits));
    case DType::kFloat16: return fp16_to_float(uint16_t(bits));
    case DType::kFloat8E4M3: return e4m3_to_float(uint8_t(bits));
    case DType::kFloat32: return bits_float(uint32_t(bits));
    default: return double(bits);
  }
}

CompareResult compare_codes(const TensorView& actual, const TensorView& expected, DType code_dtype,
                            double tolerance, double abs_tol) {
  if (actual.sizes() != expected.sizes() || actual.dtype != expected.dtype)
    throw Error("compare_codes: " + actual.describe() + " vs " + expected.describe());
  CompareResult r;
  const int n = actual.ndim;
  int64_t idx[kMaxDims] = {};
  const int64_t total = actual.numel();
  const bool is_float = code_dtype == DType::kBFloat16 || code_dtype == DType::kFloat16 ||
                        code_dtype == DType::kFloat8E4M3 || code_dtype == DType::kFloat32;
  const int width = code_width(code_dtype);
  for (int64_t e = 0; e < total; ++e) {
    int64_t oa = 0, oe = 0;
    for (int d = 0; d < n; ++d) {
      oa += idx[d] * actual.stride[d];
      oe += idx[d] * expected.stride[d];
    }
    const uint64_t a = load_bits(actual, oa), b = load_bits(expected, oe);
    double err = 0;
    if (a != b) {
      if (!is_float) {
        err = INFINITY;
      } else {
        const bool an = is_nan_code(uint32_t(a), code_dtype), bn = is_nan_code(uint32_t(b), code_dtype);
        const bool ai = is_inf_code(uint32_t(a), code_dtype), bi = is_inf_code(uint32_t(b), code_dtype);
        if (an && bn) {
          err = 0;
        } else if (an || bn || ai || bi) {
          err = INFINITY;
        } else {
          err = double(std::llabs(ordered(uint32_t(a), width) - ordered(uint32_t(b), width)));
          if (abs_tol > 0 && std::fabs(decode(a, code_dtype) - decode(b, code_dtype)) <= abs_tol) err = 0;
        }
      }
    }
    ++r.checked;
    if (err > r.worst || r.where.empty()) {
      r.worst = std::max(r.worst, err);
      r.where = coords(idx, n);
    }
    if (err > tolerance) {
      if (++r.failed <= 5) {
        std::ostringstream os;
        os << coords(idx, n) << " got 0x" << std::hex << a << " want 0x" << b << std::dec << "; ";
        r.first_failures += os.str();
      }
    }
    for (int d = n - 1; d >= 0; --d) {  // next index, row-major
      if (++idx[d] < actual.shape[d]) break;
      idx[d] = 0;
    }
  }
  return r;
}

void fill_row(CheckRow& row, const CompareResult& r, DType code_dtype, double tolerance) {
  row.worst = r.worst;
  row.where = r.where;
  row.unit = code_unit(code_dtype);
  row.tolerance = tolerance;
  row.checked = r.checked;
  row.pass = r.failed == 0;
  if (!row.pass) {
    row.message = std::to_string(r.failed) + " of " + std::to_string(r.checked) +
                  " elements out of tolerance: " + r.first_failures;
  }
}

}  // namespace m3rt::detail
