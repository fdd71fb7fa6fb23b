// CPU reference of the DSpark context-K/V writer: plain fp32 loops, the spec (README.md here;
// ../shared/spec/dspark.md §2.4 and §5.4). Built with -ffp-contract=off: every expression rounds
// as written.
#include <cmath>
#include <string>

#include "m3rt/dtype.h"
#include "m3rt/error.h"
#include "ops/common/ref_common.h"
#include "ops/dspark_context_kv/dspark_context_kv.h"

namespace m3rt {

void dspark_context_kv_ref(const DsparkContextKvParams& p) {
  const int L = p.num_layers, nkv = p.num_kv_heads, R = p.rotary_dim, half = R / 2;
  const int64_t bs = int64_t(1) << p.block_size_log2;
  // Check every row before writing any, so bad indices never leave a partial write.
  for (int64_t t = 0; t < p.num_ctx; ++t) {
    if (p.slots[t] >= 0) check_slot_and_position("dspark_context_kv_write", t, p.slots[t],
                                                  p.num_slots, p.positions[t], p.max_pos);
  }
  for (int64_t t = 0; t < p.num_ctx; ++t) {
    const int64_t slot = p.slots[t];
    if (slot < 0) continue;
    const int64_t pos = p.positions[t];
    const uint16_t* cs = p.cos_sin + pos * R;
    for (int l = 0; l < L; ++l) {
      const float k_scale = p.scale0[p.tables.scale_offsets[l]];
      const float v_scale = p.scale0[p.tables.scale_offsets[L + l]];
      const int64_t elem = p.fp8 ? 1 : 2;
      char* cache = static_cast<char*>(p.cache0) + p.tables.cache_offsets[l] * elem;
      for (int h = 0; h < nkv; ++h) {
        const uint16_t* k = p.all_kv + t * p.stride_all_kv_t + ((int64_t(l) * 2 + 0) * nkv + h) * 128;
        const uint16_t* v = p.all_kv + t * p.stride_all_kv_t + ((int64_t(l) * 2 + 1) * nkv + h) * 128;
        const uint16_t* w = p.k_norm_weight + l * 128;
        // K: Gemma RMSNorm in fp32, materialized to bf16.
        float kf[128], kn[128];
        for (int d = 0; d < 128; ++d) kf[d] = bf16_to_float(k[d]);
        const float ss = head_sum_of_squares(kf);
        const float inv_rms = 1.f / std::sqrt(ss / 128.f + p.eps);
        for (int d = 0; d < 128; ++d)
          kn[d] = round_bf16(kf[d] * inv_rms * (1.f + bf16_to_float(w[d])));
        // Partial NeoX RoPE in fp32 with the bf16 table, rounded to bf16.
        float kr[128];
        for (int d = 0; d < 128; ++d) kr[d] = kn[d];
        for (int i = 0; i < half; ++i) {
          const float c = bf16_to_float(cs[i]), s = bf16_to_float(cs[half + i]);
          kr[i] = kn[i] * c - kn[i + half] * s;
          kr[i + half] = kn[i + half] * c + kn[i] * s;
        }
        const int64_t row = (slot / bs) * p.stride_cache_block + h * p.stride_cache_head +
                            (slot % bs) * 256;
        for (int d = 0; d < 128; ++d) {
          const float kv = round_bf16(kr[d]);
          const float vv = bf16_to_float(v[d]);
          if (p.fp8) {
            uint8_t* c8 = reinterpret_cast<uint8_t*>(cache);
            c8[row + d] = float_to_e4m3(kv / k_scale);
            c8[row + 128 + d] = float_to_e4m3(vv / v_scale);
          } else {
            uint16_t* c16 = reinterpret_cast<uint16_t*>(cache);
            c16[row + d] = float_to_bf16(kv);
            c16[row + 128 + d] = v[d];
          }
        }
      }
    }
  }
}

}  // namespace m3rt
