// CPU path of every op (public API, Device::cpu() tensors) against fp64 oracles written here from
// the spec formulas (../shared/spec/README.md, dspark.md §2.4, §5). Tolerances in dtype units:
// bf16/fp16 results within 1 code (ordered-code distance) of the fp64 value rounded once, copies
// bit-exact, e4m3 results within 1 code of the fp64 value quantized. Where a RoPE output cancels
// (|y| far below its two terms) the fp32 evaluation error of the terms is allowed instead.
// Caches are poisoned with 0xFF first; rows that no slot targets must keep every byte.
// Composition: the context-K/V writer equals bit for bit the unfused path built from
// gemma_rms_norm + RoPE + reshape_and_cache; qknorm_rope_kv_insert's fp8 q equals
// e4m3(bf16(q) * (1/scale)). Build with -ffp-contract=off: the test's fp32 RoPE rounds as written.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <map>
#include <numeric>
#include <random>
#include <string>
#include <vector>

#include "m3rt/dtype.h"
#include "m3rt/ops.h"
#include "m3rt/tensor.h"

namespace {

using namespace m3rt;

constexpr uint64_t kSeed = 0x6d33727431ull;
constexpr int64_t kMaxPos = 4096;
constexpr float kEps = 1e-6f;

struct Rng {
  uint64_t seed;
  std::mt19937_64 g;
  explicit Rng(uint64_t salt) : seed(kSeed + salt), g(seed) {}
  float uni(float lo, float hi) { return std::uniform_real_distribution<float>(lo, hi)(g); }
};
#define SEED_TRACE(rng) SCOPED_TRACE("seed " + std::to_string((rng).seed))

// ---- tensors ------------------------------------------------------------------------------------

uint16_t to16(DType dt, double v) {
  return dt == DType::kBFloat16 ? float_to_bf16(float(v)) : float_to_fp16(float(v));
}
double from16(DType dt, uint16_t c) { return dt == DType::kBFloat16 ? bf16_to_float(c) : fp16_to_float(c); }
Tensor rand16(const std::vector<int64_t>& shape, Rng& r, float lo, float hi, DType dt = DType::kBFloat16) {
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
// A bf16 [d0, d1, 128] view at element `off` of `base`: token stride s0, head stride 128.
TensorView heads_view(const Tensor& base, int64_t off, int64_t d0, int64_t d1, int64_t s0) {
  TensorView v = TensorView::contiguous(base.ptr<uint16_t>() + off, DType::kBFloat16, {d0, d1, 128});
  v.stride[0] = s0;
  return v;
}

// The spec's RoPE table: row p = [cos(p f_i) | sin(p f_i)], f_i = theta^(-2i/R), fp32, then bf16.
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

// n distinct slots of [0, num_slots), about one in five replaced by -1 (padding).
std::vector<int64_t> make_slots(Rng& r, int64_t n, int64_t num_slots) {
  std::vector<int64_t> all(static_cast<size_t>(num_slots));
  std::iota(all.begin(), all.end(), 0);
  std::shuffle(all.begin(), all.end(), r.g);
  all.resize(size_t(n));
  for (auto& s : all) s = r.g() % 5 == 0 ? -1 : s;
  return all;
}
// Random positions in [0, max_pos), the first max_pos - 1 and the second 0.
std::vector<int64_t> make_positions(Rng& r, int64_t n) {
  std::vector<int64_t> p(static_cast<size_t>(n));
  for (auto& x : p) x = int64_t(r.g() % kMaxPos);
  if (n > 0) p[0] = kMaxPos - 1;
  if (n > 1) p[1] = 0;
  return p;
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

// e4m3fn of an fp64 value: the nearest of the 127 finite magnitudes (ties to the even code);
// |v| >= 448 saturates.
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

// One unit in the last place of round(v) in bf16 (7 stored mantissa bits) or fp16 (10).
double ulp16(DType dt, double v) {
  const int man = dt == DType::kBFloat16 ? 7 : 10, emin = dt == DType::kBFloat16 ? -126 : -14;
  return std::ldexp(1.0, std::max(std::ilogb(std::max(std::fabs(v), 0x1p-126)), emin) - man);
}

// `got` within one code of round(exact); or, for a sum of terms (term > 0) that cancels, within
// their fp32 evaluation error (2^-15 * term) plus `slack` plus one ulp of it.
bool near16(DType dt, uint16_t got, double exact, double term = 0, double slack = 0) {
  if (dist16(dt, got, to16(dt, exact)) <= 1) return true;
  return term > 0 && std::fabs(from16(dt, got) - exact) <= 0x1p-15 * term + slack + ulp16(dt, exact);
}

// Counts failed element checks of one test; reports the first few.
struct Mismatches {
  int count = 0;
  std::string first;
  void add(const std::string& what) {
    if (count++ < 5) first += what + "\n";
  }
  ~Mismatches() { EXPECT_EQ(count, 0) << first; }
};
std::string at(std::initializer_list<int64_t> idx) {
  std::string s;
  for (int64_t i : idx) s += (s.empty() ? "[" : ",") + std::to_string(i);
  return s + "]";
}

// "name=value ..." for SCOPED_TRACE.
std::string tag(std::initializer_list<std::pair<const char*, int64_t>> kv) {
  std::string s;
  for (const auto& [k, v] : kv) s += std::string(s.empty() ? "" : " ") + k + "=" + std::to_string(v);
  return s;
}

// ---- fp64 oracles -------------------------------------------------------------------------------

void load_head(const uint16_t* p, double* x) {
  for (int d = 0; d < 128; ++d) x[d] = bf16_to_float(p[d]);
}
// Gemma RMSNorm: y = x / sqrt(mean(x^2) + eps) * (1 + w).
void gemma_norm64(const double* x, const double* w, int64_t n, double* y) {
  double ss = 0;
  for (int64_t i = 0; i < n; ++i) ss += x[i] * x[i];
  const double inv = 1.0 / std::sqrt(ss / double(n) + double(kEps));
  for (int64_t i = 0; i < n; ++i) y[i] = x[i] * inv * (1.0 + w[i]);
}
// Partial NeoX RoPE of a 128-vector with the bf16 table row; term[d]: sum of the terms' magnitudes.
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
// One K head of the context writer (§2.4): norm, rounded to bf16 (the materialized boundary),
// RoPE. slack[d]: how far a one-code flip of a normed value within 2^-14 of a bf16 tie (which the
// library's fp32 norm may round the other way) can move y[d].
void dspark_k64(const uint16_t* k, const uint16_t* w, const uint16_t* cs, int R, double* y, double* term,
                double* slack) {
  double x[128], wd[128], n[128], nb[128], flip[128];
  load_head(k, x);
  load_head(w, wd);
  gemma_norm64(x, wd, 128, n);
  for (int d = 0; d < 128; ++d) {
    nb[d] = bf16_to_float(float_to_bf16(float(n[d])));
    const bool tie = float_to_bf16(float(n[d] * (1 + 0x1p-14))) != float_to_bf16(float(n[d] * (1 - 0x1p-14)));
    flip[d] = tie ? ulp16(DType::kBFloat16, nb[d]) : 0;
    slack[d] = 0;
  }
  rope64(nb, cs, R, y, term);
  for (int i = 0; i < R / 2; ++i) slack[i] = slack[i + R / 2] = flip[i] + flip[i + R / 2];
}

// Every row of a poisoned [nb, nkv, bs, 256] cache: rows no slot targets must still be all 0xFF;
// the others go to check(row, token, head).
template <class F>
void check_cache(Mismatches& mm, const TensorView& cache, const std::vector<int64_t>& slots, const F& check) {
  const int64_t nb = cache.shape[0], nkv = cache.shape[1], bs = cache.shape[2];
  const int64_t row_bytes = 256 * dtype_size(cache.dtype);
  std::map<int64_t, int64_t> token_of;
  for (size_t t = 0; t < slots.size(); ++t)
    if (slots[t] >= 0) token_of[slots[t]] = int64_t(t);
  for (int64_t b = 0; b < nb; ++b)
    for (int64_t h = 0; h < nkv; ++h)
      for (int64_t o = 0; o < bs; ++o) {
        const uint8_t* row = cache.ptr<uint8_t>() + ((b * nkv + h) * bs + o) * row_bytes;
        auto it = token_of.find(b * bs + o);
        if (it != token_of.end()) {
          check(row, it->second, int(h));
        } else if (!all_ff(row, size_t(row_bytes))) {
          mm.add("untargeted cache row " + at({b, h, o}) + " was written");
        }
      }
}
// One cache row: K against its fp64 value (fp8: within 1 code of e4m3(k / ks); bf16: k_ok),
// V against the bf16 head v (fp8: within 1 code of e4m3(v / vs); bf16: bit-exact copy).
template <class KCheck>
void check_row(Mismatches& mm, const uint8_t* row, bool fp8, const double* k, const KCheck& k_ok,
               const uint16_t* v, float ks, float vs, const std::string& where) {
  const uint16_t* row16 = reinterpret_cast<const uint16_t*>(row);
  for (int d = 0; d < 128; ++d) {
    const bool k_bad = fp8 ? dist_e4m3(row[d], e4m3_of(k[d] / ks)) > 1 : !k_ok(d, row16[d]);
    const bool v_bad =
        fp8 ? dist_e4m3(row[128 + d], e4m3_of(bf16_to_float(v[d]) / double(vs))) > 1 : row16[128 + d] != v[d];
    if (k_bad) mm.add(where + " K d=" + std::to_string(d) + " want ~" + std::to_string(k[d]));
    if (v_bad) mm.add(where + " V d=" + std::to_string(d));
  }
}

// ---- reshape_and_cache --------------------------------------------------------------------------

TEST(ReshapeAndCacheCpu, MatchesOracle) {
  const struct { int T, nkv, bs; bool fp8; float ks, vs; } cases[] = {
      {0, 2, 16, true, 1, 1},          {1, 2, 16, false, 1, 1},  {7, 1, 16, false, 1, 1},
      {64, 4, 128, true, 0.37f, 2.5f}, {513, 2, 64, true, 1, 1}, {513, 4, 64, false, 1, 1}};
  for (const auto& c : cases) {
    Rng r(uint64_t(c.T * 131 + c.nkv * 7 + c.bs));
    SEED_TRACE(r);
    SCOPED_TRACE(tag({{"T", c.T}, {"nkv", c.nkv}, {"bs", c.bs}, {"fp8", c.fp8}}));
    // key/value: strided head views into a qkv-like row [q | k | v | pad], with some values
    // large enough to saturate e4m3.
    const int64_t width = (2 * c.nkv + 2) * 128;
    Tensor qkv = rand16({c.T, width}, r, -2, 2);
    for (int64_t i = 0; i < qkv.numel(); i += 97)
      qkv.ptr<uint16_t>()[i] = float_to_bf16(i % 2 ? 3000.f : -600.f);
    const TensorView key = heads_view(qkv, 128, c.T, c.nkv, width);
    const TensorView value = heads_view(qkv, (1 + c.nkv) * 128, c.T, c.nkv, width);
    const int64_t nb = c.T / c.bs + 2;
    Tensor cache = poisoned({nb, c.nkv, c.bs, 256}, c.fp8 ? DType::kUInt8 : DType::kBFloat16);
    const std::vector<int64_t> slots = make_slots(r, c.T, nb * c.bs);
    reshape_and_cache(key, value, cache, i64s(slots),
                      c.fp8 ? KvCacheDtype::kFp8E4M3 : KvCacheDtype::kBFloat16, f32(c.ks), f32(c.vs));
    Mismatches mm;
    check_cache(mm, cache, slots, [&](const uint8_t* row, int64_t t, int h) {
      const uint16_t* k = key.ptr<uint16_t>() + t * width + h * 128;
      double kx[128];
      load_head(k, kx);
      check_row(mm, row, c.fp8, kx, [&](int d, uint16_t g) { return g == k[d]; },
                value.ptr<uint16_t>() + t * width + h * 128, c.ks, c.vs, at({t, h}));
    });
  }
}

// ---- gemma_rms_norm / gemma_fused_add_rms_norm --------------------------------------------------

// x: the buffer `buf_shape`, narrowed to [1, 1 + narrow_len) along narrow_dim when >= 0 (a strided
// view); out a fresh tensor or x itself (alias); the fused form adds a residual of x's layout.
void run_norm_case(DType dt, std::vector<int64_t> buf_shape, int narrow_dim, int64_t narrow_len, bool fused,
                   bool alias, uint64_t salt) {
  Rng r(salt);
  SEED_TRACE(r);
  Tensor xb = rand16(buf_shape, r, -10, 10, dt), rb = rand16(buf_shape, r, -10, 10, dt);
  const Tensor x0 = clone(xb), r0 = clone(rb);
  auto narrow = [&](const Tensor& t) {
    return narrow_dim >= 0 ? t.view().narrowed(narrow_dim, 1, narrow_len) : t.view();
  };
  const TensorView x = narrow(xb), res = narrow(rb);
  const int64_t d = x.shape[x.ndim - 1];
  Tensor w = rand16({d}, r, -1, 1, dt), ob = poisoned(x.sizes(), dt);
  const TensorView out = alias ? x : ob.view();
  if (fused) gemma_fused_add_rms_norm(out, x, res, w, kEps);
  if (!fused) gemma_rms_norm(out, x, w, kEps);

  const int64_t A = x.ndim >= 2 ? x.shape[0] : 1, B = x.ndim == 3 ? x.shape[1] : 1;
  auto off = [](const TensorView& v, int64_t a, int64_t b) {
    return (v.ndim >= 2 ? a * v.stride[0] : 0) + (v.ndim == 3 ? b * v.stride[1] : 0);
  };
  const int64_t x_base = (static_cast<const uint16_t*>(x.data) - xb.ptr<uint16_t>());
  Mismatches mm;
  std::vector<double> s(static_cast<size_t>(d)), wd(s), y(s);
  for (int64_t i = 0; i < d; ++i) wd[i] = from16(dt, w.ptr<uint16_t>()[i]);
  for (int64_t a = 0; a < A; ++a)
    for (int64_t b = 0; b < B; ++b) {
      const int64_t xo = x_base + off(x, a, b);
      for (int64_t i = 0; i < d; ++i)
        s[i] =
            from16(dt, x0.ptr<uint16_t>()[xo + i]) + (fused ? from16(dt, r0.ptr<uint16_t>()[xo + i]) : 0.0);
      gemma_norm64(s.data(), wd.data(), d, y.data());
      const uint16_t* o = out.ptr<uint16_t>() + off(out, a, b);
      for (int64_t i = 0; i < d; ++i) {
        if (!near16(dt, o[i], y[i])) mm.add("out" + at({a, b, i}) + " want " + std::to_string(y[i]));
        if (fused && rb.ptr<uint16_t>()[xo + i] != to16(dt, s[i])) mm.add("residual" + at({a, b, i}));
      }
    }
  EXPECT_TRUE(alias || same_bytes(xb, x0)) << "x was modified";
}

TEST(GemmaRmsNormCpu, MatchesOracle) {
  const DType bf = DType::kBFloat16, fp = DType::kFloat16;
  run_norm_case(bf, {5, 128}, -1, 0, false, false, 1);    // rows
  run_norm_case(fp, {3, 6144}, -1, 0, false, false, 2);   // wide fp16 rows
  run_norm_case(bf, {33}, -1, 0, false, false, 3);        // [d], odd d
  run_norm_case(bf, {4, 1}, -1, 0, false, false, 4);      // d = 1
  run_norm_case(bf, {3, 6, 128}, 1, 4, false, false, 5);  // strided per-head view [3, 4, 128]
  run_norm_case(bf, {4, 64}, -1, 0, false, true, 6);      // in place (out aliases x)
}

TEST(GemmaFusedAddRmsNormCpu, MatchesOracle) {
  run_norm_case(DType::kBFloat16, {4, 6144}, -1, 0, true, false, 7);
  run_norm_case(DType::kFloat16, {3, 4, 128}, 1, 2, true, false, 8);  // strided [3, 2, 128]
}

// ---- swiglu_oai ---------------------------------------------------------------------------------

// gate_up [T, 2I] (row stride 2I + pad), out [T, I] at column `pad` of a [T, I + pad] buffer.
void run_swiglu_case(DType dt, int64_t T, int64_t I, int64_t pad, SwigluOaiParams p, uint64_t salt) {
  Rng r(salt);
  SEED_TRACE(r);
  Tensor in = rand16({T, 2 * I + pad}, r, -10, 10, dt), ob = poisoned({T, I + pad}, dt);
  const TensorView gu = in.view().narrowed(1, 0, 2 * I), out = ob.view().narrowed(1, pad, I);
  swiglu_oai(out, gu, p);
  Mismatches mm;
  for (int64_t t = 0; t < T; ++t) {
    for (int64_t i = 0; i < I; ++i) {
      const uint16_t* row = in.ptr<uint16_t>() + t * gu.stride[0];
      const double g = std::min(from16(dt, row[i]), double(p.limit));
      const double u = std::clamp(from16(dt, row[I + i]), -double(p.limit), double(p.limit));
      const double y = g / (1.0 + std::exp(-double(p.alpha) * g)) * (u + double(p.beta));
      const uint16_t got = out.ptr<uint16_t>()[t * out.stride[0] + i];
      if (!near16(dt, got, y)) mm.add(at({t, i}) + " want " + std::to_string(y));
    }
    if (!all_ff(ob.ptr<uint16_t>() + t * (I + pad), size_t(pad) * 2))
      mm.add("pad written, row " + std::to_string(t));
  }
}

TEST(SwigluOaiCpu, MatchesOracle) {
  run_swiglu_case(DType::kBFloat16, 7, 64, 0, {}, 11);                       // M3 defaults
  run_swiglu_case(DType::kFloat16, 5, 33, 8, {1.0f, 3.0f, 0.5f}, 12);        // padded rows
  run_swiglu_case(DType::kBFloat16, 3, 1, 0, {1.702f, INFINITY, 1.0f}, 13);  // I = 1, no clamp
}

// ---- DSpark context-K/V writer ------------------------------------------------------------------

struct DsCase {
  int num_ctx, L, nkv, bs, R;
  bool fp8, padded, carved;  // padded: all_kv token stride > row; carved: layers share one buffer
};
const float kKScales[] = {0.37f, 1.0f, 2.5f, 0.8f, 1.7f}, kVScales[] = {2.5f, 0.37f, 1.0f, 3.1f, 0.6f};

std::string ds_name(const DsCase& c) {
  return "ctx" + std::to_string(c.num_ctx) + "_L" + std::to_string(c.L) + "_nkv" + std::to_string(c.nkv) +
         "_bs" + std::to_string(c.bs) + "_rot" + std::to_string(c.R) + (c.fp8 ? "_fp8" : "_bf16") +
         (c.padded ? "_padded" : "") + (c.carved ? "_carved" : "");
}

// Inputs of one writer call and its layers' poisoned caches.
struct DsSetup {
  DsCase c;
  Rng rng;
  int64_t row = 0, nb = 0;
  Tensor kv_buf, weight, table, positions, slots;
  std::vector<int64_t> slot_v, pos_v;
  std::vector<Tensor> owned;
  std::vector<DsparkDraftLayerKv> layers;

  DsSetup(const DsCase& dc, uint64_t salt) : c(dc), rng(salt) {
    row = int64_t(c.L) * 2 * c.nkv * 128 + (c.padded ? 64 : 0);
    kv_buf = rand16({std::max(c.num_ctx, 1), row}, rng, -2, 2);
    for (int64_t t = 0; t < c.num_ctx; ++t)  // K heads get the wider norm inputs
      for (int l = 0; l < c.L; ++l)
        for (int i = 0; i < c.nkv * 128; ++i)
          kv_buf.ptr<uint16_t>()[t * row + l * 2 * c.nkv * 128 + i] = float_to_bf16(rng.uni(-10, 10));
    weight = rand16({c.L, 128}, rng, -1, 1);
    table = rope_table(c.R);
    nb = c.num_ctx / c.bs + 2;
    slot_v = make_slots(rng, c.num_ctx, nb * c.bs);
    pos_v = make_positions(rng, c.num_ctx);
    slots = i64s(slot_v);
    positions = i64s(pos_v);
    layers = make_layers();
  }
  // A fresh set of poisoned caches with layer l's scales kKScales[l], kVScales[l]: separate
  // allocations, or (carved) 16 elements apart in one buffer with all scales in one array.
  std::vector<DsparkDraftLayerKv> make_layers() {
    const DType dt = c.fp8 ? DType::kUInt8 : DType::kBFloat16;
    const int64_t n = nb * c.nkv * c.bs * 256;
    Tensor buf = poisoned({c.carved ? c.L * (n + 16) : 1}, dt),
           sc = Tensor::empty({2 * c.L}, DType::kFloat32);
    owned.insert(owned.end(), {buf, sc});
    std::vector<DsparkDraftLayerKv> ls;
    for (int l = 0; l < c.L; ++l) {
      Tensor cache = poisoned({nb, c.nkv, c.bs, 256}, dt), ks = f32(kKScales[l % 5]),
             vs = f32(kVScales[l % 5]);
      owned.insert(owned.end(), {cache, ks, vs});
      ls.push_back({cache, c.fp8 ? KvCacheDtype::kFp8E4M3 : KvCacheDtype::kBFloat16, ks, vs});
      if (!c.carved) continue;
      ls[l].kv_cache.data = buf.ptr<uint8_t>() + l * (n + 16) * dtype_size(dt);
      ls[l].k_scale.data = sc.ptr<float>() + 2 * c.L - 1 - l;  // k scales backwards, v scales forwards
      ls[l].v_scale.data = sc.ptr<float>() + l;
      *ls[l].k_scale.ptr<float>() = kKScales[l % 5];
      *ls[l].v_scale.ptr<float>() = kVScales[l % 5];
    }
    return ls;
  }
  DsparkContextKvArgs args() const {
    TensorView all_kv =
        TensorView::contiguous(kv_buf.data(), DType::kBFloat16, {c.num_ctx, c.L, 2, c.nkv, 128});
    all_kv.stride[0] = row;  // padded rows when c.padded
    return {.all_kv = all_kv, .k_norm_weight = weight, .eps = kEps, .positions = positions,
            .cos_sin_cache = table, .rotary_dim = c.R, .slot_mapping = slots};
  }
  const uint16_t* head(int64_t t, int l, int side, int h) const {
    return kv_buf.ptr<uint16_t>() + t * row + ((int64_t(l) * 2 + side) * c.nkv + h) * 128;
  }
};

class DsparkWriterCpu : public ::testing::TestWithParam<DsCase> {};

TEST_P(DsparkWriterCpu, MatchesOracle) {
  const DsCase& c = GetParam();
  DsSetup s(c, 100 + uint64_t(c.num_ctx * 7 + c.R + c.L));
  SEED_TRACE(s.rng);
  DsparkContextKvWriter writer(s.layers);
  writer(s.args());
  EXPECT_EQ(writer.table_builds(), c.num_ctx > 0 ? 1 : 0);
  Mismatches mm;
  double y[128], term[128], slack[128];
  for (int l = 0; l < c.L; ++l)
    check_cache(mm, s.layers[l].kv_cache, s.slot_v, [&](const uint8_t* row, int64_t t, int h) {
      dspark_k64(s.head(t, l, 0, h), s.weight.ptr<uint16_t>() + l * 128,
                 s.table.ptr<uint16_t>() + s.pos_v[t] * c.R, c.R, y, term, slack);
      auto k_ok = [&](int d, uint16_t g) { return near16(DType::kBFloat16, g, y[d], term[d], slack[d]); };
      check_row(mm, row, c.fp8, y, k_ok, s.head(t, l, 1, h), kKScales[l % 5], kVScales[l % 5],
                "layer " + std::to_string(l) + " " + at({t, h}));
    });
}

// num_ctx 0/1/7/513, layers 1/5, nkv 1/2/4, block sizes 16/64/128, rotary 16/32/64, fp8 and bf16.
const DsCase kDsCases[] = {{0, 5, 4, 128, 64, false, false, false},  {1, 1, 1, 16, 16, true, false, false},
                           {1, 5, 2, 16, 64, false, false, true},    {7, 5, 2, 64, 32, false, true, false},
                           {7, 5, 2, 64, 32, true, false, true},     {513, 5, 4, 128, 64, true, true, false},
                           {513, 1, 4, 16, 64, false, false, false}, {60, 2, 1, 128, 16, false, false, true},
                           {60, 5, 1, 64, 16, true, false, false},   {100, 3, 2, 16, 32, true, true, true}};
INSTANTIATE_TEST_SUITE_P(Cases, DsparkWriterCpu, ::testing::ValuesIn(kDsCases),
                         [](const auto& info) { return ds_name(info.param); });

// The unfused path from the other public ops: per layer, gemma_rms_norm over the K heads (a
// strided view into all_kv) into bf16, NeoX RoPE in fp32 with the bf16 table into bf16, then
// reshape_and_cache with the layer's scales.
void unfused_context_kv(const DsSetup& s, const std::vector<DsparkDraftLayerKv>& ref) {
  const DsCase& c = s.c;
  const int h2 = c.R / 2;
  for (int l = 0; l < c.L; ++l) {
    const TensorView k = heads_view(s.kv_buf, int64_t(l) * 2 * c.nkv * 128, c.num_ctx, c.nkv, s.row);
    const TensorView v = heads_view(s.kv_buf, (int64_t(l) * 2 + 1) * c.nkv * 128, c.num_ctx, c.nkv, s.row);
    Tensor normed = Tensor::empty({c.num_ctx, c.nkv, 128}, DType::kBFloat16);
    gemma_rms_norm(normed, k,
                   TensorView::contiguous(s.weight.ptr<uint16_t>() + l * 128, DType::kBFloat16, {128}), kEps);
    Tensor roped = clone(normed);
    for (int64_t t = 0; t < c.num_ctx; ++t) {
      const uint16_t* cs = s.table.ptr<uint16_t>() + s.pos_v[t] * c.R;
      for (int h = 0; h < c.nkv; ++h) {
        const uint16_t* x = normed.ptr<uint16_t>() + (t * c.nkv + h) * 128;
        uint16_t* y = roped.ptr<uint16_t>() + (t * c.nkv + h) * 128;
        for (int i = 0; i < h2; ++i) {
          const float co = bf16_to_float(cs[i]), si = bf16_to_float(cs[h2 + i]);
          const float a = bf16_to_float(x[i]), b = bf16_to_float(x[i + h2]);
          y[i] = float_to_bf16(a * co - b * si);
          y[i + h2] = float_to_bf16(b * co + a * si);
        }
      }
    }
    reshape_and_cache(roped, v, ref[l].kv_cache, s.slots, ref[l].kv_cache_dtype, ref[l].k_scale,
                      ref[l].v_scale);
  }
}

TEST(DsparkWriterCpu, EqualsUnfusedPathBitwise) {
  for (const DsCase& c :
       {DsCase{7, 5, 2, 64, 32, false, true, false}, DsCase{513, 5, 4, 16, 64, true, false, false},
        DsCase{33, 3, 1, 128, 16, true, true, true}, DsCase{200, 2, 2, 64, 64, false, false, true}}) {
    DsSetup s(c, 200 + uint64_t(c.num_ctx));
    SEED_TRACE(s.rng);
    SCOPED_TRACE(ds_name(c));
    DsparkContextKvWriter writer(s.layers);
    writer(s.args());
    const std::vector<DsparkDraftLayerKv> ref = s.make_layers();
    unfused_context_kv(s, ref);
    const int64_t bytes = s.nb * c.nkv * c.bs * 256 * (c.fp8 ? 1 : 2);
    for (int l = 0; l < c.L; ++l) {
      const uint8_t *a = s.layers[l].kv_cache.ptr<uint8_t>(), *b = ref[l].kv_cache.ptr<uint8_t>();
      EXPECT_EQ(std::mismatch(a, a + bytes, b).first - a, bytes) << "first differing byte of layer " << l;
    }
  }
}

TEST(DsparkWriterCpu, TablesAreCachedAcrossCallsAndRebuiltOnRebind) {
  DsSetup s(DsCase{9, 3, 2, 16, 64, true, false, false}, 300);
  SEED_TRACE(s.rng);
  DsparkContextKvWriter w(s.layers);
  EXPECT_EQ(w.table_builds(), 0);
  for (int i = 0; i < 3; ++i) w(s.args());
  EXPECT_EQ(w.table_builds(), 1);
  const std::vector<DsparkDraftLayerKv> fresh = s.make_layers();
  const size_t bytes = size_t(s.nb) * 2 * 16 * 256;
  uint8_t* old0 = s.layers[0].kv_cache.ptr<uint8_t>();
  std::fill(old0, old0 + bytes, 0x5a);  // any later write to the old cache would show
  w.rebind(fresh);
  w(s.args());
  EXPECT_EQ(w.table_builds(), 2);
  EXPECT_TRUE(std::all_of(old0, old0 + bytes, [](uint8_t b) { return b == 0x5a; }))
      << "old cache written after rebind";
  EXPECT_FALSE(all_ff(fresh[0].kv_cache.data, bytes)) << "new cache not written after rebind";
  EXPECT_EQ(std::memcmp(s.layers[2].kv_cache.data, fresh[2].kv_cache.data, bytes), 0)
      << "layer 2 differs after rebind";
  w.rebind(fresh);
  w(s.args());
  w(s.args());
  EXPECT_EQ(w.table_builds(), 2);
}

// ---- qknorm_rope_kv_insert ----------------------------------------------------------------------

// The arguments every qknorm_rope_kv_insert call needs (no outputs, no insert).
QknormRopeKvInsertArgs qk_args(const TensorView& qkv, const Tensor& qw, const Tensor& kw, const Tensor& table,
                               const Tensor& pos, int nq, int nkv, int R) {
  return {.qkv = qkv, .q_norm_weight = qw, .k_norm_weight = kw, .cos_sin_cache = table, .positions = pos,
          .num_heads = nq, .num_kv_heads = nkv, .rotary_dim = R, .eps = kEps};
}

TEST(QknormRopeKvInsertCpu, MatchesOracle) {
  // insert: 0 none, 1 bf16 cache, 2 fp8 cache (k_scale 0.37, v_scale 2.5); pad: qkv row padding.
  const struct { int T, nq, nkv, R, bs, insert; bool q_out, q_fp8; float q_scale; int64_t pad; } cases[] = {
      {0, 2, 1, 64, 16, 1, false, false, 1, 0},       {1, 2, 1, 16, 16, 0, false, false, 1, 0},
      {7, 4, 2, 32, 64, 1, true, false, 1, 0},        {64, 8, 4, 64, 16, 2, true, true, 0.5f, 0},
      {513, 2, 1, 64, 128, 2, false, true, 0.37f, 8}, {7, 2, 2, 64, 16, 1, false, false, 1, 24},
      {33, 4, 4, 16, 64, 2, false, false, 1, 0}};
  for (const auto& c : cases) {
    Rng r(uint64_t(400 + c.T * 3 + c.R));
    SEED_TRACE(r);
    SCOPED_TRACE(tag({{"T", c.T}, {"nq", c.nq}, {"nkv", c.nkv}, {"R", c.R}, {"insert", c.insert}}));
    const int64_t W = int64_t(c.nq + 2 * c.nkv) * 128, row = W + c.pad, v0 = (c.nq + c.nkv) * 128;
    Tensor buf = rand16({std::max(c.T, 1), row}, r, -10, 10);
    for (int64_t t = 0; t < c.T; ++t)  // V in the narrower range
      for (int64_t i = v0; i < W; ++i) buf.ptr<uint16_t>()[t * row + i] = float_to_bf16(r.uni(-2, 2));
    const Tensor orig = clone(buf);
    Tensor qw = rand16({128}, r, -1, 1), kw = rand16({128}, r, -1, 1), table = rope_table(c.R);
    const int64_t nb = c.T / c.bs + 2;
    const std::vector<int64_t> pos = make_positions(r, c.T), slots = make_slots(r, c.T, nb * c.bs);
    Tensor q_out = poisoned({c.T, c.nq * 128}, DType::kBFloat16),
           q8 = poisoned({c.T, c.nq * 128}, DType::kUInt8);
    Tensor cache = poisoned({nb, c.nkv, c.bs, 256}, c.insert == 2 ? DType::kUInt8 : DType::kBFloat16);
    Tensor pos_t = i64s(pos), slot_t = i64s(slots), ks = f32(0.37f), vs = f32(2.5f);
    TensorView qkv = TensorView::contiguous(buf.data(), DType::kBFloat16, {c.T, W});
    qkv.stride[0] = row;
    QknormRopeKvInsertArgs a = qk_args(qkv, qw, kw, table, pos_t, c.nq, c.nkv, c.R);
    if (c.q_out) a.q_out = q_out;
    if (c.q_fp8) a.q_fp8_out = q8, a.q_fp8_scale = c.q_scale;
    if (c.insert) a.kv_cache = cache, a.slot_mapping = slot_t, a.k_scale = ks, a.v_scale = vs;
    a.kv_cache_dtype = c.insert == 2 ? KvCacheDtype::kFp8E4M3 : KvCacheDtype::kBFloat16;
    qknorm_rope_kv_insert(a);

    Mismatches mm;
    const bool q_in_place = !c.q_out && !c.q_fp8;
    double x[128], n[128], y[128], term[128], wq[128], wk[128];
    load_head(qw.ptr<uint16_t>(), wq);
    load_head(kw.ptr<uint16_t>(), wk);
    for (int64_t t = 0; t < c.T; ++t) {
      const uint16_t *in = orig.ptr<uint16_t>() + t * row, *res = buf.ptr<uint16_t>() + t * row;
      for (int h = 0; h < c.nq + c.nkv; ++h) {
        const bool is_q = h < c.nq;
        load_head(in + h * 128, x);
        gemma_norm64(x, is_q ? wq : wk, 128, n);  // fp32 throughout: no intermediate rounding
        rope64(n, table.ptr<uint16_t>() + pos[t] * c.R, c.R, y, term);
        for (int d = 0; d < 128; ++d) {
          const int64_t qo = (t * c.nq + h) * 128 + d;
          const uint16_t got = res[h * 128 + d];
          if ((!is_q || q_in_place) && !near16(DType::kBFloat16, got, y[d], term[d]))
            mm.add("qkv" + at({t, h, d}) + " want " + std::to_string(y[d]));
          if (is_q && !q_in_place && got != in[h * 128 + d]) mm.add("qkv q changed" + at({t, h, d}));
          if (is_q && c.q_out && !near16(DType::kBFloat16, q_out.ptr<uint16_t>()[qo], y[d], term[d]))
            mm.add("q_out" + at({t, h, d}));
          if (is_q && c.q_fp8 && dist_e4m3(q8.ptr<uint8_t>()[qo], e4m3_of(y[d] / double(c.q_scale))) > 1)
            mm.add("q_fp8_out" + at({t, h, d}));
        }
      }
      if (!std::equal(in + v0, in + row, res + v0))
        mm.add("v or row padding changed, token " + std::to_string(t));
    }
    // Cache rows hold exactly the k' left in qkv (bf16) or e4m3(k' / k_scale); V likewise.
    if (c.insert)
      check_cache(mm, cache, slots, [&](const uint8_t* crow, int64_t t, int h) {
        const uint16_t* k = buf.ptr<uint16_t>() + t * row + (c.nq + h) * 128;
        const uint16_t* v = buf.ptr<uint16_t>() + t * row + (c.nq + c.nkv + h) * 128;
        const uint16_t* c16 = reinterpret_cast<const uint16_t*>(crow);
        for (int d = 0; d < 128; ++d) {
          const bool ok = c.insert == 1 ? c16[d] == k[d] && c16[128 + d] == v[d]
                                        : crow[d] == float_to_e4m3(bf16_to_float(k[d]) / 0.37f) &&
                                              crow[128 + d] == float_to_e4m3(bf16_to_float(v[d]) / 2.5f);
          if (!ok) mm.add("cache row of token/head/dim " + at({t, h, d}));
        }
      });
  }
}

// q_fp8_out is exactly e4m3(float(bf16(q')) * (1/scale)), with or without q_out.
TEST(QknormRopeKvInsertCpu, Fp8QEqualsScaledQuantOfQOut) {
  for (float scale : {0.5f, 0.37f}) {
    Rng r(500 + uint64_t(scale * 100));
    SEED_TRACE(r);
    const int T = 7, nq = 4, nkv = 2, R = 64, W = (nq + 2 * nkv) * 128;
    Tensor qkv = rand16({T, W}, r, -10, 10), qw = rand16({128}, r, -1, 1), kw = rand16({128}, r, -1, 1);
    Tensor table = rope_table(R), pos = i64s(make_positions(r, T));
    const Tensor orig = clone(qkv);
    Tensor q_out = poisoned({T, nq * 128}, DType::kBFloat16), q8 = poisoned({T, nq * 128}, DType::kUInt8);
    QknormRopeKvInsertArgs a = qk_args(qkv, qw, kw, table, pos, nq, nkv, R);
    a.q_out = q_out;
    a.q_fp8_out = q8;
    a.q_fp8_scale = scale;
    qknorm_rope_kv_insert(a);
    const float inv = 1.0f / scale;
    for (int64_t i = 0; i < q8.numel(); ++i)
      ASSERT_EQ(q8.ptr<uint8_t>()[i], float_to_e4m3(bf16_to_float(q_out.ptr<uint16_t>()[i]) * inv))
          << "element " << i << " scale " << scale;
    for (int64_t t = 0; t < T; ++t) {  // q (q_out was given) and v unchanged in qkv
      const uint16_t *now = qkv.ptr<uint16_t>() + t * W, *was = orig.ptr<uint16_t>() + t * W;
      const int v0 = (nq + nkv) * 128;
      EXPECT_TRUE(std::equal(was, was + nq * 128, now) && std::equal(was + v0, was + W, now + v0))
          << "q or v changed in qkv, token " << t;
    }
    // q_fp8_out without q_out: q is emitted only in fp8 (same codes); qkv's q stays unchanged.
    Tensor qkv2 = clone(orig), q8b = poisoned({T, nq * 128}, DType::kUInt8);
    a.qkv = qkv2;
    a.q_out = TensorView{};
    a.q_fp8_out = q8b;
    qknorm_rope_kv_insert(a);
    EXPECT_TRUE(same_bytes(q8b, q8)) << "fp8-only q differs from the q_out + q_fp8_out run";
    EXPECT_TRUE(same_bytes(qkv2, qkv)) << "qkv (unchanged q, same k', v) differs between the runs";
  }
}

}  // namespace
