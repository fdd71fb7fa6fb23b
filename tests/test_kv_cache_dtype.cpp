// parse_kv_cache_dtype: the known names and the error for unknown ones.
// Shared helpers: tests/test_util.h.
#include "test_util.h"

namespace {

using m3rt::KvCacheDtype;
using m3rt_test::error_of;
using ::testing::AllOf;
using ::testing::HasSubstr;

TEST(KvCacheDtypeNames, ParseKnownAndUnknown) {
  EXPECT_EQ(m3rt::parse_kv_cache_dtype("auto"), KvCacheDtype::kAuto);
  EXPECT_EQ(m3rt::parse_kv_cache_dtype("bfloat16"), KvCacheDtype::kBFloat16);
  EXPECT_EQ(m3rt::parse_kv_cache_dtype("fp8"), KvCacheDtype::kFp8E4M3);
  EXPECT_EQ(m3rt::parse_kv_cache_dtype("fp8_e4m3"), KvCacheDtype::kFp8E4M3);
  EXPECT_EQ(m3rt::parse_kv_cache_dtype("fp8_e5m2"), KvCacheDtype::kFp8E5M2);
  EXPECT_EQ(m3rt::parse_kv_cache_dtype("nvfp4"), KvCacheDtype::kNvfp4);
  EXPECT_THAT(error_of([] { m3rt::parse_kv_cache_dtype("fp16"); }),
              AllOf(HasSubstr("kv_cache_dtype = 'fp16'"), HasSubstr("known: auto")));
  EXPECT_THAT(error_of([] { m3rt::parse_kv_cache_dtype(""); }), HasSubstr("kv_cache_dtype = ''"));
  EXPECT_THAT(error_of([] { m3rt::parse_kv_cache_dtype("FP8"); }), HasSubstr("'FP8'"));
}

}  // namespace
