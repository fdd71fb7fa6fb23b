// msa_prefill and MsaDecodePlan: argument validation and dispatch.
#include "m3rt/msa_attention.h"

#include <cmath>

#include "core/dispatch.h"
#include "ops/msa_attention/msa_attention.h"

namespace m3rt {

namespace {

constexpr const char* kOp = "msa_attention";

std::string str(int64_t v) { return std::to_string(v); }

bool group_supported(int hq, int hkv) {
  if (hkv < 1 || hq % hkv != 0) return false;
  const int g = hq / hkv;
  return g == 1 || g == 2 || g == 4 || g == 8 || g == 16;
}

// The checks shared by prefill and decode; fills everything but the lengths.
MsaParams check_and_fill(Device dev, const TensorView& q, const MsaKvCache& c, const TensorView& topk,
                         const TensorView& seq_lens, const TensorView& block_table, float softmax_scale,
                         const MsaMask& mask, const TensorView& out, const TensorView& lse) {
  using namespace detail;
  require_defined(kOp, "q", q);
  require_device(kOp, "q", q, dev);
  require_dtype(kOp, "q", q, {DType::kBFloat16});
  require_shape(kOp, "q", q, {-1, -1, kHeadDim});
  require_last_dim_contiguous(kOp, "q", q);
  const int64_t T = q.shape[0];
  const int hq = int(q.shape[1]);

  require_defined(kOp, "cache.kv_cache", c.kv_cache);
  require_device(kOp, "cache.kv_cache", c.kv_cache, dev);
  const int hkv = c.kv_cache.ndim == 4 ? int(c.kv_cache.shape[1]) : 0;
  const KvCacheGeometry geo = require_kv_cache(kOp, c.kv_cache, c.kv_cache_dtype, hkv, dev);
  if (geo.block_size != kMsaPageSize)
    throw_arg_error(kOp, "kv_cache.shape", c.kv_cache.shape_str(), "MSA layers use block size 128");
  if (!group_supported(hq, hkv))
    throw_arg_error(kOp, "q.shape", q.shape_str(),
                    "query heads per KV head (Hq / Hkv, Hkv = " + str(hkv) + ") must be 1, 2, 4, 8 or 16");
  if (geo.fp8) {
    require_scale(kOp, "cache.k_scale", c.k_scale, dev);
    require_scale(kOp, "cache.v_scale", c.v_scale, dev);
  }

  require_defined(kOp, "topk", topk);
  require_device(kOp, "topk", topk, dev);
  require_dtype(kOp, "topk", topk, {DType::kInt32});
  require_shape(kOp, "topk", topk, {hkv, T, -1});
  if (topk.shape[2] < 1 || topk.shape[2] > kMsaMaxTopk)
    throw_arg_error(kOp, "topk.shape", topk.shape_str(), "topk (dim 2) must lie in 1.." + str(kMsaMaxTopk));

  require_defined(kOp, "seq_lens", seq_lens);
  require_device(kOp, "seq_lens", seq_lens, dev);
  require_dtype(kOp, "seq_lens", seq_lens, {DType::kInt32});
  require_shape(kOp, "seq_lens", seq_lens, {-1});
  require_contiguous(kOp, "seq_lens", seq_lens);
  const int B = int(seq_lens.shape[0]);

  require_defined(kOp, "block_table", block_table);
  require_device(kOp, "block_table", block_table, dev);
  require_dtype(kOp, "block_table", block_table, {DType::kInt32});
  require_shape(kOp, "block_table", block_table, {B, -1});
  require_last_dim_contiguous(kOp, "block_table", block_table);
  if (dev.is_cuda() && block_table.shape[1] > (int64_t(1) << 26))
    throw_arg_error(kOp, "block_table.shape", block_table.shape_str(),
                    "at most 2^26 blocks per request on a GPU (block ids are packed into 64-bit sort keys)");

  if (!(softmax_scale > 0.f) || !std::isfinite(softmax_scale))
    throw_arg_error(kOp, "softmax_scale", std::to_string(softmax_scale), "must be finite and > 0");
  if (mask.window_left < 0)
    throw_arg_error(kOp, "mask.window_left", str(mask.window_left), "must be >= 0 (0: no window)");

  require_defined(kOp, "out", out);
  require_device(kOp, "out", out, dev);
  require_dtype(kOp, "out", out, {DType::kBFloat16});
  require_shape(kOp, "out", out, {T, hq, kHeadDim});
  require_last_dim_contiguous(kOp, "out", out);
  if (lse.defined()) {
    require_device(kOp, "lse", lse, dev);
    require_dtype(kOp, "lse", lse, {DType::kFloat32});
    require_shape(kOp, "lse", lse, {T, hq});
    require_last_dim_contiguous(kOp, "lse", lse);
  }
  if (dev.is_cuda()) {
    if (T > 0 && (q.stride[0] % 8 != 0 || q.stride[1] % 8 != 0))
      throw_arg_error(kOp, "q.strides", q.stride_str(), "token and head strides must be multiples of 8");
    if (T > 0 && (out.stride[0] % 8 != 0 || out.stride[1] % 8 != 0))
      throw_arg_error(kOp, "out.strides", out.stride_str(), "token and head strides must be multiples of 8");
    require_aligned16(kOp, "q", q);
    require_aligned16(kOp, "out", out);
  }

  return msa_call_params(q, c, topk, TensorView{}, seq_lens, block_table, 0, 0, softmax_scale, mask, out, lse);
}

}  // namespace

MsaParams msa_call_params(const TensorView& q, const MsaKvCache& cache, const TensorView& topk,
                          const TensorView& cu_seqlens_q, const TensorView& seq_lens,
                          const TensorView& block_table, int decode_query_len, int max_query_len,
                          float softmax_scale, const MsaMask& mask, const TensorView& out,
                          const TensorView& lse) {
  MsaParams p{};
  p.q = q.ptr<const uint16_t>();
  p.q_stride_t = q.stride[0];
  p.q_stride_h = q.stride[1];
  p.cache = cache.kv_cache.data;
  p.fp8 = kv_cache_is_fp8(cache.kv_cache_dtype);
  p.num_cache_blocks = cache.kv_cache.shape[0];
  if (p.fp8) {
    p.k_scale = cache.k_scale.ptr<const float>();
    p.v_scale = cache.v_scale.ptr<const float>();
  }
  p.topk = topk.ptr<const int32_t>();
  p.topk_stride_h = topk.stride[0];
  p.topk_stride_t = topk.stride[1];
  p.topk_stride_k = topk.stride[2];
  p.topk_k = int(topk.shape[2]);
  p.cu_seqlens_q = cu_seqlens_q.defined() ? cu_seqlens_q.ptr<const int32_t>() : nullptr;
  p.seq_lens = seq_lens.ptr<const int32_t>();
  p.num_seqs = int(seq_lens.shape[0]);
  p.num_tokens = q.shape[0];
  p.decode_query_len = p.cu_seqlens_q ? 0 : decode_query_len;
  p.max_query_len = max_query_len;
  p.block_table = block_table.ptr<const int32_t>();
  p.block_table_stride = p.num_seqs > 1 ? block_table.stride[0] : block_table.shape[1];
  p.max_blocks = int(block_table.shape[1]);
  p.num_heads = int(q.shape[1]);
  p.num_kv_heads = int(cache.kv_cache.shape[1]);
  p.softmax_scale = softmax_scale;
  p.causal = mask.causal;
  p.window_left = mask.window_left;
  if (out.defined()) {
    p.out = out.ptr<uint16_t>();
    p.out_stride_t = out.stride[0];
    p.out_stride_h = out.stride[1];
  }
  if (lse.defined()) {
    p.lse = lse.ptr<float>();
    p.lse_stride_t = lse.stride[0];
  }
  return p;
}

void msa_prefill(const MsaPrefillArgs& a, stream_t stream) {
  using namespace detail;
  const Device dev = a.q.device;
  MsaParams p = check_and_fill(dev, a.q, a.cache, a.topk, a.seq_lens, a.block_table, a.softmax_scale,
                               a.mask, a.out, a.lse);
  require_prefill_batch(kOp, a.cu_seqlens_q, p.num_seqs, p.num_tokens, a.max_query_len, dev);
  if (p.num_tokens == 0) return;
  p.cu_seqlens_q = a.cu_seqlens_q.ptr<const int32_t>();
  p.max_query_len = a.max_query_len;
  p.p16 = !a.p_residue;
  run_on_device(kOp, dev, p, msa_attention_ref, M3RT_LAUNCHER(msa_attention_launch), stream);
}

std::string MsaDecodePlan::validate(const MsaDecodeShape& s) {
  if (s.batch < 0) return "batch = " + str(s.batch) + ": must be >= 0";
  if (s.decode_query_len < 1 || s.decode_query_len > 32)
    return "decode_query_len = " + str(s.decode_query_len) + ": supported 1..32";
  if (!group_supported(s.num_heads, s.num_kv_heads))
    return "num_heads = " + str(s.num_heads) + ", num_kv_heads = " + str(s.num_kv_heads) +
           ": Hq / Hkv must be 1, 2, 4, 8 or 16";
  if (s.topk < 1 || s.topk > kMsaMaxTopk) return "topk = " + str(s.topk) + ": supported 1.." + str(kMsaMaxTopk);
  if (s.max_blocks < 1) return "max_blocks = " + str(s.max_blocks) + ": must be >= 1";
  const KvCacheDtype d = s.kv_cache_dtype;
  if (d != KvCacheDtype::kAuto && d != KvCacheDtype::kBFloat16 && d != KvCacheDtype::kFp8E4M3)
    return std::string("kv_cache_dtype = ") + kv_cache_dtype_name(d) + ": supported auto/bfloat16 or fp8/fp8_e4m3";
  return {};
}

struct MsaDecodePlan::Scratch {
  int splits = 1;         // split decode: the partial slots a pair has
  int mixed_whole = 0;    // msa_decode_mixed's whole pairs (0: the split grid)
  Tensor part_o, part_ml, counters;
};

int msa_decode1_bf16_lean_splits(int64_t pairs, int cap, int sms) {
  if (pairs < 1 || cap < 1 || sms < 1) return 1;
  int s = 1;
  while (2 * s <= cap && pairs * 2 * s <= sms) s *= 2;
  // Clusters of 16 fill a GPC: beyond half the SMs some land two CTAs on an SM (H100, batch 2 =
  // 8 pairs: 16 splits 11.47 us against 8 splits 11.19).
  if (s == 16 && 2 * pairs * s > sms) s = 8;
  return s;
}

MsaDecodePlan::MsaDecodePlan(const MsaDecodeShape& shape, Device device)
    : shape_(shape), device_(device), scratch_(std::make_unique<Scratch>()) {
  if (const std::string why = validate(shape); !why.empty())
    throw Error(std::string(kOp) + ": unsupported MsaDecodeShape: " + why);
  if (!device.is_cuda()) return;
  if (!built_with_cuda()) throw_arg_error(kOp, "device", device.str(), "m3rt was built without CUDA");
#ifdef M3RT_WITH_CUDA
  detail::DeviceGuard guard(device.index);
  const MsaDecodeShape& s = shape;
  const int G = s.num_heads / s.num_kv_heads;
  const bool fp8 = kv_cache_is_fp8(s.kv_cache_dtype);
  const int splits =
      msa_decode_splits(s.batch, s.decode_query_len, s.num_heads, s.num_kv_heads, s.topk, s.max_blocks, fp8);
  const MsaDecodeMixed mixed =
      msa_decode_mixed(s.batch, s.decode_query_len, s.num_kv_heads, s.topk, s.max_blocks, fp8, splits);
  scratch_->mixed_whole = mixed.whole;
  scratch_->splits = mixed.whole > 0 ? mixed.pieces : splits;
  if (scratch_->splits > 1) {
    const int64_t pairs = msa_decode_groups(s.batch, s.decode_query_len, G) * s.num_kv_heads;
    const int64_t rows = msa_group_rows(G, msa_group_tokens(G, s.decode_query_len));
    scratch_->part_o = Tensor::empty({pairs * scratch_->splits * rows, kHeadDim}, DType::kFloat32, device);
    scratch_->part_ml = Tensor::empty({pairs * scratch_->splits * rows, 2}, DType::kFloat32, device);
    scratch_->counters = Tensor::empty({pairs}, DType::kInt32, device);
    scratch_->counters.fill_bytes(0);
  }
#endif
}

MsaDecodePlan::~MsaDecodePlan() = default;

void MsaDecodePlan::run(const MsaDecodeArgs& a, stream_t stream) {
  using namespace detail;
  const Device dev = device_;
  MsaParams p = check_and_fill(dev, a.q, a.cache, a.topk, a.seq_lens, a.block_table, a.softmax_scale,
                               a.mask, a.out, a.lse);
  const MsaDecodeShape& s = shape_;
  auto mismatch = [&](const char* arg, const std::string& value, const std::string& planned) {
    throw_arg_error(kOp, arg, value, "the plan was built for " + planned);
  };
  if (p.num_seqs != s.batch) mismatch("seq_lens.shape", a.seq_lens.shape_str(), "batch " + str(s.batch));
  if (p.num_tokens != int64_t(s.batch) * s.decode_query_len)
    mismatch("q.shape", a.q.shape_str(),
             str(int64_t(s.batch) * s.decode_query_len) + " rows (batch x decode_query_len " +
                 str(s.decode_query_len) + ")");
  if (p.num_heads != s.num_heads || p.num_kv_heads != s.num_kv_heads)
    mismatch("q.shape", a.q.shape_str() + " with Hkv " + str(p.num_kv_heads),
             "Hq " + str(s.num_heads) + ", Hkv " + str(s.num_kv_heads));
  if (p.topk_k != s.topk) mismatch("topk.shape", a.topk.shape_str(), "topk " + str(s.topk));
  if (p.max_blocks != s.max_blocks)
    mismatch("block_table.shape", a.block_table.shape_str(), "max_blocks " + str(s.max_blocks));
  if (p.fp8 != kv_cache_is_fp8(s.kv_cache_dtype))
    mismatch("cache.kv_cache_dtype", kv_cache_dtype_name(a.cache.kv_cache_dtype),
             kv_cache_dtype_name(s.kv_cache_dtype));
  if (p.num_tokens == 0) return;
  p.decode_query_len = s.decode_query_len;
  p.pdl = a.enable_pdl;
  p.p16 = !a.p_residue;
  if (scratch_->splits > 1) {
    p.num_splits = scratch_->splits;
    p.part_o = scratch_->part_o.ptr<float>();
    p.part_ml = scratch_->part_ml.ptr<float>();
    p.counters = scratch_->counters.ptr<int>();
    p.mixed_whole = scratch_->mixed_whole;
  }
  run_on_device(kOp, dev, p, msa_attention_ref, M3RT_LAUNCHER(msa_attention_launch), stream);
}

}  // namespace m3rt
