#include "core/validate.h"

#include <sstream>

namespace m3rt::detail {

namespace {
std::string dtype_list(std::initializer_list<DType> allowed) {
  std::string s;
  for (DType d : allowed) s += std::string(s.empty() ? "" : " or ") + dtype_name(d);
  return s;
}
}  // namespace

void require_defined(const char* op, const char* name, const TensorView& v) {
  if (!v.defined() || v.data == nullptr) {
    if (v.numel() == 0 && v.ndim > 0) return;  // an empty tensor may have no storage
    throw_arg_error(op, name, "(none)", "is required");
  }
}

void require_dtype(const char* op, const char* name, const TensorView& v,
                   std::initializer_list<DType> allowed) {
  for (DType d : allowed)
    if (v.dtype == d) return;
  throw_arg_error(op, std::string(name) + ".dtype", dtype_name(v.dtype),
                  "supported: " + dtype_list(allowed));
}

void require_shape(const char* op, const char* name, const TensorView& v,
                   std::initializer_list<int64_t> expected) {
  bool ok = v.ndim == int(expected.size());
  int d = 0;
  for (int64_t e : expected) {
    if (ok && e >= 0 && v.shape[d] != e) ok = false;
    ++d;
  }
  if (ok) return;
  // The message only on failure: building it costs more host time than the launch it guards.
  std::string want = "expected [";
  d = 0;
  for (int64_t e : expected) want += (d++ ? ", " : "") + (e < 0 ? std::string("*") : std::to_string(e));
  throw_arg_error(op, std::string(name) + ".shape", v.shape_str(), want + "]");
}

void require_contiguous(const char* op, const char* name, const TensorView& v) {
  if (!v.is_contiguous()) {
    throw_arg_error(op, std::string(name) + ".strides", v.stride_str(),
                    "must be contiguous for shape " + v.shape_str());
  }
}

void require_last_dim_contiguous(const char* op, const char* name, const TensorView& v) {
  if (v.ndim > 0 && v.shape[v.ndim - 1] > 1 && v.stride[v.ndim - 1] != 1) {
    throw_arg_error(op, std::string(name) + ".strides", v.stride_str(),
                    "the last dim must be contiguous (stride 1)");
  }
}

void require_device(const char* op, const char* name, const TensorView& v, Device device) {
  if (!(v.device == device)) {
    throw_arg_error(op, std::string(name) + ".device", v.device.str(),
                    "must be on " + device.str() + " with the op's other tensors");
  }
}

unsigned* claim_counters_arg(const char* op, const TensorView& v, Device device) {
  if (!v.defined()) return nullptr;
  require_dtype(op, "claim_counters", v, {DType::kInt32});
  require_contiguous(op, "claim_counters", v);
  require_device(op, "claim_counters", v, device);
  if (v.numel() < kClaimCounterInts) {
    throw_arg_error(op, "claim_counters", v.describe(),
                    "must hold at least kClaimCounterInts = " + std::to_string(kClaimCounterInts) + " int32");
  }
  return v.ptr<unsigned>();
}

void require_scale(const char* op, const char* name, const TensorView& v, Device device) {
  require_defined(op, name, v);
  require_dtype(op, name, v, {DType::kFloat32});
  if (v.numel() != 1) {
    throw_arg_error(op, std::string(name) + ".shape", v.shape_str(), "expected one fp32 value");
  }
  require_device(op, name, v, device);
}

void require_index_vector(const char* op, const char* name, const TensorView& v, int64_t n,
                          Device device) {
  require_defined(op, name, v);
  require_dtype(op, name, v, {DType::kInt64});
  require_shape(op, name, v, {n});
  require_contiguous(op, name, v);
  require_device(op, name, v, device);
}

void require_prefill_batch(const char* op, const TensorView& cu_seqlens_q, int num_seqs,
                           int64_t num_tokens, int max_query_len, Device device) {
  require_defined(op, "cu_seqlens_q", cu_seqlens_q);
  require_device(op, "cu_seqlens_q", cu_seqlens_q, device);
  require_dtype(op, "cu_seqlens_q", cu_seqlens_q, {DType::kInt32});
  require_shape(op, "cu_seqlens_q", cu_seqlens_q, {int64_t(num_seqs) + 1});
  require_contiguous(op, "cu_seqlens_q", cu_seqlens_q);
  if (max_query_len < 0 || max_query_len > num_tokens)
    throw_arg_error(op, "max_query_len", std::to_string(max_query_len),
                    "must lie in [0, T = " + std::to_string(num_tokens) + "]");
  if (num_seqs == 0 && num_tokens > 0)
    throw_arg_error(op, "seq_lens.shape", "[0]",
                    "no requests for " + std::to_string(num_tokens) + " query tokens");
}

void require_rope_table(const char* op, const TensorView& cos_sin_cache, int rotary_dim,
                        Device device) {
  if (rotary_dim != 16 && rotary_dim != 32 && rotary_dim != 64) {
    throw_arg_error(op, "rotary_dim", std::to_string(rotary_dim),
                    "supported: 16, 32 or 64 of a 128-dim head");
  }
  require_defined(op, "cos_sin_cache", cos_sin_cache);
  require_dtype(op, "cos_sin_cache", cos_sin_cache, {DType::kBFloat16});
  require_shape(op, "cos_sin_cache", cos_sin_cache, {-1, rotary_dim});
  if (cos_sin_cache.shape[0] < 1) {
    throw_arg_error(op, "cos_sin_cache.shape", cos_sin_cache.shape_str(), "needs max_pos >= 1");
  }
  require_contiguous(op, "cos_sin_cache", cos_sin_cache);
  require_device(op, "cos_sin_cache", cos_sin_cache, device);
}

void require_aligned16(const char* op, const char* name, const TensorView& v) {
  if (reinterpret_cast<uintptr_t>(v.data) % 16 != 0) {
    std::ostringstream os;
    os << v.data;
    throw_arg_error(op, std::string(name) + ".data", os.str(), "must be 16-byte aligned");
  }
}

void require_below_2_31(const char* op, const char* what, int64_t value) {
  if (value < 0 || value >= (int64_t(1) << 31))
    throw_arg_error(op, what, std::to_string(value), "supported: [0, 2^31) (the kernel indexes it in 32 bits)");
}

void require_filter_matches(const char* op, const std::string& filter, const std::vector<std::string>& names) {
  std::string list;
  for (const std::string& n : names) {
    if (n.find(filter) != std::string::npos) return;
    list += (list.empty() ? "" : ", ") + n;
  }
  throw_arg_error(op, "--filter", "'" + filter + "'", "matches no op; supported: a part of one of " + list);
}

KvCacheGeometry require_kv_cache(const char* op, const TensorView& kv_cache,
                                 KvCacheDtype kv_cache_dtype, int num_kv_heads, Device device) {
  require_defined(op, "kv_cache", kv_cache);
  if (kv_cache_dtype != KvCacheDtype::kAuto && kv_cache_dtype != KvCacheDtype::kBFloat16 &&
      kv_cache_dtype != KvCacheDtype::kFp8E4M3) {
    throw_arg_error(op, "kv_cache_dtype", kv_cache_dtype_name(kv_cache_dtype),
                    "supported: auto/bfloat16 or fp8/fp8_e4m3");
  }
  KvCacheGeometry g;
  g.fp8 = kv_cache_is_fp8(kv_cache_dtype);
  require_dtype(op, "kv_cache", kv_cache, {g.fp8 ? DType::kUInt8 : DType::kBFloat16});
  require_shape(op, "kv_cache", kv_cache, {-1, num_kv_heads, -1, 2 * kHeadDim});
  require_contiguous(op, "kv_cache", kv_cache);
  require_device(op, "kv_cache", kv_cache, device);
  require_aligned16(op, "kv_cache", kv_cache);
  g.num_blocks = kv_cache.shape[0];
  g.num_kv_heads = int(kv_cache.shape[1]);
  const int64_t bs = kv_cache.shape[2];
  if (bs <= 0 || (bs & (bs - 1)) != 0) {
    throw_arg_error(op, "kv_cache.shape", kv_cache.shape_str(),
                    "block size (dim 2) must be a power of two");
  }
  g.block_size = int(bs);
  g.block_size_log2 = log2_pow2(bs);
  return g;
}

}  // namespace m3rt::detail
