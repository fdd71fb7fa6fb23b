// Argument validation: every rule raises m3rt::Error (or, for DsparkContextKvWriter::validate, a
// reason string) whose message names the argument and its value. Covers the seed-000 layout rules
// of the DSpark context-K/V writer, the writer's call arguments, bad arguments of every other op,
// out-of-range device indices on the CPU path (which must throw before writing anything), and
// parse_kv_cache_dtype. CPU tensors only; views "on cuda:0" are built but never dereferenced.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <functional>
#include <string>
#include <vector>

#include "m3rt/dtype.h"
#include "m3rt/error.h"
#include "m3rt/ops.h"
#include "m3rt/tensor.h"

namespace {

using m3rt::Device;
using m3rt::DsparkContextKvWriter;
using m3rt::DsparkDraftLayerKv;
using m3rt::DType;
using m3rt::KvCacheDtype;
using m3rt::Tensor;
using m3rt::TensorView;
using ::testing::AllOf;
using ::testing::HasSubstr;
using ::testing::StartsWith;

// The message of the m3rt::Error that fn throws ("" and a test failure when it does not throw).
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

Tensor scale_of(float v) {
  Tensor t = Tensor::empty({1}, DType::kFloat32);
  *t.ptr<float>() = v;
  return t;
}

// ---- DSpark layers -----------------------------------------------------------------------------

// L draft layers with separate caches [nb, nkv, bs, 256] and scales; the Tensors stay owned here.
struct Layers {
  std::vector<Tensor> owned;
  std::vector<DsparkDraftLayerKv> layers;
};

Layers make_layers(int L, bool fp8 = false, int nkv = 2, int bs = 16, int nb = 4) {
  Layers s;
  for (int l = 0; l < L; ++l) {
    Tensor c = filled({nb, nkv, bs, 256}, fp8 ? DType::kUInt8 : DType::kBFloat16, 0);
    Tensor k = scale_of(1.0f), v = scale_of(1.0f);
    s.layers.push_back({c.view(), fp8 ? KvCacheDtype::kFp8E4M3 : KvCacheDtype::kAuto, k.view(), v.view()});
    s.owned.insert(s.owned.end(), {c, k, v});
  }
  return s;
}

// The reason validate() gives; the constructor must throw the same reason with the fixed prefix.
std::string reason(const std::vector<DsparkDraftLayerKv>& layers) {
  const auto r = DsparkContextKvWriter::validate(layers);
  EXPECT_TRUE(r.has_value()) << "validate accepted the layers";
  EXPECT_FALSE(DsparkContextKvWriter::supported(layers));
  const std::string msg = error_of([&] { DsparkContextKvWriter w(layers); });
  EXPECT_THAT(msg, StartsWith("unsupported DSpark context-KV layout: "));
  if (r) {
    EXPECT_EQ(msg, "unsupported DSpark context-KV layout: " + *r);
  }
  return r.value_or("");
}

TEST(DsparkLayout, ValidLayersAccepted) {
  Layers s = make_layers(5, /*fp8=*/true);
  EXPECT_FALSE(DsparkContextKvWriter::validate(s.layers).has_value());
  DsparkContextKvWriter w(s.layers);
  EXPECT_EQ(w.num_layers(), 5);
  EXPECT_EQ(w.num_kv_heads(), 2);
  EXPECT_EQ(w.block_size(), 16);
  EXPECT_EQ(w.kv_cache_dtype(), KvCacheDtype::kFp8E4M3);
}

TEST(DsparkLayout, NoLayers) { EXPECT_EQ(reason({}), "no layers"); }

TEST(DsparkLayout, TooManyLayers) {
  EXPECT_THAT(reason(make_layers(17).layers), HasSubstr("17 layers; at most 16"));
}

TEST(DsparkLayout, UnsupportedKvCacheDtypeE5m2) {
  Layers s = make_layers(2, true);
  s.layers[1].kv_cache_dtype = KvCacheDtype::kFp8E5M2;
  EXPECT_THAT(reason(s.layers), AllOf(HasSubstr("layer 1"), HasSubstr("kv_cache_dtype 'fp8_e5m2'")));
}

TEST(DsparkLayout, UnsupportedKvCacheDtypeNvfp4) {
  Layers s = make_layers(1, true);
  s.layers[0].kv_cache_dtype = KvCacheDtype::kNvfp4;
  EXPECT_THAT(reason(s.layers), AllOf(HasSubstr("layer 0"), HasSubstr("kv_cache_dtype 'nvfp4'")));
}

TEST(DsparkLayout, CacheUnbound) {
  Layers s = make_layers(3);
  s.layers[2].kv_cache = TensorView{};
  EXPECT_THAT(reason(s.layers), AllOf(HasSubstr("layer 2"), HasSubstr("KV cache not bound")));
}

TEST(DsparkLayout, CacheEmpty) {
  Layers s = make_layers(1);
  Tensor empty = Tensor::empty({0, 2, 16, 256}, DType::kBFloat16);
  s.layers[0].kv_cache = empty.view();
  EXPECT_THAT(reason(s.layers), HasSubstr("KV cache not bound"));
}

TEST(DsparkLayout, CacheNot4D) {
  Layers s = make_layers(1);
  s.layers[0].kv_cache = s.layers[0].kv_cache.reshaped({8, 16, 256});
  EXPECT_THAT(reason(s.layers), AllOf(HasSubstr("unexpected cache shape [8, 16, 256]")));
}

TEST(DsparkLayout, CacheLastDimNot256) {
  Layers s = make_layers(1);
  s.layers[0].kv_cache = s.layers[0].kv_cache.reshaped({4, 2, 32, 128});
  EXPECT_THAT(reason(s.layers), HasSubstr("unexpected cache shape [4, 2, 32, 128]"));
}

TEST(DsparkLayout, BlockSizeNotPowerOfTwo) {
  Layers s = make_layers(3);
  Tensor c = filled({4, 2, 96, 256}, DType::kBFloat16, 0);
  s.layers[2].kv_cache = c.view();
  EXPECT_THAT(reason(s.layers), HasSubstr("layer 2: block size 96 is not a power of two"));
}

TEST(DsparkLayout, CacheNotContiguous) {
  Layers s = make_layers(1);
  TensorView v = s.layers[0].kv_cache;  // [4, 2, 16, 256] viewed with blocks and heads swapped
  v.stride[0] = 16 * 256;
  v.stride[1] = 4 * 16 * 256;
  s.layers[0].kv_cache = v;
  EXPECT_THAT(reason(s.layers),
              AllOf(HasSubstr("cache is not contiguous"), HasSubstr("(4096, 16384, 256, 1)")));
}

TEST(DsparkLayout, Fp8CacheNotUint8) {
  Layers s = make_layers(1, /*fp8=*/false);
  s.layers[0].kv_cache_dtype = KvCacheDtype::kFp8E4M3;  // bf16 storage declared as fp8
  EXPECT_THAT(reason(s.layers), HasSubstr("fp8 cache has dtype bfloat16 (expected uint8 storage)"));
}

TEST(DsparkLayout, Bf16CacheNotBf16) {
  Layers s = make_layers(1);
  s.layers[0].kv_cache.dtype = DType::kFloat16;
  EXPECT_THAT(reason(s.layers), HasSubstr("cache has dtype float16 (expected bfloat16)"));
}

TEST(DsparkLayout, ScaleNotFp32) {
  Layers s = make_layers(2, true);
  s.layers[1].v_scale.dtype = DType::kFloat16;
  EXPECT_THAT(reason(s.layers),
              AllOf(HasSubstr("layer 1: v_scale is not a one-element fp32 tensor"), HasSubstr("float16[1]")));
}

TEST(DsparkLayout, ScaleNotOneElement) {
  Layers s = make_layers(1, true);
  Tensor two = filled({2}, DType::kFloat32, 0);
  s.layers[0].k_scale = two.view();
  EXPECT_THAT(reason(s.layers),
              AllOf(HasSubstr("k_scale is not a one-element fp32 tensor"), HasSubstr("float32[2]")));
}

TEST(DsparkLayout, ScaleMissing) {
  Layers s = make_layers(1, true);
  s.layers[0].k_scale = TensorView{};
  EXPECT_THAT(reason(s.layers), AllOf(HasSubstr("k_scale is not"), HasSubstr("(none)")));
}

TEST(DsparkLayout, ScaleOnAnotherDevice) {
  Layers s = make_layers(2, true);
  s.layers[1].k_scale.device = Device::cuda(0);  // metadata only: never dereferenced
  EXPECT_THAT(reason(s.layers), AllOf(HasSubstr("layer 1: k_scale"), HasSubstr("cache's device (cpu)"),
                                      HasSubstr("on cuda:0")));
}

TEST(DsparkLayout, LayersDifferInShape) {
  Layers s = make_layers(2);
  Tensor c = filled({5, 2, 16, 256}, DType::kBFloat16, 0);
  s.layers[1].kv_cache = c.view();
  EXPECT_THAT(reason(s.layers), AllOf(HasSubstr("layer 1: layers do not share cache shape/stride/dtype"),
                                      HasSubstr("[5, 2, 16, 256]")));
}

TEST(DsparkLayout, LayersDifferInStride) {
  // nkv = 1: a contiguous view may carry any stride on the size-1 head dim.
  Layers s = make_layers(2, false, /*nkv=*/1);
  s.layers[1].kv_cache.stride[1] = 12345;
  ASSERT_TRUE(s.layers[1].kv_cache.is_contiguous());
  EXPECT_THAT(reason(s.layers), HasSubstr("layers do not share cache shape/stride/dtype"));
}

TEST(DsparkLayout, LayersDifferInDtype) {
  Layers bf = make_layers(1), f8 = make_layers(1, true);
  std::vector<DsparkDraftLayerKv> mixed = {bf.layers[0], f8.layers[0]};
  EXPECT_THAT(reason(mixed), AllOf(HasSubstr("layer 1: layers do not share"), HasSubstr("uint8")));
}

TEST(DsparkLayout, LayersDifferInDevice) {
  Layers s = make_layers(2);
  for (TensorView* v : {&s.layers[1].kv_cache, &s.layers[1].k_scale, &s.layers[1].v_scale})
    v->device = Device::cuda(0);  // metadata only
  EXPECT_THAT(reason(s.layers), AllOf(HasSubstr("layers do not share"), HasSubstr("on cuda:0")));
}

TEST(DsparkLayout, CachesNot16ElementAligned) {
  const int64_t n = 4 * 2 * 16 * 256;
  Tensor buf = filled({2 * n + 16}, DType::kBFloat16, 0);
  Layers s = make_layers(2);
  auto carve = [&](int64_t off) {
    return TensorView::contiguous(buf.ptr<uint16_t>() + off, DType::kBFloat16, {4, 2, 16, 256});
  };
  s.layers[0].kv_cache = carve(0);
  s.layers[1].kv_cache = carve(n + 16);  // 16 elements apart from a whole cache: fine
  EXPECT_FALSE(DsparkContextKvWriter::validate(s.layers).has_value());
  s.layers[1].kv_cache = carve(n + 8);  // 8 elements: refused
  EXPECT_THAT(reason(s.layers), HasSubstr("layer 1: layer caches are not 16-element aligned to each other"));
}

// ---- call arguments: table-driven bad-argument cases -------------------------------------------

// A valid call of one op on small CPU tensors; `make` allocates tensors that live as long as it.
struct CallBase {
  std::vector<Tensor> keep;
  TensorView make(const std::vector<int64_t>& shape, DType dt, uint8_t byte = 0) {
    keep.push_back(filled(shape, dt, byte));
    return keep.back();
  }
};

// One bad-argument case: `edit` breaks the valid call; the error must contain every `want`.
template <class Call>
struct BadArg {
  const char* what;
  std::function<void(Call&)> edit;
  std::vector<std::string> want;
};

template <class Call>
void expect_bad_args(const std::vector<BadArg<Call>>& cases) {
  Call valid;
  EXPECT_NO_THROW(valid.call()) << "the unedited call must be valid";
  for (const BadArg<Call>& c : cases) {
    SCOPED_TRACE(c.what);
    Call call;
    c.edit(call);
    const std::string msg = error_of([&] { call.call(); });
    for (const std::string& w : c.want) EXPECT_THAT(msg, HasSubstr(w));
  }
}

struct DsparkCall : CallBase {  // L 2, nkv 2, num_ctx 3, rotary 32, max_pos 64
  Layers layers = make_layers(2);
  m3rt::DsparkContextKvArgs a;
  DsparkCall() {
    a.all_kv = make({3, 2, 2, 2, 128}, DType::kBFloat16);
    a.k_norm_weight = make({2, 128}, DType::kBFloat16);
    a.positions = make({3}, DType::kInt64);
    a.cos_sin_cache = make({64, 32}, DType::kBFloat16);
    a.rotary_dim = 32;
    a.slot_mapping = make({3}, DType::kInt64, 0xff);  // -1: nothing written
  }
  void call() {
    DsparkContextKvWriter w(layers.layers);
    w(a);
  }
};

TEST(DsparkCallArgs, BadArguments) {
  using C = DsparkCall;
  const std::string op = "dspark_context_kv_write: ";
  expect_bad_args<C>({
      {"L mismatch", [](C& c) { c.a.all_kv = c.make({3, 3, 2, 2, 128}, DType::kBFloat16); },
       {op + "all_kv.shape = [3, 3, 2, 2, 128]", "expected [*, 2, 2, 2, 128]"}},
      {"nkv mismatch", [](C& c) { c.a.all_kv = c.make({3, 2, 2, 4, 128}, DType::kBFloat16); },
       {"all_kv.shape = [3, 2, 2, 4, 128]", "expected [*, 2, 2, 2, 128]"}},
      {"all_kv dtype", [](C& c) { c.a.all_kv.dtype = DType::kFloat16; },
       {"all_kv.dtype = float16", "bfloat16"}},
      {"all_kv heads not contiguous", [](C& c) { c.a.all_kv.stride[3] = 256; },
       {"all_kv.strides = (1024, 512, 256, 256, 1)"}},
      {"positions int32", [](C& c) { c.a.positions = c.make({3}, DType::kInt32); },
       {"positions.dtype = int32", "int64"}},
      {"positions length", [](C& c) { c.a.positions = c.make({4}, DType::kInt64); },
       {"positions.shape = [4]", "expected [3]"}},
      {"slot_mapping int32", [](C& c) { c.a.slot_mapping = c.make({3}, DType::kInt32); },
       {"slot_mapping.dtype = int32"}},
      {"slot_mapping length", [](C& c) { c.a.slot_mapping = c.make({2}, DType::kInt64, 0xff); },
       {"slot_mapping.shape = [2]", "expected [3]"}},
      {"rotary_dim 48",
       [](C& c) {
         c.a.cos_sin_cache = c.make({64, 48}, DType::kBFloat16);
         c.a.rotary_dim = 48;
       },
       {"rotary_dim = 48", "16, 32 or 64"}},
      {"table width", [](C& c) { c.a.rotary_dim = 64; },
       {"cos_sin_cache.shape = [64, 32]", "expected [*, 64]"}},
      {"k_norm_weight width", [](C& c) { c.a.k_norm_weight = c.make({2, 64}, DType::kBFloat16); },
       {"k_norm_weight.shape = [2, 64]", "expected [2, 128]"}},
      {"k_norm_weight layers", [](C& c) { c.a.k_norm_weight = c.make({3, 128}, DType::kBFloat16); },
       {"k_norm_weight.shape = [3, 128]"}},
      {"eps", [](C& c) { c.a.eps = -1.0f; }, {"eps = -1"}},
  });
  EXPECT_FALSE(m3rt::dspark_rotary_dim_supported(48, 128));
  EXPECT_FALSE(m3rt::dspark_rotary_dim_supported(64, 256));
  EXPECT_TRUE(m3rt::dspark_rotary_dim_supported(16, 128));
}

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

struct QkCall : CallBase {  // T 3, nq 2, nkv 1, rotary 64, max_pos 16
  m3rt::QknormRopeKvInsertArgs a;
  QkCall() {
    a.qkv = make({3, 4 * 128}, DType::kBFloat16);
    a.q_norm_weight = make({128}, DType::kBFloat16);
    a.k_norm_weight = make({128}, DType::kBFloat16);
    a.cos_sin_cache = make({16, 64}, DType::kBFloat16);
    a.positions = make({3}, DType::kInt64);
    a.num_heads = 2;
    a.num_kv_heads = 1;
    a.rotary_dim = 64;
    a.q_fp8_out = make({3, 256}, DType::kUInt8);
    a.kv_cache = make({2, 1, 16, 256}, DType::kUInt8);
    a.kv_cache_dtype = KvCacheDtype::kFp8E4M3;
    a.slot_mapping = make({3}, DType::kInt64, 0xff);
    a.k_scale = make({1}, DType::kFloat32);
    a.v_scale = make({1}, DType::kFloat32);
  }
  void call() { m3rt::qknorm_rope_kv_insert(a); }
};

TEST(QknormRopeArgs, BadArguments) {
  using C = QkCall;
  std::vector<BadArg<C>> cases = {
      {"slot_mapping without kv_cache", [](C& c) { c.a.kv_cache = TensorView{}; },
       {"qknorm_rope_kv_insert: slot_mapping = int64[3] on cpu", "without kv_cache"}},
      {"qkv width", [](C& c) { c.a.num_kv_heads = 2; },
       {"qkv.shape = [3, 512]", "expected [*, 768]"}},
      {"num_heads 0", [](C& c) { c.a.num_heads = 0; }, {"num_heads = 0"}},
      {"rotary_dim 48", [](C& c) { c.a.rotary_dim = 48; }, {"rotary_dim = 48"}},
      {"q_out shape", [](C& c) { c.a.q_out = c.make({3, 128}, DType::kBFloat16); },
       {"q_out.shape = [3, 128]", "expected [3, 256]"}},
      {"q_fp8_out dtype", [](C& c) { c.a.q_fp8_out = c.make({3, 256}, DType::kBFloat16); },
       {"q_fp8_out.dtype = bfloat16"}},
      {"missing v_scale", [](C& c) { c.a.v_scale = TensorView{}; },
       {"v_scale = (none): is required"}},
      {"cache heads", [](C& c) { c.a.kv_cache = c.make({2, 2, 16, 256}, DType::kUInt8); },
       {"kv_cache.shape = [2, 2, 16, 256]", "expected [*, 1, *, 256]"}},
      {"positions int32", [](C& c) { c.a.positions = c.make({3}, DType::kInt32); },
       {"positions.dtype = int32"}},
  };
  for (float s : {0.0f, -0.5f, NAN, INFINITY})
    cases.push_back({"q_fp8_scale", [s](C& c) { c.a.q_fp8_scale = s; },
                     {"q_fp8_scale = ", "must be finite and > 0"}});
  expect_bad_args<C>(cases);
}

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

// ---- out-of-range device indices on the CPU path: throw, write nothing --------------------------

std::vector<uint8_t> bytes_of(const TensorView& v) {
  const uint8_t* p = v.ptr<uint8_t>();
  return {p, p + v.numel() * m3rt::dtype_size(v.dtype)};
}
void set_i64(const TensorView& v, std::initializer_list<int64_t> values) {
  std::copy(values.begin(), values.end(), v.ptr<int64_t>());
}

// Runs call.call() with the bad index in the LAST row; expects an m3rt::Error naming `arg` and the
// value, and every byte of the watched tensors unchanged (rows 0.. were valid, so an op that
// wrote before checking would have changed them).
template <class Call>
void expect_throws_and_untouched(Call& call, const std::vector<TensorView>& watched,
                                 const std::string& arg, const std::string& value) {
  std::vector<std::vector<uint8_t>> before;
  for (const TensorView& v : watched) before.push_back(bytes_of(v));
  EXPECT_THAT(error_of([&] { call.call(); }), AllOf(HasSubstr(arg + " = " + value), HasSubstr("must")));
  for (size_t i = 0; i < watched.size(); ++i)
    EXPECT_EQ(bytes_of(watched[i]), before[i]) << "tensor " << i << " was written before the error";
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

TEST(OutOfRange, QknormSlotAndPosition) {
  for (bool bad_slot : {true, false}) {  // slot 32 >= 2 blocks x 16, or position 16 >= max_pos 16
    QkCall c;
    c.a.qkv = c.make({3, 512}, DType::kBFloat16, 0x3f);
    c.a.kv_cache = c.make({2, 1, 16, 256}, DType::kUInt8, 0xff);
    set_i64(c.a.slot_mapping, {0, 1, bad_slot ? 32 : 2});
    set_i64(c.a.positions, {0, 15, bad_slot ? 3 : 16});
    expect_throws_and_untouched(c, {c.a.qkv, c.a.kv_cache, c.a.q_fp8_out},
                                bad_slot ? "slot_mapping[2]" : "positions[2]", bad_slot ? "32" : "16");
  }
}

TEST(OutOfRange, DsparkSlotAndPosition) {
  // slot 64 >= 4 blocks x 16; position 64 >= max_pos 64; position -1
  const struct { int64_t slot, pos; const char *arg, *value; } cases[] = {
      {64, 3, "slot_mapping[2]", "64"}, {9, 64, "positions[2]", "64"}, {9, -1, "positions[2]", "-1"}};
  for (const auto& bad : cases) {
    DsparkCall c;
    for (auto& l : c.layers.layers) std::memset(l.kv_cache.data, 0xff, l.kv_cache.numel() * 2);
    set_i64(c.a.slot_mapping, {0, 7, bad.slot});
    set_i64(c.a.positions, {1, 2, bad.pos});
    expect_throws_and_untouched(c, {c.layers.layers[0].kv_cache, c.layers.layers[1].kv_cache},
                                std::string("dspark_context_kv_write: ") + bad.arg, bad.value);
  }
}

// ---- parse_kv_cache_dtype ----------------------------------------------------------------------

TEST(KvCacheDtypeNames, ParseKnownAndUnknown) {
  EXPECT_EQ(m3rt::parse_kv_cache_dtype("auto"), KvCacheDtype::kAuto);
  EXPECT_EQ(m3rt::parse_kv_cache_dtype("bfloat16"), KvCacheDtype::kBFloat16);
  EXPECT_EQ(m3rt::parse_kv_cache_dtype("fp8"), KvCacheDtype::kFp8E4M3);
  EXPECT_EQ(m3rt::parse_kv_cache_dtype("fp8_e4m3"), KvCacheDtype::kFp8E4M3);
  EXPECT_EQ(m3rt::parse_kv_cache_dtype("fp8_e5m2"), KvCacheDtype::kFp8E5M2);
  EXPECT_EQ(m3rt::parse_kv_cache_dtype("nvfp4"), KvCacheDtype::kNvfp4);
  EXPECT_THAT(error_of([] { m3rt::parse_kv_cache_dtype("fp16"); }),
              AllOf(HasSubstr("kv_cache_dtype = 'fp16'"), HasSubstr("known: auto")));
  EXPECT_THAT(error_of([] { m3rt::parse_kv_cache_dtype(""); }), HasSubstr("kv_cache_dtype = ''"));
  EXPECT_THAT(error_of([] { m3rt::parse_kv_cache_dtype("FP8"); }), HasSubstr("'FP8'"));
}

}  // namespace
