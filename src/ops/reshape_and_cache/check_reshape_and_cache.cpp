// The `m3rt check` rows of reshape_and_cache: K/V rows stored into a paged cache (bf16 or fp8).
// Shared helpers and the method (poisoned outputs; CPU reference on a GPU, fp64 oracle on the
// CPU): src/check/check_helpers.h.
#include <string>
#include <utility>

#include "check/check_helpers.h"
#include "check/check_util.h"
#include "m3rt/ops.h"

namespace m3rt::detail {

namespace {

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

}  // namespace

void check_reshape_and_cache(CheckContext& c) {
  check_reshape_and_cache_variant(c, false);
  check_reshape_and_cache_variant(c, true);
}

}  // namespace m3rt::detail
