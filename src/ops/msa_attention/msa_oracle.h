// Internal: an fp64 oracle of MSA sparse attention, used by the tests and by `m3rt check` (on the
// CPU) to check the reference; README.md here, "Numerics".
//
// Independent of the reference's code: positions from its own reading of cu_seqlens_q / the decode
// layout, and the keys of a row enumerated explicitly — key n < seq_len is visible when
//   (causal: n <= p) and (window: n >= p - window_left + 1) and block n / 128 appears anywhere in
//   the row's top-k list
// (so -1, ids past the visible blocks and repeats need no rule: they select no further key). Then,
// all in double: k = code * k_scale, v = code * v_scale (exact products), s_n = scale * sum_d q_d k_nd,
// out = sum_n exp(s_n - max) v_n / sum_n exp(s_n - max), lse = max + log(sum_n exp(s_n - max)).
#pragma once

#include <cstdint>
#include <vector>

#include "m3rt/msa_attention.h"
#include "ops/msa_attention/msa_attention.h"

namespace m3rt::detail {

struct MsaOracle {
  int64_t num_tokens = 0;
  int num_heads = 0;
  std::vector<double> out;      // [T, Hq, 128]; 0 for a row with no visible key
  std::vector<double> abs_out;  // [T, Hq, 128]: sum_n p_n |v_n| / sum_n p_n (the scale of P's rounding)
  std::vector<double> lse;      // [T, Hq]; -inf for a row with no visible key
  std::vector<int64_t> keys;    // [T, Hq]: visible keys of the row
  double out_at(int64_t t, int h, int d) const { return out[size_t((t * num_heads + h) * 128 + d)]; }
  double lse_at(int64_t t, int h) const { return lse[size_t(t * num_heads + h)]; }
  int64_t keys_at(int64_t t, int h) const { return keys[size_t(t * num_heads + h)]; }
};

// The oracle of the call `p` describes (msa_call_params over host tensors). `p` must point at HOST copies of the inputs (q, cache,
// scales, topk, cu_seqlens_q, seq_lens, block_table), consistent (what msa_attention_ref accepts);
// p.out and p.lse are not read.
MsaOracle msa_oracle(const MsaParams& p);

// bf16 of a double, rounded once (to nearest, ties to even), by comparing the two neighbours in
// double.
uint16_t msa_oracle_bf16(double x);

}  // namespace m3rt::detail
