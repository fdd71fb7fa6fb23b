// CPU reference of MSA sparse attention (../shared/spec/msa.md §4): fp32 dot products, fp64 softmax
// sums, built with -ffp-contract=off. Per (token, KV head) the used keys are gathered and decoded
// once, then every query head of the group is evaluated:
//   k_nd = float(k code) [* k_scale in fp32],  v_nd likewise with v_scale
//   s_n  = softmax_scale * dot_n        dot_n = sum over d = 0..127 in order of q_d * k_nd (fp32)
//   m    = max_n s_n (fp32)
//   w_n  = exp(double(s_n) - double(m)),   den = sum_n w_n (double, keys in list order)
//   out_d = (sum_n w_n * double(v_nd)) / den, rounded to bf16 once (double -> bf16 directly)
//   lse  = float(double(m) + log(den))
// A row with no key writes out = 0 and lse = -inf. NaN inputs propagate (a NaN score never becomes
// the max, so its weight and the row turn NaN).
#include <algorithm>
#include <cmath>
#include <cstring>
#include <string>
#include <vector>

#include "m3rt/dtype.h"
#include "m3rt/error.h"
#include "ops/common/ref_common.h"
#include "ops/msa_attention/msa_attention.h"

namespace m3rt {

namespace {

constexpr const char* kOp = "msa_attention";
constexpr int kBs = 128;   // tokens per page == sparse block
constexpr int kDim = 128;  // head dim; a cache row holds K (dims 0..127) then V (128..255)

std::string str(int64_t v) { return std::to_string(v); }


// bf16 of a double, rounded once (to nearest, ties to even). A plain double -> float -> bf16 can
// round twice: when the float lands exactly on a bf16 midpoint but the double was not there, the
// float is moved one float ulp towards the double first, so the second rounding sees the side.
uint16_t bf16_of(double x) {
  float f = float(x);
  if ((float_bits(f) & 0xFFFFu) == 0x8000u && double(f) != x && std::isfinite(f))
    f = std::nextafter(f, x > double(f) ? INFINITY : -INFINITY);
  return float_to_bf16(f);
}

// Visible key range [lo, hi) of a row at position `pos` of a request with `len` keys.
void key_range(const MsaParams& p, int64_t pos, int64_t len, int64_t* lo, int64_t* hi) {
  *hi = p.causal ? std::min(pos + 1, len) : len;
  *lo = p.window_left > 0 ? std::max<int64_t>(0, pos - p.window_left + 1) : 0;
}

// The used entries of one top-k list, in list order: ids in [0, nb) not seen before.
int used_ids(const MsaParams& p, int64_t t, int g, int64_t nb, std::vector<int>& ids) {
  ids.clear();
  const int32_t* list = p.topk + g * p.topk_stride_h + t * p.topk_stride_t;
  for (int i = 0; i < p.topk_k; ++i) {
    const int32_t id = list[i * p.topk_stride_k];
    if (id < 0 || id >= nb) continue;
    if (std::find(ids.begin(), ids.end(), id) != ids.end()) continue;
    ids.push_back(id);
  }
  return int(ids.size());
}

int64_t visible_blocks(int64_t hi) { return hi > 0 ? (hi + kBs - 1) / kBs : 0; }

RequestLayout layout(const MsaParams& p) {
  return {p.cu_seqlens_q, p.seq_lens, p.num_seqs, p.num_tokens, p.decode_query_len, p.max_query_len,
          p.max_blocks};
}

// Rejects lengths and page ids the kernels cannot report (they are device-resident): called before
// anything is written.
void check_indices(const MsaParams& p) {
  check_request_layout(kOp, layout(p), "the q rows");
  // Every page a used top-k entry points at (ids < the row's visible blocks <= max_blocks).
  std::vector<int> ids;
  for (int64_t t = 0; t < p.num_tokens; ++t) {
    int b = 0;
    int64_t pos = 0, lo = 0, hi = 0;
    if (!msa_token_position(p, t, &b, &pos)) continue;
    key_range(p, pos, p.seq_lens[b], &lo, &hi);
    const int32_t* row = p.block_table + b * p.block_table_stride;
    for (int g = 0; g < p.num_kv_heads; ++g) {
      used_ids(p, t, g, visible_blocks(hi), ids);
      for (size_t i = 0; i < ids.size(); ++i) {
        const int32_t page = row[ids[i]];
        if (page < 0 || page >= p.num_cache_blocks)
          throw_arg_error(kOp, "block_table[" + str(b) + "][" + str(ids[i]) + "]", str(page),
                          "must lie in [0, num_cache_blocks = " + str(p.num_cache_blocks) +
                              ") (block " + str(ids[i]) + " is selected by topk[" + str(g) + "][" +
                              str(t) + "], seq_len " + str(p.seq_lens[b]) + ")");
      }
    }
  }
}

// One (token, KV head): the group's G query heads over the keys of the used blocks.
void attend(const MsaParams& p, int64_t t, int g, std::vector<int>& ids, std::vector<float>& kt,
            std::vector<float>& v, std::vector<float>& s, std::vector<double>& acc) {
  const int G = p.num_heads / p.num_kv_heads;
  int b = 0;
  int64_t pos = 0, lo = 0, hi = 0;
  int64_t n_keys = 0;
  if (msa_token_position(p, t, &b, &pos)) {
    key_range(p, pos, p.seq_lens[b], &lo, &hi);
    used_ids(p, t, g, visible_blocks(hi), ids);
    // Gather the keys: K dim-major (kt[d * cap + i]) so the dot products run side by side over
    // keys in the inner loop, V key-major.
    const size_t cap = ids.size() * kBs;
    kt.resize(size_t(kDim) * cap);
    v.resize(cap * kDim);
    const float ks = p.fp8 ? *p.k_scale : 1.f, vs = p.fp8 ? *p.v_scale : 1.f;
    const int32_t* table_row = p.block_table + b * p.block_table_stride;
    for (int id : ids) {
      const int64_t first = std::max<int64_t>(lo, int64_t(id) * kBs);
      const int64_t last = std::min<int64_t>(hi, int64_t(id + 1) * kBs);
      const int64_t page = table_row[id];
      for (int64_t n = first; n < last; ++n, ++n_keys) {
        const int64_t row = ((page * p.num_kv_heads + g) * kBs + n % kBs) * 2 * kDim;
        for (int d = 0; d < kDim; ++d) {
          float k, x;
          if (p.fp8) {
            const uint8_t* c = static_cast<const uint8_t*>(p.cache) + row;
            k = e4m3_code_to_float(c[d]) * ks;
            x = e4m3_code_to_float(c[kDim + d]) * vs;
          } else {
            const uint16_t* c = static_cast<const uint16_t*>(p.cache) + row;
            k = bf16_to_float(c[d]);
            x = bf16_to_float(c[kDim + d]);
          }
          kt[size_t(d) * cap + size_t(n_keys)] = k;
          v[size_t(n_keys) * kDim + size_t(d)] = x;
        }
      }
    }
    const size_t n = size_t(n_keys);
    s.resize(n);
    for (int hh = 0; hh < G && n > 0; ++hh) {
      const int h = g * G + hh;
      const uint16_t* qh = p.q + t * p.q_stride_t + h * p.q_stride_h;
      std::fill(s.begin(), s.end(), 0.f);
      for (int d = 0; d < kDim; ++d) {
        const float qd = bf16_to_float(qh[d]);
        const float* kd = kt.data() + size_t(d) * cap;
        for (size_t i = 0; i < n; ++i) s[i] += qd * kd[i];
      }
      float m = -INFINITY;
      for (size_t i = 0; i < n; ++i) {
        s[i] = p.softmax_scale * s[i];
        if (s[i] > m) m = s[i];
      }
      double den = 0;
      acc.assign(kDim, 0.0);
      for (size_t i = 0; i < n; ++i) {
        const double w = std::exp(double(s[i]) - double(m));
        den += w;
        const float* vi = v.data() + i * kDim;
        for (int d = 0; d < kDim; ++d) acc[size_t(d)] += w * double(vi[d]);
      }
      uint16_t* o = p.out + t * p.out_stride_t + h * p.out_stride_h;
      for (int d = 0; d < kDim; ++d) o[d] = bf16_of(acc[size_t(d)] / den);
      if (p.lse) p.lse[t * p.lse_stride_t + h] = float(double(m) + std::log(den));
    }
  }
  if (n_keys > 0) return;
  for (int hh = 0; hh < G; ++hh) {  // no visible key: out 0, lse -inf
    const int h = g * G + hh;
    std::memset(p.out + t * p.out_stride_t + h * p.out_stride_h, 0, kDim * sizeof(uint16_t));
    if (p.lse) p.lse[t * p.lse_stride_t + h] = -INFINITY;
  }
}

}  // namespace

bool msa_token_position(const MsaParams& p, int64_t t, int* seq, int64_t* position) {
  // The position may be negative (seq_len < dql): a causal row then sees no key, a non-causal one
  // every key.
  return request_token_position(layout(p), t, seq, position);
}

void msa_attention_ref(const MsaParams& p) {
  check_indices(p);
  std::vector<int> ids;
  std::vector<float> kt, v, s;
  std::vector<double> acc;
  for (int64_t t = 0; t < p.num_tokens; ++t)
    for (int g = 0; g < p.num_kv_heads; ++g) attend(p, t, g, ids, kt, v, s, acc);
}

}  // namespace m3rt
