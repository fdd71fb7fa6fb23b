// reshape_and_cache: validation and dispatch.
#include "core/dispatch.h"
#include "m3rt/ops.h"
#include "ops/reshape_and_cache/reshape_and_cache.h"


namespace m3rt {

void reshape_and_cache(const TensorView& key, const TensorView& value, const TensorView& kv_cache,
                       const TensorView& slot_mapping, KvCacheDtype kv_cache_dtype,
                       const TensorView& k_scale, const TensorView& v_scale, stream_t stream) {
  using namespace detail;
  constexpr const char* kOp = "reshape_and_cache";
  require_defined(kOp, "kv_cache", kv_cache);
  const Device dev = kv_cache.device;
  const int nkv = kv_cache.ndim == 4 ? int(kv_cache.shape[1]) : -1;
  const KvCacheGeometry g = require_kv_cache(kOp, kv_cache, kv_cache_dtype, nkv, dev);
  for (const auto& [name, v] : {std::pair{"key", &key}, std::pair{"value", &value}}) {
    require_defined(kOp, name, *v);
    require_dtype(kOp, name, *v, {DType::kBFloat16});
    require_shape(kOp, name, *v, {-1, nkv, kHeadDim});
    require_last_dim_contiguous(kOp, name, *v);
    require_device(kOp, name, *v, dev);
    if (v->stride[0] % 8 != 0 || v->stride[1] % 8 != 0)
      throw_arg_error(kOp, std::string(name) + ".strides", v->stride_str(),
                      "token and head strides must be multiples of 8 elements");
    if (dev.is_cuda()) require_aligned16(kOp, name, *v);
  }
  if (value.shape[0] != key.shape[0])
    throw_arg_error(kOp, "value.shape", value.shape_str(), "must match key.shape " + key.shape_str());
  const int64_t T = key.shape[0];
  require_index_vector(kOp, "slot_mapping", slot_mapping, T, dev);
  if (g.fp8) {
    require_scale(kOp, "k_scale", k_scale, dev);
    require_scale(kOp, "v_scale", v_scale, dev);
  }
  if (T == 0) return;
  ReshapeAndCacheParams p{};
  p.key = key.ptr<const uint16_t>();
  p.value = value.ptr<const uint16_t>();
  p.stride_key_t = key.stride[0];
  p.stride_key_h = key.stride[1];
  p.stride_value_t = value.stride[0];
  p.stride_value_h = value.stride[1];
  p.slots = slot_mapping.ptr<const int64_t>();
  p.cache = kv_cache.data;
  p.num_tokens = T;
  p.num_kv_heads = nkv;
  p.block_size_log2 = g.block_size_log2;
  p.num_slots = g.num_blocks * g.block_size;
  p.stride_cache_block = kv_cache.stride[0];
  p.stride_cache_head = kv_cache.stride[1];
  p.fp8 = g.fp8;
  p.k_scale = g.fp8 ? k_scale.ptr<const float>() : nullptr;
  p.v_scale = g.fp8 ? v_scale.ptr<const float>() : nullptr;
  run_on_device(kOp, dev, p, reshape_and_cache_ref, M3RT_LAUNCHER(reshape_and_cache_launch), stream);
}

}  // namespace m3rt
