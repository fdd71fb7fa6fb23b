// msa_attention baseline kernel, the first (correctness) version: one CTA per (query token, KV head) over the
// token's selected blocks, the group's G query heads together, online softmax in fp32.
//
//   q      [T, Hq, 128] bf16            out [T, Hq, 128] bf16, lse [T, Hq] fp32 (natural log)
//   cache  [num_blocks, Hkv, 128, 256]  bf16 or e4m3: K in [..., :128], V in [..., 128:]
//   topk   [Hkv, T, K] int32 (strided)  logical block ids of the token's request
//
// Per block (128 keys): thread j scores key j against the G heads (its K row from global memory,
// the queries from shared memory), the block's per-head max rescales the running sums, then thread
// d accumulates dim d of every head's P V. fp8 descales fold into the softmax scale (k) and the
// output (v). Used entries, masks and empty rows follow the reference (msa_attention_ref.cpp); a
// page id outside the cache is skipped, and a token whose request lengths are inconsistent is left
// unwritten (the CPU path throws for both). The tensor-core kernel (msa_attention.cu) replaced it; it stays as
// the baseline of benches and a cross-check in the GPU tests.
#include <cuda_bf16.h>
#include <cuda_fp8.h>

#include <cmath>

#include "core/cuda_check.h"
#include "m3rt/error.h"
#include "ops/msa_attention/msa_attention.h"

namespace m3rt {
namespace {

constexpr int kPage = 128;
constexpr int kThreads = 128;  // one key per thread when scoring, one dim per thread when summing
constexpr int kMaxGroup = 16;
constexpr int kMaxTopk = 64;

__device__ __forceinline__ float bf16_bits_to_float(uint16_t b) { return __uint_as_float(uint32_t(b) << 16); }

__device__ __forceinline__ float e4m3_to_f32(uint8_t code) {
  const __half_raw h = __nv_cvt_fp8_to_halfraw(static_cast<__nv_fp8_storage_t>(code), __NV_E4M3);
  return __half2float(__half(h));
}

__global__ void __launch_bounds__(kThreads) msa_attention_kernel(const __grid_constant__ MsaParams p) {
  __shared__ float q_s[kMaxGroup][128];
  __shared__ float prob[kMaxGroup][kPage];  // this block's exp(s - m) per head and key
  __shared__ float head_max[kMaxGroup], head_scale[kMaxGroup], head_sum[kMaxGroup];
  __shared__ int used_page[kMaxTopk], used_id[kMaxTopk];
  __shared__ int num_used, key_lo, key_hi;
  __shared__ bool valid_token;
  const int64_t t = blockIdx.x;
  const int g = blockIdx.y;
  const int G = p.num_heads / p.num_kv_heads;
  const int tid = threadIdx.x;

  // The token's request, visible key range and used blocks (thread 0).
  if (tid == 0) {
    valid_token = false;
    int b = 0;
    int64_t pos = 0;
    bool ok = true;
    if (p.cu_seqlens_q) {
      int lo = 0, hi = p.num_seqs - 1;
      while (lo < hi) {
        const int mid = (lo + hi + 1) / 2;
        if (p.cu_seqlens_q[mid] <= t) lo = mid; else hi = mid - 1;
      }
      b = lo;
      const int q0 = p.cu_seqlens_q[b], ql = p.cu_seqlens_q[b + 1] - q0;
      const int sl = p.seq_lens[b];
      ok = t >= q0 && t < q0 + ql && ql <= p.max_query_len && sl >= ql;
      pos = int64_t(sl) - ql + (t - q0);
    } else {
      b = int(t / p.decode_query_len);
      ok = p.seq_lens[b] >= 0;
      pos = int64_t(p.seq_lens[b]) - p.decode_query_len + t % p.decode_query_len;
    }
    const int64_t sl = ok ? p.seq_lens[b] : 0;
    ok = ok && (sl + kPage - 1) / kPage <= p.max_blocks;
    if (ok) {
      const int64_t hi = p.causal ? min(pos + 1, sl) : sl;
      const int64_t lo = p.window_left > 0 ? max(int64_t(0), pos - p.window_left + 1) : 0;
      const int64_t nb_vis = hi > 0 ? (hi + kPage - 1) / kPage : 0;
      int n = 0;
      const int32_t* list = p.topk + g * p.topk_stride_h + t * p.topk_stride_t;
      for (int i = 0; i < p.topk_k; ++i) {
        const int id = list[i * p.topk_stride_k];
        if (id < 0 || id >= nb_vis) continue;
        bool seen = false;
        for (int e = 0; e < n; ++e) seen |= used_id[e] == id;
        if (seen) continue;
        const int page = p.block_table[b * p.block_table_stride + id];
        if (page < 0 || page >= p.num_cache_blocks) continue;  // never read outside the cache
        used_id[n] = id;
        used_page[n] = page;
        ++n;
      }
      num_used = n;
      key_lo = int(lo);
      key_hi = int(max(hi, int64_t(0)));
      valid_token = true;
    }
  }
  __syncthreads();
  if (!valid_token) return;  // block-uniform

  const float k_scale = p.fp8 ? *p.k_scale : 1.f, v_scale = p.fp8 ? *p.v_scale : 1.f;
  const float scale = p.softmax_scale * k_scale;
  for (int i = tid; i < G * 128; i += kThreads) {
    const int h = i / 128, d = i % 128;
    q_s[h][d] = bf16_bits_to_float(p.q[t * p.q_stride_t + int64_t(g * G + h) * p.q_stride_h + d]);
  }
  if (tid < G) {
    head_max[tid] = -INFINITY;
    head_sum[tid] = 0.f;
  }
  float acc[kMaxGroup];
#pragma unroll
  for (int h = 0; h < kMaxGroup; ++h) acc[h] = 0.f;
  __syncthreads();

  const int64_t head_stride = int64_t(kPage) * 256;  // elements between KV heads of a page
  for (int u = 0; u < num_used; ++u) {
    const int id = used_id[u];
    const int64_t base = (int64_t(used_page[u]) * p.num_kv_heads + g) * head_stride;
    // Score key j = tid of the block.
    const int key_pos = id * kPage + tid;
    const bool visible = key_pos >= key_lo && key_pos < key_hi;
    float s[kMaxGroup];
#pragma unroll
    for (int h = 0; h < kMaxGroup; ++h) s[h] = 0.f;
    if (visible) {
      for (int d = 0; d < 128; ++d) {
        const int64_t e = base + int64_t(tid) * 256 + d;
        const float k = p.fp8 ? e4m3_to_f32(static_cast<const uint8_t*>(p.cache)[e])
                              : bf16_bits_to_float(static_cast<const uint16_t*>(p.cache)[e]);
#pragma unroll
        for (int h = 0; h < kMaxGroup; ++h)
          if (h < G) s[h] = fmaf(q_s[h][d], k, s[h]);
      }
    }
#pragma unroll
    for (int h = 0; h < kMaxGroup; ++h)
      if (h < G) prob[h][tid] = visible ? s[h] * scale : -INFINITY;
    __syncthreads();
    // Per head: the block's max (thread h), the new running max and the rescale of the old sums.
    if (tid < G) {
      float m = -INFINITY;
      for (int j = 0; j < kPage; ++j) m = fmaxf(m, prob[tid][j]);
      const float m_new = fmaxf(head_max[tid], m);
      head_scale[tid] = m_new == -INFINITY ? 1.f : expf(head_max[tid] - m_new);
      head_max[tid] = m_new;
    }
    __syncthreads();
#pragma unroll
    for (int h = 0; h < kMaxGroup; ++h)
      if (h < G) {
        const float m = head_max[h];
        prob[h][tid] = prob[h][tid] == -INFINITY ? 0.f : expf(prob[h][tid] - m);
      }
    __syncthreads();
    if (tid < G) {
      float l = 0.f;
      for (int j = 0; j < kPage; ++j) l += prob[tid][j];
      head_sum[tid] = head_sum[tid] * head_scale[tid] + l;
    }
    // P V for dim d = tid.
#pragma unroll
    for (int h = 0; h < kMaxGroup; ++h)
      if (h < G) acc[h] *= head_scale[h];
    // Only the visible keys: a masked key's V may be anything (NaN past seq_len), and 0 * NaN is NaN.
    const int j_lo = max(0, key_lo - id * kPage), j_hi = min(kPage, key_hi - id * kPage);
    for (int j = j_lo; j < j_hi; ++j) {
      const int64_t e = base + int64_t(j) * 256 + 128 + tid;
      const float v = p.fp8 ? e4m3_to_f32(static_cast<const uint8_t*>(p.cache)[e])
                            : bf16_bits_to_float(static_cast<const uint16_t*>(p.cache)[e]);
#pragma unroll
      for (int h = 0; h < kMaxGroup; ++h)
        if (h < G) acc[h] = fmaf(prob[h][j], v, acc[h]);
    }
    __syncthreads();  // prob, head_* are rewritten by the next block
  }

#pragma unroll
  for (int h = 0; h < kMaxGroup; ++h) {
    if (h >= G) break;
    const float l = head_sum[h];
    const float o = l > 0.f ? acc[h] * v_scale / l : 0.f;  // a row without keys writes 0
    p.out[t * p.out_stride_t + int64_t(g * G + h) * p.out_stride_h + tid] =
        __bfloat16_as_ushort(__float2bfloat16_rn(o));
  }
  if (p.lse && tid < G) {
    const float l = head_sum[tid];
    p.lse[t * p.lse_stride_t + g * G + tid] = l > 0.f ? head_max[tid] + logf(l) : -INFINITY;
  }
}

}  // namespace

void msa_attention_baseline_launch(const MsaParams& p, CUstream_st* stream) {
  if (p.num_tokens == 0) return;
  const dim3 grid(unsigned(p.num_tokens), unsigned(p.num_kv_heads));
  msa_attention_kernel<<<grid, kThreads, 0, stream>>>(p);
  M3RT_LAUNCH_CHECK(stream, "msa_attention_baseline_kernel");
}

}  // namespace m3rt
