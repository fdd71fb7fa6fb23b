// Helpers shared by the per-op checks of `m3rt check`; see check_helpers.h.
#include "check/check_helpers.h"

#include <algorithm>
#include <climits>
#include <numeric>

#include "check/compare.h"
#include "m3rt/dtype.h"
#include "m3rt/ops.h"

namespace m3rt::detail {

Tensor poisoned(const std::vector<int64_t>& shape, DType dtype, Device device) {
  Tensor t = Tensor::empty(shape, dtype, device);
  t.fill_bytes(kPoison);
  return t;
}

CheckClaims::CheckClaims(int pct, const char* env_name, Device device)
    : pct_(pct),
      counters_(Tensor::empty({kClaimCounterInts}, DType::kInt32, device)),
      value_(std::to_string(pct)),
      env_(env_name, pct >= 0 && device.is_cuda() ? value_.c_str() : nullptr) {
  counters_.fill_bytes(0);
}

std::string CheckClaims::suffix(int pct) {
  return pct == -2 ? "" : pct < 0 ? " cl" : " cl" + std::to_string(pct);
}

void CheckClaims::add_rows(CheckContext& c) const {
  if (pct_ == -2 || !counters_.device().is_cuda()) return;  // the CPU path ignores them
  Tensor zeros = Tensor::empty({kClaimCounterInts}, DType::kInt32);
  zeros.fill_bytes(0);
  add_row(c, "claim_counters", counters_.to(Device::cpu()), zeros, DType::kInt32, 0);
}

void add_row(CheckContext& c, const std::string& output, const TensorView& actual,
             const TensorView& expected, DType code_dtype, double tolerance, double abs_tol) {
  CheckRow row;
  row.op = c.op;
  row.variant = c.variant;
  row.device = c.device.str();
  row.output = output;
  fill_row(row, compare_codes(actual, expected, code_dtype, tolerance, abs_tol), code_dtype, tolerance);
  if (abs_tol > 0) row.unit += " or " + std::to_string(abs_tol).substr(0, 7) + " abs";
  c.rows.push_back(row);
}

float b2f(uint16_t v) { return bf16_to_float(v); }

void oracle_rope_f64(const double* n, const uint16_t* cs, int rotary_dim, uint16_t* out) {
  double y[128];
  for (int d = 0; d < 128; ++d) y[d] = n[d];
  const int h = rotary_dim / 2;
  for (int i = 0; i < h; ++i) {
    const double c = b2f(cs[i]), s = b2f(cs[h + i]);
    y[i] = n[i] * c - n[i + h] * s;
    y[i + h] = n[i + h] * c + n[i] * s;
  }
  for (int d = 0; d < 128; ++d) out[d] = float_to_bf16(float(y[d]));
}

void oracle_rope(const uint16_t* x, const uint16_t* cs, int rotary_dim, uint16_t* out) {
  double n[128];
  for (int d = 0; d < 128; ++d) n[d] = b2f(x[d]);
  oracle_rope_f64(n, cs, rotary_dim, out);
}

void oracle_store(void* cache, bool fp8, int64_t elem, const uint16_t* v, double scale) {
  for (int d = 0; d < 128; ++d) {
    if (fp8) {
      static_cast<uint8_t*>(cache)[elem + d] = float_to_e4m3(float(double(b2f(v[d])) / scale));
    } else {
      static_cast<uint16_t*>(cache)[elem + d] = v[d];
    }
  }
}

int64_t cache_elem(const TensorView& cache, int64_t slot, int h) {
  const int64_t bs = cache.shape[2];
  return (slot / bs) * cache.stride[0] + h * cache.stride[1] + (slot % bs) * cache.stride[2];
}

uint16_t random_code(Rng& rng, bool fp8) {
  return fp8 ? float_to_e4m3(rng.uniform(-2.f, 2.f)) : float_to_bf16(rng.uniform(-1.f, 1.f));
}

PagedBatch make_paged_batch(Rng& rng, const std::vector<int>& seq_lens, const std::vector<int>& q_lens, int dql) {
  constexpr int kBs = 128;
  const int B = int(seq_lens.size());
  PagedBatch pb;
  pb.cu.assign(size_t(B) + 1, 0);
  for (int b = 0; b < B; ++b) {
    const int ql = dql ? dql : q_lens[size_t(b)];
    pb.cu[size_t(b) + 1] = pb.cu[size_t(b)] + ql;
    pb.max_query_len = std::max(pb.max_query_len, ql);
  }
  pb.T = pb.cu[size_t(B)];
  pb.blocks.resize(size_t(B));
  int used = 0;
  pb.width = 1;
  for (int b = 0; b < B; ++b) {
    pb.blocks[size_t(b)] = (seq_lens[size_t(b)] + kBs - 1) / kBs;
    pb.width = std::max(pb.width, pb.blocks[size_t(b)] + 1);
    used += pb.blocks[size_t(b)];
  }
  pb.pages = used + 3;
  std::vector<int32_t> perm(static_cast<size_t>(pb.pages));
  std::iota(perm.begin(), perm.end(), 0);
  std::shuffle(perm.begin(), perm.end(), rng.gen());
  const int32_t garbage[] = {-1, pb.pages, INT32_MAX, INT32_MIN, perm[size_t(pb.pages) - 1]};
  pb.block_table = Tensor::empty({B, pb.width}, DType::kInt32);
  int next = 0;
  for (int b = 0; b < B; ++b)
    for (int j = 0; j < pb.width; ++j)
      pb.block_table.ptr<int32_t>()[b * pb.width + j] =
          j < pb.blocks[size_t(b)] ? perm[size_t(next++)] : garbage[(b + j) % 5];
  pb.cu_seqlens_q = Tensor::empty({B + 1}, DType::kInt32);
  std::copy(pb.cu.begin(), pb.cu.end(), pb.cu_seqlens_q.ptr<int32_t>());
  pb.seq_lens = Tensor::empty({B}, DType::kInt32);
  std::copy(seq_lens.begin(), seq_lens.end(), pb.seq_lens.ptr<int32_t>());
  return pb;
}

}  // namespace m3rt::detail
