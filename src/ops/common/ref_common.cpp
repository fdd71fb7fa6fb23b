// Helpers shared by the CPU references (ref_common.h).
#include "ops/common/ref_common.h"

#include <algorithm>
#include <array>

namespace m3rt {

namespace {
std::string str(int64_t v) { return std::to_string(v); }
constexpr int64_t kBlock = 128;
}  // namespace

float e4m3_code_to_float(uint8_t code) {
  static const std::array<float, 256> table = [] {
    std::array<float, 256> t{};
    for (int c = 0; c < 256; ++c) t[size_t(c)] = e4m3_to_float(uint8_t(c));
    return t;
  }();
  return table[code];
}

void check_request_layout(const char* op, const RequestLayout& r, const char* rows) {
  const int B = r.num_seqs;
  const int32_t* cu = r.cu_seqlens_q;
  if (cu) {
    if (cu[0] != 0) throw_arg_error(op, "cu_seqlens_q[0]", str(cu[0]), "must be 0");
    for (int b = 0; b < B; ++b)
      if (cu[b + 1] < cu[b])
        throw_arg_error(op, "cu_seqlens_q[" + str(b + 1) + "]", str(cu[b + 1]),
                        "must be >= cu_seqlens_q[" + str(b) + "] = " + str(cu[b]) + " (non-decreasing)");
    if (cu[B] != r.num_tokens)
      throw_arg_error(op, "cu_seqlens_q[" + str(B) + "]", str(cu[B]),
                      "must equal T = " + str(r.num_tokens) + " (" + rows + ")");
  }
  for (int b = 0; b < B; ++b) {
    const int64_t len = r.seq_lens[b];
    const std::string arg = "seq_lens[" + str(b) + "]";
    if (len < 0) throw_arg_error(op, arg, str(len), "must be >= 0");
    if (cu) {
      const int64_t q_len = int64_t(cu[b + 1]) - cu[b];
      if (q_len > r.max_query_len)
        throw_arg_error(op, "cu_seqlens_q[" + str(b + 1) + "] - cu_seqlens_q[" + str(b) + "]", str(q_len),
                        "must be <= max_query_len = " + str(r.max_query_len));
      if (len < q_len)
        throw_arg_error(op, arg, str(len),
                        "must be >= the request's query length " + str(q_len) + " (cu_seqlens_q[" +
                            str(b + 1) + "] - cu_seqlens_q[" + str(b) + "])");
    }
    const int64_t blocks = (len + kBlock - 1) / kBlock;
    if (blocks > r.max_blocks)
      throw_arg_error(op, arg, str(len),
                      "must be <= 128 * max_blocks = " + str(kBlock * r.max_blocks) + " (its " + str(blocks) +
                          " blocks must fit block_table's " + str(r.max_blocks) + " columns)");
  }
}

bool request_token_position(const RequestLayout& r, int64_t t, int* seq, int64_t* position) {
  if (t < 0 || t >= r.num_tokens) return false;
  int b = 0;
  int64_t pos = 0;
  if (r.cu_seqlens_q) {
    // The request b with cu[b] <= t < cu[b + 1] (empty requests own no token).
    const int32_t* cu = r.cu_seqlens_q;
    const int32_t* it = std::upper_bound(cu, cu + r.num_seqs + 1, t);
    if (it == cu || it == cu + r.num_seqs + 1) return false;
    b = int(it - cu) - 1;
    pos = int64_t(r.seq_lens[b]) - (int64_t(cu[b + 1]) - cu[b]) + (t - cu[b]);
  } else {
    if (r.decode_query_len < 1) return false;
    b = int(t / r.decode_query_len);
    if (b >= r.num_seqs) return false;
    pos = int64_t(r.seq_lens[b]) - r.decode_query_len + t % r.decode_query_len;
  }
  *seq = b;
  *position = pos;
  return true;
}

}  // namespace m3rt
