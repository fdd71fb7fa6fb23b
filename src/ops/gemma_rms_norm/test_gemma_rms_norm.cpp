// Tests of gemma_rms_norm and gemma_fused_add_rms_norm: the CPU path against an fp64 oracle
// (rows, strided per-head views, in place) and argument validation.
// Shared helpers: tests/test_util.h.
#include "test_util.h"

namespace {

using namespace m3rt;
using namespace m3rt_test;

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

// ---- argument validation ------------------------------------------------------------------------

struct NormCall : CallBase {  // x, out, residual [4, 64]
  TensorView x = make({4, 64}, DType::kBFloat16), out = make({4, 64}, DType::kBFloat16);
  TensorView res = make({4, 64}, DType::kBFloat16), w = make({64}, DType::kBFloat16);
  float eps = 1e-6f;
  bool fused = false;
  void call() {
    if (fused) m3rt::gemma_fused_add_rms_norm(out, x, res, w, eps);
    else m3rt::gemma_rms_norm(out, x, w, eps);
  }
};

TEST(GemmaNormArgs, BadArguments) {
  using C = NormCall;
  expect_bad_args<C>({
      {"x float32", [](C& c) { c.x.dtype = DType::kFloat32; },
       {"gemma_rms_norm: x.dtype = float32", "bfloat16 or float16"}},
      {"weight shape", [](C& c) { c.w = c.make({32}, DType::kBFloat16); },
       {"weight.shape = [32]", "expected [64]"}},
      {"weight dtype", [](C& c) { c.w.dtype = DType::kFloat16; }, {"weight.dtype = float16"}},
      {"out shape", [](C& c) { c.out = c.out.reshaped({2, 128}); },
       {"out.shape = [2, 128]", "x.shape [4, 64]"}},
      {"x 4-D", [](C& c) { c.x = c.x.reshaped({1, 2, 2, 64}); }, {"x.shape = [1, 2, 2, 64]"}},
      {"eps", [](C& c) { c.eps = -1e-6f; }, {"eps = -0.000001"}},
      {"fused: residual shape",
       [](C& c) {
         c.fused = true;
         c.res = c.res.narrowed(0, 0, 3);
       },
       {"gemma_fused_add_rms_norm: residual.shape = [3, 64]", "x.shape [4, 64]"}},
      {"fused: residual dtype",
       [](C& c) {
         c.fused = true;
         c.res.dtype = DType::kFloat16;
       },
       {"residual.dtype = float16"}},
      {"fused: residual missing",
       [](C& c) {
         c.fused = true;
         c.res = TensorView{};
       },
       {"residual = (none): is required"}},
  });
}

}  // namespace
