// m3rt/ops.h — the ops. Each validates its arguments (throwing m3rt::Error that names the argument,
// its value and what is supported) and dispatches on the tensors' device: CPU tensors run the CPU
// reference (plain fp32 loops: the spec), CUDA tensors the kernel on `stream`. All tensors of one
// call live on one device. Layouts, math and numerics: src/ops/<op>/README.md.
//
// Conventions (../shared/spec/README.md):
//   KV cache   [num_blocks, num_kv_heads, block_size, 256]: K in [..., :128], V in [..., 128:],
//              contiguous; bf16, or fp8 e4m3 stored as uint8 holding sat(x / scale).
//   slots      int64, slot = block * block_size + offset; slot < 0 writes nothing.
//   RoPE table cos_sin_cache [max_pos, rotary_dim] bf16: cos half then sin half; NeoX pairing.
//   positions  int64 in [0, max_pos).
// Device-resident indices (slots, positions) cannot be checked on the host without a sync: the CPU
// path throws on out-of-range values; CUDA kernels never touch memory outside the cache or table
// for them and leave such rows unwritten.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "m3rt/tensor.h"

namespace m3rt {

constexpr int kHeadDim = 128;  // every head in MiniMax-M3 and its drafter

// The int32 counters of an op's run-time work claims (QknormRopeKvInsertArgs::claim_counters,
// DsparkContextKvArgs::claim_counters).
constexpr int64_t kClaimCounterInts = 256;

// What a KV cache holds. Engines name it with a string ("auto", "bfloat16", "fp8", "fp8_e4m3",
// "fp8_e5m2", "nvfp4"); m3rt stores bf16 and fp8 e4m3 caches and refuses the rest.
enum class KvCacheDtype : uint8_t { kAuto, kBFloat16, kFp8E4M3, kFp8E5M2, kNvfp4 };
KvCacheDtype parse_kv_cache_dtype(std::string_view name);  // throws on an unknown name
const char* kv_cache_dtype_name(KvCacheDtype dtype);
inline bool kv_cache_is_fp8(KvCacheDtype d) { return d == KvCacheDtype::kFp8E4M3; }

// ---------------------------------------------------------------------------------------------
// reshape_and_cache: write one layer's K/V rows into its paged cache by slot.
//   key, value  [T, nkv, 128] bf16, last dim contiguous (any token/head strides)
//   kv_cache    [num_blocks, nkv, block_size, 256], bf16, or uint8 for fp8
//   slot_mapping [T] int64
//   k_scale, v_scale  fp32 [1] (or scalar) on the cache's device; required for fp8, ignored for bf16
// cache[slot / bs, h, slot % bs, d] = key[t, h, d] (bf16) or e4m3(key / k_scale); V at d + 128.
void reshape_and_cache(const TensorView& key, const TensorView& value, const TensorView& kv_cache,
                       const TensorView& slot_mapping, KvCacheDtype kv_cache_dtype,
                       const TensorView& k_scale, const TensorView& v_scale,
                       stream_t stream = nullptr);

// ---------------------------------------------------------------------------------------------
// gemma_rms_norm: out = x * rsqrt(mean(x^2) + eps) * (1 + w) over the last dim, in fp32, rounded to
// the output dtype. x, out: [d], [rows, d] or [a, b, d] (last dim contiguous; out may alias x
// exactly); bf16 or fp16, out the same dtype; weight [d] same dtype. Any d >= 1; a per-head norm is
// the [T, H, 128] case.
void gemma_rms_norm(const TensorView& out, const TensorView& x, const TensorView& weight, float eps,
                    stream_t stream = nullptr);

// gemma_fused_add_rms_norm: s = x + residual (fp32); residual <- round(s); out = norm(s) with s in
// fp32 (not the rounded residual). Shapes as above; residual is read and written in place.
void gemma_fused_add_rms_norm(const TensorView& out, const TensorView& x,
                              const TensorView& residual, const TensorView& weight, float eps,
                              stream_t stream = nullptr);

// ---------------------------------------------------------------------------------------------
// swiglu_oai: gate_up [T, 2I] split as [gate | up]; out [T, I]; bf16 or fp16.
//   g = min(gate, limit); u = clamp(up, -limit, limit); out = g * sigmoid(alpha * g) * (u + beta)
struct SwigluOaiParams {
  float alpha = 1.702f;
  float limit = 7.0f;
  float beta = 1.0f;
};
void swiglu_oai(const TensorView& out, const TensorView& gate_up, const SwigluOaiParams& params,
                stream_t stream = nullptr);

// ---------------------------------------------------------------------------------------------
// qknorm_rope_kv_insert: the fused per-head Gemma RMSNorm + partial NeoX RoPE of q and k on a dense
// qkv row [q (nq heads) | k (nkv) | v (nkv)] x 128, in place, with optional outputs and KV insert;
// with num_index_heads = Hidx > 0 a MiniMax-M3 sparse-layer row
// [q (nq) | k (nkv) | v (nkv) | index_q (Hidx) | index_k (1)] x 128 and the index-K insert too.
// One launch. Math per head (fp32 throughout, one rounding at the end):
//   q' = rope(norm(q; q_norm_weight)), k' = rope(norm(k; k_norm_weight)); rounded to bf16;
//   iq' = rope(norm(index_q; index_q_norm_weight)), ik' = rope(norm(index_k; index_k_norm_weight))
//   likewise (same table row, position and eps).
// Outputs:
//   k' is written back into qkv. q' goes to q_out when given, else in place into qkv — unless
//   q_fp8_out is given without q_out, then q is emitted only in fp8 (qkv's q is left unchanged).
//   q_fp8_out (optional): e4m3(float(bf16(q')) * (1 / q_fp8_scale)), like scaled_fp8_quant.
//   Insert (when kv_cache is given): cache K = bf16(k') or e4m3(bf16(k') / k_scale), cache V = v or
//   e4m3(v / v_scale), at slot_mapping[t] (skipped when < 0). v is never changed in qkv.
//   Sparse rows (Hidx > 0; every index_* tensor then required, none allowed with Hidx 0):
//   iq' goes only to index_q_out (qkv's index_q is left unchanged): bf16, or e4m3(float(iq')) with
//   no scale (saturating to +-448) when the index cache is fp8. ik' is written back into qkv and
//   into index_cache at element index_slot_mapping[t] * 128 (block slot / 128, row slot % 128;
//   skipped when < 0) as bf16(ik') or e4m3(float(ik')), unscaled. The main insert stays optional.
struct QknormRopeKvInsertArgs {
  TensorView qkv;            // [T, (nq + 2 nkv [+ Hidx + 1]) * 128] bf16, row stride any multiple
                             // of 8, row contiguous
  TensorView q_norm_weight;  // [128] bf16
  TensorView k_norm_weight;  // [128] bf16
  TensorView cos_sin_cache;  // [max_pos, rotary_dim] bf16
  TensorView positions;      // [T] int64
  int num_heads = 0;         // nq
  int num_kv_heads = 0;      // nkv
  int rotary_dim = 0;        // 16, 32 or 64
  float eps = 1e-6f;
  TensorView q_out;          // optional [T, nq * 128] bf16, contiguous
  TensorView q_fp8_out;      // optional [T, nq * 128] e4m3 (dtype float8_e4m3 or uint8), contiguous
  float q_fp8_scale = 1.0f;  // > 0
  // Optional insert of the tokens' k/v into a paged cache.
  TensorView slot_mapping;   // [T] int64, required with kv_cache
  TensorView kv_cache;       // [num_blocks, nkv, block_size, 256] bf16 or uint8 (fp8)
  KvCacheDtype kv_cache_dtype = KvCacheDtype::kAuto;
  TensorView k_scale;        // fp32 [1], required for an fp8 cache
  TensorView v_scale;        // fp32 [1], required for an fp8 cache
  // MiniMax-M3 sparse (MSA) layers: the indexer's heads on the same row, and the index-K insert.
  int num_index_heads = 0;          // Hidx: 0 = dense row; 1..16
  TensorView index_q_norm_weight;   // [128] bf16
  TensorView index_k_norm_weight;   // [128] bf16
  TensorView index_q_out;           // [T, Hidx * 128], contiguous: bf16, or e4m3 (float8_e4m3 or
                                    // uint8) when the index cache is fp8
  TensorView index_slot_mapping;    // [T] int64, the index cache's own slots
  TensorView index_cache;           // [num_blocks, 128, 128] bf16 or uint8 (fp8), contiguous
  KvCacheDtype index_cache_dtype = KvCacheDtype::kAuto;  // auto/bfloat16 or fp8/fp8_e4m3
  // Hopper: launch as a programmatic dependent of the kernel before it on the stream (PDL), e.g.
  // the qkv projection: the CTAs are scheduled and start while that kernel finishes, and read
  // nothing that kernel may write until it has completed (griddepcontrol.wait); the norm weights
  // and the cache scales, parameters that the kernel before must not write, may be read before it
  // (the small-T kernel does, so their loads overlap that kernel's tail). The grid is one wave, so
  // it then lets the next kernel do the same at once. Ignored on the CPU, on other GPUs and in builds
  // without sm_90a code. Graph capture keeps it (programmatic edges).
  bool enable_pdl = false;
  // Optional run-time claims (CUDA, bf16 cache or no insert, from 2048 tokens on GPUs below the
  // H200's DRAM bandwidth an SM; on others the call runs its static split, session 64): int32
  // [>= kClaimCounterInts] on qkv's device, all zero before the first call (e.g. cudaMemset once);
  // every completed call leaves it zero again. With it, the warps of the one-wave kernel take the
  // last tokens one at a time instead of in equal shares, so SMs that stream faster take more
  // (H100: T = 4096-16384 1.03-1.09x; docs/perf.md). One buffer serves every claiming call on a
  // stream, of this op and the context writer alike (each leaves it zero; with enable_pdl a call
  // touches it only after the previous kernel has completed); calls that may run at the same time
  // (other streams, graphs replayed concurrently) need buffers of their own. Ignored on the CPU.
  TensorView claim_counters;
};
void qknorm_rope_kv_insert(const QknormRopeKvInsertArgs& args, stream_t stream = nullptr);

// ---------------------------------------------------------------------------------------------
// dspark_context_kv_write: the DSpark drafter's context-K/V writer (seed 000). For every context
// token t, draft layer l and KV head h, in one launch:
//   K: Gemma RMSNorm with layer l's k-norm weight in fp32, rounded to bf16, then partial NeoX RoPE at
//      positions[t] in fp32, rounded to bf16; stored as bf16 or e4m3(k / k_scale_l).
//   V: copied, as bf16 or e4m3(v / v_scale_l).
// into layer l's cache at slot_mapping[t] (skipped when < 0). num_ctx == 0 is a no-op.

// One draft layer's KV cache, as an engine binds it.
struct DsparkDraftLayerKv {
  TensorView kv_cache;  // [num_blocks, nkv, block_size, 256], contiguous; bf16, or uint8 for fp8
  KvCacheDtype kv_cache_dtype = KvCacheDtype::kAuto;
  TensorView k_scale;   // fp32 [1] on the cache's device (read on the device at each call)
  TensorView v_scale;   // fp32 [1]
};

struct DsparkContextKvArgs {
  TensorView all_kv;         // [num_ctx, L, 2, nkv, 128] bf16 (K = index 0, V = 1); dims 1.. contiguous
  TensorView k_norm_weight;  // [L, 128] bf16, contiguous: layer l's k-norm weight
  float eps = 1e-6f;
  TensorView positions;      // [num_ctx] int64
  TensorView cos_sin_cache;  // [max_pos, rotary_dim] bf16, contiguous
  int rotary_dim = 0;        // 16, 32 or 64; must equal cos_sin_cache.shape[1]
  TensorView slot_mapping;   // [num_ctx] int64, shared by every layer
  // Hopper: launch as a programmatic dependent of the kernel before it on the stream (PDL), e.g.
  // the K/V projection, as QknormRopeKvInsertArgs::enable_pdl (k_norm_weight and the layers'
  // k_scale / v_scale may be read before the wait). Ignored on the CPU and other GPUs.
  bool enable_pdl = false;
  // Optional run-time claims, as QknormRopeKvInsertArgs::claim_counters (the same buffer rules),
  // here for bf16 caches from 8192 tokens (16384 on GPUs with the H200's DRAM bandwidth an SM) and
  // fp8 caches from 32768 (in the half-warp kernel: not on GPUs with the H200's DRAM bandwidth an
  // SM): the last 15% of the tokens handed out 8 tokens a claim (H100: bf16 1.03-1.05x, fp8 1.045x;
  // H200 bf16 from 16384 1.01-1.025x). Ignored on the CPU.
  TensorView claim_counters;
};

// The kernel rotates the leading 16, 32 or 64 dims of a 128-dim head.
bool dspark_rotary_dim_supported(int rotary_dim, int head_dim);

// Writes precomputed context K/V into every draft layer's cache. Built once from the layers'
// caches; each layer's cache is addressed as layer 0's plus a per-layer element offset and each
// scale as layer 0's k scale plus a float offset. These offset tables are built at the first call
// and rebuilt only when a cache's or scale's address changes (rebind), never inside a call that
// reuses them, so calls captured in a CUDA graph keep addressing the same memory. The tables are
// passed to the kernel by value: no device allocation, nothing to upload during capture.
class DsparkContextKvWriter {
 public:
  static constexpr int kMaxLayers = 16;

  explicit DsparkContextKvWriter(std::vector<DsparkDraftLayerKv> layers);

  // Why these layers cannot be served ("no layers", "layer 2: block size 96 is not a power of
  // two", ...), or nullopt when they can.
  static std::optional<std::string> validate(const std::vector<DsparkDraftLayerKv>& layers);
  static bool supported(const std::vector<DsparkDraftLayerKv>& layers) {
    return !validate(layers).has_value();
  }

  // Point the writer at re-allocated caches or scales (same rules as the constructor).
  void rebind(std::vector<DsparkDraftLayerKv> layers);

  void operator()(const DsparkContextKvArgs& args, stream_t stream = nullptr);

  int num_layers() const { return int(layers_.size()); }
  int num_kv_heads() const { return int(layers_[0].kv_cache.shape[1]); }
  int block_size() const { return int(layers_[0].kv_cache.shape[2]); }
  KvCacheDtype kv_cache_dtype() const { return layers_[0].kv_cache_dtype; }
  // How many times the offset tables were built (tests check they are cached).
  int table_builds() const { return table_builds_; }

  struct Tables {
    int64_t cache_offsets[kMaxLayers] = {};      // elements from layer 0's cache
    int64_t scale_offsets[2 * kMaxLayers] = {};  // floats from layer 0's k scale: k scales, then v
  };

 private:
  void ensure_tables();

  std::vector<DsparkDraftLayerKv> layers_;
  std::vector<const void*> table_key_;  // (cache, k_scale, v_scale) data pointers per layer
  Tables tables_{};
  int table_builds_ = 0;
};

// Debug switch: when on, every launch is followed by a stream synchronize and an error check
// (never while the stream is capturing). Also enabled by the environment variable M3RT_SYNC_CHECK=1.
void set_sync_check(bool on);
bool sync_check();

}  // namespace m3rt
