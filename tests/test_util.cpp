// Definitions of the shared test helpers; see test_util.h.
#include "test_util.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <numeric>

namespace m3rt_test {

// ================================ CPU path against fp64 oracles ================================

// ---- tensors ------------------------------------------------------------------------------------

uint16_t to16(DType dt, double v) {
  return dt == DType::kBFloat16 ? float_to_bf16(float(v)) : float_to_fp16(float(v));
}

double from16(DType dt, uint16_t c) { return dt == DType::kBFloat16 ? bf16_to_float(c) : fp16_to_float(c); }

Tensor rand16(const std::vector<int64_t>& shape, Rng& r, float lo, float hi, DType dt) {
  Tensor t = Tensor::empty(shape, dt);
  for (int64_t i = 0; i < t.numel(); ++i) t.ptr<uint16_t>()[i] = to16(dt, r.uni(lo, hi));
  return t;
}

Tensor i64s(const std::vector<int64_t>& v) {
  Tensor t = Tensor::empty({int64_t(v.size())}, DType::kInt64);
  std::copy(v.begin(), v.end(), t.ptr<int64_t>());
  return t;
}

Tensor f32(float v) {
  Tensor t = Tensor::empty({1}, DType::kFloat32);
  *t.ptr<float>() = v;
  return t;
}

Tensor poisoned(const std::vector<int64_t>& shape, DType dt) {
  Tensor t = Tensor::empty(shape, dt);
  t.fill_bytes(0xff);
  return t;
}

Tensor clone(const Tensor& t) {
  Tensor c = Tensor::empty(t.view().sizes(), t.view().dtype);
  c.copy_from(t);
  return c;
}

bool same_bytes(const Tensor& a, const Tensor& b) {
  return a.nbytes() == b.nbytes() && std::memcmp(a.data(), b.data(), size_t(a.nbytes())) == 0;
}

bool all_ff(const void* p, size_t n) {
  const uint8_t* b = static_cast<const uint8_t*>(p);
  return std::all_of(b, b + n, [](uint8_t x) { return x == 0xff; });
}

TensorView heads_view(const Tensor& base, int64_t off, int64_t d0, int64_t d1, int64_t s0) {
  TensorView v = TensorView::contiguous(base.ptr<uint16_t>() + off, DType::kBFloat16, {d0, d1, 128});
  v.stride[0] = s0;
  return v;
}

Tensor rope_table(int R) {
  Tensor t = Tensor::empty({kMaxPos, R}, DType::kBFloat16);
  for (int64_t p = 0; p < kMaxPos; ++p)
    for (int i = 0; i < R / 2; ++i) {
      const float a = float(p) * std::pow(5e6f, -2.0f * float(i) / float(R));
      t.ptr<uint16_t>()[p * R + i] = float_to_bf16(std::cos(a));
      t.ptr<uint16_t>()[p * R + R / 2 + i] = float_to_bf16(std::sin(a));
    }
  return t;
}

std::vector<int64_t> make_slots(Rng& r, int64_t n, int64_t num_slots) {
  std::vector<int64_t> all(static_cast<size_t>(num_slots));
  std::iota(all.begin(), all.end(), 0);
  std::shuffle(all.begin(), all.end(), r.g);
  all.resize(size_t(n));
  for (auto& s : all) s = r.g() % 5 == 0 ? -1 : s;
  return all;
}

std::vector<int64_t> make_positions(Rng& r, int64_t n) {
  std::vector<int64_t> p(static_cast<size_t>(n));
  for (auto& x : p) x = int64_t(r.g() % kMaxPos);
  if (n > 0) p[0] = kMaxPos - 1;
  if (n > 1) p[1] = 0;
  return p;
}

std::vector<int32_t> query_offsets(int B, int dql, const std::vector<int>& q_lens, int& max_query_len) {
  std::vector<int32_t> c(static_cast<size_t>(B) + 1, 0);
  for (int b = 0; b < B; ++b) {
    const int ql = dql ? dql : q_lens[size_t(b)];
    c[size_t(b) + 1] = c[size_t(b)] + ql;
    max_query_len = std::max(max_query_len, ql);
  }
  return c;
}

std::vector<int32_t> page_order(const Rng& r, int pages, bool shuffle) {
  std::vector<int32_t> perm(static_cast<size_t>(pages));
  std::iota(perm.begin(), perm.end(), 0);
  std::mt19937_64 page_rng(r.seed ^ 0x5eedu);
  if (shuffle) std::shuffle(perm.begin(), perm.end(), page_rng);
  return perm;
}

// ---- comparisons --------------------------------------------------------------------------------

int dist16(DType dt, uint16_t a, uint16_t b) {
  auto ord = [dt](uint16_t c) {
    const int mag = c & 0x7fff;
    if (mag > (dt == DType::kBFloat16 ? 0x7f80 : 0x7c00)) return 1 << 20;  // NaN: never close
    return (c & 0x8000) ? -mag : mag;
  };
  return std::abs(ord(a) - ord(b));
}

int dist_e4m3(uint8_t a, uint8_t b) {
  auto ord = [](uint8_t c) { return (c & 0x7f) == 0x7f ? 1 << 20 : (c & 0x80) ? -(c & 0x7f) : c & 0x7f; };
  return std::abs(ord(a) - ord(b));
}

uint8_t e4m3_of(double v) {
  static const std::vector<double> mags = [] {
    std::vector<double> m;
    for (int c = 0; c < 0x7f; ++c)
      m.push_back(c < 8 ? std::ldexp(c, -9) : std::ldexp(8 + (c & 7), (c >> 3) - 10));
    return m;
  }();
  if (std::isnan(v)) return 0x7f;
  const uint8_t sign = v < 0 ? 0x80 : 0;
  const double a = std::fabs(v);
  if (a >= 448.0) return sign | 0x7e;
  const size_t hi = size_t(std::upper_bound(mags.begin(), mags.end(), a) - mags.begin());
  const size_t lo = hi - 1;
  const double twice = 2 * a, mid2 = mags[lo] + mags[hi];
  return sign | uint8_t(twice < mid2 ? lo : twice > mid2 ? hi : (lo % 2 ? hi : lo));
}

double ulp16(DType dt, double v) {
  const int man = dt == DType::kBFloat16 ? 7 : 10, emin = dt == DType::kBFloat16 ? -126 : -14;
  return std::ldexp(1.0, std::max(std::ilogb(std::max(std::fabs(v), 0x1p-126)), emin) - man);
}

bool near16(DType dt, uint16_t got, double exact, double term, double slack) {
  if (dist16(dt, got, to16(dt, exact)) <= 1) return true;
  return term > 0 && std::fabs(from16(dt, got) - exact) <= 0x1p-15 * term + slack + ulp16(dt, exact);
}

// "[i,j,...]". Appended piece by piece: `"literal" + std::string` here drew a bogus -Wrestrict
// from GCC 12 at -O2/-O3 (GCC bug 105329).
std::string at(std::initializer_list<int64_t> idx) {
  std::string s = "[";
  for (int64_t i : idx) {
    if (s.size() > 1) s += ',';
    s += std::to_string(i);
  }
  return s + "]";
}

std::string tag(std::initializer_list<std::pair<const char*, int64_t>> kv) {
  std::string s;
  for (const auto& [k, v] : kv) s += std::string(s.empty() ? "" : " ") + k + "=" + std::to_string(v);
  return s;
}

// ---- fp64 oracles -------------------------------------------------------------------------------

void load_head(const uint16_t* p, double* x) {
  for (int d = 0; d < 128; ++d) x[d] = bf16_to_float(p[d]);
}

void gemma_norm64(const double* x, const double* w, int64_t n, double* y) {
  double ss = 0;
  for (int64_t i = 0; i < n; ++i) ss += x[i] * x[i];
  const double inv = 1.0 / std::sqrt(ss / double(n) + double(kEps));
  for (int64_t i = 0; i < n; ++i) y[i] = x[i] * inv * (1.0 + w[i]);
}

void rope64(const double* x, const uint16_t* cs, int R, double* y, double* term) {
  const int h = R / 2;
  for (int d = 0; d < 128; ++d) y[d] = x[d], term[d] = std::fabs(x[d]);
  for (int i = 0; i < h; ++i) {
    const double c = bf16_to_float(cs[i]), s = bf16_to_float(cs[h + i]);
    y[i] = x[i] * c - x[i + h] * s;
    y[i + h] = x[i + h] * c + x[i] * s;
    term[i] = std::fabs(x[i] * c) + std::fabs(x[i + h] * s);
    term[i + h] = std::fabs(x[i + h] * c) + std::fabs(x[i] * s);
  }
}

// ===================================== argument validation =====================================

std::string error_of(const std::function<void()>& fn) {
  try {
    fn();
  } catch (const m3rt::Error& e) {
    return e.what();
  } catch (const std::exception& e) {
    ADD_FAILURE() << "threw a non-m3rt exception: " << e.what();
    return "";
  }
  ADD_FAILURE() << "did not throw";
  return "";
}

Tensor filled(const std::vector<int64_t>& shape, DType dt, uint8_t byte) {
  Tensor t = Tensor::empty(shape, dt);
  t.fill_bytes(byte);
  return t;
}

// ---- out-of-range device indices on the CPU path: throw, write nothing --------------------------

std::vector<uint8_t> bytes_of(const TensorView& v) {
  const uint8_t* p = v.ptr<uint8_t>();
  return {p, p + v.numel() * m3rt::dtype_size(v.dtype)};
}

void set_i64(const TensorView& v, std::initializer_list<int64_t> values) {
  std::copy(values.begin(), values.end(), v.ptr<int64_t>());
}

void wild_fill(const TensorView& v, std::mt19937_64& g, int64_t lo, int64_t hi) {
  std::uniform_int_distribution<int> kind(0, 19);
  std::uniform_int_distribution<int64_t> in(lo, hi), past(hi + 1, hi + 1000), neg(-1000, -2);
  constexpr int64_t kMin32 = std::numeric_limits<int32_t>::min(), kMax32 = std::numeric_limits<int32_t>::max();
  for (int64_t i = 0; i < v.numel(); ++i) {
    const int k = kind(g);
    const int64_t x = k < 16 ? in(g) : k == 16 ? -1 : k == 17 ? neg(g) : k == 18 ? past(g) : int64_t(1) << 40;
    if (v.dtype == DType::kInt64)
      v.ptr<int64_t>()[i] = x;
    else
      v.ptr<int32_t>()[i] = int32_t(std::clamp(x, kMin32, kMax32));
  }
}

}  // namespace m3rt_test
