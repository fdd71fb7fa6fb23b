// qknorm_rope_kv_insert: params, CPU reference and launcher. Public API: m3rt::qknorm_rope_kv_insert
// (include/m3rt/ops.h). Math and layout: README.md here.
#pragma once

#include <cstdint>

struct CUstream_st;

namespace m3rt {

enum class QkvInsertMode : uint8_t { kNone, kBFloat16, kFp8 };

struct QknormRopeKvInsertParams {
  uint16_t* qkv;                  // [T, (nq + 2 nkv [+ Hidx + 1]) * 128] bf16, rows stride_qkv_t apart
  int64_t stride_qkv_t;
  const uint16_t* q_norm_weight;  // [128]
  const uint16_t* k_norm_weight;  // [128]
  const uint16_t* cos_sin;        // [max_pos, rotary_dim]
  const int64_t* positions;       // [T]
  int64_t num_tokens;
  int num_heads;                  // nq
  int num_kv_heads;               // nkv
  int rotary_dim;                 // 16, 32, 64
  int64_t max_pos;                // positions outside [0, max_pos): the token is not written
  float eps;
  uint16_t* q_out;                // [T, nq * 128] bf16 or nullptr
  uint8_t* q_fp8_out;             // [T, nq * 128] e4m3 or nullptr
  float q_fp8_inv_scale;          // 1 / q_fp8_scale
  bool q_in_place;                // write q back into qkv
  QkvInsertMode insert;
  const int64_t* slots;           // [T] (insert only); < 0: skip
  void* cache;                    // [num_blocks, nkv, bs, 256] bf16 or uint8 (insert only)
  int64_t num_slots;              // num_blocks * bs
  int block_size_log2;
  int64_t stride_cache_block;
  int64_t stride_cache_head;
  const float* k_scale;           // fp8 insert only
  const float* v_scale;
  // Sparse (MSA) rows: [q | k | v | index_q (Hidx) | index_k] x 128. num_index_heads 0: dense row.
  int num_index_heads;                  // Hidx
  const uint16_t* index_q_norm_weight;  // [128]
  const uint16_t* index_k_norm_weight;  // [128]
  void* index_q_out;                    // [T, Hidx * 128] bf16, or e4m3 when index_fp8
  const int64_t* index_slots;           // [T]; < 0: skip
  void* index_cache;                    // [num_blocks * 128, 128] bf16, or e4m3 when index_fp8
  int64_t index_num_slots;              // num_blocks * 128
  bool index_fp8;                       // e4m3 index_q_out and index cache, unscaled (a runtime flag)
  bool pdl;                             // launch as a programmatic dependent (enable_pdl; Hopper only)
  // The quad kernel's run-time claims (ops/common/claims.cuh): kClaimCounterInts zeroed counters or
  // nullptr (static split); the launcher sets claim_from, the first claimed token.
  unsigned* claims;
  int claim_from;
};

void qknorm_rope_kv_insert_ref(const QknormRopeKvInsertParams& p);
void qknorm_rope_kv_insert_launch(const QknormRopeKvInsertParams& p, CUstream_st* stream);

}  // namespace m3rt
