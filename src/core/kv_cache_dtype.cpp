#include <string>

#include "m3rt/error.h"
#include "m3rt/ops.h"

namespace m3rt {

KvCacheDtype parse_kv_cache_dtype(std::string_view name) {
  if (name == "auto") return KvCacheDtype::kAuto;
  if (name == "bfloat16" || name == "bf16") return KvCacheDtype::kBFloat16;
  if (name == "fp8" || name == "fp8_e4m3") return KvCacheDtype::kFp8E4M3;
  if (name == "fp8_e5m2") return KvCacheDtype::kFp8E5M2;
  if (name == "nvfp4") return KvCacheDtype::kNvfp4;
  throw_arg_error("parse_kv_cache_dtype", "kv_cache_dtype", std::string("'").append(name).append("'"),
                  "known: auto, bfloat16, fp8, fp8_e4m3, fp8_e5m2, nvfp4");
}

const char* kv_cache_dtype_name(KvCacheDtype dtype) {
  switch (dtype) {
    case KvCacheDtype::kAuto: return "auto";
    case KvCacheDtype::kBFloat16: return "bfloat16";
    case KvCacheDtype::kFp8E4M3: return "fp8_e4m3";
    case KvCacheDtype::kFp8E5M2: return "fp8_e5m2";
    case KvCacheDtype::kNvfp4: return "nvfp4";
  }
  return "?";
}

}  // namespace m3rt
