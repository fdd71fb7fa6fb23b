// m3rt/msa_attention.h — MSA block-sparse paged attention (../shared/spec/msa.md §4): prefill
// (varlen, causal right-aligned) and decode / speculative verify, bf16 or fp8 e4m3 KV cache.
// Math, layouts and decisions: src/ops/msa_attention/README.md.
//
// For query token t at position p (request b), query head h and its KV head g = h / (Hq / Hkv):
//   keys  = { n : block(n) in the token's selected blocks of head g, lo <= n < hi }
//           hi = min(p + 1, seq_len[b]) (causal) or seq_len[b] (non-causal);
//           lo = max(0, p - window_left + 1) with a window, else 0
//   s_n   = softmax_scale * dot(q[t, h], k[g, n])        k = code * k_scale for an fp8 cache
//   out   = sum_n softmax(s)_n * v[g, n]                 v = code * v_scale for an fp8 cache
//   lse   = ln(sum_n exp(s_n))                            (natural log)
// A top-k entry is used when it is a block id in [0, ceil(hi / 128)) not seen before in the list;
// -1, ids past the visible blocks and repeats are skipped and never read. A row with no key writes
// out = 0 and lse = -inf.
#pragma once

#include <cstdint>
#include <memory>

#include "m3rt/ops.h"
#include "m3rt/tensor.h"

namespace m3rt {

constexpr int kMsaPageSize = 128;   // KV cache block size of MSA layers
constexpr int kMsaMaxTopk = 64;

// Row visibility switches (the drafter's draft block needs both; the target uses the defaults).
struct MsaMask {
  bool causal = true;    // false: every key < seq_len is visible to every row of the request
  int window_left = 0;   // > 0: only keys at position >= p - window_left + 1; 0: no window
};

// The KV cache of one layer.
struct MsaKvCache {
  TensorView kv_cache;  // [num_blocks, Hkv, 128, 256] contiguous: K in [..., :128], V in [..., 128:]
  KvCacheDtype kv_cache_dtype = KvCacheDtype::kAuto;  // bf16 (auto/bfloat16) or fp8 (uint8 storage)
  TensorView k_scale;   // fp32 [1] on the cache's device; required for fp8
  TensorView v_scale;
};

// Prefill: request b owns query tokens [cu_seqlens_q[b], cu_seqlens_q[b+1]); its i-th token sits
// at position seq_lens[b] - query_len_b + i.
struct MsaPrefillArgs {
  TensorView q;             // [T, Hq, 128] bf16, last dim contiguous
  MsaKvCache cache;
  TensorView topk;          // [Hkv, T, topk] int32, any strides (the token-major buffer
                            // [T_pad, Hkv, topk] is read in place through a permuted view)
  TensorView cu_seqlens_q;  // [B + 1] int32
  TensorView seq_lens;      // [B] int32
  TensorView block_table;   // [B, max_blocks] int32, last dim contiguous
  int max_query_len = 0;    // >= every request's query length (sizes the GPU grid)
  float softmax_scale = 0;  // > 0, e.g. 1 / sqrt(128)
  MsaMask mask{};
  TensorView out;           // [T, Hq, 128] bf16, last dim contiguous
  TensorView lse;           // optional [T, Hq] fp32
  // The GPU's P V numerics. true (default): each softmax weight enters P V as a 16-bit value plus
  // its 16-bit residue, so the output stays within 3 bf16 ulps (or 8e-4) of the reference.
  // false: as the 16-bit value alone (bf16; f16 for an fp8 cache), FlashAttention's numerics,
  // adding up to u * sum_n p_n |v_n| / sum_n p_n per output element (u = 2^-8 bf16, 2^-11 f16);
  // where Hopper's copy-engine wgmma loop runs (groups of more than 64 rows: verify, prefill, the
  // drafter's blocks) that saves 8-15%. Other kernels and the CPU keep the default.
  bool p_residue = true;
};

void msa_prefill(const MsaPrefillArgs& args, stream_t stream = nullptr);

// Decode / verify: every request has decode_query_len rows; row r of request b (token b*dql + r)
// sits at position seq_lens[b] - dql + r. seq_lens[b] == 0 pads the request: its rows write 0.
struct MsaDecodeArgs {
  TensorView q;             // [B * dql, Hq, 128] bf16
  MsaKvCache cache;
  TensorView topk;          // [Hkv, B * dql, topk] int32, any strides
  TensorView seq_lens;      // [B] int32
  TensorView block_table;   // [B, max_blocks] int32
  float softmax_scale = 0;
  MsaMask mask{};
  TensorView out;           // [B * dql, Hq, 128] bf16
  TensorView lse;           // optional [B * dql, Hq] fp32
  // P V numerics on the GPU: as MsaPrefillArgs::p_residue.
  bool p_residue = true;
  // Hopper: launch as a programmatic dependent of the kernel before it on the stream (PDL), so
  // that its CTAs are scheduled and start while that kernel finishes; they read nothing until it
  // has completed (griddepcontrol.wait first), and let the next kernel do the same. Ignored on
  // other GPUs. Graph capture keeps it (programmatic edges).
  bool enable_pdl = false;
};

// What a decode plan is built for: calls must match it (checked), so graphs captured with a plan
// replay with the same grid. Built once per shape on its device, outside capture; on a GPU it picks
// how many CTAs share each request's pages (from the device's size) and owns their fp32 partials
// at a stable address; run() allocates nothing and never synchronizes. Split runs of one plan
// share those partials and arrival counters, so its runs must follow one another in stream order:
// runs that may overlap (two streams without an event between them) need a plan each.
struct MsaDecodeShape {
  int batch = 0;               // requests per call
  int decode_query_len = 1;    // 1..32
  int num_heads = 0;           // Hq
  int num_kv_heads = 0;        // Hkv; Hq / Hkv in {1, 2, 4, 8, 16}
  int topk = 16;               // 1..64
  int max_blocks = 0;          // block_table width
  KvCacheDtype kv_cache_dtype = KvCacheDtype::kAuto;
};

class MsaDecodePlan {
 public:
  MsaDecodePlan(const MsaDecodeShape& shape, Device device);
  ~MsaDecodePlan();
  MsaDecodePlan(const MsaDecodePlan&) = delete;
  MsaDecodePlan& operator=(const MsaDecodePlan&) = delete;

  void run(const MsaDecodeArgs& args, stream_t stream = nullptr);

  const MsaDecodeShape& shape() const { return shape_; }
  Device device() const { return device_; }
  // Why this shape cannot be served, or an empty string.
  static std::string validate(const MsaDecodeShape& shape);

 private:
  struct Scratch;  // GPU split scratch (partials, arrival counters), allocated at construction
  MsaDecodeShape shape_;
  Device device_;
  std::unique_ptr<Scratch> scratch_;
};

}  // namespace m3rt
