// The set comparison of lightning-indexer selections; see indexer_compare.h.
#include "ops/lightning_indexer/indexer_compare.h"

#include <algorithm>
#include <array>
#include <cstdio>
#include <memory>

#include "m3rt/dtype.h"

namespace m3rt::detail {

namespace {

constexpr int kBs = 128, kDim = 128;

// |element i| of a bf16 or e4m3 array, exact in double.
double abs_load(const void* base, bool fp8, int64_t i) {
  static const std::array<double, 256> e4m3 = [] {
    std::array<double, 256> t{};
    for (int c = 0; c < 256; ++c) t[size_t(c)] = std::fabs(double(e4m3_to_float(uint8_t(c))));
    return t;
  }();
  if (fp8) return e4m3[static_cast<const uint8_t*>(base)[i]];
  return std::fabs(double(bf16_to_float(static_cast<const uint16_t*>(base)[i])));
}

// bound[h * nb + j] = A_j of head h: the largest sum_d |q_d * k_nd| over the block's visible keys
// n <= pos, skipping NaN sums (0 when there is none, or the page lies outside the cache).
void token_bounds(const IndexerParams& p, int64_t t, int seq, int64_t pos, int nb,
                  std::vector<double>& bound) {
  const int H = p.num_heads;
  bound.assign(size_t(H) * size_t(nb), 0.0);
  std::vector<double> q(size_t(H) * kDim), kt(size_t(kDim) * kBs);
  for (int h = 0; h < H; ++h)
    for (int d = 0; d < kDim; ++d) q[size_t(h * kDim + d)] = abs_load(p.index_q, p.fp8, (t * H + h) * kDim + d);
  const int32_t* table_row = p.block_table + seq * p.block_table_stride;
  double acc[kBs];
  for (int j = 0; j < nb; ++j) {
    const int64_t page = j < p.max_blocks ? table_row[j] : -1;
    if (page < 0 || page >= p.num_cache_blocks) continue;
    const int n = int(std::min<int64_t>(kBs, pos + 1 - int64_t(j) * kBs));
    for (int i = 0; i < n; ++i)
      for (int d = 0; d < kDim; ++d)
        kt[size_t(d * kBs + i)] = abs_load(p.index_cache, p.fp8, (page * kBs + i) * kDim + d);
    for (int h = 0; h < H; ++h) {
      for (int i = 0; i < n; ++i) acc[i] = 0;
      for (int d = 0; d < kDim; ++d) {
        const double qd = q[size_t(h * kDim + d)];
        const double* kd = kt.data() + d * kBs;
        for (int i = 0; i < n; ++i) acc[i] += qd * kd[i];
      }
      double a = 0;
      for (int i = 0; i < n; ++i)
        if (!std::isnan(acc[i])) a = std::max(a, acc[i]);
      bound[size_t(h) * nb + j] = a;
    }
  }
}

std::string num(double v) {
  char buf[32];
  std::snprintf(buf, sizeof(buf), "%.9g", v);
  return buf;
}

std::string pair_text(int g, int u, const std::vector<double>& s, double allowed) {
  return "selected " + std::to_string(g) + " (score " + num(s[size_t(g)]) + ") over " +
         std::to_string(u) + " (score " + num(s[size_t(u)]) + "), allowed error " + num(allowed);
}

std::string row_text(const int32_t* row, int n) {
  std::string t;
  for (int x = 0; x < n; ++x) {
    if (x) t += ' ';
    t += std::to_string(row[x]);
  }
  return t;
}

// The first problem of one row ("" when it passes); updates r.worst_ratio / worst_where.
std::string check_row(const IndexerParams& p, const int32_t* row, int nb, const double* bound,
                      const std::vector<double>& s, double rel_tol, const std::string& who,
                      IndexerCompareResult& r) {
  const int K = p.topk, k = std::min(K, nb);
  // (a) the contract.
  for (int i = 0; i < K; ++i) {
    const int32_t id = row[i];
    const bool ok = i < k ? id >= 0 && id < nb && (i == 0 || id > row[i - 1]) : id == -1;
    if (!ok)
      return "entry " + std::to_string(i) + " = " + std::to_string(id) + " (want " +
             std::to_string(k) + " ascending ids in [0, " + std::to_string(nb) + ") then -1; row " +
             row_text(row, K) + ")";
  }
  if (nb == 0) return "";
  std::vector<char> sel(size_t(nb), 0);
  for (int i = 0; i < k; ++i) sel[size_t(row[i])] = 1;
  // (b) forced blocks.
  const int init_end = std::min(p.init_blocks, nb), local_begin = std::max(0, nb - p.local_blocks);
  auto forced = [&](int j) { return j < init_end || j >= local_begin; };
  for (int j = 0; j < nb; ++j)
    if (forced(j) && !sel[size_t(j)])
      return "forced block " + std::to_string(j) + " missing (init_blocks " +
             std::to_string(p.init_blocks) + ", local_blocks " + std::to_string(p.local_blocks) +
             ", " + std::to_string(nb) + " visible blocks)";
  // (c) ranking within the error bounds.
  std::string first;
  for (int g = 0; g < nb; ++g) {
    if (!sel[size_t(g)] || forced(g)) continue;
    const double sg = s[size_t(g)], eg = rel_tol * bound[g];
    for (int u = 0; u < nb; ++u) {
      const double su = s[size_t(u)];
      if (sel[size_t(u)] || std::isnan(su)) continue;  // a NaN u ranks below everything
      const double allowed = eg + rel_tol * bound[u];
      double ratio = INFINITY;
      bool fail = true;
      if (!std::isnan(sg)) {
        const double diff = su == sg ? 0.0 : su - sg;  // inf == inf ties
        fail = diff > allowed;
        ratio = allowed > 0 ? diff / allowed : diff > 0 ? INFINITY : diff < 0 ? -INFINITY : 0.0;
        if (std::isnan(ratio)) ratio = 0;  // inf against an infinite bound
      }
      if (ratio > r.worst_ratio || r.worst_where.empty()) {
        r.worst_ratio = std::max(r.worst_ratio, ratio);
        r.worst_where = who + pair_text(g, u, s, allowed);
      }
      if (fail && first.empty()) first = pair_text(g, u, s, allowed);
    }
  }
  return first;
}

}  // namespace

std::string IndexerCompareResult::summary() const {
  std::string s = "rows " + std::to_string(rows_checked) + ", failed " + std::to_string(rows_failed);
  if (worst_ratio > -INFINITY) s += ", closest call " + num(worst_ratio) + " of the allowed error";
  return s;
}

IndexerRowScores indexer_ref_row_scores(const IndexerParams& p) {
  return [p](int64_t t, int h, std::vector<double>& score) {
    std::vector<float> f;
    const int nb = indexer_row_scores_ref(p, t, h, f);
    score.assign(f.begin(), f.end());
    return nb;
  };
}

IndexerRowScores indexer_oracle_row_scores(const IndexerParams& p) {
  auto decode = [&p](const void* base, int64_t n) {
    auto out = std::make_shared<std::vector<double>>(size_t(n));
    for (int64_t i = 0; i < n; ++i)
      (*out)[size_t(i)] = p.fp8 ? e4m3_to_float(static_cast<const uint8_t*>(base)[i])
                                : bf16_to_float(static_cast<const uint16_t*>(base)[i]);
    return std::shared_ptr<const std::vector<double>>(out);
  };
  const auto q = decode(p.index_q, p.num_tokens * p.num_heads * kDim);
  const auto k = decode(p.index_cache, p.num_cache_blocks * kBs * kDim);
  return [p, q, k](int64_t t, int h, std::vector<double>& s) -> int {
    s.clear();
    int b = 0;
    int64_t pos = 0;
    if (p.decode_query_len > 0) {  // decode: row r of request b
      b = int(t / p.decode_query_len);
      pos = int64_t(p.seq_lens[b]) - p.decode_query_len + t % p.decode_query_len;
    } else {  // prefill: the request whose query range holds t
      while (b + 1 < p.num_seqs && p.cu_seqlens_q[b + 1] <= t) ++b;
      const int64_t first = p.cu_seqlens_q[b], q_len = p.cu_seqlens_q[b + 1] - first;
      if (t < first || t >= first + q_len) return 0;
      pos = p.seq_lens[b] - q_len + (t - first);
    }
    if (pos < 0) return 0;
    const int nb = int(pos / kBs) + 1;
    s.assign(size_t(nb), NAN);
    const double* qt = q->data() + (t * p.num_heads + h) * kDim;
    for (int64_t n = 0; n <= pos; ++n) {
      const int64_t page = p.block_table[b * p.block_table_stride + n / kBs];
      const double* kn = k->data() + (page * kBs + n % kBs) * kDim;
      double dot = 0;
      for (int d = 0; d < kDim; ++d) dot += qt[d] * kn[d];
      double& best = s[size_t(n / kBs)];
      if (!std::isnan(dot) && (std::isnan(best) || dot > best)) best = dot;
    }
    return nb;
  };
}

IndexerCompareResult compare_indexer_topk(const IndexerParams& p, const int32_t* topk,
                                          int64_t topk_stride_t, const IndexerRowScores& ref,
                                          double rel_tol) {
  IndexerCompareResult r;
  std::vector<double> bound, s;
  for (int64_t t = 0; t < p.num_tokens; ++t) {
    int seq = 0;
    int64_t pos = 0;
    const bool has = indexer_token_position(p, t, &seq, &pos);
    const int nb = has ? int(pos / kBs) + 1 : 0;
    if (has) token_bounds(p, t, seq, pos, nb, bound);
    for (int h = 0; h < p.num_heads; ++h) {
      ++r.rows_checked;
      const std::string who = "token " + std::to_string(t) + " head " + std::to_string(h) + ": ";
      const int ref_nb = ref(t, h, s);
      std::string why;
      if (ref_nb != nb || s.size() < size_t(nb)) {
        why = "the reference scores " + std::to_string(ref_nb) + " blocks, the position " +
              (has ? std::to_string(pos) : std::string("(none)")) + " gives " + std::to_string(nb);
      } else {
        why = check_row(p, topk + t * topk_stride_t + int64_t(h) * p.topk, nb,
                        nb ? bound.data() + size_t(h) * nb : nullptr, s, rel_tol, who, r);
      }
      if (!why.empty() && ++r.rows_failed <= 5) r.first_failures += who + why + "\n";
    }
  }
  return r;
}

}  // namespace m3rt::detail
