// Runs the `m3rt check` registry as tests: every op's check on the CPU (reference vs fp64 spec
// evaluation) and on each GPU present (kernel vs CPU reference, outputs poisoned with NaN).
#include <gtest/gtest.h>

#include "m3rt/check.h"
#include "m3rt/error.h"
#include "m3rt/tensor.h"

namespace {

using namespace m3rt;

void expect_all_pass(const Device& dev, const std::string& op) {
  CheckOptions opt;
  opt.filter = op;
  uint64_t seed = 0;
  const auto rows = run_checks({dev}, opt, &seed);
  ASSERT_FALSE(rows.empty());
  for (const auto& r : rows) {
    EXPECT_TRUE(r.pass) << r.op << " " << r.variant << " on " << r.device << " " << r.output
                        << ": worst " << r.worst << " " << r.unit << " at " << r.where
                        << " (seed " << seed << "): " << r.message;
    if (r.output != "(exception)") {
      EXPECT_GT(r.checked, 0) << r.op << " " << r.variant;
    }
  }
}

class CheckCpu : public ::testing::TestWithParam<std::string> {};
TEST_P(CheckCpu, MatchesSpec) { expect_all_pass(Device::cpu(), GetParam()); }

class CheckGpu : public ::testing::TestWithParam<std::string> {};
TEST_P(CheckGpu, MatchesCpuReference) {
  if (!cuda_available()) {
    GTEST_SKIP() << "no CUDA device present (built with CUDA: " << (built_with_cuda() ? "yes" : "no")
                 << "); GPU check not run";
  }
  if (!check_op_has_gpu(GetParam())) GTEST_SKIP() << GetParam() << " has no GPU path yet; GPU check not run";
  for (int i = 0; i < cuda_device_count(); ++i) expect_all_pass(Device::cuda(i), GetParam());
}

INSTANTIATE_TEST_SUITE_P(Ops, CheckCpu, ::testing::ValuesIn(check_op_names()));
INSTANTIATE_TEST_SUITE_P(Ops, CheckGpu, ::testing::ValuesIn(check_op_names()));

TEST(Check, TableNamesEveryOp) {
  const std::vector<std::string> want = {"reshape_and_cache", "gemma_rms_norm", "swiglu_oai",
                                         "dspark_context_kv_write", "qknorm_rope_kv_insert",
                                         "indexer_prefill", "indexer_decode", "msa_prefill",
                                         "msa_decode", "dspark_draft"};
  EXPECT_EQ(check_op_names(), want);
}

// A filter that selects no op is an error naming it and the ops, not an empty run that passes
// (the bench's op names, e.g. lightning_indexer, are not the check's).
TEST(Check, FilterMatchingNoOpThrows) {
  CheckOptions opt;
  opt.seed = 1;
  opt.filter = "lightning_indexer";
  try {
    run_checks({Device::cpu()}, opt);
    FAIL() << "no exception";
  } catch (const Error& e) {
    EXPECT_EQ(std::string(e.what()),
              "check: --filter = 'lightning_indexer': matches no op; supported: a part of one of "
              "reshape_and_cache, gemma_rms_norm, swiglu_oai, dspark_context_kv_write, "
              "qknorm_rope_kv_insert, indexer_prefill, indexer_decode, msa_prefill, msa_decode, dspark_draft");
  }
  opt.filter = "swiglu";  // a part of one name runs that op
  const auto rows = run_checks({Device::cpu()}, opt);
  ASSERT_FALSE(rows.empty());
  for (const auto& r : rows) EXPECT_EQ(r.op, "swiglu_oai");
}

}  // namespace
