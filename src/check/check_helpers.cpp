// Helpers shared by the per-op checks of `m3rt check`; see check_helpers.h.
#include "check/check_helpers.h"

#include "check/compare.h"
#include "m3rt/dtype.h"

namespace m3rt::detail {

Tensor poisoned(const std::vector<int64_t>& shape, DType dtype, Device device) {
  Tensor t = Tensor::empty(shape, dtype, device);
  t.fill_bytes(kPoison);
  return t;
}

void add_row(CheckContext& c, const std::string& output, const TensorView& actual,
             const TensorView& expected, DType code_dtype, double tolerance, double abs_tol) {
  CheckRow row;
  row.op = c.op;
  row.variant = c.variant;
  row.device = c.device.str();
  row.output = output;
  fill_row(row, compare_codes(actual, expected, code_dtype, tolerance, abs_tol), code_dtype, tolerance);
  if (abs_tol > 0) row.unit += " or " + std::to_string(abs_tol).substr(0, 7) + " abs";
  c.rows.push_back(row);
}

float b2f(uint16_t v) { return bf16_to_float(v); }

void oracle_rope_f64(const double* n, const uint16_t* cs, int rotary_dim, uint16_t* out) {
  double y[128];
  for (int d = 0; d < 128; ++d) y[d] = n[d];
  const int h = rotary_dim / 2;
  for (int i = 0; i < h; ++i) {
    const double c = b2f(cs[i]), s = b2f(cs[h + i]);
    y[i] = n[i] * c - n[i + h] * s;
    y[i + h] = n[i + h] * c + n[i] * s;
  }
  for (int d = 0; d < 128; ++d) out[d] = float_to_bf16(float(y[d]));
}

void oracle_rope(const uint16_t* x, const uint16_t* cs, int rotary_dim, uint16_t* out) {
  double n[128];
  for (int d = 0; d < 128; ++d) n[d] = b2f(x[d]);
  oracle_rope_f64(n, cs, rotary_dim, out);
}

void oracle_store(void* cache, bool fp8, int64_t elem, const uint16_t* v, double scale) {
  for (int d = 0; d < 128; ++d) {
    if (fp8) {
      static_cast<uint8_t*>(cache)[elem + d] = float_to_e4m3(float(double(b2f(v[d])) / scale));
    } else {
      static_cast<uint16_t*>(cache)[elem + d] = v[d];
    }
  }
}

int64_t cache_elem(const TensorView& cache, int64_t slot, int h) {
  const int64_t bs = cache.shape[2];
  return (slot / bs) * cache.stride[0] + h * cache.stride[1] + (slot % bs) * cache.stride[2];
}

}  // namespace m3rt::detail
