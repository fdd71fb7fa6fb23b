// The DSpark draft step's own CUDA kernels. Contract: dspark_draft_kernels.h.
#include "model/dspark_draft_kernels.h"

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cfloat>

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
  __shared__ int s_pad;
  __shared__ int64_t s_first, s_last;
  if (threadIdx.x == 0) {
    const int32_t anchor = p.anchors[r];
    const int64_t pos = p.anchor_pos[r];
    int64_t code = kDraftErrorNone, value = 0, at = 0, first = 0, last = -1;
    if (anchor >= 0) {
      const int64_t seq = pos + p.N;
      const float temp = p.temperatures[r];
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
        for (int64_t b = first; code == kDraftErrorNone && b <= last; ++b) {
          const int32_t page = b < p.table_width ? p.block_table[int64_t(r) * p.table_width + b] : -1;
          if (page < 0 || page >= p.num_cache_blocks) code = kDraftErrorPage, value = page, at = b;
        }
        for (int j = 0; code == kDraftErrorNone && j < p.N; ++j) {
          const int64_t slot = p.block_slots[int64_t(r) * p.N + j];
          if (slot >= p.num_cache_blocks * p.page) code = kDraftErrorSlot, value = slot, at = j;
        }
      }
      if (code != kDraftErrorNone) p.errors[3 * r] = code, p.errors[3 * r + 1] = value, p.errors[3 * r + 2] = at;
    }
    const bool pad = anchor < 0 || code != kDraftErrorNone;
    s_pad = pad;
    s_first = pad ? 0 : first;
    s_last = pad ? -1 : last;
    p.seq_lens[r] = pad ? 0 : int32_t(pos + p.N);
    p.prev[r] = pad ? -1 : anchor;
  }
  __syncthreads();
  const bool pad = s_pad;
  const int64_t first = s_first, last = s_last;
  const int32_t anchor = p.anchors[r];
  const int64_t pos = p.anchor_pos[r];
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

// ---- embedding ----------------------------------------------------------------------------------

__global__ void embed_rows_kernel(uint16_t* h, const uint16_t* table, const int32_t* ids, int H) {
  const int t = blockIdx.x;
  const uint4* src = reinterpret_cast<const uint4*>(table + int64_t(ids[t]) * H);
  uint4* dst = reinterpret_cast<uint4*>(h + int64_t(t) * H);
  for (int i = threadIdx.x; i < H / 8; i += blockDim.x) dst[i] = src[i];
}

// ---- Markov loop --------------------------------------------------------------------------------

constexpr int kMarkovThreads = 256;
constexpr int kMarkovChunk = kMarkovThreads * 8;  // vocabulary entries per CTA

// One CTA per (chunk, request): logits = bf16(base + bias) over its chunk, and the chunk's best
// (key, id): key = logit (greedy) or logit / T + Gumbel noise (sampled).
__global__ void __launch_bounds__(kMarkovThreads) markov_finalize_kernel(MarkovStepParams p) {
  const int chunk = blockIdx.x, r = blockIdx.y, chunks = gridDim.x;
  if (p.prev[r] < 0) return;  // padding: the reduce writes -1
  const float T = p.temperatures[r];
  const uint64_t seed = uint64_t(p.seeds[r]);
  const int64_t qpos = p.anchor_pos[r] + p.step;
  const uint16_t* base = p.base + (int64_t(r) * p.N + p.step) * p.V;
  const uint16_t* bias = p.bias + int64_t(r) * p.V;
  uint16_t* out = p.logits + (int64_t(r) * p.N + p.step) * p.V;
  double best = -INFINITY;
  int idx = -1;
  for (int k = 0; k < kMarkovChunk / kMarkovThreads; ++k) {
    const int v = chunk * kMarkovChunk + k * kMarkovThreads + threadIdx.x;
    if (v >= p.V) break;
    const float l = __bfloat162float(__float2bfloat16_rn(bf(base[v]) + bf(bias[v])));
    out[v] = to_bf(l);
    const double key = T == 0.f ? double(l) : double(l) / double(T) + gumbel_noise(seed, qpos, v);
    better(best, idx, key, v);
  }
  block_argmax<kMarkovThreads>(best, idx);
  if (threadIdx.x == 0) {
    p.part_key[int64_t(r) * chunks + chunk] = best;
    p.part_idx[int64_t(r) * chunks + chunk] = idx;
  }
}

// One CTA per request: the best of the chunks' candidates is the step's token; it becomes the
// previous token of the next step, whose Markov embedding W1[token] is gathered here.
__global__ void __launch_bounds__(kMarkovThreads) markov_reduce_kernel(MarkovStepParams p, int chunks) {
  const int r = blockIdx.x;
  __shared__ int s_token;
  const bool pad = p.prev[r] < 0;
  double best = -INFINITY;
  int idx = -1;
  if (!pad)
    for (int c = threadIdx.x; c < chunks; c += blockDim.x)
      better(best, idx, p.part_key[int64_t(r) * chunks + c], p.part_idx[int64_t(r) * chunks + c]);
  block_argmax<kMarkovThreads>(best, idx);
  if (threadIdx.x == 0) {
    // Every key NaN: the lowest id, as the reference's strict comparisons leave it.
    s_token = pad ? -1 : (idx < 0 ? 0 : idx);
    p.tokens[int64_t(r) * p.N + p.step] = s_token;
  }
  __syncthreads();
  const int token = s_token;
  if (threadIdx.x == 0) p.prev_out[r] = token;
  for (int k = threadIdx.x; k < p.rank; k += blockDim.x)
    p.e[int64_t(r) * p.rank + k] = token < 0 ? 0 : p.w1[int64_t(token) * p.rank + k];
}

// ---- confidence head ----------------------------------------------------------------------------

constexpr int kConfThreads = 128;

__global__ void __launch_bounds__(kConfThreads) confidence_kernel(ConfidenceParams p) {
  const int t = blockIdx.x, r = t / p.N, i = t % p.N;
  const int32_t prev = i == 0 ? p.anchors[r] : p.tokens[t - 1];
  const bool pad = p.anchors[r] < 0 || p.tokens[t] < 0;
  float z = 0.f;
  if (!pad) {
    for (int k = threadIdx.x; k < p.H; k += blockDim.x) z += bf(p.w[k]) * bf(p.head[int64_t(t) * p.H + k]);
    if (p.with_markov)
      for (int k = threadIdx.x; k < p.rank; k += blockDim.x) z += bf(p.w[p.H + k]) * bf(p.w1[int64_t(prev) * p.rank + k]);
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

void launch_embed_rows(uint16_t* h, const uint16_t* table, const int32_t* ids, int rows, int H, stream_t stream) {
  const cudaStream_t s = reinterpret_cast<cudaStream_t>(stream);
  embed_rows_kernel<<<rows, 128, 0, s>>>(h, table, ids, H);
  M3RT_LAUNCH_CHECK(s, "embed_rows_kernel");
}

int markov_partials(int V) { return (V + kMarkovChunk - 1) / kMarkovChunk; }

void launch_markov_finalize(const MarkovStepParams& p, stream_t stream) {
  const cudaStream_t s = reinterpret_cast<cudaStream_t>(stream);
  markov_finalize_kernel<<<dim3(markov_partials(p.V), p.R), kMarkovThreads, 0, s>>>(p);
  M3RT_LAUNCH_CHECK(s, "markov_finalize_kernel");
}

void launch_markov_reduce(const MarkovStepParams& p, stream_t stream) {
  const cudaStream_t s = reinterpret_cast<cudaStream_t>(stream);
  markov_reduce_kernel<<<p.R, kMarkovThreads, 0, s>>>(p, markov_partials(p.V));
  M3RT_LAUNCH_CHECK(s, "markov_reduce_kernel");
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
