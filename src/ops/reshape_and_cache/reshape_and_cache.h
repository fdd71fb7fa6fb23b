// reshape_and_cache: params, CPU reference and launcher. Public API: m3rt::reshape_and_cache.
#pragma once

#include <cstdint>

struct CUstream_st;

namespace m3rt {

struct ReshapeAndCacheParams {
  const uint16_t* key;       // [T, nkv, 128] bf16
  const uint16_t* value;     // [T, nkv, 128] bf16
  int64_t stride_key_t, stride_key_h;      // elements, multiples of 8
  int64_t stride_value_t, stride_value_h;
  const int64_t* slots;      // [T]; < 0: skip
  void* cache;               // [num_blocks, nkv, bs, 256] bf16 or uint8 (fp8)
  int64_t num_tokens;
  int num_kv_heads;
  int block_size_log2;
  int64_t num_slots;
  int64_t stride_cache_block, stride_cache_head;
  bool fp8;
  const float* k_scale;      // fp8 only
  const float* v_scale;
};

void reshape_and_cache_ref(const ReshapeAndCacheParams& p);
void reshape_and_cache_launch(const ReshapeAndCacheParams& p, CUstream_st* stream);

}  // namespace m3rt
