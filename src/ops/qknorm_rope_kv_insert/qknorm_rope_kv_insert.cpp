// qknorm_rope_kv_insert: validation and dispatch.
#include "core/dispatch.h"
#include "m3rt/ops.h"
#include "ops/qknorm_rope_kv_insert/qknorm_rope_kv_insert.h"


namespace m3rt {

namespace {
constexpr int kMaxIndexHeads = 16;
constexpr int64_t kIndexBlockSize = 128;  // the index cache is [num_blocks, 128, 128]
}  // namespace

void qknorm_rope_kv_insert(const QknormRopeKvInsertArgs& a, stream_t stream) {
  using namespace detail;
  constexpr const char* kOp = "qknorm_rope_kv_insert";
  require_defined(kOp, "qkv", a.qkv);
  const Device dev = a.qkv.device;
  if (a.num_heads < 1) throw_arg_error(kOp, "num_heads", std::to_string(a.num_heads), "must be >= 1");
  if (a.num_kv_heads < 1)
    throw_arg_error(kOp, "num_kv_heads", std::to_string(a.num_kv_heads), "must be >= 1");
  const int nidx = a.num_index_heads;
  if (nidx < 0 || nidx > kMaxIndexHeads) {
    throw_arg_error(kOp, "num_index_heads", std::to_string(nidx),
                    "supported: 0 (dense row) or 1.." + std::to_string(kMaxIndexHeads) + " (sparse row)");
  }
  // A sparse row appends Hidx index_q heads and one index_k head.
  const int64_t width = int64_t(a.num_heads + 2 * a.num_kv_heads + (nidx > 0 ? nidx + 1 : 0)) * kHeadDim;
  require_dtype(kOp, "qkv", a.qkv, {DType::kBFloat16});
  require_shape(kOp, "qkv", a.qkv, {-1, width});
  require_last_dim_contiguous(kOp, "qkv", a.qkv);
  const int64_t T = a.qkv.shape[0];
  if (T > 1 && a.qkv.stride[0] % 8 != 0)
    throw_arg_error(kOp, "qkv.strides", a.qkv.stride_str(), "the row stride must be a multiple of 8");
  for (const auto& [name, w] : {std::pair{"q_norm_weight", &a.q_norm_weight},
                                std::pair{"k_norm_weight", &a.k_norm_weight}}) {
    require_defined(kOp, name, *w);
    require_dtype(kOp, name, *w, {DType::kBFloat16});
    require_shape(kOp, name, *w, {kHeadDim});
    require_contiguous(kOp, name, *w);
    require_device(kOp, name, *w, dev);
  }
  require_rope_table(kOp, a.cos_sin_cache, a.rotary_dim, dev);
  require_index_vector(kOp, "positions", a.positions, T, dev);
  if (!(a.eps >= 0.f)) throw_arg_error(kOp, "eps", std::to_string(a.eps), "must be >= 0");
  const int64_t q_width = int64_t(a.num_heads) * kHeadDim;
  if (a.q_out.defined()) {
    require_dtype(kOp, "q_out", a.q_out, {DType::kBFloat16});
    require_shape(kOp, "q_out", a.q_out, {T, q_width});
    require_contiguous(kOp, "q_out", a.q_out);
    require_device(kOp, "q_out", a.q_out, dev);
  }
  if (a.q_fp8_out.defined()) {
    require_dtype(kOp, "q_fp8_out", a.q_fp8_out, {DType::kFloat8E4M3, DType::kUInt8});
    require_shape(kOp, "q_fp8_out", a.q_fp8_out, {T, q_width});
    require_contiguous(kOp, "q_fp8_out", a.q_fp8_out);
    require_device(kOp, "q_fp8_out", a.q_fp8_out, dev);
    if (!(a.q_fp8_scale > 0.f) || !std::isfinite(a.q_fp8_scale))
      throw_arg_error(kOp, "q_fp8_scale", std::to_string(a.q_fp8_scale), "must be finite and > 0");
  }
  const bool insert = a.kv_cache.defined();
  KvCacheGeometry g;
  if (insert) {
    g = require_kv_cache(kOp, a.kv_cache, a.kv_cache_dtype, a.num_kv_heads, dev);
    require_index_vector(kOp, "slot_mapping", a.slot_mapping, T, dev);
    if (g.fp8) {
      require_scale(kOp, "k_scale", a.k_scale, dev);
      require_scale(kOp, "v_scale", a.v_scale, dev);
    }
  } else if (a.slot_mapping.defined()) {
    throw_arg_error(kOp, "slot_mapping", a.slot_mapping.describe(),
                    "given without kv_cache; pass both to insert, or neither");
  }
  const bool sparse = nidx > 0;
  bool index_fp8 = false;
  if (sparse) {
    for (const auto& [name, w] : {std::pair{"index_q_norm_weight", &a.index_q_norm_weight},
                                  std::pair{"index_k_norm_weight", &a.index_k_norm_weight}}) {
      require_defined(kOp, name, *w);
      require_dtype(kOp, name, *w, {DType::kBFloat16});
      require_shape(kOp, name, *w, {kHeadDim});
      require_contiguous(kOp, name, *w);
      require_device(kOp, name, *w, dev);
    }
    if (a.index_cache_dtype != KvCacheDtype::kAuto && a.index_cache_dtype != KvCacheDtype::kBFloat16 &&
        a.index_cache_dtype != KvCacheDtype::kFp8E4M3) {
      throw_arg_error(kOp, "index_cache_dtype", kv_cache_dtype_name(a.index_cache_dtype),
                      "supported: auto/bfloat16 or fp8/fp8_e4m3");
    }
    index_fp8 = kv_cache_is_fp8(a.index_cache_dtype);
    require_defined(kOp, "index_cache", a.index_cache);
    require_dtype(kOp, "index_cache", a.index_cache, {index_fp8 ? DType::kUInt8 : DType::kBFloat16});
    require_shape(kOp, "index_cache", a.index_cache, {-1, -1, kHeadDim});
    if (a.index_cache.shape[1] != kIndexBlockSize) {
      throw_arg_error(kOp, "index_cache.shape", a.index_cache.shape_str(),
                      "block size (dim 1) must be 128 (the index cache is [num_blocks, 128, 128])");
    }
    require_contiguous(kOp, "index_cache", a.index_cache);
    require_device(kOp, "index_cache", a.index_cache, dev);
    require_index_vector(kOp, "index_slot_mapping", a.index_slot_mapping, T, dev);
    require_defined(kOp, "index_q_out", a.index_q_out);
    if (index_fp8) {
      require_dtype(kOp, "index_q_out", a.index_q_out, {DType::kFloat8E4M3, DType::kUInt8});
    } else {
      require_dtype(kOp, "index_q_out", a.index_q_out, {DType::kBFloat16});
    }
    require_shape(kOp, "index_q_out", a.index_q_out, {T, int64_t(nidx) * kHeadDim});
    require_contiguous(kOp, "index_q_out", a.index_q_out);
    require_device(kOp, "index_q_out", a.index_q_out, dev);
  } else {
    for (const auto& [name, v] : {std::pair{"index_q_norm_weight", &a.index_q_norm_weight},
                                  std::pair{"index_k_norm_weight", &a.index_k_norm_weight},
                                  std::pair{"index_q_out", &a.index_q_out},
                                  std::pair{"index_slot_mapping", &a.index_slot_mapping},
                                  std::pair{"index_cache", &a.index_cache}}) {
      if (v->defined())
        throw_arg_error(kOp, name, v->describe(), "given without num_index_heads > 0 (a dense row)");
    }
  }
  unsigned* const claims = claim_counters_arg(kOp, a.claim_counters, dev);
  if (T == 0) return;
  if (dev.is_cuda()) {
    require_aligned16(kOp, "qkv", a.qkv);
    if (a.q_out.defined()) require_aligned16(kOp, "q_out", a.q_out);
    if (a.q_fp8_out.defined() && reinterpret_cast<uintptr_t>(a.q_fp8_out.data) % 8 != 0)
      throw_arg_error(kOp, "q_fp8_out.data", "unaligned", "must be 8-byte aligned");
    if (sparse) {
      require_aligned16(kOp, "index_cache", a.index_cache);
      if (!index_fp8) {
        require_aligned16(kOp, "index_q_out", a.index_q_out);
      } else if (reinterpret_cast<uintptr_t>(a.index_q_out.data) % 8 != 0) {
        throw_arg_error(kOp, "index_q_out.data", "unaligned", "must be 8-byte aligned");
      }
    }
  }

  QknormRopeKvInsertParams p{};
  p.qkv = a.qkv.ptr<uint16_t>();
  p.stride_qkv_t = T > 1 ? a.qkv.stride[0] : width;
  p.q_norm_weight = a.q_norm_weight.ptr<const uint16_t>();
  p.k_norm_weight = a.k_norm_weight.ptr<const uint16_t>();
  p.cos_sin = a.cos_sin_cache.ptr<const uint16_t>();
  p.positions = a.positions.ptr<const int64_t>();
  p.num_tokens = T;
  p.num_heads = a.num_heads;
  p.num_kv_heads = a.num_kv_heads;
  p.rotary_dim = a.rotary_dim;
  p.max_pos = a.cos_sin_cache.shape[0];
  p.eps = a.eps;
  p.q_out = a.q_out.defined() ? a.q_out.ptr<uint16_t>() : nullptr;
  p.q_fp8_out = a.q_fp8_out.defined() ? a.q_fp8_out.ptr<uint8_t>() : nullptr;
  p.q_fp8_inv_scale = 1.f / a.q_fp8_scale;
  p.q_in_place = p.q_out == nullptr && p.q_fp8_out == nullptr;
  p.insert = !insert ? QkvInsertMode::kNone : g.fp8 ? QkvInsertMode::kFp8 : QkvInsertMode::kBFloat16;
  if (insert) {
    p.slots = a.slot_mapping.ptr<const int64_t>();
    p.cache = a.kv_cache.data;
    p.num_slots = g.num_blocks * g.block_size;
    p.block_size_log2 = g.block_size_log2;
    p.stride_cache_block = a.kv_cache.stride[0];
    p.stride_cache_head = a.kv_cache.stride[1];
    if (g.fp8) {
      p.k_scale = a.k_scale.ptr<const float>();
      p.v_scale = a.v_scale.ptr<const float>();
    }
  }
  p.pdl = a.enable_pdl;
  p.claims = claims;
  p.num_index_heads = nidx;
  if (sparse) {
    p.index_q_norm_weight = a.index_q_norm_weight.ptr<const uint16_t>();
    p.index_k_norm_weight = a.index_k_norm_weight.ptr<const uint16_t>();
    p.index_q_out = a.index_q_out.data;
    p.index_slots = a.index_slot_mapping.ptr<const int64_t>();
    p.index_cache = a.index_cache.data;
    p.index_num_slots = a.index_cache.shape[0] * kIndexBlockSize;
    p.index_fp8 = index_fp8;
  }
  run_on_device(kOp, dev, p, qknorm_rope_kv_insert_ref, M3RT_LAUNCHER(qknorm_rope_kv_insert_launch), stream);
}

}  // namespace m3rt
