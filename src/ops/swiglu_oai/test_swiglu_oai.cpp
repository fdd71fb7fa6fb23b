// Tests of swiglu_oai: the CPU path against an fp64 oracle (padded rows, clamps) and argument
// validation.
// Shared helpers: tests/test_util.h.
#include "test_util.h"

namespace {

using namespace m3rt;
using namespace m3rt_test;

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

// ---- argument validation ------------------------------------------------------------------------

struct SwigluCall : CallBase {  // gate_up [3, 16], out [3, 8]
  TensorView in = make({3, 16}, DType::kBFloat16), out = make({3, 8}, DType::kBFloat16);
  m3rt::SwigluOaiParams p;
  void call() { m3rt::swiglu_oai(out, in, p); }
};

TEST(SwigluArgs, BadArguments) {
  using C = SwigluCall;
  expect_bad_args<C>({
      {"odd width", [](C& c) { c.in = c.in.narrowed(1, 0, 15); },
       {"swiglu_oai: gate_up.shape = [3, 15]", "2*I"}},
      {"out shape", [](C& c) { c.out = c.out.narrowed(1, 0, 4); },
       {"out.shape = [3, 4]", "expected [3, 8]"}},
      {"out dtype", [](C& c) { c.out.dtype = DType::kFloat16; }, {"out.dtype = float16"}},
      {"gate_up float32", [](C& c) { c.in.dtype = DType::kFloat32; }, {"gate_up.dtype = float32"}},
      {"limit 0", [](C& c) { c.p.limit = 0.0f; }, {"limit = 0", "> 0"}},
      {"alpha nan", [](C& c) { c.p.alpha = NAN; }, {"alpha = nan"}},
      {"beta inf", [](C& c) { c.p.beta = INFINITY; }, {"beta = inf"}},
  });
}

}  // namespace
