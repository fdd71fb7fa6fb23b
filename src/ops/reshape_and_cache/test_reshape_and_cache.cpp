// Tests of reshape_and_cache: the CPU path against an fp64 oracle (strided K/V views, fp8
// saturation, untargeted cache rows untouched) and argument validation (bad arguments, an
// out-of-range slot that must throw before anything is written).
// Shared helpers: tests/test_util.h.
#include "test_util.h"

namespace {

using namespace m3rt;
using namespace m3rt_test;

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

// ---- argument validation ------------------------------------------------------------------------

struct RacCall : CallBase {  // T 3, nkv 2, fp8 cache [4, 2, 16, 256]
  TensorView k = make({3, 2, 128}, DType::kBFloat16), v = make({3, 2, 128}, DType::kBFloat16);
  TensorView cache = make({4, 2, 16, 256}, DType::kUInt8), slots = make({3}, DType::kInt64, 0xff);
  TensorView ks = make({1}, DType::kFloat32), vs = make({1}, DType::kFloat32);
  KvCacheDtype dt = KvCacheDtype::kFp8E4M3;
  void call() { m3rt::reshape_and_cache(k, v, cache, slots, dt, ks, vs); }
};

TEST(ReshapeAndCacheArgs, BadArguments) {
  using C = RacCall;
  expect_bad_args<C>({
      {"key dtype", [](C& c) { c.k.dtype = DType::kFloat16; },
       {"reshape_and_cache: key.dtype = float16", "bfloat16"}},
      {"value heads", [](C& c) { c.v = c.make({3, 4, 128}, DType::kBFloat16); },
       {"value.shape = [3, 4, 128]", "expected [*, 2, 128]"}},
      {"value tokens", [](C& c) { c.v = c.make({2, 2, 128}, DType::kBFloat16); },
       {"value.shape = [2, 2, 128]", "key.shape [3, 2, 128]"}},
      {"missing k_scale", [](C& c) { c.ks = TensorView{}; }, {"k_scale = (none): is required"}},
      {"two-element v_scale", [](C& c) { c.vs = c.make({2}, DType::kFloat32); },
       {"v_scale.shape = [2]", "one fp32 value"}},
      {"bf16 cache declared fp8", [](C& c) { c.cache = c.make({4, 2, 16, 256}, DType::kBFloat16); },
       {"kv_cache.dtype = bfloat16", "uint8"}},
      {"block size 96", [](C& c) { c.cache = c.make({4, 2, 96, 256}, DType::kUInt8); },
       {"kv_cache.shape = [4, 2, 96, 256]", "power of two"}},
      {"slot_mapping int32", [](C& c) { c.slots = c.make({3}, DType::kInt32); },
       {"slot_mapping.dtype = int32"}},
      {"nvfp4", [](C& c) { c.dt = KvCacheDtype::kNvfp4; }, {"kv_cache_dtype = nvfp4"}},
  });
}

TEST(OutOfRange, ReshapeAndCacheSlot) {
  for (bool fp8 : {false, true}) {
    RacCall c;  // 4 blocks x 16: slots 0..63
    c.k = c.v = c.make({3, 2, 128}, DType::kBFloat16, 0x3f);
    c.cache = c.make({4, 2, 16, 256}, fp8 ? DType::kUInt8 : DType::kBFloat16, 0xff);
    c.dt = fp8 ? KvCacheDtype::kFp8E4M3 : KvCacheDtype::kBFloat16;
    set_i64(c.slots, {0, 5, 64});
    expect_throws_and_untouched(c, {c.cache}, "reshape_and_cache: slot_mapping[2]", "64");
  }
}

// Random slots: the CPU path runs, or throws before writing anything; under scripts/sanitize.sh it
// also never reads or writes out of bounds.
TEST(OutOfRange, ReshapeAndCacheRandomSlotsRunOrThrowUntouched) {
  expect_runs_or_throws_untouched<RacCall>(
      300, 51, [](RacCall& c, std::mt19937_64& g) { wild_fill(c.slots, g, -1, 63); },
      [](RacCall& c) { return std::vector<TensorView>{c.cache}; });
}

}  // namespace
