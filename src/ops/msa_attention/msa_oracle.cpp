// The fp64 oracle of MSA sparse attention; see msa_oracle.h.
#include "ops/msa_attention/msa_oracle.h"

#include <cmath>

#include "m3rt/dtype.h"

namespace m3rt::detail {

namespace {

constexpr int kBs = 128, kDim = 128;

double code_value(const MsaParams& p, int64_t elem) {
  if (p.fp8) return e4m3_to_float(static_cast<const uint8_t*>(p.cache)[elem]);
  return bf16_to_float(static_cast<const uint16_t*>(p.cache)[elem]);
}

}  // namespace

uint16_t msa_oracle_bf16(double x) {
  if (std::isnan(x)) return 0x7FC0;
  // c: a bf16 within one code of x (float(x) then bf16 may round twice); the other neighbour of x
  // is one code further from or closer to zero (codes are sign-magnitude).
  const uint16_t c = float_to_bf16(float(x));
  const double cv = bf16_to_float(c);
  if (cv == x || std::isinf(cv)) return c;
  const uint16_t other = std::fabs(cv) > std::fabs(x) ? uint16_t(c - 1) : uint16_t(c + 1);
  const double dc = std::fabs(cv - x), dother = std::fabs(double(bf16_to_float(other)) - x);
  if (dc != dother) return dc < dother ? c : other;
  return (c & 1) ? other : c;  // a tie: the even code
}

MsaOracle msa_oracle(const MsaParams& p) {
  MsaOracle o;
  o.num_tokens = p.num_tokens;
  o.num_heads = p.num_heads;
  const size_t rows = size_t(p.num_tokens) * size_t(p.num_heads);
  o.out.assign(rows * kDim, 0.0);
  o.abs_out.assign(rows * kDim, 0.0);
  o.lse.assign(rows, -INFINITY);
  o.keys.assign(rows, 0);
  const double ks = p.fp8 ? double(*p.k_scale) : 1.0, vs = p.fp8 ? double(*p.v_scale) : 1.0;
  const int G = p.num_heads / p.num_kv_heads;
  std::vector<double> s, q(kDim), acc(kDim), acc_abs(kDim), kv;
  std::vector<int64_t> keys;
  for (int64_t t = 0; t < p.num_tokens; ++t) {
    // The request and position of t.
    int b = 0;
    int64_t pos = 0;
    if (p.cu_seqlens_q) {
      while (p.cu_seqlens_q[b + 1] <= t) ++b;  // cu[B] == T > t ends the walk
      const int64_t q_len = p.cu_seqlens_q[b + 1] - p.cu_seqlens_q[b];
      pos = p.seq_lens[b] - q_len + (t - p.cu_seqlens_q[b]);
    } else {
      b = int(t / p.decode_query_len);
      pos = int64_t(p.seq_lens[b]) - p.decode_query_len + t % p.decode_query_len;
    }
    const int64_t len = p.seq_lens[b];
    for (int g = 0; g < p.num_kv_heads; ++g) {
      // The visible keys, enumerated.
      keys.clear();
      const int32_t* list = p.topk + g * p.topk_stride_h + t * p.topk_stride_t;
      for (int64_t n = 0; n < len; ++n) {
        if (p.causal && n > pos) continue;
        if (p.window_left > 0 && n < pos - p.window_left + 1) continue;
        bool selected = false;
        for (int i = 0; i < p.topk_k && !selected; ++i) selected = list[i * p.topk_stride_k] == n / kBs;
        if (selected) keys.push_back(n);
      }
      // Their K and V rows in double (k = code * k_scale, v = code * v_scale, exact).
      kv.resize(keys.size() * 2 * kDim);
      for (size_t i = 0; i < keys.size(); ++i) {
        const int64_t n = keys[i];
        const int64_t page = p.block_table[b * p.block_table_stride + n / kBs];
        const int64_t row = ((page * p.num_kv_heads + g) * kBs + n % kBs) * 2 * kDim;
        for (int d = 0; d < 2 * kDim; ++d)
          kv[i * 2 * kDim + size_t(d)] = code_value(p, row + d) * (d < kDim ? ks : vs);
      }
      for (int h = g * G; h < (g + 1) * G; ++h) {
        const size_t r = size_t(t * p.num_heads + h);
        o.keys[r] = int64_t(keys.size());
        if (keys.empty()) continue;
        const uint16_t* qh = p.q + t * p.q_stride_t + h * p.q_stride_h;
        for (int d = 0; d < kDim; ++d) q[size_t(d)] = bf16_to_float(qh[d]);
        s.assign(keys.size(), 0.0);
        double m = -INFINITY;
        for (size_t i = 0; i < keys.size(); ++i) {
          const double* k = kv.data() + i * 2 * kDim;
          double dot = 0;
          for (int d = 0; d < kDim; ++d) dot += q[size_t(d)] * k[d];
          s[i] = double(p.softmax_scale) * dot;
          m = std::max(m, s[i]);
        }
        double den = 0;
        acc.assign(kDim, 0.0);
        acc_abs.assign(kDim, 0.0);
        for (size_t i = 0; i < keys.size(); ++i) {
          const double* v = kv.data() + i * 2 * kDim + kDim;
          const double w = std::exp(s[i] - m);
          den += w;
          for (int d = 0; d < kDim; ++d) {
            acc[size_t(d)] += w * v[d];
            acc_abs[size_t(d)] += w * std::fabs(v[d]);
          }
        }
        for (int d = 0; d < kDim; ++d) {
          o.out[r * kDim + size_t(d)] = acc[size_t(d)] / den;
          o.abs_out[r * kDim + size_t(d)] = acc_abs[size_t(d)] / den;
        }
        o.lse[r] = m + std::log(den);
      }
    }
  }
  return o;
}

}  // namespace m3rt::detail
