// CPU reference of reshape_and_cache: cache[slot] = K | V, as bf16 or e4m3(x / scale).
#include "m3rt/dtype.h"
#include "ops/common/ref_common.h"
#include "ops/reshape_and_cache/reshape_and_cache.h"

namespace m3rt {

void reshape_and_cache_ref(const ReshapeAndCacheParams& p) {
  for (int64_t t = 0; t < p.num_tokens; ++t)
    check_slot_and_position("reshape_and_cache", t, p.slots[t], p.num_slots, 0, -1);
  const int64_t bs = int64_t(1) << p.block_size_log2;
  for (int64_t t = 0; t < p.num_tokens; ++t) {
    const int64_t slot = p.slots[t];
    if (slot < 0) continue;
    for (int h = 0; h < p.num_kv_heads; ++h) {
      const uint16_t* k = p.key + t * p.stride_key_t + h * p.stride_key_h;
      const uint16_t* v = p.value + t * p.stride_value_t + h * p.stride_value_h;
      const int64_t row = (slot / bs) * p.stride_cache_block + h * p.stride_cache_head + (slot % bs) * 256;
      for (int d = 0; d < 128; ++d) {
        if (p.fp8) {
          uint8_t* c = static_cast<uint8_t*>(p.cache) + row;
          c[d] = float_to_e4m3(bf16_to_float(k[d]) / *p.k_scale);
          c[128 + d] = float_to_e4m3(bf16_to_float(v[d]) / *p.v_scale);
        } else {
          uint16_t* c = static_cast<uint16_t*>(p.cache) + row;
          c[d] = k[d];
          c[128 + d] = v[d];
        }
      }
    }
  }
}

}  // namespace m3rt
