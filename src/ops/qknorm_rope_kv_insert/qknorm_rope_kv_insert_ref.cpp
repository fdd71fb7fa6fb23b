// CPU reference of qknorm_rope_kv_insert: plain fp32 loops (../shared/spec/dspark.md §5.3; sparse
// rows: msa.md §1.4, §2.2-2.3), built with -ffp-contract=off. Norm and RoPE stay in fp32 with a
// single rounding to bf16 at the end.
#include <cmath>
#include <vector>

#include "m3rt/dtype.h"
#include "ops/common/ref_common.h"
#include "ops/qknorm_rope_kv_insert/qknorm_rope_kv_insert.h"

namespace m3rt {

namespace {
// norm + rope of one 128-dim head, fp32 in and out.
void norm_rope_head(const uint16_t* x, const uint16_t* w, const uint16_t* cs, int R, float eps,
                    float* out) {
  float xf[128], n[128];
  for (int d = 0; d < 128; ++d) xf[d] = bf16_to_float(x[d]);
  const float inv_rms = 1.f / std::sqrt(head_sum_of_squares(xf) / 128.f + eps);
  for (int d = 0; d < 128; ++d) n[d] = xf[d] * inv_rms * (1.f + bf16_to_float(w[d]));
  for (int d = 0; d < 128; ++d) out[d] = n[d];
  const int half = R / 2;
  for (int i = 0; i < half; ++i) {
    const float c = bf16_to_float(cs[i]), s = bf16_to_float(cs[half + i]);
    out[i] = n[i] * c - n[i + half] * s;
    out[i + half] = n[i + half] * c + n[i] * s;
  }
}
}  // namespace

void qknorm_rope_kv_insert_ref(const QknormRopeKvInsertParams& p) {
  const char* op = "qknorm_rope_kv_insert";
  const int nq = p.num_heads, nkv = p.num_kv_heads, R = p.rotary_dim;
  const int nidx = p.num_index_heads;
  const bool insert = p.insert != QkvInsertMode::kNone;
  // Every index is checked before anything is written.
  for (int64_t t = 0; t < p.num_tokens; ++t) {
    const int64_t slot = insert ? p.slots[t] : -1;
    check_slot_and_position(op, t, slot, insert ? p.num_slots : INT64_MAX, p.positions[t],
                            p.max_pos);
    if (nidx > 0 && p.index_slots[t] >= p.index_num_slots) {
      throw_arg_error(op, "index_slot_mapping[" + std::to_string(t) + "]", std::to_string(p.index_slots[t]),
                      "must be < num_blocks * 128 = " + std::to_string(p.index_num_slots));
    }
  }
  const int64_t bs = int64_t(1) << p.block_size_log2;
  float y[128];
  for (int64_t t = 0; t < p.num_tokens; ++t) {
    uint16_t* row = p.qkv + t * p.stride_qkv_t;
    const uint16_t* cs = p.cos_sin + p.positions[t] * R;
    for (int h = 0; h < nq; ++h) {
      uint16_t* q = row + h * 128;
      norm_rope_head(q, p.q_norm_weight, cs, R, p.eps, y);
      for (int d = 0; d < 128; ++d) {
        const uint16_t qb = float_to_bf16(y[d]);
        const int64_t o = t * int64_t(nq) * 128 + h * 128 + d;
        if (p.q_out) p.q_out[o] = qb;
        if (p.q_fp8_out) p.q_fp8_out[o] = float_to_e4m3(bf16_to_float(qb) * p.q_fp8_inv_scale);
        if (p.q_in_place) q[d] = qb;
      }
    }
    const int64_t slot = insert ? p.slots[t] : -1;
    for (int h = 0; h < nkv; ++h) {
      uint16_t* k = row + (nq + h) * 128;
      const uint16_t* v = row + (nq + nkv + h) * 128;
      norm_rope_head(k, p.k_norm_weight, cs, R, p.eps, y);
      for (int d = 0; d < 128; ++d) k[d] = float_to_bf16(y[d]);
      if (slot < 0) continue;
      const int64_t base = (slot / bs) * p.stride_cache_block + h * p.stride_cache_head + (slot % bs) * 256;
      for (int d = 0; d < 128; ++d) {
        if (p.insert == QkvInsertMode::kFp8) {
          uint8_t* c8 = static_cast<uint8_t*>(p.cache);
          c8[base + d] = float_to_e4m3(bf16_to_float(k[d]) / *p.k_scale);
          c8[base + 128 + d] = float_to_e4m3(bf16_to_float(v[d]) / *p.v_scale);
        } else {
          uint16_t* c16 = static_cast<uint16_t*>(p.cache);
          c16[base + d] = k[d];
          c16[base + 128 + d] = v[d];
        }
      }
    }
    if (nidx == 0) continue;
    // Sparse row: index_q heads to index_q_out only, index_k in place and into the index cache,
    // bf16 or e4m3 of the bf16-rounded value with no scale.
    for (int h = 0; h < nidx; ++h) {
      norm_rope_head(row + (nq + 2 * nkv + h) * 128, p.index_q_norm_weight, cs, R, p.eps, y);
      for (int d = 0; d < 128; ++d) {
        const uint16_t qb = float_to_bf16(y[d]);
        const int64_t o = (t * nidx + h) * 128 + d;
        if (p.index_fp8) {
          static_cast<uint8_t*>(p.index_q_out)[o] = float_to_e4m3(bf16_to_float(qb));
        } else {
          static_cast<uint16_t*>(p.index_q_out)[o] = qb;
        }
      }
    }
    uint16_t* ik = row + (nq + 2 * nkv + nidx) * 128;
    norm_rope_head(ik, p.index_k_norm_weight, cs, R, p.eps, y);
    for (int d = 0; d < 128; ++d) ik[d] = float_to_bf16(y[d]);
    const int64_t islot = p.index_slots[t];
    if (islot < 0) continue;
    for (int d = 0; d < 128; ++d) {
      if (p.index_fp8) {
        static_cast<uint8_t*>(p.index_cache)[islot * 128 + d] = float_to_e4m3(bf16_to_float(ik[d]));
      } else {
        static_cast<uint16_t*>(p.index_cache)[islot * 128 + d] = ik[d];
      }
    }
  }
}

}  // namespace m3rt
