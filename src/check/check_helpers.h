// Internal: helpers shared by the per-op checks of `m3rt check` (src/ops/<op>/check_<op>.cpp).
//
// Each check draws fresh inputs, runs the op on the device under test with every output poisoned
// (0xFF bytes: NaN in bf16, fp16 and e4m3), and compares with
//   - the CPU reference (the op on CPU tensors) when the device is a GPU, and
//   - an fp64 evaluation of the spec's formulas, written in the op's check, when the device is the CPU.
// Tolerances are in units of the output dtype; copies and untouched memory must match bitwise.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "check/check_cases.h"
#include "core/scoped_env.h"
#include "m3rt/tensor.h"

namespace m3rt::detail {

constexpr uint8_t kPoison = 0xFF;
// RoPE in fp32 (two rounded products, then a rounded sum) against fp64: the absolute error is at
// most ~3 fp32 ulps of the larger term (|term| < 16 here, so < 6e-6), which for a result that
// nearly cancels is many bf16 ulps of the result. Elements within this distance pass.
constexpr double kRopeAbsTol = 1e-5;

Tensor poisoned(const std::vector<int64_t>& shape, DType dtype, Device device);

// abs_tol: see compare_codes; used only against the fp64 oracle, never GPU vs reference.
void add_row(CheckContext& c, const std::string& output, const TensorView& actual,
             const TensorView& expected, DType code_dtype, double tolerance, double abs_tol = 0);

float b2f(uint16_t v);

// A check row's claim counters (claim_counters of the paged-KV write ops): pct -2 none; -1 given,
// the op's own rule; P >= 0 given and P% claimed (environment variable `env_name`, set for the
// object's life on a GPU). A GPU row with counters checks after the call that they are zero again.
class CheckClaims {
 public:
  CheckClaims(int pct, const char* env_name, Device device);
  TensorView view() const { return pct_ == -2 ? TensorView{} : counters_.view(); }
  static std::string suffix(int pct);  // the variant's " cl" / " cl30", empty without counters
  void add_rows(CheckContext& c) const;  // "claim_counters": all zero (GPU rows with counters)

 private:
  int pct_;
  Tensor counters_;
  std::string value_;
  ScopedEnv env_;
};

// fp64 partial NeoX RoPE of one head given in fp64, with the bf16 table row; rounded to bf16.
void oracle_rope_f64(const double* n, const uint16_t* cs, int rotary_dim, uint16_t* out);

// fp64 RoPE of a bf16 head.
void oracle_rope(const uint16_t* x, const uint16_t* cs, int rotary_dim, uint16_t* out);

// Stores 128 bf16 values into a cache row half: bf16, or e4m3(value / scale).
void oracle_store(void* cache, bool fp8, int64_t elem, const uint16_t* v, double scale);

int64_t cache_elem(const TensorView& cache, int64_t slot, int h);

// A random bf16 code in [-1, 1], or an e4m3 code of a value in [-2, 2].
uint16_t random_code(Rng& rng, bool fp8);

// The batch layout of an MSA check (indexer, attention): requests with `seq_lens` tokens and
// `q_lens` query tokens each (prefill), or `dql` rows each (decode, q_lens ignored). Every 128-token
// block of a request gets its own page of a shuffled set of `pages` (= the blocks used + 3 spare
// pages nobody references); block-table entries past a request's blocks hold garbage ids
// (-1, out-of-range ids, a spare page), so a kernel that reads one fails.
struct PagedBatch {
  std::vector<int32_t> cu;     // [B + 1] query-token offsets
  std::vector<int> blocks;     // [B] blocks of each request
  Tensor cu_seqlens_q, seq_lens, block_table;  // host int32 tensors; table [B, width]
  int64_t T = 0;
  int max_query_len = 0, width = 0, pages = 0;
  int32_t page(int b, int j) const { return block_table.ptr<int32_t>()[b * width + j]; }
};
PagedBatch make_paged_batch(Rng& rng, const std::vector<int>& seq_lens, const std::vector<int>& q_lens, int dql);

}  // namespace m3rt::detail
