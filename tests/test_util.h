// Helpers shared by the per-op tests (src/ops/<op>/test_<op>.cpp, built into tests/test_ops) and
// tests/test_kv_cache_dtype.cpp; definitions in test_util.cpp.
//
// CPU-path tests: the op's public API on Device::cpu() tensors against fp64 oracles written from
// the spec formulas (../shared/spec/README.md, dspark.md §2.4, §5). Tolerances in dtype units:
// bf16/fp16 results within 1 code (ordered-code distance) of the fp64 value rounded once, copies
// bit-exact, e4m3 results within 1 code of the fp64 value quantized. Where a RoPE output cancels
// (|y| far below its two terms) the fp32 evaluation error of the terms is allowed instead.
// Caches are poisoned with 0xFF first; rows that no slot targets must keep every byte.
// Build with -ffp-contract=off: the tests' fp32 RoPE rounds as written.
//
// Validation tests: every rule raises m3rt::Error whose message names the argument and its value;
// table-driven bad-argument cases; out-of-range device indices on the CPU path must throw before
// writing anything. CPU tensors only; views "on cuda:0" are built but never dereferenced.
#pragma once

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <functional>
#include <map>
#include <random>
#include <string>
#include <utility>
#include <vector>

#include "m3rt/dtype.h"
#include "m3rt/error.h"
#include "m3rt/ops.h"
#include "m3rt/tensor.h"

namespace m3rt_test {

using namespace m3rt;
using ::testing::AllOf;
using ::testing::HasSubstr;
using ::testing::StartsWith;

// ================================ CPU path against fp64 oracles ================================

constexpr uint64_t kSeed = 0x6d33727431ull;
constexpr int64_t kMaxPos = 4096;
constexpr float kEps = 1e-6f;

struct Rng {
  uint64_t seed;
  std::mt19937_64 g;
  explicit Rng(uint64_t salt) : seed(kSeed + salt), g(seed) {}
  float uni(float lo, float hi) { return std::uniform_real_distribution<float>(lo, hi)(g); }
};
#define SEED_TRACE(rng) SCOPED_TRACE("seed " + std::to_string((rng).seed))

// ---- tensors ------------------------------------------------------------------------------------

uint16_t to16(DType dt, double v);
double from16(DType dt, uint16_t c);
Tensor rand16(const std::vector<int64_t>& shape, Rng& r, float lo, float hi, DType dt = DType::kBFloat16);
Tensor i64s(const std::vector<int64_t>& v);
Tensor f32(float v);
Tensor poisoned(const std::vector<int64_t>& shape, DType dt);
Tensor clone(const Tensor& t);
bool same_bytes(const Tensor& a, const Tensor& b);
bool all_ff(const void* p, size_t n);
// A bf16 [d0, d1, 128] view at element `off` of `base`: token stride s0, head stride 128.
TensorView heads_view(const Tensor& base, int64_t off, int64_t d0, int64_t d1, int64_t s0);

// The spec's RoPE table: row p = [cos(p f_i) | sin(p f_i)], f_i = theta^(-2i/R), fp32, then bf16.
Tensor rope_table(int R);

// n distinct slots of [0, num_slots), about one in five replaced by -1 (padding).
std::vector<int64_t> make_slots(Rng& r, int64_t n, int64_t num_slots);
// Random positions in [0, max_pos), the first max_pos - 1 and the second 0.
std::vector<int64_t> make_positions(Rng& r, int64_t n);
// A batch's query offsets [B + 1] (cu_seqlens_q): request b has dql tokens (decode, dql > 0) or
// q_lens[b] (prefill, dql == 0); max_query_len gets the longest.
std::vector<int32_t> query_offsets(int B, int dql, const std::vector<int>& q_lens, int& max_query_len);
// The order of a test cache's pages in its block table: 0 .. pages - 1, shuffled (when `shuffle`)
// by a generator of its own seeded from r, so that a shuffled and an identity table hold the same
// keys when both draw the cache from r.
std::vector<int32_t> page_order(const Rng& r, int pages, bool shuffle);

// ---- comparisons --------------------------------------------------------------------------------

int dist16(DType dt, uint16_t a, uint16_t b);
int dist_e4m3(uint8_t a, uint8_t b);

// e4m3fn of an fp64 value: the nearest of the 127 finite magnitudes (ties to the even code);
// |v| >= 448 saturates.
uint8_t e4m3_of(double v);

// One unit in the last place of round(v) in bf16 (7 stored mantissa bits) or fp16 (10).
double ulp16(DType dt, double v);

// `got` within one code of round(exact); or, for a sum of terms (term > 0) that cancels, within
// their fp32 evaluation error (2^-15 * term) plus `slack` plus one ulp of it.
bool near16(DType dt, uint16_t got, double exact, double term = 0, double slack = 0);

// Counts failed element checks of one test; reports the first few.
struct Mismatches {
  int count = 0;
  std::string first;
  void add(const std::string& what) {
    if (count++ < 5) first += what + "\n";
  }
  ~Mismatches() { EXPECT_EQ(count, 0) << first; }
};
std::string at(std::initializer_list<int64_t> idx);

// "name=value ..." for SCOPED_TRACE.
std::string tag(std::initializer_list<std::pair<const char*, int64_t>> kv);

// ---- fp64 oracles -------------------------------------------------------------------------------

void load_head(const uint16_t* p, double* x);
// Gemma RMSNorm: y = x / sqrt(mean(x^2) + eps) * (1 + w).
void gemma_norm64(const double* x, const double* w, int64_t n, double* y);
// Partial NeoX RoPE of a 128-vector with the bf16 table row; term[d]: sum of the terms' magnitudes.
void rope64(const double* x, const uint16_t* cs, int R, double* y, double* term);

// Every row of a poisoned [nb, nkv, bs, 256] cache: rows no slot targets must still be all 0xFF;
// the others go to check(row, token, head).
template <class F>
void check_cache(Mismatches& mm, const TensorView& cache, const std::vector<int64_t>& slots, const F& check) {
  const int64_t nb = cache.shape[0], nkv = cache.shape[1], bs = cache.shape[2];
  const int64_t row_bytes = 256 * dtype_size(cache.dtype);
  std::map<int64_t, int64_t> token_of;
  for (size_t t = 0; t < slots.size(); ++t)
    if (slots[t] >= 0) token_of[slots[t]] = int64_t(t);
  for (int64_t b = 0; b < nb; ++b)
    for (int64_t h = 0; h < nkv; ++h)
      for (int64_t o = 0; o < bs; ++o) {
        const uint8_t* row = cache.ptr<uint8_t>() + ((b * nkv + h) * bs + o) * row_bytes;
        auto it = token_of.find(b * bs + o);
        if (it != token_of.end()) {
          check(row, it->second, int(h));
        } else if (!all_ff(row, size_t(row_bytes))) {
          mm.add("untargeted cache row " + at({b, h, o}) + " was written");
        }
      }
}
// One cache row: K against its fp64 value (fp8: within 1 code of e4m3(k / ks); bf16: k_ok),
// V against the bf16 head v (fp8: within 1 code of e4m3(v / vs); bf16: bit-exact copy).
template <class KCheck>
void check_row(Mismatches& mm, const uint8_t* row, bool fp8, const double* k, const KCheck& k_ok,
               const uint16_t* v, float ks, float vs, const std::string& where) {
  const uint16_t* row16 = reinterpret_cast<const uint16_t*>(row);
  for (int d = 0; d < 128; ++d) {
    const bool k_bad = fp8 ? dist_e4m3(row[d], e4m3_of(k[d] / ks)) > 1 : !k_ok(d, row16[d]);
    const bool v_bad =
        fp8 ? dist_e4m3(row[128 + d], e4m3_of(bf16_to_float(v[d]) / double(vs))) > 1 : row16[128 + d] != v[d];
    if (k_bad) mm.add(where + " K d=" + std::to_string(d) + " want ~" + std::to_string(k[d]));
    if (v_bad) mm.add(where + " V d=" + std::to_string(d));
  }
}

// ===================================== argument validation =====================================

// The message of the m3rt::Error that fn throws ("" and a test failure when it does not throw).
std::string error_of(const std::function<void()>& fn);

Tensor filled(const std::vector<int64_t>& shape, DType dt, uint8_t byte);

// ---- call arguments: table-driven bad-argument cases -------------------------------------------

// A valid call of one op on small CPU tensors; `make` allocates tensors that live as long as it.
struct CallBase {
  std::vector<Tensor> keep;
  TensorView make(const std::vector<int64_t>& shape, DType dt, uint8_t byte = 0) {
    keep.push_back(filled(shape, dt, byte));
    return keep.back();
  }
};

// One bad-argument case: `edit` breaks the valid call; the error must contain every `want`.
template <class Call>
struct BadArg {
  const char* what;
  std::function<void(Call&)> edit;
  std::vector<std::string> want;
};

template <class Call>
void expect_bad_args(const std::vector<BadArg<Call>>& cases) {
  Call valid;
  EXPECT_NO_THROW(valid.call()) << "the unedited call must be valid";
  for (const BadArg<Call>& c : cases) {
    SCOPED_TRACE(c.what);
    Call call;
    c.edit(call);
    const std::string msg = error_of([&] { call.call(); });
    for (const std::string& w : c.want) EXPECT_THAT(msg, HasSubstr(w));
  }
}

// ---- out-of-range device indices on the CPU path: throw, write nothing --------------------------

std::vector<uint8_t> bytes_of(const TensorView& v);
void set_i64(const TensorView& v, std::initializer_list<int64_t> values);

// Runs call.call() with the bad index in the LAST row; expects an m3rt::Error naming `arg` and the
// value, and every byte of the watched tensors unchanged (rows 0.. were valid, so an op that
// wrote before checking would have changed them).
template <class Call>
void expect_throws_and_untouched(Call& call, const std::vector<TensorView>& watched,
                                 const std::string& arg, const std::string& value) {
  std::vector<std::vector<uint8_t>> before;
  for (const TensorView& v : watched) before.push_back(bytes_of(v));
  EXPECT_THAT(error_of([&] { call.call(); }), AllOf(HasSubstr(arg + " = " + value), HasSubstr("must")));
  for (size_t i = 0; i < watched.size(); ++i)
    EXPECT_EQ(bytes_of(watched[i]), before[i]) << "tensor " << i << " was written before the error";
}

// An edit that makes a valid call invalid, and the argument and value its error must name.
template <class Call>
struct BadEdit {
  std::function<void(Call&)> edit;
  const char* arg;
  const char* value;
};
// A fresh Call runs; each case's edit of a fresh Call throws naming `arg = value` and leaves every
// tensor `watched` names as it was.
template <class Call>
void expect_edits_throw_untouched(const std::vector<BadEdit<Call>>& cases,
                                  const std::function<std::vector<TensorView>(Call&)>& watched) {
  {
    Call ok;
    EXPECT_NO_THROW(ok.call());
  }
  for (const BadEdit<Call>& c : cases) {
    SCOPED_TRACE(c.arg);
    Call call;
    c.edit(call);
    expect_throws_and_untouched(call, watched(call), c.arg, c.value);
  }
}

// ---- random device-resident indices on the CPU path: run, or throw and write nothing -----------

// Random contents for a contiguous int32 or int64 index tensor: each element in [lo, hi] four times
// in five, else -1, a negative value, a value past hi or 2^40 (int32: 2^31 - 1): what a buggy
// engine could pass.
void wild_fill(const TensorView& v, std::mt19937_64& g, int64_t lo, int64_t hi);
// A fair coin from g (which fields a round randomizes).
inline bool coin(std::mt19937_64& g) { return (g() & 1) != 0; }

// `rounds` fresh calls, each randomized by `fill`: every call either runs or throws m3rt::Error
// (anything else fails), and an error leaves every watched tensor as it was. Both outcomes must
// occur (else the randomization missed one path and the test proves nothing). Under
// scripts/sanitize.sh a read or write out of bounds on either path fails too.
template <class Call>
void expect_runs_or_throws_untouched(int rounds, uint64_t seed, const std::function<void(Call&, std::mt19937_64&)>& fill,
                                     const std::function<std::vector<TensorView>(Call&)>& watched) {
  std::mt19937_64 g(seed);
  int ran = 0, threw = 0;
  for (int i = 0; i < rounds; ++i) {
    Call call;
    fill(call, g);
    const std::vector<TensorView> w = watched(call);
    std::vector<std::vector<uint8_t>> before;
    for (const TensorView& v : w) before.push_back(bytes_of(v));
    try {
      call.call();
      ++ran;
    } catch (const Error&) {
      ++threw;
      for (size_t k = 0; k < w.size(); ++k)
        ASSERT_EQ(bytes_of(w[k]), before[k]) << "round " << i << ": tensor " << k << " was written before the error";
    }
  }
  EXPECT_GT(ran, 0) << "no round ran";
  EXPECT_GT(threw, 0) << "no round threw";
}

}  // namespace m3rt_test
