// Tests of the DSpark context-K/V writer (dspark_context_kv_write): the CPU path against an fp64
// oracle over named cases, bit-for-bit equality with the unfused path built from gemma_rms_norm +
// RoPE + reshape_and_cache, table caching across calls and rebinds; validation of the seed-000
// layout rules (DsparkContextKvWriter::validate gives a reason string), of the call arguments and
// of out-of-range slots and positions (which must throw before anything is written).
// Shared helpers: tests/test_util.h.
#include "core/validate.h"
#include "test_util.h"

namespace {

using namespace m3rt;
using namespace m3rt_test;

// ---- fp64 oracle --------------------------------------------------------------------------------

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
  DsparkContextKvArgs a = s.args();
  a.enable_pdl = c.num_ctx % 2 == 1;  // GPU launch options: the CPU path ignores them
  Tensor claims = poisoned({kClaimCounterInts}, DType::kInt32);
  if (c.num_ctx % 3 == 1) a.claim_counters = claims;
  writer(a);
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

// ---- argument validation ------------------------------------------------------------------------

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
      {"claim_counters float", [](C& c) { c.a.claim_counters = c.make({256}, DType::kFloat32); },
       {op + "claim_counters.dtype = float32", "supported: int32"}},
      {"claim_counters too few", [](C& c) { c.a.claim_counters = c.make({16}, DType::kInt32); },
       {"claim_counters = int32[16] on cpu", "at least kClaimCounterInts = 256"}},
  });
  EXPECT_FALSE(m3rt::dspark_rotary_dim_supported(48, 128));
  EXPECT_FALSE(m3rt::dspark_rotary_dim_supported(64, 256));
  EXPECT_TRUE(m3rt::dspark_rotary_dim_supported(16, 128));
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

// Random positions and slots: the CPU path runs, or throws before writing anything; under
// scripts/sanitize.sh it also never reads or writes out of bounds.
TEST(OutOfRange, DsparkRandomIndicesRunOrThrowUntouched) {
  expect_runs_or_throws_untouched<DsparkCall>(
      300, 41,
      [](DsparkCall& c, std::mt19937_64& g) {
        wild_fill(c.a.positions, g, 0, 63);
        wild_fill(c.a.slot_mapping, g, -1, 63);
      },
      [](DsparkCall& c) {
        std::vector<TensorView> w{c.a.all_kv};
        for (const auto& l : c.layers.layers) w.push_back(l.kv_cache);
        return w;
      });
}

}  // namespace

// The launchers of the kernels that index in 32 bits (this writer, qknorm_rope_kv_insert) refuse
// larger sizes with this check before launching anything.
TEST(Validate, Below2To31NamesTheValue) {
  EXPECT_NO_THROW(m3rt::detail::require_below_2_31("op", "num_ctx", 0));
  EXPECT_NO_THROW(m3rt::detail::require_below_2_31("op", "num_ctx", (int64_t(1) << 31) - 1));
  for (const int64_t bad : {int64_t(1) << 31, int64_t(-1), int64_t(1) << 40}) {
    try {
      m3rt::detail::require_below_2_31("dspark_context_kv_write", "num_ctx", bad);
      ADD_FAILURE() << "no error for " << bad;
    } catch (const m3rt::Error& e) {
      const std::string msg = e.what();
      EXPECT_NE(msg.find("dspark_context_kv_write"), std::string::npos) << msg;
      EXPECT_NE(msg.find("num_ctx"), std::string::npos) << msg;
      EXPECT_NE(msg.find(std::to_string(bad)), std::string::npos) << msg;
      EXPECT_NE(msg.find("2^31"), std::string::npos) << msg;
    }
  }
}
