// The correctness checks of `m3rt check`, one function per op.
//
// Each check draws fresh inputs, runs the op on the device under test with every output poisoned
// (0xFF bytes: NaN in bf16, fp16 and e4m3), and compares with
//   - the CPU reference (the op on CPU tensors) when the device is a GPU, and
//   - an fp64 evaluation of the spec's formulas, written here, when the device is the CPU.
// Tolerances are in units of the output dtype; copies and untouched memory must match bitwise.
#include <algorithm>
#include <cmath>
#include <functional>

#include "check/check_cases.h"
#include "check/check_util.h"
#include "check/compare.h"
#include "m3rt/error.h"
#include "m3rt/ops.h"

namespace m3rt::detail {

namespace {

constexpr uint8_t kPoison = 0xFF;
// RoPE in fp32 (two rounded products, then a rounded sum) against fp64: the absolute error is at
// most ~3 fp32 ulps of the larger term (|term| < 16 here, so < 6e-6), which for a result that
// nearly cancels is many bf16 ulps of the result. Elements within this distance pass.
constexpr double kRopeAbsTol = 1e-5;

Tensor poisoned(const std::vector<int64_t>& shape, DType dtype, Device device) {
  Tensor t = Tensor::empty(shape, dtype, device);
  t.fill_bytes(kPoison);
  return t;
}

// abs_tol: see compare_codes; used only against the fp64 oracle, never GPU vs reference.
void add_row(CheckContext& c, const std::string& output, const TensorView& actual,
             const TensorView& expected, DType code_dtype, double tolerance, double abs_tol = 0) {
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

// fp64 partial NeoX RoPE of one head given in fp64, with the bf16 table row; rounded to bf16.
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

// fp64 RoPE of a bf16 head.
void oracle_rope(const uint16_t* x, const uint16_t* cs, int rotary_dim, uint16_t* out) {
  double n[128];
  for (int d = 0; d < 128; ++d) n[d] = b2f(x[d]);
  oracle_rope_f64(n, cs, rotary_dim, out);
}

// fp64 Gemma RMSNorm of one 128-dim head, then partial NeoX RoPE, rounded once to bf16.
void oracle_norm_rope(const uint16_t* x, const uint16_t* w, const uint16_t* cs, int rotary_dim,
                      double eps, uint16_t* out) {
  double ss = 0;
  for (int d = 0; d < 128; ++d) ss += double(b2f(x[d])) * b2f(x[d]);
  const double inv = 1.0 / std::sqrt(ss / 128.0 + eps);
  double n[128];
  for (int d = 0; d < 128; ++d) n[d] = double(b2f(x[d])) * inv * (1.0 + b2f(w[d]));
  oracle_rope_f64(n, cs, rotary_dim, out);
}

// Stores 128 bf16 values into a cache row half: bf16, or e4m3(value / scale).
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

// ------------------------------------------------------------------------------------------------
// reshape_and_cache
void check_reshape_and_cache_variant(CheckContext& c, bool fp8) {
  const int64_t T = 37, nkv = 4, bs = 16, nb = 8, nq = 8;
  c.variant = std::string(fp8 ? "fp8" : "bf16") + " T37 nkv4 bs16 strided-kv";
  // key/value are strided views into a qkv-like buffer, as an engine passes them.
  Tensor qkv = random_half({T, (nq + 2 * nkv) * 128}, DType::kBFloat16, c.rng, -3, 3);
  Tensor slots = int64_vector(random_slots(T, nb * bs, 5, c.rng));
  Tensor k_scale = scalar_f32(fp8 ? 0.37f : 1.f), v_scale = scalar_f32(fp8 ? 2.5f : 1.f);
  const DType cdt = fp8 ? DType::kUInt8 : DType::kBFloat16;
  const KvCacheDtype kd = fp8 ? KvCacheDtype::kFp8E4M3 : KvCacheDtype::kAuto;
  auto kv_views = [&](const Tensor& q) {
    TensorView k = q.view(), v = q.view();
    for (TensorView* x : {&k, &v}) {
      x->ndim = 3;
      x->shape[0] = T, x->shape[1] = nkv, x->shape[2] = 128;
      x->stride[0] = (nq + 2 * nkv) * 128, x->stride[1] = 128, x->stride[2] = 1;
    }
    k.data = q.ptr<uint16_t>() + nq * 128;
    v.data = q.ptr<uint16_t>() + (nq + nkv) * 128;
    return std::pair{k, v};
  };
  auto run = [&](Device dev) {
    Tensor q = on(qkv, dev), s = on(slots, dev), ks = on(k_scale, dev), vs = on(v_scale, dev);
    Tensor cache = poisoned({nb, nkv, bs, 256}, cdt, dev);
    auto [k, v] = kv_views(q);
    reshape_and_cache(k, v, cache, s, kd, ks, vs);
    return to_host(cache);
  };
  Tensor got = run(c.device);
  Tensor want;
  if (c.device.is_cuda()) {
    want = run(Device::cpu());
  } else {
    want = poisoned({nb, nkv, bs, 256}, cdt, Device::cpu());
    auto [k, v] = kv_views(qkv);
    for (int64_t t = 0; t < T; ++t) {
      const int64_t slot = slots.ptr<int64_t>()[t];
      if (slot < 0) continue;
      for (int h = 0; h < nkv; ++h) {
        const int64_t e = cache_elem(want, slot, h);
        oracle_store(want.data(), fp8, e, k.ptr<uint16_t>() + t * k.stride[0] + h * 128, 0.37);
        oracle_store(want.data(), fp8, e + 128, v.ptr<uint16_t>() + t * v.stride[0] + h * 128, 2.5);
      }
    }
  }
  add_row(c, "cache", got, want, fp8 ? DType::kFloat8E4M3 : DType::kBFloat16, 0);
}

// ------------------------------------------------------------------------------------------------
// gemma_rms_norm and gemma_fused_add_rms_norm
void oracle_norm(const TensorView& x, const TensorView* res_in, const TensorView& w, double eps,
                 const TensorView& out, const TensorView* res_out) {
  const bool bf = x.dtype == DType::kBFloat16;
  auto ld = [&](const TensorView& v, int64_t i) {
    const uint16_t b = v.ptr<uint16_t>()[i];
    return double(bf ? bf16_to_float(b) : fp16_to_float(b));
  };
  auto st = [&](const TensorView& v, int64_t i, double y) {
    v.ptr<uint16_t>()[i] = bf ? float_to_bf16(float(y)) : float_to_fp16(float(y));
  };
  const int64_t d = x.shape[x.ndim - 1], inner = x.ndim == 3 ? x.shape[1] : 1;
  const int64_t rows = x.numel() / d;
  auto off = [&](const TensorView& v, int64_t r) {
    return (v.ndim >= 2 ? (r / inner) * v.stride[0] : 0) + (v.ndim == 3 ? (r % inner) * v.stride[1] : 0);
  };
  std::vector<double> s(static_cast<size_t>(d));
  for (int64_t r = 0; r < rows; ++r) {
    double ss = 0;
    for (int64_t i = 0; i < d; ++i) {
      s[i] = ld(x, off(x, r) + i) + (res_in ? ld(*res_in, off(*res_in, r) + i) : 0.0);
      ss += s[i] * s[i];
    }
    const double inv = 1.0 / std::sqrt(ss / double(d) + eps);
    for (int64_t i = 0; i < d; ++i) {
      st(out, off(out, r) + i, s[i] * inv * (1.0 + ld(w, i)));
      if (res_out) st(*res_out, off(*res_out, r) + i, s[i]);
    }
  }
}

void check_gemma_rms_norm_variant(CheckContext& c, DType dt, std::vector<int64_t> shape,
                                  bool per_head_view, bool fused) {
  const float eps = 1e-6f;
  const int64_t d = shape.back();
  c.op = fused ? "gemma_fused_add_rms_norm" : "gemma_rms_norm";
  c.variant = std::string(dt == DType::kBFloat16 ? "bf16" : "fp16") + " " +
              TensorView::contiguous(nullptr, dt, shape).shape_str() + (per_head_view ? " heads-in-qkv" : "");
  // A per-head view reads heads 1..H of a wider row, as the QK norm does inside qkv.
  const int64_t H = per_head_view ? shape[1] : 0, row_w = (H + 2) * d;
  Tensor xbuf = per_head_view ? random_half({shape[0], row_w}, dt, c.rng, -10, 10)
                              : random_half(shape, dt, c.rng, -10, 10);
  Tensor res = random_half(shape, dt, c.rng, -10, 10);
  Tensor w = random_half({d}, dt, c.rng, -1, 1);
  auto xview = [&](const Tensor& buf) {
    if (!per_head_view) return buf.view();
    TensorView v = buf.view();
    v.ndim = 3;
    v.shape[0] = shape[0], v.shape[1] = H, v.shape[2] = d;
    v.stride[0] = row_w, v.stride[1] = d, v.stride[2] = 1;
    v.data = buf.ptr<uint16_t>() + d;
    return v;
  };
  auto run = [&](Device dev) {
    Tensor xb = on(xbuf, dev), r = on(res, dev), wd = on(w, dev);
    Tensor out = poisoned(shape, dt, dev);
    if (fused) {
      gemma_fused_add_rms_norm(out, xview(xb), r, wd, eps);
    } else {
      gemma_rms_norm(out, xview(xb), wd, eps);
    }
    return std::pair{to_host(out), to_host(r)};
  };
  auto [out, r_out] = run(c.device);
  Tensor want_out, want_res;
  if (c.device.is_cuda()) {
    std::tie(want_out, want_res) = run(Device::cpu());
  } else {
    want_out = poisoned(shape, dt, Device::cpu());
    want_res = fused ? poisoned(shape, dt, Device::cpu()) : res;
    oracle_norm(xview(xbuf), fused ? &res.view() : nullptr, w, eps, want_out,
                fused ? &want_res.view() : nullptr);
  }
  add_row(c, "out", out, want_out, dt, 1);
  // The GPU must form the residual exactly like the reference; vs fp64 a double rounding may differ.
  if (fused) add_row(c, "residual", r_out, want_res, dt, c.device.is_cuda() ? 0 : 1);
}

// ------------------------------------------------------------------------------------------------
// swiglu_oai
void check_swiglu_variant(CheckContext& c, DType dt, int64_t T, int64_t I) {
  const SwigluOaiParams sp{};
  c.variant = std::string(dt == DType::kBFloat16 ? "bf16" : "fp16") + " T" + std::to_string(T) +
              " I" + std::to_string(I);
  Tensor in = random_half({T, 2 * I}, dt, c.rng, -12, 12);  // past both clamps
  auto run = [&](Device dev) {
    Tensor x = on(in, dev);
    Tensor out = poisoned({T, I}, dt, dev);
    swiglu_oai(out, x, sp);
    return to_host(out);
  };
  Tensor got = run(c.device), want;
  if (c.device.is_cuda()) {
    want = run(Device::cpu());
  } else {
    want = poisoned({T, I}, dt, Device::cpu());
    const bool bf = dt == DType::kBFloat16;
    auto ld = [&](int64_t i) {
      const uint16_t b = in.ptr<uint16_t>()[i];
      return double(bf ? bf16_to_float(b) : fp16_to_float(b));
    };
    for (int64_t t = 0; t < T; ++t)
      for (int64_t i = 0; i < I; ++i) {
        const double g = std::min(ld(t * 2 * I + i), double(sp.limit));
        const double u = std::clamp(ld(t * 2 * I + I + i), -double(sp.limit), double(sp.limit));
        const double y = g / (1.0 + std::exp(-double(sp.alpha) * g)) * (u + sp.beta);
        want.ptr<uint16_t>()[t * I + i] = bf ? float_to_bf16(float(y)) : float_to_fp16(float(y));
      }
  }
  add_row(c, "out", got, want, dt, 1);
}

// ------------------------------------------------------------------------------------------------
// dspark_context_kv_write
struct WriterShape {
  bool fp8;
  int L, nkv, bs, rot;
  int64_t n;
};

void check_writer_variant(CheckContext& c, const WriterShape& s) {
  const int64_t max_pos = 4096, nb = (s.n + s.bs - 1) / s.bs + 3;
  const float eps = 1e-6f;
  c.variant = std::string(s.fp8 ? "fp8" : "bf16") + " L" + std::to_string(s.L) + " nkv" +
              std::to_string(s.nkv) + " bs" + std::to_string(s.bs) + " rot" + std::to_string(s.rot) +
              " n" + std::to_string(s.n);
  Tensor all_kv = random_half({s.n, s.L, 2, s.nkv, 128}, DType::kBFloat16, c.rng, -3, 3);
  Tensor w = random_half({s.L, 128}, DType::kBFloat16, c.rng, -1, 1);
  std::vector<int64_t> pos(static_cast<size_t>(s.n));
  for (auto& p : pos) p = c.rng.integer(0, max_pos - 1);
  if (s.n > 1) pos[1] = max_pos - 1;
  Tensor positions = int64_vector(pos);
  Tensor slots = int64_vector(random_slots(s.n, nb * s.bs, 7, c.rng));
  Tensor table = rope_table(max_pos, s.rot);
  std::vector<Tensor> ks, vs;
  for (int l = 0; l < s.L; ++l) {
    ks.push_back(scalar_f32(s.fp8 ? c.rng.uniform(0.25f, 4.f) : 1.f));
    vs.push_back(scalar_f32(s.fp8 ? c.rng.uniform(0.25f, 4.f) : 1.f));
  }
  const DType cdt = s.fp8 ? DType::kUInt8 : DType::kBFloat16;
  const std::vector<int64_t> cshape = {nb, s.nkv, s.bs, 256};
  auto run = [&](Device dev) {
    std::vector<Tensor> caches, kd, vd;
    std::vector<DsparkDraftLayerKv> layers;
    for (int l = 0; l < s.L; ++l) {  // separate allocations per layer, like an engine's
      caches.push_back(poisoned(cshape, cdt, dev));
      kd.push_back(on(ks[l], dev));
      vd.push_back(on(vs[l], dev));
      layers.push_back({caches.back(), s.fp8 ? KvCacheDtype::kFp8E4M3 : KvCacheDtype::kAuto,
                        kd.back(), vd.back()});
    }
    DsparkContextKvWriter writer(layers);
    Tensor kv = on(all_kv, dev), wd = on(w, dev), pd = on(positions, dev), sd = on(slots, dev),
           td = on(table, dev);
    writer({.all_kv = kv, .k_norm_weight = wd, .eps = eps, .positions = pd, .cos_sin_cache = td,
            .rotary_dim = s.rot, .slot_mapping = sd});
    std::vector<Tensor> out;
    for (auto& cache : caches) out.push_back(to_host(cache));
    return out;
  };
  std::vector<Tensor> got = run(c.device), want;
  if (c.device.is_cuda()) {
    want = run(Device::cpu());
  } else {
    // The spec's unfused path: K normed by the CPU gemma_rms_norm op (itself checked against
    // fp64) and materialized in bf16, then rotated in fp64 and rounded; V copied.
    Tensor kn = Tensor::empty({s.n, s.L, s.nkv, 128}, DType::kBFloat16);
    for (int l = 0; l < s.L; ++l) {
      TensorView k = all_kv.view(), o = kn.view();
      k.ndim = o.ndim = 3;
      k.shape[0] = o.shape[0] = s.n, k.shape[1] = o.shape[1] = s.nkv, k.shape[2] = o.shape[2] = 128;
      k.stride[0] = int64_t(s.L) * 2 * s.nkv * 128, k.stride[1] = 128, k.stride[2] = 1;
      o.stride[0] = int64_t(s.L) * s.nkv * 128, o.stride[1] = 128, o.stride[2] = 1;
      k.data = all_kv.ptr<uint16_t>() + int64_t(l) * 2 * s.nkv * 128;
      o.data = kn.ptr<uint16_t>() + int64_t(l) * s.nkv * 128;
      gemma_rms_norm(o, k, w.view().narrowed(0, l, 1).reshaped({128}), eps);
    }
    for (int l = 0; l < s.L; ++l) want.push_back(poisoned(cshape, cdt, Device::cpu()));
    for (int64_t t = 0; t < s.n; ++t) {
      const int64_t slot = slots.ptr<int64_t>()[t];
      if (slot < 0) continue;
      const uint16_t* cs = table.ptr<uint16_t>() + pos[size_t(t)] * s.rot;
      for (int l = 0; l < s.L; ++l)
        for (int h = 0; h < s.nkv; ++h) {
          const uint16_t* k = kn.ptr<uint16_t>() + ((t * s.L + l) * s.nkv + h) * 128;
          const uint16_t* v = all_kv.ptr<uint16_t>() + (((t * s.L + l) * 2 + 1) * s.nkv + h) * 128;
          uint16_t kr[128];
          oracle_rope(k, cs, s.rot, kr);
          const int64_t e = cache_elem(want[l], slot, h);
          oracle_store(want[l].data(), s.fp8, e, kr, *ks[l].ptr<float>());
          oracle_store(want[l].data(), s.fp8, e + 128, v, *vs[l].ptr<float>());
        }
    }
  }
  const DType code = s.fp8 ? DType::kFloat8E4M3 : DType::kBFloat16;
  const double rope_abs = c.device.is_cuda() ? 0 : kRopeAbsTol;
  for (int l = 0; l < s.L; ++l) {
    const std::string layer = "layer" + std::to_string(l);
    add_row(c, layer + ".K", got[l].view().narrowed(3, 0, 128), want[l].view().narrowed(3, 0, 128), code, 1,
            rope_abs);
    add_row(c, layer + ".V", got[l].view().narrowed(3, 128, 128), want[l].view().narrowed(3, 128, 128), code, 0);
  }
}

// ------------------------------------------------------------------------------------------------
// qknorm_rope_kv_insert
struct QkShape {
  int nq, nkv, rot, bs;
  int64_t T;
  bool insert, fp8_cache, q_out, q_fp8;
  float q_scale;
};

void check_qk_variant(CheckContext& c, const QkShape& s) {
  const int64_t max_pos = 4096, nb = (s.T + s.bs - 1) / s.bs + 2, W = (s.nq + 2 * s.nkv) * 128;
  const float eps = 1e-6f;
  c.variant = std::string(!s.insert ? "no-insert" : s.fp8_cache ? "fp8-cache" : "bf16-cache") +
              " nq" + std::to_string(s.nq) + " nkv" + std::to_string(s.nkv) + " rot" +
              std::to_string(s.rot) + " T" + std::to_string(s.T) + (s.q_out ? " +q_out" : "") +
              (s.q_fp8 ? " +q_fp8" : "");
  Tensor qkv = random_half({s.T, W}, DType::kBFloat16, c.rng, -4, 4);
  Tensor qw = random_half({128}, DType::kBFloat16, c.rng, -1, 1);
  Tensor kw = random_half({128}, DType::kBFloat16, c.rng, -1, 1);
  std::vector<int64_t> pos(static_cast<size_t>(s.T));
  for (auto& p : pos) p = c.rng.integer(0, max_pos - 1);
  pos[0] = max_pos - 1;
  Tensor positions = int64_vector(pos);
  Tensor slots = int64_vector(random_slots(s.T, nb * s.bs, 6, c.rng));
  Tensor table = rope_table(max_pos, s.rot);
  const float ksc = s.fp8_cache ? 0.6f : 1.f, vsc = s.fp8_cache ? 1.7f : 1.f;
  Tensor k_scale = scalar_f32(ksc), v_scale = scalar_f32(vsc);
  const DType cdt = s.fp8_cache ? DType::kUInt8 : DType::kBFloat16;
  const std::vector<int64_t> cshape = {nb, s.nkv, s.bs, 256};
  struct Out {
    Tensor qkv, q_out, q_fp8, cache;
  };
  auto run = [&](Device dev) {
    Out o;
    Tensor x = on(qkv, dev), qwd = on(qw, dev), kwd = on(kw, dev), pd = on(positions, dev),
           td = on(table, dev), sd = on(slots, dev), ksd = on(k_scale, dev), vsd = on(v_scale, dev);
    Tensor q_out = poisoned({s.T, int64_t(s.nq) * 128}, DType::kBFloat16, dev);
    Tensor q_fp8 = poisoned({s.T, int64_t(s.nq) * 128}, DType::kFloat8E4M3, dev);
    Tensor cache = poisoned(cshape, cdt, dev);
    QknormRopeKvInsertArgs a{.qkv = x, .q_norm_weight = qwd, .k_norm_weight = kwd,
                             .cos_sin_cache = td, .positions = pd, .num_heads = s.nq,
                             .num_kv_heads = s.nkv, .rotary_dim = s.rot, .eps = eps};
    if (s.q_out) a.q_out = q_out;
    if (s.q_fp8) {
      a.q_fp8_out = q_fp8;
      a.q_fp8_scale = s.q_scale;
    }
    if (s.insert) {
      a.slot_mapping = sd;
      a.kv_cache = cache;
      a.kv_cache_dtype = s.fp8_cache ? KvCacheDtype::kFp8E4M3 : KvCacheDtype::kAuto;
      a.k_scale = ksd;
      a.v_scale = vsd;
    }
    qknorm_rope_kv_insert(a);
    return Out{to_host(x), to_host(q_out), to_host(q_fp8), to_host(cache)};
  };
  Out got = run(c.device), want;
  if (c.device.is_cuda()) {
    want = run(Device::cpu());
  } else {
    want = Out{qkv.to(Device::cpu()), poisoned({s.T, int64_t(s.nq) * 128}, DType::kBFloat16, Device::cpu()),
               poisoned({s.T, int64_t(s.nq) * 128}, DType::kFloat8E4M3, Device::cpu()),
               poisoned(cshape, cdt, Device::cpu())};
    const bool q_in_place = !s.q_out && !s.q_fp8;
    for (int64_t t = 0; t < s.T; ++t) {
      const uint16_t* row = qkv.ptr<uint16_t>() + t * W;
      uint16_t* wrow = want.qkv.ptr<uint16_t>() + t * W;
      const uint16_t* cs = table.ptr<uint16_t>() + pos[size_t(t)] * s.rot;
      uint16_t y[128];
      for (int h = 0; h < s.nq; ++h) {
        oracle_norm_rope(row + h * 128, qw.ptr<uint16_t>(), cs, s.rot, eps, y);
        for (int d = 0; d < 128; ++d) {
          const int64_t o = t * s.nq * 128 + h * 128 + d;
          if (s.q_out) want.q_out.ptr<uint16_t>()[o] = y[d];
          if (s.q_fp8) want.q_fp8.ptr<uint8_t>()[o] = float_to_e4m3(float(double(b2f(y[d])) / s.q_scale));
          if (q_in_place) wrow[h * 128 + d] = y[d];
        }
      }
      const int64_t slot = slots.ptr<int64_t>()[t];
      for (int h = 0; h < s.nkv; ++h) {
        oracle_norm_rope(row + (s.nq + h) * 128, kw.ptr<uint16_t>(), cs, s.rot, eps, y);
        std::copy(y, y + 128, wrow + (s.nq + h) * 128);
        if (!s.insert || slot < 0) continue;
        const int64_t e = cache_elem(want.cache, slot, h);
        oracle_store(want.cache.data(), s.fp8_cache, e, y, ksc);
        oracle_store(want.cache.data(), s.fp8_cache, e + 128, row + (s.nq + s.nkv + h) * 128, vsc);
      }
    }
  }
  const int64_t qk = int64_t(s.nq + s.nkv) * 128;
  const double rope_abs = c.device.is_cuda() ? 0 : kRopeAbsTol;
  add_row(c, "qkv.qk", got.qkv.view().narrowed(1, 0, qk), want.qkv.view().narrowed(1, 0, qk),
          DType::kBFloat16, 1, rope_abs);
  add_row(c, "qkv.v", got.qkv.view().narrowed(1, qk, s.nkv * 128),
          want.qkv.view().narrowed(1, qk, s.nkv * 128), DType::kBFloat16, 0);
  if (s.q_out) add_row(c, "q_out", got.q_out, want.q_out, DType::kBFloat16, 1, rope_abs);
  if (s.q_fp8) {
    add_row(c, "q_fp8_out", got.q_fp8, want.q_fp8, DType::kFloat8E4M3, 1, rope_abs);
    if (s.q_out) {
      // Bitwise: the fp8 q is exactly scaled_fp8_quant of the bf16 q the same run produced.
      Tensor requant = Tensor::empty({s.T, int64_t(s.nq) * 128}, DType::kFloat8E4M3);
      for (int64_t i = 0; i < requant.numel(); ++i)
        requant.ptr<uint8_t>()[i] = float_to_e4m3(b2f(got.q_out.ptr<uint16_t>()[i]) * (1.f / s.q_scale));
      add_row(c, "q_fp8_out=quant(q_out)", got.q_fp8, requant, DType::kFloat8E4M3, 0);
    }
  }
  if (s.insert) {
    const DType code = s.fp8_cache ? DType::kFloat8E4M3 : DType::kBFloat16;
    add_row(c, "cache.K", got.cache.view().narrowed(3, 0, 128), want.cache.view().narrowed(3, 0, 128), code, 1,
            rope_abs);
    add_row(c, "cache.V", got.cache.view().narrowed(3, 128, 128), want.cache.view().narrowed(3, 128, 128), code, 0);
  }
}

}  // namespace

void check_reshape_and_cache(CheckContext& c) {
  check_reshape_and_cache_variant(c, false);
  check_reshape_and_cache_variant(c, true);
}

void check_gemma_rms_norm(CheckContext& c) {
  check_gemma_rms_norm_variant(c, DType::kBFloat16, {9, 6144}, false, false);
  check_gemma_rms_norm_variant(c, DType::kBFloat16, {13, 6, 128}, true, false);
  check_gemma_rms_norm_variant(c, DType::kFloat16, {5, 1000}, false, false);
  check_gemma_rms_norm_variant(c, DType::kBFloat16, {7, 6144}, false, true);
  check_gemma_rms_norm_variant(c, DType::kBFloat16, {3, 300}, false, true);
}

void check_swiglu_oai(CheckContext& c) {
  check_swiglu_variant(c, DType::kBFloat16, 33, 1536);
  check_swiglu_variant(c, DType::kFloat16, 5, 100);
}

void check_dspark_context_kv_write(CheckContext& c) {
  check_writer_variant(c, {false, 5, 4, 128, 64, 513});
  check_writer_variant(c, {true, 5, 4, 128, 64, 513});
  check_writer_variant(c, {false, 1, 1, 16, 16, 7});
  check_writer_variant(c, {true, 2, 2, 64, 32, 65});
}

void check_qknorm_rope_kv_insert(CheckContext& c) {
  check_qk_variant(c, {8, 2, 64, 16, 37, false, false, false, false, 1.f});
  check_qk_variant(c, {64, 4, 64, 64, 29, true, false, true, false, 1.f});
  check_qk_variant(c, {16, 4, 32, 16, 41, true, true, true, true, 0.5f});
  check_qk_variant(c, {8, 1, 16, 128, 9, true, true, false, true, 0.37f});
}

}  // namespace m3rt::detail
