// LightningIndexer: configuration and argument validation, GPU scratch, dispatch.
#include "m3rt/lightning_indexer.h"

#include "core/dispatch.h"
#include "ops/lightning_indexer/lightning_indexer.h"

namespace m3rt {

namespace {

constexpr const char* kOp = "lightning_indexer";

std::string str(int64_t v) { return std::to_string(v); }

// Shapes shared by prefill and decode, checked against the indexer's configuration.
struct CallShape {
  int64_t num_tokens = 0;
  int num_seqs = 0;
  int max_blocks = 0;
};

CallShape check_common(const IndexerConfig& cfg, Device dev, const TensorView& index_q,
                       const TensorView& index_cache, const TensorView& seq_lens,
                       const TensorView& block_table, const TensorView& topk_out) {
  using namespace detail;
  const bool fp8 = kv_cache_is_fp8(cfg.index_cache_dtype);
  const int H = cfg.num_index_heads;
  CallShape s;
  require_defined(kOp, "index_q", index_q);
  require_device(kOp, "index_q", index_q, dev);
  if (fp8)
    require_dtype(kOp, "index_q", index_q, {DType::kFloat8E4M3, DType::kUInt8});
  else
    require_dtype(kOp, "index_q", index_q, {DType::kBFloat16});
  require_shape(kOp, "index_q", index_q, {-1, H, kHeadDim});
  require_contiguous(kOp, "index_q", index_q);
  s.num_tokens = index_q.shape[0];

  require_defined(kOp, "index_cache", index_cache);
  require_device(kOp, "index_cache", index_cache, dev);
  require_dtype(kOp, "index_cache", index_cache, {fp8 ? DType::kUInt8 : DType::kBFloat16});
  require_shape(kOp, "index_cache", index_cache, {-1, kIndexBlockSize, kHeadDim});
  require_contiguous(kOp, "index_cache", index_cache);

  require_defined(kOp, "seq_lens", seq_lens);
  require_device(kOp, "seq_lens", seq_lens, dev);
  require_dtype(kOp, "seq_lens", seq_lens, {DType::kInt32});
  require_shape(kOp, "seq_lens", seq_lens, {-1});
  require_contiguous(kOp, "seq_lens", seq_lens);
  s.num_seqs = int(seq_lens.shape[0]);

  require_defined(kOp, "block_table", block_table);
  require_device(kOp, "block_table", block_table, dev);
  require_dtype(kOp, "block_table", block_table, {DType::kInt32});
  require_shape(kOp, "block_table", block_table, {s.num_seqs, -1});
  require_last_dim_contiguous(kOp, "block_table", block_table);
  if (block_table.shape[1] > cfg.max_blocks_per_seq)
    throw_arg_error(kOp, "block_table.shape", block_table.shape_str(),
                    "at most max_blocks_per_seq = " + str(cfg.max_blocks_per_seq) +
                        " blocks per request (IndexerConfig)");
  s.max_blocks = int(block_table.shape[1]);

  require_defined(kOp, "topk_out", topk_out);
  require_device(kOp, "topk_out", topk_out, dev);
  require_dtype(kOp, "topk_out", topk_out, {DType::kInt32});
  require_shape(kOp, "topk_out", topk_out, {-1, H, cfg.select.topk});
  if (topk_out.shape[0] < s.num_tokens)
    throw_arg_error(kOp, "topk_out.shape", topk_out.shape_str(),
                    "needs at least " + str(s.num_tokens) + " rows (one per index_q token)");
  if (s.num_tokens > 1 && topk_out.stride[0] < int64_t(H) * cfg.select.topk)
    throw_arg_error(kOp, "topk_out.strides", topk_out.stride_str(),
                    "rows must not overlap (row stride >= Hidx * topk)");
  if ((topk_out.shape[2] > 1 && topk_out.stride[2] != 1) ||
      (H > 1 && topk_out.stride[1] != cfg.select.topk))
    throw_arg_error(kOp, "topk_out.strides", topk_out.stride_str(),
                    "the last two dims must be contiguous");
  if (dev.is_cuda()) {
    require_aligned16(kOp, "index_q", index_q);
    require_aligned16(kOp, "index_cache", index_cache);
  }
  return s;
}

}  // namespace

IndexerParams indexer_call_params(const IndexerConfig& cfg, const TensorView& index_q,
                                  const TensorView& index_cache, const TensorView& seq_lens,
                                  const TensorView& block_table, const TensorView& topk_out,
                                  const TensorView& cu_seqlens_q, int decode_query_len,
                                  int max_query_len) {
  IndexerParams p{};
  p.index_q = index_q.data;
  p.index_cache = index_cache.data;
  p.fp8 = kv_cache_is_fp8(cfg.index_cache_dtype);
  p.num_cache_blocks = index_cache.shape[0];
  p.block_table = block_table.ptr<const int32_t>();
  p.block_table_stride = block_table.shape[0] > 1 ? block_table.stride[0] : block_table.shape[1];
  p.max_blocks = int(block_table.shape[1]);
  p.seq_lens = seq_lens.ptr<const int32_t>();
  p.cu_seqlens_q = decode_query_len > 0 ? nullptr : cu_seqlens_q.ptr<const int32_t>();
  p.num_seqs = int(seq_lens.shape[0]);
  p.num_tokens = index_q.shape[0];
  p.decode_query_len = decode_query_len;
  p.max_query_len = max_query_len;
  p.num_heads = cfg.num_index_heads;
  p.topk = cfg.select.topk;
  p.init_blocks = cfg.select.init_blocks;
  p.local_blocks = cfg.select.local_blocks;
  p.topk_out = topk_out.ptr<int32_t>();
  p.topk_stride_t = topk_out.ndim > 0 ? topk_out.stride[0] : int64_t(cfg.num_index_heads) * cfg.select.topk;
  return p;
}

struct LightningIndexer::Scratch {
  Tensor prefill_scores;  // [max_prefill_tokens, Hidx, max_blocks_per_seq] fp32
  Tensor decode_scores;   // [max_decode_seqs * max_decode_query_len, Hidx, max_blocks_per_seq]
  Tensor counters;        // [max_decode_seqs] int32, zero between calls
};

std::string LightningIndexer::validate(const IndexerConfig& c) {
  const IndexerSelection& s = c.select;
  if (c.num_index_heads < 1 || c.num_index_heads > 16)
    return "num_index_heads = " + str(c.num_index_heads) + ": supported 1..16";
  if (s.topk < 1 || s.topk > kIndexerMaxTopk)
    return "select.topk = " + str(s.topk) + ": supported 1.." + str(kIndexerMaxTopk);
  if (s.init_blocks < 0) return "select.init_blocks = " + str(s.init_blocks) + ": must be >= 0";
  if (s.local_blocks < 1)
    return "select.local_blocks = " + str(s.local_blocks) +
           ": must be >= 1 (the token's own block is always selected)";
  if (s.init_blocks + s.local_blocks > s.topk)
    return "select.init_blocks + select.local_blocks = " + str(s.init_blocks + s.local_blocks) +
           ": must be <= topk = " + str(s.topk);
  const KvCacheDtype d = c.index_cache_dtype;
  if (d != KvCacheDtype::kAuto && d != KvCacheDtype::kBFloat16 && d != KvCacheDtype::kFp8E4M3)
    return std::string("index_cache_dtype = ") + kv_cache_dtype_name(d) +
           ": supported auto/bfloat16 or fp8/fp8_e4m3";
  if (c.max_prefill_tokens < 0) return "max_prefill_tokens = " + str(c.max_prefill_tokens) + ": must be >= 0";
  if (c.max_decode_seqs < 0) return "max_decode_seqs = " + str(c.max_decode_seqs) + ": must be >= 0";
  if (c.max_decode_query_len < 1 || c.max_decode_query_len > 32)
    return "max_decode_query_len = " + str(c.max_decode_query_len) + ": supported 1..32";
  if (c.max_blocks_per_seq < 1)
    return "max_blocks_per_seq = " + str(c.max_blocks_per_seq) + ": must be >= 1";
  return {};
}

LightningIndexer::LightningIndexer(const IndexerConfig& config, Device device)
    : config_(config), device_(device), scratch_(std::make_unique<Scratch>()) {
  if (const std::string why = validate(config); !why.empty())
    throw Error(std::string(kOp) + ": unsupported IndexerConfig: " + why);
  if (!device.is_cuda()) return;
  if (!built_with_cuda()) throw_arg_error(kOp, "device", device.str(), "m3rt was built without CUDA");
  const int64_t H = config.num_index_heads, nb = config.max_blocks_per_seq;
  const int64_t decode_rows = int64_t(config.max_decode_seqs) * config.max_decode_query_len;
  if (config.max_prefill_tokens > 0)
    scratch_->prefill_scores = Tensor::empty({config.max_prefill_tokens, H, nb}, DType::kFloat32, device);
  if (decode_rows > 0) {
    scratch_->decode_scores = Tensor::empty({decode_rows, H, nb}, DType::kFloat32, device);
    scratch_->counters = Tensor::empty({config.max_decode_seqs}, DType::kInt32, device);
    scratch_->counters.fill_bytes(0);
  }
}

LightningIndexer::~LightningIndexer() = default;

void LightningIndexer::prefill(const IndexerPrefillArgs& a, stream_t stream) {
  using namespace detail;
  const Device dev = device_;
  const CallShape s = check_common(config_, dev, a.index_q, a.index_cache, a.seq_lens,
                                   a.block_table, a.topk_out);
  if (s.num_tokens > config_.max_prefill_tokens)
    throw_arg_error(kOp, "index_q.shape", a.index_q.shape_str(),
                    "at most max_prefill_tokens = " + str(config_.max_prefill_tokens) +
                        " tokens (IndexerConfig)");
  require_prefill_batch(kOp, a.cu_seqlens_q, s.num_seqs, s.num_tokens, a.max_query_len, dev);
  if (s.num_tokens == 0 || s.num_seqs == 0) return;
  IndexerParams p = indexer_call_params(config_, a.index_q, a.index_cache, a.seq_lens, a.block_table,
                                        a.topk_out, a.cu_seqlens_q, 0, a.max_query_len);
  if (dev.is_cuda()) p.scores = scratch_->prefill_scores.ptr<float>();
  run_on_device(kOp, dev, p, indexer_ref, M3RT_LAUNCHER(indexer_prefill_launch), stream);
}

void LightningIndexer::decode(const IndexerDecodeArgs& a, stream_t stream) {
  using namespace detail;
  const Device dev = device_;
  const CallShape s = check_common(config_, dev, a.index_q, a.index_cache, a.seq_lens,
                                   a.block_table, a.topk_out);
  if (a.decode_query_len < 1 || a.decode_query_len > config_.max_decode_query_len)
    throw_arg_error(kOp, "decode_query_len", str(a.decode_query_len),
                    "supported 1..max_decode_query_len = " + str(config_.max_decode_query_len));
  if (s.num_seqs > config_.max_decode_seqs)
    throw_arg_error(kOp, "seq_lens.shape", a.seq_lens.shape_str(),
                    "at most max_decode_seqs = " + str(config_.max_decode_seqs) +
                        " requests (IndexerConfig)");
  if (s.num_tokens != int64_t(s.num_seqs) * a.decode_query_len)
    throw_arg_error(kOp, "index_q.shape", a.index_q.shape_str(),
                    "expected " + str(int64_t(s.num_seqs) * a.decode_query_len) +
                        " rows (num_seqs * decode_query_len)");
  if (s.num_seqs == 0) return;
  IndexerParams p = indexer_call_params(config_, a.index_q, a.index_cache, a.seq_lens, a.block_table,
                                        a.topk_out, TensorView{}, a.decode_query_len, 0);
  if (dev.is_cuda()) {
    p.scores = scratch_->decode_scores.ptr<float>();
    p.counters = scratch_->counters.ptr<int>();
  }
  p.pdl = a.enable_pdl;
  run_on_device(kOp, dev, p, indexer_ref, M3RT_LAUNCHER(indexer_decode_launch), stream);
}

}  // namespace m3rt
