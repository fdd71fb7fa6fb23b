// m3rt/lightning_indexer.h — MSA's lightning indexer: block scores and top-k block selection for
// prefill and decode (../shared/spec/msa.md §3). Math, layout and decisions:
// src/ops/lightning_indexer/README.md.
//
// For query token t at position p, index head h and logical block j <= p / 128:
//   score[t, h, j] = max over keys n of block j with position(n) <= p of dot(index_q[t, h], index_k[n])
// in fp32 (fp8 inputs dequantized unscaled). A NaN dot is ignored by the max; a block whose every
// visible dot is NaN scores NaN. Selection: the first `init_blocks` and the last `local_blocks`
// visible blocks are forced, then the best remaining blocks by score (ties: the lower block id;
// NaN ranks below every number), min(topk, visible blocks) ids in total, written in ascending id
// order (so the local block is the last valid entry: the MSA contract), -1 after.
#pragma once

#include <cstdint>
#include <memory>

#include "m3rt/ops.h"
#include "m3rt/tensor.h"

namespace m3rt {

constexpr int kIndexBlockSize = 128;  // tokens per index-cache page == the sparse block size
constexpr int kIndexerMaxTopk = 64;

struct IndexerSelection {
  int topk = 16;         // 1..64
  int init_blocks = 0;   // >= 0
  int local_blocks = 1;  // >= 1 (the token's own block is always selected); init + local <= topk
};

// Capacities of one indexer: the scratch of GPU runs is allocated once, at construction, at a
// stable address (CUDA-graph safe); calls are checked against these limits. Every GPU call of one
// indexer uses that scratch (score rows, per-request arrival counters), so its calls must run one
// after another in stream order: calls that may overlap (two streams without an event between
// them, two graphs replayed on different streams) need an indexer each.
struct IndexerConfig {
  int num_index_heads = 4;                         // Hidx, 1..16
  IndexerSelection select{};
  KvCacheDtype index_cache_dtype = KvCacheDtype::kAuto;  // bf16 (kAuto/kBFloat16) or kFp8E4M3
  int64_t max_prefill_tokens = 0;                  // index_q rows of one prefill call
  int max_decode_seqs = 0;                         // requests of one decode call
  int max_decode_query_len = 1;                    // 1..32
  int max_blocks_per_seq = 0;                      // block_table width
};

// Prefill (varlen): request b owns query tokens [cu_seqlens_q[b], cu_seqlens_q[b+1]); its i-th
// token sits at position seq_lens[b] - query_len_b + i (causal, right-aligned).
struct IndexerPrefillArgs {
  TensorView index_q;       // [T, Hidx, 128] bf16; e4m3 (float8_e4m3 or uint8) with an fp8 cache
  TensorView index_cache;   // [num_blocks, 128, 128] bf16, or uint8 holding e4m3; contiguous
  TensorView cu_seqlens_q;  // [B + 1] int32: 0, ..., T
  TensorView seq_lens;      // [B] int32, tokens of each request including the new ones
  TensorView block_table;   // [B, max_blocks] int32 (last dim contiguous): logical -> physical page
  int max_query_len = 0;    // >= every request's query length (sizes the GPU grid)
  TensorView topk_out;      // [>= T, Hidx, topk] int32, last two dims contiguous; rows >= T untouched
};

// Decode / speculative verify: every request has decode_query_len rows; row r of request b
// (token b * dql + r) sits at position seq_lens[b] - dql + r. seq_lens[b] == 0 pads: all -1.
struct IndexerDecodeArgs {
  TensorView index_q;       // [B * dql, Hidx, 128], dtypes as for prefill
  TensorView index_cache;
  TensorView seq_lens;      // [B] int32
  TensorView block_table;   // [B, max_blocks] int32
  int decode_query_len = 1; // 1..32
  TensorView topk_out;      // [>= B * dql, Hidx, topk] int32
  // Hopper: launch as a programmatic dependent of the kernel before it on the stream (PDL): the
  // CTAs are scheduled and start while that kernel finishes, and read nothing until it has
  // completed (griddepcontrol.wait first); a one-wave grid then lets the next kernel do the same.
  // Ignored on other GPUs (and builds without sm_90a code). Graph capture keeps it.
  bool enable_pdl = false;
};

class LightningIndexer {
 public:
  // Allocates the GPU scratch (score rows and per-request counters) on `device`; none on the CPU.
  LightningIndexer(const IndexerConfig& config, Device device);
  ~LightningIndexer();
  LightningIndexer(const LightningIndexer&) = delete;
  LightningIndexer& operator=(const LightningIndexer&) = delete;

  // Scores and selects for every token; one scoring launch and one selection launch on a GPU.
  void prefill(const IndexerPrefillArgs& args, stream_t stream = nullptr);
  // Scores and selects for every decode row in one launch on a GPU (graph-capturable: the grid
  // depends only on shapes; lengths, tables and queries may change in place between replays).
  void decode(const IndexerDecodeArgs& args, stream_t stream = nullptr);

  const IndexerConfig& config() const { return config_; }
  Device device() const { return device_; }

  // Why this configuration cannot be served, or an empty string.
  static std::string validate(const IndexerConfig& config);

 private:
  struct Scratch;
  IndexerConfig config_;
  Device device_;
  std::unique_ptr<Scratch> scratch_;
};

}  // namespace m3rt
