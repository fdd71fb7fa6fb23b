// dspark_context_kv: params, CPU reference and launcher of the DSpark context-K/V writer.
// Public API: m3rt::DsparkContextKvWriter (include/m3rt/ops.h). Math and layout: README.md here.
#pragma once

#include <cstdint>

#include "m3rt/ops.h"

struct CUstream_st;

namespace m3rt {

struct DsparkContextKvParams {
  const uint16_t* all_kv;         // [num_ctx, L, 2, nkv, 128] bf16; rows stride_all_kv_t apart
  int64_t stride_all_kv_t;        // elements between tokens (>= L*2*nkv*128, multiple of 8)
  const uint16_t* k_norm_weight;  // [L, 128] bf16
  const uint16_t* cos_sin;        // [max_pos, rotary_dim] bf16
  const int64_t* positions;       // [num_ctx]
  const int64_t* slots;           // [num_ctx]; < 0: skip
  void* cache0;                   // layer 0's cache [num_blocks, nkv, bs, 256], bf16 or uint8
  const float* scale0;            // layer 0's k scale; the others at scale0 + scale_offsets[]
  DsparkContextKvWriter::Tables tables;
  int64_t num_ctx;
  int num_layers;
  int num_kv_heads;
  int block_size_log2;
  int64_t num_slots;              // num_blocks * block_size: slots >= this are not written
  int64_t max_pos;                // positions outside [0, max_pos) are not written
  int64_t stride_cache_block;     // elements: nkv * bs * 256
  int64_t stride_cache_head;      // elements: bs * 256
  float eps;
  int rotary_dim;                 // 16, 32, 64
  bool fp8;
  bool pdl;                       // launch as a programmatic dependent (enable_pdl; Hopper only)
  // The half-warp kernel's run-time claims (ops/common/claims.cuh): kClaimCounterInts zeroed
  // counters or nullptr (static split); the launcher sets claim_from, the first claimed token pair.
  unsigned* claims;
  int claim_from;
};

// CPU reference: the spec's unfused math, per (token, layer, head), in plain fp32.
void dspark_context_kv_ref(const DsparkContextKvParams& p);

// CUDA: one launch for every layer (src/ops/dspark_context_kv/dspark_context_kv.cu).
void dspark_context_kv_launch(const DsparkContextKvParams& p, CUstream_st* stream);

}  // namespace m3rt
