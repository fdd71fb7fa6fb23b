// DsparkContextKvWriter: validation (the seed-000 rules), offset tables, dispatch.
#include <sstream>

#include "core/dispatch.h"
#include "m3rt/ops.h"
#include "ops/dspark_context_kv/dspark_context_kv.h"


namespace m3rt {

namespace {
constexpr const char* kOp = "dspark_context_kv_write";

std::string layer_prefix(size_t i) { return "layer " + std::to_string(i) + ": "; }
}  // namespace

bool dspark_rotary_dim_supported(int rotary_dim, int head_dim) {
  return head_dim == kHeadDim && (rotary_dim == 16 || rotary_dim == 32 || rotary_dim == 64);
}

std::optional<std::string> DsparkContextKvWriter::validate(
    const std::vector<DsparkDraftLayerKv>& layers) {
  if (layers.empty()) return "no layers";
  if (layers.size() > size_t(kMaxLayers)) {
    return std::to_string(layers.size()) + " layers; at most " + std::to_string(kMaxLayers);
  }
  const TensorView& c0 = layers[0].kv_cache;
  for (size_t i = 0; i < layers.size(); ++i) {
    const DsparkDraftLayerKv& a = layers[i];
    const std::string at = layer_prefix(i);
    const KvCacheDtype kd = a.kv_cache_dtype;
    if (kd != KvCacheDtype::kAuto && kd != KvCacheDtype::kBFloat16 && kd != KvCacheDtype::kFp8E4M3)
      return at + "kv_cache_dtype '" + kv_cache_dtype_name(kd) + "' (supported: auto, bfloat16, fp8_e4m3)";
    const TensorView& cache = a.kv_cache;
    if (!cache.defined() || cache.data == nullptr || cache.numel() == 0)
      return at + "KV cache not bound";
    if (cache.ndim != 4 || cache.shape[3] != 2 * kHeadDim)
      return at + "unexpected cache shape " + cache.shape_str() + " (expected [num_blocks, nkv, block_size, 256])";
    const int64_t bs = cache.shape[2];
    if (bs & (bs - 1)) return at + "block size " + std::to_string(bs) + " is not a power of two";
    if (!cache.is_contiguous()) return at + "cache is not contiguous (strides " + cache.stride_str() + ")";
    if (kv_cache_is_fp8(kd)) {
      if (cache.dtype != DType::kUInt8)
        return at + "fp8 cache has dtype " + dtype_name(cache.dtype) + " (expected uint8 storage)";
    } else if (cache.dtype != DType::kBFloat16) {
      return at + "cache has dtype " + dtype_name(cache.dtype) + " (expected bfloat16)";
    }
    const std::pair<const char*, const TensorView*> scales[] = {{"k_scale", &a.k_scale},
                                                                {"v_scale", &a.v_scale}};
    for (const auto& [name, s] : scales) {
      if (!s->defined() || s->data == nullptr || s->dtype != DType::kFloat32 || s->numel() != 1 ||
          !(s->device == cache.device))
        return at + name + " is not a one-element fp32 tensor on the cache's device (" +
               cache.device.str() + "): " + s->describe();
    }
    if (i == 0) {
      if (reinterpret_cast<uintptr_t>(cache.data) % 16 != 0)
        return at + "cache data is not 16-byte aligned";
      continue;
    }
    if (!(cache.device == c0.device) || cache.dtype != c0.dtype || kd != layers[0].kv_cache_dtype ||
        cache.sizes() != c0.sizes() ||
        std::vector<int64_t>(cache.stride, cache.stride + 4) != std::vector<int64_t>(c0.stride, c0.stride + 4))
      return at + "layers do not share cache shape/stride/dtype/device (" + cache.describe() +
             " vs layer 0 " + c0.describe() + ")";
    // Caches are addressed from layer 0's as 16-element aligned offsets.
    const intptr_t delta = static_cast<const char*>(cache.data) - static_cast<const char*>(c0.data);
    if (delta % (16 * dtype_size(cache.dtype)) != 0)
      return at + "layer caches are not 16-element aligned to each other";
  }
  return std::nullopt;
}

DsparkContextKvWriter::DsparkContextKvWriter(std::vector<DsparkDraftLayerKv> layers) {
  rebind(std::move(layers));
}

void DsparkContextKvWriter::rebind(std::vector<DsparkDraftLayerKv> layers) {
  if (auto err = validate(layers)) throw Error("unsupported DSpark context-KV layout: " + *err);
  layers_ = std::move(layers);
}

void DsparkContextKvWriter::ensure_tables() {
  std::vector<const void*> key;
  key.reserve(layers_.size() * 3);
  for (const auto& a : layers_) {
    key.push_back(a.kv_cache.data);
    key.push_back(a.k_scale.data);
    key.push_back(a.v_scale.data);
  }
  if (key == table_key_) return;
  const int L = num_layers();
  const char* c0 = static_cast<const char*>(layers_[0].kv_cache.data);
  const char* s0 = static_cast<const char*>(layers_[0].k_scale.data);
  const int64_t elem = dtype_size(layers_[0].kv_cache.dtype);
  Tables t{};
  for (int l = 0; l < L; ++l) {
    t.cache_offsets[l] = (static_cast<const char*>(layers_[l].kv_cache.data) - c0) / elem;
    const intptr_t dk = static_cast<const char*>(layers_[l].k_scale.data) - s0;
    const intptr_t dv = static_cast<const char*>(layers_[l].v_scale.data) - s0;
    if (dk % 4 != 0 || dv % 4 != 0)
      throw Error("unsupported DSpark context-KV layout: " + layer_prefix(l) +
                  "scales are not 4-byte aligned to layer 0's k_scale");
    t.scale_offsets[l] = dk / 4;
    t.scale_offsets[L + l] = dv / 4;
  }
  tables_ = t;
  table_key_ = std::move(key);
  ++table_builds_;
}

void DsparkContextKvWriter::operator()(const DsparkContextKvArgs& a, stream_t stream) {
  using namespace detail;
  const TensorView& cache0 = layers_[0].kv_cache;
  const Device dev = cache0.device;
  const int L = num_layers(), nkv = num_kv_heads();
  require_defined(kOp, "all_kv", a.all_kv);
  require_dtype(kOp, "all_kv", a.all_kv, {DType::kBFloat16});
  require_shape(kOp, "all_kv", a.all_kv, {-1, L, 2, nkv, kHeadDim});
  // Dims 1.. contiguous; the token stride may be larger (a row-padded GEMM output).
  const TensorView& kv = a.all_kv;
  if (kv.stride[4] != 1 || kv.stride[3] != kHeadDim || kv.stride[2] != int64_t(nkv) * kHeadDim ||
      kv.stride[1] != 2 * int64_t(nkv) * kHeadDim ||
      (kv.shape[0] > 1 && (kv.stride[0] < 2 * int64_t(L) * nkv * kHeadDim || kv.stride[0] % 8 != 0)))
    throw_arg_error(kOp, "all_kv.strides", kv.stride_str(),
                    "dims 1.. must be contiguous and the token stride a multiple of 8 covering a row");
  const int64_t num_ctx = kv.shape[0];
  require_device(kOp, "all_kv", kv, dev);
  require_defined(kOp, "k_norm_weight", a.k_norm_weight);
  require_dtype(kOp, "k_norm_weight", a.k_norm_weight, {DType::kBFloat16});
  require_shape(kOp, "k_norm_weight", a.k_norm_weight, {L, kHeadDim});
  require_contiguous(kOp, "k_norm_weight", a.k_norm_weight);
  require_device(kOp, "k_norm_weight", a.k_norm_weight, dev);
  require_rope_table(kOp, a.cos_sin_cache, a.rotary_dim, dev);
  require_index_vector(kOp, "positions", a.positions, num_ctx, dev);
  require_index_vector(kOp, "slot_mapping", a.slot_mapping, num_ctx, dev);
  if (!(a.eps >= 0.f)) throw_arg_error(kOp, "eps", std::to_string(a.eps), "must be >= 0");
  unsigned* const claims = claim_counters_arg(kOp, a.claim_counters, dev);
  if (num_ctx == 0) return;
  if (dev.is_cuda()) {
    require_aligned16(kOp, "all_kv", kv);
    require_aligned16(kOp, "k_norm_weight", a.k_norm_weight);
  }
  ensure_tables();

  DsparkContextKvParams p{};
  p.all_kv = kv.ptr<const uint16_t>();
  p.stride_all_kv_t = num_ctx > 1 ? kv.stride[0] : 2 * int64_t(L) * nkv * kHeadDim;
  p.k_norm_weight = a.k_norm_weight.ptr<const uint16_t>();
  p.cos_sin = a.cos_sin_cache.ptr<const uint16_t>();
  p.positions = a.positions.ptr<const int64_t>();
  p.slots = a.slot_mapping.ptr<const int64_t>();
  p.cache0 = cache0.data;
  p.scale0 = layers_[0].k_scale.ptr<const float>();
  p.tables = tables_;
  p.num_ctx = num_ctx;
  p.num_layers = L;
  p.num_kv_heads = nkv;
  p.block_size_log2 = log2_pow2(cache0.shape[2]);
  p.num_slots = cache0.shape[0] * cache0.shape[2];
  p.max_pos = a.cos_sin_cache.shape[0];
  p.stride_cache_block = cache0.stride[0];
  p.stride_cache_head = cache0.stride[1];
  p.eps = a.eps;
  p.rotary_dim = a.rotary_dim;
  p.fp8 = kv_cache_is_fp8(kv_cache_dtype());
  p.pdl = a.enable_pdl;
  p.claims = claims;
  run_on_device(kOp, dev, p, dspark_context_kv_ref, M3RT_LAUNCHER(dspark_context_kv_launch), stream);
}

}  // namespace m3rt
