// Internal: argument checks shared by every op. Each throws m3rt::Error naming the op, the argument,
// its value and what is supported.
//
// defines: require_defined, require_dtype, require_shape, require_same_device, require_scale,
//          require_kv_cache, require_rope_table, require_index_vector, require_below_2_31,
//          require_filter_matches, claim_counters_arg, KvCacheGeometry.
#pragma once

#include <initializer_list>
#include <string>
#include <vector>

#include "m3rt/error.h"
#include "m3rt/ops.h"
#include "m3rt/tensor.h"

namespace m3rt::detail {

void require_defined(const char* op, const char* name, const TensorView& v);
void require_dtype(const char* op, const char* name, const TensorView& v,
                   std::initializer_list<DType> allowed);
// Shape with -1 as "any" for a dim.
void require_shape(const char* op, const char* name, const TensorView& v,
                   std::initializer_list<int64_t> expected);
void require_contiguous(const char* op, const char* name, const TensorView& v);
void require_last_dim_contiguous(const char* op, const char* name, const TensorView& v);
// Every defined view in `views` lives on `device`.
void require_device(const char* op, const char* name, const TensorView& v, Device device);
// An fp32 scalar ([] or [1]) on `device`.
void require_scale(const char* op, const char* name, const TensorView& v, Device device);
// Optional run-time claim counters (QknormRopeKvInsertArgs / DsparkContextKvArgs::claim_counters):
// int32, contiguous, at least kClaimCounterInts, on `device`. Returns them as the kernels take them,
// nullptr when not given.
unsigned* claim_counters_arg(const char* op, const TensorView& v, Device device);
// A 1-D int64 vector of n elements, contiguous, on `device`.
void require_index_vector(const char* op, const char* name, const TensorView& v, int64_t n,
                          Device device);
// A prefill batch's cu_seqlens_q ([num_seqs + 1] int32, contiguous, on `device`) and max_query_len
// (in [0, num_tokens]); throws when num_tokens > 0 but there are no requests.
void require_prefill_batch(const char* op, const TensorView& cu_seqlens_q, int num_seqs,
                           int64_t num_tokens, int max_query_len, Device device);
// The RoPE table: [max_pos, rotary_dim] bf16 contiguous, rotary_dim in {16, 32, 64}.
void require_rope_table(const char* op, const TensorView& cos_sin_cache, int rotary_dim,
                        Device device);
// Memory at 16-byte alignment (vector loads and stores).
void require_aligned16(const char* op, const char* name, const TensorView& v);
// A size or count a kernel indexes in 32 bits: [0, 2^31) (no GPU's memory holds more today).
void require_below_2_31(const char* op, const char* what, int64_t value);
// A name filter (`--filter`) selects by substring; one that selects none of `names` is an error
// listing them (a run that silently does nothing would read as a pass).
void require_filter_matches(const char* op, const std::string& filter, const std::vector<std::string>& names);

// log2 of a power of two.
inline int log2_pow2(int64_t v) {
  int r = 0;
  while ((int64_t(1) << r) < v) ++r;
  return r;
}

// A paged KV cache [num_blocks, nkv, block_size, 256], checked and summarized.
struct KvCacheGeometry {
  int64_t num_blocks = 0;
  int num_kv_heads = 0;
  int block_size = 0;
  int block_size_log2 = 0;
  bool fp8 = false;
};
KvCacheGeometry require_kv_cache(const char* op, const TensorView& kv_cache,
                                 KvCacheDtype kv_cache_dtype, int num_kv_heads, Device device);

}  // namespace m3rt::detail
