// The DSpark draft step's own CUDA kernels. Contract: dspark_draft_kernels.h.
#include "model/dspark_draft_kernels.h"

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cfloat>
#include <climits>

#include "core/cuda_check.h"
#include "model/dspark_hash.h"

namespace m3rt::detail {

namespace {

__device__ __forceinline__ float bf(uint16_t x) { return __uint_as_float(uint32_t(x) << 16); }
__device__ __forceinline__ uint16_t to_bf(float x) {
  return __bfloat16_as_ushort(__float2bfloat16_rn(x));
}

// ---- block reductions ---------------------------------------------------------------------------

// The better of two (key, index) candidates: larger key, then lower index.
__device__ __forceinline__ void better(double& k, int& i, double k2, int i2) {
  if (k2 > k || (k2 == k && i2 >= 0 && (i < 0 || i2 < i))) k = k2, i = i2;
}

template <int kThreads>
__device__ void block_argmax(double& k, int& i) {
  __shared__ double sk[kThreads / 32];
  __shared__ int si[kThreads / 32];
  for (int o = 16; o > 0; o >>= 1) better(k, i, __shfl_xor_sync(~0u, k, o), __shfl_xor_sync(~0u, i, o));
  const int w = threadIdx.x / 32;
  if (threadIdx.x % 32 == 0) sk[w] = k, si[w] = i;
  __syncthreads();
  k = sk[0], i = si[0];
  for (int j = 1; j < kThreads / 32; ++j) better(k, i, sk[j], si[j]);
  __syncthreads();
}

template <int kThreads, typename T, typename Op>
__device__ T block_reduce(T v, Op op) {
  __shared__ T s[kThreads / 32];
  for (int o = 16; o > 0; o >>= 1) v = op(v, __shfl_xor_sync(~0u, v, o));
  if (threadIdx.x % 32 == 0) s[threadIdx.x / 32] = v;
  __syncthreads();
  v = s[0];
  for (int j = 1; j < kThreads / 32; ++j) v = op(v, s[j]);
  __syncthreads();
  return v;
}

// ---- prep ---------------------------------------------------------------------------------------

constexpr int kPrepThreads = 256;

__global__ void __launch_bounds__(kPrepThreads) draft_prep_kernel(DraftPrepParams p) {
  const int r = blockIdx.x;
  __shared__ int s_code, s_bad_page, s_bad_slot;
  __shared__ int64_t s_value, s_first, s_last;
  const int32_t anchor = p.anchors[r];
  const int64_t pos = p.anchor_pos[r];
  const int64_t seq = pos + p.N;
  // Scalar checks (thread 0), then the block's pages and slots in parallel; the first bad column
  // or row is the one reported (a shared minimum).
  if (threadIdx.x == 0) {
    const float temp = p.temperatures[r];
    int64_t code = kDraftErrorNone, value = 0, first = 0, last = -1;
    if (anchor >= 0) {
      if (anchor >= p.vocab) {
        code = kDraftErrorAnchorToken, value = anchor;
      } else if (pos < 0 || seq > p.max_pos) {
        code = kDraftErrorPosition, value = pos;
      } else if (!(temp >= 0.f) || isinf(temp)) {
        code = kDraftErrorTemperature, value = __float_as_uint(temp);
      } else {
        first = (p.sliding_window > 0 ? max(int64_t(0), pos - p.sliding_window + 1) : 0) / p.page;
        last = (seq - 1) / p.page;
        if (last - first + 1 > p.topk) code = kDraftErrorSpan, value = pos;
      }
    }
    s_code = int(code), s_value = value;
    s_first = code == kDraftErrorNone ? first : 0;
    s_last = code == kDraftErrorNone ? last : -1;
    s_bad_page = s_bad_slot = INT_MAX;
  }
  __syncthreads();
  if (anchor >= 0 && s_code == kDraftErrorNone) {
    for (int64_t b = s_first + threadIdx.x; b <= s_last; b += blockDim.x) {
      const int32_t page = b < p.table_width ? p.block_table[int64_t(r) * p.table_width + b] : -1;
      if (page < 0 || page >= p.num_cache_blocks) atomicMin(&s_bad_page, int(b));
    }
    for (int j = threadIdx.x; j < p.N; j += blockDim.x)
      if (p.block_slots[int64_t(r) * p.N + j] >= p.num_cache_blocks * p.page) atomicMin(&s_bad_slot, j);
  }
  __syncthreads();
  if (threadIdx.x == 0) {
    int64_t code = s_code, value = s_value, at = 0;
    if (code == kDraftErrorNone && s_bad_page != INT_MAX) {
      const int64_t b = s_bad_page;
      code = kDraftErrorPage, at = b, value = b < p.table_width ? p.block_table[int64_t(r) * p.table_width + b] : -1;
    } else if (code == kDraftErrorNone && s_bad_slot != INT_MAX) {
      code = kDraftErrorSlot, at = s_bad_slot, value = p.block_slots[int64_t(r) * p.N + s_bad_slot];
    }
    if (code != kDraftErrorNone) p.errors[3 * r] = code, p.errors[3 * r + 1] = value, p.errors[3 * r + 2] = at;
    const bool pad = anchor < 0 || code != kDraftErrorNone;
    s_code = pad;  // from here: 1 = padding
    if (pad) s_first = 0, s_last = -1;
    p.seq_lens[r] = pad ? 0 : int32_t(seq);
    p.prev[r] = pad ? -1 : anchor;
  }
  __syncthreads();
  const bool pad = s_code;
  const int64_t first = s_first, last = s_last;
  const int64_t T = int64_t(p.R) * p.N;
  for (int j = threadIdx.x; j < p.N; j += blockDim.x) {
    const int64_t t = int64_t(r) * p.N + j;
    p.ids[t] = pad ? 0 : (j == 0 ? anchor : p.mask_token);
    p.positions[t] = pad ? 0 : pos + j;
    p.slots[t] = pad ? -1 : p.block_slots[t];
  }
  const int per_head = p.N * p.topk;
  for (int x = threadIdx.x; x < p.num_kv_heads * per_head; x += blockDim.x) {
    const int g = x / per_head, j = (x % per_head) / p.topk, k = x % p.topk;
    p.lists[(g * T + int64_t(r) * p.N + j) * p.topk + k] = first + k <= last ? int32_t(first + k) : -1;
  }
  for (int k = threadIdx.x; k < p.rank; k += blockDim.x)
    p.e[int64_t(r) * p.rank + k] = pad ? 0 : p.w1[int64_t(anchor) * p.rank + k];
}

// ---- inputs and outputs -------------------------------------------------------------------------

__global__ void draft_inputs_kernel(DraftInputsParams p) {
  const int r = blockIdx.x;
  const bool real = r < p.R;
  if (threadIdx.x == 0) {
    p.s_anchors[r] = real ? p.anchors[r] : -1;
    p.s_positions[r] = real ? p.positions[r] : 0;
    p.s_temps[r] = real ? p.temps[r] : 0.f;
    p.s_seeds[r] = real ? p.seeds[r] : 0;
  }
  for (int j = threadIdx.x; j < p.N; j += blockDim.x)
    p.s_slots[int64_t(r) * p.N + j] = real ? p.slots[int64_t(r) * p.N + j] : -1;
  for (int b = threadIdx.x; b < p.MB; b += blockDim.x)
    p.s_table[int64_t(r) * p.MB + b] = real && b < p.W ? p.table[int64_t(r) * p.W + b] : -1;
}

__global__ void draft_outputs_kernel(int32_t* tokens, const int32_t* s_tokens, float* conf, const float* s_conf, int n) {
  for (int i = blockIdx.x * blockDim.x + threadIdx.x; i < n; i += gridDim.x * blockDim.x) {
    tokens[i] = s_tokens[i];
    if (conf) conf[i] = s_conf[i];
  }
}

// ---- embedding ----------------------------------------------------------------------------------

__global__ void embed_rows_kernel(uint16_t* h, uint16_t* copy, const uint16_t* table, const int32_t* ids, int H) {
  const int t = blockIdx.x;
  const uint4* src = reinterpret_cast<const uint4*>(table + int64_t(ids[t]) * H);
  uint4* dst = reinterpret_cast<uint4*>(h + int64_t(t) * H);
  uint4* dst2 = copy ? reinterpret_cast<uint4*>(copy + int64_t(t) * H) : nullptr;
  for (int i = threadIdx.x; i < H / 8; i += blockDim.x) {
    const uint4 v = src[i];
    dst[i] = v;
    if (dst2) dst2[i] = v;
  }
}

// ---- Markov loop --------------------------------------------------------------------------------

constexpr int kMarkovThreads = 128;
constexpr int kMarkovChunk = kMarkovThreads * 8;  // vocabulary entries per CTA: 8 per thread

// The key a step ranks token v by: its logit (greedy) or logit / T + Gumbel noise (sampled).
__device__ __forceinline__ double markov_key(float logit, float T, uint64_t seed, int64_t qpos, int v) {
  return T == 0.f ? double(logit) : double(logit) / double(T) + gumbel_noise(seed, qpos, v);
}

// Called by every thread of a CTA once its best candidate (best, idx) for request r over its chunk
// is known (any thread's copy: thread 0's is used). Publishes it; the request's last CTA to arrive
// (an arrival counter it resets) reduces the chunks' candidates to the step's token, which becomes
// the next step's previous token, and gathers its Markov embedding W1[token].
template <int kThreads>
__device__ void markov_publish(const MarkovStepParams& p, int r, int chunk, int chunks, double best, int idx) {
  __shared__ int s_last, s_token;
  if (threadIdx.x == 0) {
    p.part_key[int64_t(r) * chunks + chunk] = best;
    p.part_idx[int64_t(r) * chunks + chunk] = idx;
    __threadfence();
    s_last = atomicAdd(p.counters + r, 1) == chunks - 1;
  }
  __syncthreads();
  if (!s_last) return;
  __threadfence();
  best = -INFINITY, idx = -1;
  for (int c = threadIdx.x; c < chunks; c += kThreads)
    better(best, idx, __ldcg(p.part_key + int64_t(r) * chunks + c), __ldcg(p.part_idx + int64_t(r) * chunks + c));
  block_argmax<kThreads>(best, idx);
  if (threadIdx.x == 0) {
    // Every key NaN: the lowest id, as the reference's strict comparisons leave it.
    s_token = idx < 0 ? 0 : idx;
    p.tokens[int64_t(r) * p.N + p.step] = s_token;
    p.prev_out[r] = s_token;
    p.counters[r] = 0;
  }
  __syncthreads();
  for (int k = threadIdx.x; k < p.rank; k += kThreads) p.e[int64_t(r) * p.rank + k] = p.w1[int64_t(s_token) * p.rank + k];
  __syncthreads();
}

// A padded request's step (chunk 0 only): token -1, previous token -1, embedding 0.
__device__ void markov_pad(const MarkovStepParams& p, int r) {
  if (threadIdx.x == 0) p.tokens[int64_t(r) * p.N + p.step] = -1, p.prev_out[r] = -1;
  for (int k = threadIdx.x; k < p.rank; k += blockDim.x) p.e[int64_t(r) * p.rank + k] = 0;
}

// One CTA per (chunk, request); logits = bf16(base + bias) over the chunk, 8 entries per thread.
__global__ void __launch_bounds__(kMarkovThreads) markov_step_kernel(MarkovStepParams p) {
  const int chunk = blockIdx.x, r = blockIdx.y, chunks = gridDim.x;
  if (p.prev[r] < 0) {
    if (chunk == 0) markov_pad(p, r);
    return;
  }
  const float T = p.temperatures[r];
  const uint64_t seed = uint64_t(p.seeds[r]);
  const int64_t qpos = p.anchor_pos[r] + p.step;
  const uint16_t* base = p.base + (int64_t(r) * p.N + p.step) * p.V;
  const uint16_t* bias = p.bias + int64_t(r) * p.V;
  uint16_t* out = p.logits + (int64_t(r) * p.N + p.step) * p.V;
  double best = -INFINITY;
  int idx = -1;
  const int v0 = (chunk * kMarkovThreads + threadIdx.x) * 8;
  float l[8];
  int n = 0;
  if (v0 + 8 <= p.V && p.V % 8 == 0) {  // rows 16-byte aligned: one load of each
    const uint4 b4 = *reinterpret_cast<const uint4*>(base + v0), c4 = *reinterpret_cast<const uint4*>(bias + v0);
    const uint16_t* bb = reinterpret_cast<const uint16_t*>(&b4);
    const uint16_t* cc = reinterpret_cast<const uint16_t*>(&c4);
    uint4 o4;
    uint16_t* oo = reinterpret_cast<uint16_t*>(&o4);
#pragma unroll
    for (int i = 0; i < 8; ++i) {
      const uint16_t x = to_bf(bf(bb[i]) + bf(cc[i]));
      l[i] = bf(x), oo[i] = x;
    }
    *reinterpret_cast<uint4*>(out + v0) = o4;
    n = 8;
  } else {
    for (; n < 8 && v0 + n < p.V; ++n) {
      const uint16_t x = to_bf(bf(base[v0 + n]) + bf(bias[v0 + n]));
      l[n] = bf(x), out[v0 + n] = x;
    }
  }
  for (int i = 0; i < n; ++i) better(best, idx, markov_key(l[i], T, seed, qpos, v0 + i), v0 + i);
  block_argmax<kMarkovThreads>(best, idx);
  markov_publish<kMarkovThreads>(p, r, chunk, chunks, best, idx);
}

// ---- confidence head ----------------------------------------------------------------------------

constexpr int kConfThreads = 256;

// Dot product of n bf16 values (n % 8 == 0, 16-byte aligned) over the block's threads, 8 per load.
__device__ __forceinline__ float dot8(const uint16_t* a, const uint16_t* b, int n) {
  float z = 0.f;
  for (int c = threadIdx.x; c < n / 8; c += blockDim.x) {
    const uint4 x = reinterpret_cast<const uint4*>(a)[c], y = reinterpret_cast<const uint4*>(b)[c];
    const uint16_t* xs = reinterpret_cast<const uint16_t*>(&x);
    const uint16_t* ys = reinterpret_cast<const uint16_t*>(&y);
#pragma unroll
    for (int i = 0; i < 8; ++i) z += bf(xs[i]) * bf(ys[i]);
  }
  return z;
}

// One CTA per block row (H and rank multiples of 8: checked by the model).
__global__ void __launch_bounds__(kConfThreads) confidence_kernel(ConfidenceParams p) {
  const int t = blockIdx.x, r = t / p.N, i = t % p.N;
  const int32_t prev = i == 0 ? p.anchors[r] : p.tokens[t - 1];
  const bool pad = p.anchors[r] < 0 || p.tokens[t] < 0;
  float z = 0.f;
  if (!pad) {
    z = dot8(p.w, p.head + int64_t(t) * p.H, p.H);
    if (p.with_markov) z += dot8(p.w + p.H, p.w1 + int64_t(prev) * p.rank, p.rank);
  }
  z = block_reduce<kConfThreads>(z, [](float a, float b) { return a + b; });
  if (threadIdx.x == 0) p.out[t] = pad ? 0.f : 1.f / (1.f + expf(-(z + bf(p.b[0]))));
}

// ---- draft distributions ------------------------------------------------------------------------

constexpr int kProbThreads = 512;

__global__ void __launch_bounds__(kProbThreads) draft_probs_kernel(ProbsParams p) {
  const int t = blockIdx.x, r = t / p.N;
  const int32_t token = p.tokens[t];
  const float T = p.temperatures[r];
  const uint16_t* l = p.logits + int64_t(t) * p.V;
  float* out = p.out + int64_t(t) * p.V;
  if (token < 0 || T == 0.f) {
    for (int v = threadIdx.x; v < p.V; v += blockDim.x) out[v] = v == token ? 1.f : 0.f;
    return;
  }
  double mx = -INFINITY;
  for (int v = threadIdx.x; v < p.V; v += blockDim.x) mx = fmax(mx, double(bf(l[v])) / double(T));
  mx = block_reduce<kProbThreads>(mx, [](double a, double b) { return fmax(a, b); });
  double sum = 0;
  for (int v = threadIdx.x; v < p.V; v += blockDim.x) sum += exp(double(bf(l[v])) / double(T) - mx);
  sum = block_reduce<kProbThreads>(sum, [](double a, double b) { return a + b; });
  for (int v = threadIdx.x; v < p.V; v += blockDim.x) out[v] = float(exp(double(bf(l[v])) / double(T) - mx) / sum);
}

// ---- random weights -----------------------------------------------------------------------------

__global__ void fill_random_bf16_kernel(uint16_t* x, int64_t n, uint64_t seed, float a) {
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n; i += int64_t(gridDim.x) * blockDim.x)
    x[i] = to_bf(a * uniform_pm1(seed, uint64_t(i)));
}

}  // namespace

void launch_draft_prep(const DraftPrepParams& p, stream_t stream) {
  const cudaStream_t s = reinterpret_cast<cudaStream_t>(stream);
  draft_prep_kernel<<<p.R, kPrepThreads, 0, s>>>(p);
  M3RT_LAUNCH_CHECK(s, "draft_prep_kernel");
}

void launch_draft_inputs(const DraftInputsParams& p, stream_t stream) {
  const cudaStream_t s = reinterpret_cast<cudaStream_t>(stream);
  draft_inputs_kernel<<<p.P, 128, 0, s>>>(p);
  M3RT_LAUNCH_CHECK(s, "draft_inputs_kernel");
}

void launch_draft_outputs(int32_t* tokens, const int32_t* s_tokens, float* conf, const float* s_conf, int n,
                          stream_t stream) {
  const cudaStream_t s = reinterpret_cast<cudaStream_t>(stream);
  draft_outputs_kernel<<<std::max(1, std::min((n + 255) / 256, 1024)), 256, 0, s>>>(tokens, s_tokens, conf, s_conf, n);
  M3RT_LAUNCH_CHECK(s, "draft_outputs_kernel");
}

void launch_embed_rows(uint16_t* h, uint16_t* copy, const uint16_t* table, const int32_t* ids, int rows, int H,
                       stream_t stream) {
  const cudaStream_t s = reinterpret_cast<cudaStream_t>(stream);
  embed_rows_kernel<<<rows, 128, 0, s>>>(h, copy, table, ids, H);
  M3RT_LAUNCH_CHECK(s, "embed_rows_kernel");
}

int markov_partials(int V) { return (V + kMarkovChunk - 1) / kMarkovChunk; }

void launch_markov_step(const MarkovStepParams& p, stream_t stream) {
  const cudaStream_t s = reinterpret_cast<cudaStream_t>(stream);
  markov_step_kernel<<<dim3(markov_partials(p.V), p.R), kMarkovThreads, 0, s>>>(p);
  M3RT_LAUNCH_CHECK(s, "markov_step_kernel");
}

void launch_confidence(const ConfidenceParams& p, stream_t stream) {
  const cudaStream_t s = reinterpret_cast<cudaStream_t>(stream);
  confidence_kernel<<<p.R * p.N, kConfThreads, 0, s>>>(p);
  M3RT_LAUNCH_CHECK(s, "confidence_kernel");
}

void launch_draft_probs(const ProbsParams& p, stream_t stream) {
  const cudaStream_t s = reinterpret_cast<cudaStream_t>(stream);
  draft_probs_kernel<<<p.R * p.N, kProbThreads, 0, s>>>(p);
  M3RT_LAUNCH_CHECK(s, "draft_probs_kernel");
}

void launch_fill_random_bf16(uint16_t* x, int64_t n, uint64_t seed, float a, stream_t stream) {
  if (n == 0) return;
  const cudaStream_t s = reinterpret_cast<cudaStream_t>(stream);
  const int64_t blocks = std::min<int64_t>((n + 255) / 256, 65536);
  fill_random_bf16_kernel<<<unsigned(blocks), 256, 0, s>>>(x, n, seed, a);
  M3RT_LAUNCH_CHECK(s, "fill_random_bf16_kernel");
}

}  // namespace m3rt::detail
