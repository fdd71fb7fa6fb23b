// GPU tests (skipped with a message when no CUDA device is present):
//   - the host dtype conversions equal CUDA's device conversions bit for bit;
//   - CUDA-graph capture of the context-K/V writer and the QK insert: inputs changed in place
//     (values, positions, slots) then replayed match an eager run bit for bit;
//   - CUDA-graph capture of the lightning indexer (decode and prefill): lengths, block tables and
//     queries changed in place, replays match eager runs bit for bit, and both match the CPU
//     reference's selection (set comparison) with the NaN-filled pages never selected;
//   - the indexer's GPU selection on given scores equals the reference's bit for bit (every branch);
//   - CUDA-graph capture of MSA decode (a plan's run): seq_lens, top-k and block table changed in
//     place, replays match eager runs bit for bit;
//   - MSA's two Hopper wgmma loops (copy engine, cp.async) write the same bits; the dql-1 decode's
//     two-group CTAs agree with one group's and replay bitwise;
//   - the MSA kernels' e4m3 -> f16 conversion equals CUDA's on every 32-bit word;
//   - the QK insert leaves a token whose position lies outside the RoPE table unwritten;
//   - garbage device-resident indices (lengths, query offsets, tables, top-k ids, slots,
//     positions) never fault a kernel (compute-sanitizer memcheck in gpu-check checks the accesses);
// One host-only test runs everywhere: the one-wave grid rule of the loop-walking kernels' launchers.
// The ops' GPU-vs-CPU checks run from test_check.cpp (the `m3rt check` registry).
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <memory>
#include <random>
#include <string>
#include <tuple>
#include <vector>

#include "check/check_util.h"
#include "core/cuda_check.h"
#include "core/scoped_env.h"
#include "m3rt/m3rt.h"
#include "ops/common/head_math.cuh"
#include "ops/common/sm90.cuh"
#include "ops/lightning_indexer/indexer_compare.h"
#include "ops/lightning_indexer/lightning_indexer.h"
#include "ops/msa_attention/msa_attention.h"
#include "test_util.h"  // wild_fill

namespace {

using namespace m3rt;
using detail::Rng;

#define REQUIRE_GPU()                                                                           \
  do {                                                                                          \
    if (!cuda_available()) GTEST_SKIP() << "no CUDA device present; GPU test not run";        \
  } while (0)

#define CUDA_OK(x) ASSERT_EQ((x), cudaSuccess) << #x

// A device allocation of n T's, freed when it goes out of scope (an ASSERT's early return too).
template <class T>
class DeviceBuffer {
 public:
  explicit DeviceBuffer(size_t n) {
    if (cudaMalloc(&p_, n * sizeof(T)) != cudaSuccess) {
      p_ = nullptr;
      (void)cudaGetLastError();
    }
  }
  ~DeviceBuffer() { cudaFree(p_); }
  DeviceBuffer(const DeviceBuffer&) = delete;
  DeviceBuffer& operator=(const DeviceBuffer&) = delete;
  T* get() const { return p_; }
  explicit operator bool() const { return p_ != nullptr; }

 private:
  T* p_ = nullptr;
};

// ------------------------------------------------------------------------------------------------
__global__ void convert_kernel(const float* in, int64_t n, uint16_t* bf, uint16_t* hf, uint8_t* e4) {
  for (int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; i < n; i += int64_t(gridDim.x) * blockDim.x) {
    const float x = in[i];
    const __nv_bfloat16 b = __float2bfloat16_rn(x);
    const __half h = __float2half_rn(x);
    bf[i] = *reinterpret_cast<const uint16_t*>(&b);
    hf[i] = *reinterpret_cast<const uint16_t*>(&h);
    e4[i] = __nv_cvt_float_to_fp8(x, __NV_SATFINITE, __NV_E4M3);
  }
}

// Host only (runs without a GPU): the one-wave grid rule the writer's and the QK insert's launchers share.
TEST(LaunchGrid, OneWaveGridFillsTheGpuOnceAndClamps) {
  const dim3 a = detail::one_wave_grid(5, 1000, 660);  // 660 resident blocks over 5 columns
  EXPECT_EQ(a.x, 5u);
  EXPECT_EQ(a.y, 132u);
  EXPECT_EQ(detail::one_wave_grid(5, 7, 660).y, 7u);        // fewer steps than a wave
  EXPECT_EQ(detail::one_wave_grid(800, 1000, 660).y, 1u);   // more columns than resident blocks
  EXPECT_EQ(detail::one_wave_grid(1, 1 << 20, 1 << 20).y, 65535u);  // the grid's y limit
}

// Host only: the DRAM-bandwidth-an-SM test the MSA split rule and the writer's kernel choice share
// (specification figures: H100 SXM 3.35 TB/s, H200 4.8 TB/s, 132 SMs each).
TEST(LaunchGrid, LeanDramPerSmTellsTheH100FromTheH200) {
  detail::DeviceLimits h100, h200, unknown;
  h100.sms = h200.sms = unknown.sms = 132;
  h100.dram_bytes_per_s = 3.35e12;  // 25.4 GB/s an SM
  h200.dram_bytes_per_s = 4.8e12;   // 36.4
  EXPECT_TRUE(h100.lean_dram_per_sm());
  EXPECT_FALSE(h200.lean_dram_per_sm());
  EXPECT_FALSE(unknown.lean_dram_per_sm());  // not reported: the H200's choices
}

TEST(Gpu, HostConversionsMatchDevice) {
  REQUIRE_GPU();
  // Every float bit pattern with the low 6 bits set by the stride (2^26 values), plus every float
  // whose top 16 bits are any bf16 and low bits hit bf16/fp16/e4m3 rounding ties (0x8000, 0x1000).
  std::vector<float> xs;
  for (uint64_t u = 0; u < (1ull << 32); u += 64) xs.push_back(bits_float(uint32_t(u) ^ 0x15u));
  for (uint32_t hi = 0; hi < 65536; ++hi)
    for (uint32_t lo : {0x0000u, 0x8000u, 0x7fffu, 0x8001u, 0x1000u, 0x0fffu, 0x2000u})
      xs.push_back(bits_float((hi << 16) | lo));
  const int64_t n = int64_t(xs.size());
  DeviceBuffer<float> din{size_t(n)};
  DeviceBuffer<uint16_t> dbf{size_t(n)}, dhf{size_t(n)};
  DeviceBuffer<uint8_t> de4{size_t(n)};
  ASSERT_TRUE(din && dbf && dhf && de4) << "cudaMalloc";
  CUDA_OK(cudaMemcpy(din.get(), xs.data(), n * 4, cudaMemcpyHostToDevice));
  convert_kernel<<<4096, 256>>>(din.get(), n, dbf.get(), dhf.get(), de4.get());
  CUDA_OK(cudaGetLastError());
  std::vector<uint16_t> bf(n), hf(n);
  std::vector<uint8_t> e4(n);
  CUDA_OK(cudaMemcpy(bf.data(), dbf.get(), n * 2, cudaMemcpyDeviceToHost));
  CUDA_OK(cudaMemcpy(hf.data(), dhf.get(), n * 2, cudaMemcpyDeviceToHost));
  CUDA_OK(cudaMemcpy(e4.data(), de4.get(), n, cudaMemcpyDeviceToHost));
  int64_t bad_bf = 0, bad_hf = 0, bad_e4 = 0;
  for (int64_t i = 0; i < n; ++i) {
    const float x = xs[size_t(i)];
    if (float_to_bf16(x) != bf[i] && bad_bf++ < 3)
      ADD_FAILURE() << "bf16 of 0x" << std::hex << float_bits(x) << ": host " << float_to_bf16(x) << " device " << bf[i];
    if (float_to_fp16(x) != hf[i] && bad_hf++ < 3)
      ADD_FAILURE() << "fp16 of 0x" << std::hex << float_bits(x) << ": host " << float_to_fp16(x) << " device " << hf[i];
    if (float_to_e4m3(x) != e4[i] && bad_e4++ < 3)
      ADD_FAILURE() << "e4m3 of 0x" << std::hex << float_bits(x) << ": host " << int(float_to_e4m3(x)) << " device " << int(e4[i]);
  }
  EXPECT_EQ(bad_bf, 0);
  EXPECT_EQ(bad_hf, 0);
  EXPECT_EQ(bad_e4, 0);
}

// ------------------------------------------------------------------------------------------------
// The kernels' fp8 quantizer (reciprocal + one exact correction) must give the e4m3 codes of the
// IEEE division the reference does, for every bf16 input (all the kernels ever quantize) and many
// scales, element by element and through the 8-wide path the kernels use.
__global__ void quantizer_kernel(const float* scales, int num_scales, unsigned long long* mismatches,
                                 unsigned* first) {
  const int si = blockIdx.y;
  if (si >= num_scales) return;
  const m3rt::kernels::E4m3Quantizer quant(scales[si]);
  for (uint32_t b = blockIdx.x * blockDim.x + threadIdx.x; b < 65536; b += gridDim.x * blockDim.x) {
    const float x = __uint_as_float(b << 16);
    const float want = __fdiv_rn(x, scales[si]);
    const uint8_t want_code = __nv_cvt_float_to_fp8(want, __NV_SATFINITE, __NV_E4M3);
    const uint8_t got_code = __nv_cvt_float_to_fp8(quant.quotient(x), __NV_SATFINITE, __NV_E4M3);
    // The 8-wide path the kernels call (bf16 bits), with x in several slots and its neighbours.
    const uint32_t xb = b, nb = b ^ 0x8000u, hb = __float_as_uint(x * 0.5f) >> 16;
    const uint2 codes = quant(make_uint4(xb | (xb << 16), nb | (xb << 16), hb | (xb << 16), xb | (xb << 16)));
    const bool vec_ok = (codes.x & 0xff) == want_code && (codes.x >> 24) == want_code && (codes.y >> 24) == want_code;
    if (got_code != want_code || !vec_ok) {
      atomicAdd(mismatches, 1ull);
      atomicCAS(first, 0xffffffffu, (unsigned(si) << 16) | b);
    }
  }
}

TEST(Gpu, Fp8QuantizerEqualsIeeeDivision) {
  REQUIRE_GPU();
  std::mt19937_64 gen(5);
  std::vector<float> scales = {1.f, 0.5f, 2.f, 0.37f, 2.5f, 1.f / 3.f, 448.f, 1e-3f, 1e3f, 0x1p-99f,
                               0x1p99f, 1e-30f, 1e30f, 0.99999994f, 1.0000001f};
  for (int i = 0; i < 4000; ++i)  // log-uniform over [2^-20, 2^20], random mantissas
    scales.push_back(std::ldexp(std::uniform_real_distribution<float>(1.f, 2.f)(gen),
                                int(gen() % 41) - 20));
  DeviceBuffer<float> d_scales(scales.size());
  DeviceBuffer<unsigned long long> d_count(1);
  DeviceBuffer<unsigned> d_first(1);
  ASSERT_TRUE(d_scales && d_count && d_first) << "cudaMalloc";
  CUDA_OK(cudaMemcpy(d_scales.get(), scales.data(), scales.size() * 4, cudaMemcpyHostToDevice));
  CUDA_OK(cudaMemset(d_count.get(), 0, 8));
  CUDA_OK(cudaMemset(d_first.get(), 0xff, 4));
  quantizer_kernel<<<dim3(64, unsigned(scales.size())), 256>>>(d_scales.get(), int(scales.size()), d_count.get(),
                                                                d_first.get());
  CUDA_OK(cudaGetLastError());
  unsigned long long count = 0;
  unsigned first = 0;
  CUDA_OK(cudaMemcpy(&count, d_count.get(), 8, cudaMemcpyDeviceToHost));
  CUDA_OK(cudaMemcpy(&first, d_first.get(), 4, cudaMemcpyDeviceToHost));
  EXPECT_EQ(count, 0ull) << "first mismatch: scale " << scales[first >> 16] << ", x = bf16 0x" << std::hex
                         << (first & 0xffff);
}

// ------------------------------------------------------------------------------------------------
// e4m3x4_to_f16x2x2 (the MSA kernels' e4m3 -> f16 conversion: on sm_89+ the high pair converted
// from the register's upper half, no shift) equals CUDA's pair conversion of each half on every one
// of the 2^32 input words (NaN codes: both sides NaN).
__global__ void e4m3x4_kernel(unsigned long long* mismatches, unsigned* first) {
  const auto is_nan_half = [](uint32_t h) { return (h & 0x7c00u) == 0x7c00u && (h & 0x03ffu) != 0; };
  const uint64_t step = uint64_t(gridDim.x) * blockDim.x;
  for (uint64_t w = uint64_t(blockIdx.x) * blockDim.x + threadIdx.x; w < (1ull << 32); w += step) {
    const uint32_t four = uint32_t(w);
    uint32_t lo, hi;
    m3rt::kernels::e4m3x4_to_f16x2x2(four, lo, hi);
    const uint32_t want[2] = {m3rt::kernels::e4m3x2_to_f16x2(four), m3rt::kernels::e4m3x2_to_f16x2(four >> 16)};
    const uint32_t got[2] = {lo, hi};
    bool ok = true;
    for (int i = 0; i < 2; ++i) {
      for (int half = 0; half < 2; ++half) {
        const uint32_t g = (got[i] >> (16 * half)) & 0xffffu, e = (want[i] >> (16 * half)) & 0xffffu;
        ok = ok && (g == e || (is_nan_half(g) && is_nan_half(e)));
      }
    }
    if (!ok) {
      atomicAdd(mismatches, 1ull);
      atomicCAS(first, 0u, four | 1u);  // the first mismatch recorded, its low bit set so it is never 0
    }
  }
}

TEST(Gpu, E4m3x4ToF16PairsMatchesPairConversionOnEveryWord) {
  REQUIRE_GPU();
  DeviceBuffer<unsigned long long> d_count(1);
  DeviceBuffer<unsigned> d_first(1);
  ASSERT_TRUE(d_count && d_first) << "cudaMalloc";
  CUDA_OK(cudaMemset(d_count.get(), 0, 8));
  CUDA_OK(cudaMemset(d_first.get(), 0, 4));
  e4m3x4_kernel<<<132 * 16, 256>>>(d_count.get(), d_first.get());
  CUDA_OK(cudaGetLastError());
  CUDA_OK(cudaDeviceSynchronize());
  unsigned long long count = 0;
  unsigned first = 0;
  CUDA_OK(cudaMemcpy(&count, d_count.get(), 8, cudaMemcpyDeviceToHost));
  CUDA_OK(cudaMemcpy(&first, d_first.get(), 4, cudaMemcpyDeviceToHost));
  EXPECT_EQ(count, 0ull) << "first mismatching word (low bit forced to 1): 0x" << std::hex << first;
}

// ------------------------------------------------------------------------------------------------
// Copies host data into an existing device tensor (in place: graph captures keep the address).
// Host -> device, landed when it returns (a pageable cudaMemcpy may return before its DMA ends,
// and the tests' streams do not wait for the legacy stream).
void upload(const Tensor& dst, const Tensor& src) {
  ASSERT_EQ(dst.nbytes(), src.nbytes());
  ASSERT_EQ(cudaMemcpy(dst.data(), src.data(), size_t(src.nbytes()), cudaMemcpyHostToDevice), cudaSuccess);
  ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
}

// Tensor::fill_bytes is an asynchronous memset on the legacy stream, which the tests' non-blocking
// streams do not wait for: settle it before launching on them.
void settle() { ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess); }

bool same_bytes(const Tensor& a, const Tensor& b) {
  Tensor ha = a.to(Device::cpu()), hb = b.to(Device::cpu());
  return ha.nbytes() == hb.nbytes() && std::memcmp(ha.data(), hb.data(), size_t(ha.nbytes())) == 0;
}

// A graph captured from `run` on its own non-blocking stream (destroyed with the object).
struct CapturedGraph {
  cudaStream_t stream = nullptr;
  cudaGraph_t graph = nullptr;
  cudaGraphExec_t exec = nullptr;
  explicit CapturedGraph(const std::function<void(cudaStream_t)>& run) {
    EXPECT_EQ(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking), cudaSuccess);
    EXPECT_EQ(cudaStreamBeginCapture(stream, cudaStreamCaptureModeThreadLocal), cudaSuccess);
    run(stream);
    EXPECT_EQ(cudaStreamEndCapture(stream, &graph), cudaSuccess);
    EXPECT_EQ(cudaGraphInstantiate(&exec, graph, 0), cudaSuccess);
  }
  ~CapturedGraph() {
    cudaGraphExecDestroy(exec);
    cudaGraphDestroy(graph);
    cudaStreamDestroy(stream);
  }
};

struct GraphCase {
  static constexpr int L = 5, nkv = 4, bs = 128, rot = 64, nq = 16;
  // The QK insert runs twice: T tokens (its quad kernel) and T2 tokens (its half-warp kernel).
  static constexpr int64_t n = 300, T = 300, T2 = 40, max_pos = 8192, nb = 12;
  bool fp8;
  Rng rng{42};
  // Device state captured by the graph (fixed addresses).
  Tensor all_kv, w, positions, slots, table, qkv, qw, kw, qpos, qslots, qk_cache, qkv2, qpos2, qslots2;
  std::vector<Tensor> caches, ks, vs;
  std::vector<DsparkDraftLayerKv> layers;

  explicit GraphCase(bool fp8_) : fp8(fp8_) {
    const Device g = Device::cuda();
    const DType cdt = fp8 ? DType::kUInt8 : DType::kBFloat16;
    all_kv = Tensor::empty({n, L, 2, nkv, 128}, DType::kBFloat16, g);
    w = detail::random_half({L, 128}, DType::kBFloat16, rng, -1, 1).to(g);
    positions = Tensor::empty({n}, DType::kInt64, g);
    slots = Tensor::empty({n}, DType::kInt64, g);
    table = detail::rope_table(max_pos, rot).to(g);
    qkv = Tensor::empty({T, (nq + 2 * nkv) * 128}, DType::kBFloat16, g);
    qkv2 = Tensor::empty({T2, (nq + 2 * nkv) * 128}, DType::kBFloat16, g);
    qpos2 = Tensor::empty({T2}, DType::kInt64, g);
    qslots2 = Tensor::empty({T2}, DType::kInt64, g);
    qw = detail::random_half({128}, DType::kBFloat16, rng, -1, 1).to(g);
    kw = detail::random_half({128}, DType::kBFloat16, rng, -1, 1).to(g);
    qpos = Tensor::empty({T}, DType::kInt64, g);
    qslots = Tensor::empty({T}, DType::kInt64, g);
    qk_cache = Tensor::empty({nb, nkv, bs, 256}, cdt, g);
    for (int l = 0; l < L; ++l) {
      caches.push_back(Tensor::empty({nb, nkv, bs, 256}, cdt, g));
      ks.push_back(detail::scalar_f32(0.5f + 0.25f * l).to(g));
      vs.push_back(detail::scalar_f32(2.0f - 0.25f * l).to(g));
      layers.push_back({caches.back(), fp8 ? KvCacheDtype::kFp8E4M3 : KvCacheDtype::kAuto, ks.back(), vs.back()});
    }
  }
  // New values, positions and slots, written into the same device buffers.
  void refill() {
    upload(all_kv, detail::random_half({n, L, 2, nkv, 128}, DType::kBFloat16, rng, -3, 3));
    upload(qkv, detail::random_half({T, (nq + 2 * nkv) * 128}, DType::kBFloat16, rng, -3, 3));
    upload(qkv2, detail::random_half({T2, (nq + 2 * nkv) * 128}, DType::kBFloat16, rng, -3, 3));
    std::vector<int64_t> p(n), qp(T), qp2(T2);
    for (auto& x : p) x = rng.integer(0, max_pos - 1);
    for (auto& x : qp) x = rng.integer(0, max_pos - 1);
    for (auto& x : qp2) x = rng.integer(0, max_pos - 1);
    upload(positions, detail::int64_vector(p));
    upload(qpos, detail::int64_vector(qp));
    upload(qpos2, detail::int64_vector(qp2));
    upload(slots, detail::int64_vector(detail::random_slots(n, nb * bs, 9, rng)));
    upload(qslots, detail::int64_vector(detail::random_slots(T, nb * bs, 4, rng)));
    upload(qslots2, detail::int64_vector(detail::random_slots(T2, nb * bs, 4, rng)));
    for (auto& c : caches) c.fill_bytes(0xFF);
    qk_cache.fill_bytes(0xFF);
  }
  void write_kv(DsparkContextKvWriter& writer, cudaStream_t s, bool pdl = false) {
    writer({.all_kv = all_kv, .k_norm_weight = w, .eps = 1e-6f, .positions = positions,
            .cos_sin_cache = table, .rotary_dim = rot, .slot_mapping = slots, .enable_pdl = pdl}, s);
  }
  // The QK insert on qkv (second = false) or qkv2, in place, with the layer-0 or -1 scales.
  void insert_qk(bool second, cudaStream_t s, bool pdl = false) {
    qknorm_rope_kv_insert({.qkv = second ? qkv2 : qkv, .q_norm_weight = qw, .k_norm_weight = kw,
                           .cos_sin_cache = table, .positions = second ? qpos2 : qpos, .num_heads = nq,
                           .num_kv_heads = nkv, .rotary_dim = rot, .eps = 1e-6f,
                           .slot_mapping = second ? qslots2 : qslots, .kv_cache = qk_cache,
                           .kv_cache_dtype = fp8 ? KvCacheDtype::kFp8E4M3 : KvCacheDtype::kAuto,
                           .k_scale = ks[second ? 1 : 0], .v_scale = vs[second ? 1 : 0], .enable_pdl = pdl},
                          s);
  }
  void run(DsparkContextKvWriter& writer, cudaStream_t s) {
    write_kv(writer, s);
    insert_qk(false, s);
    insert_qk(true, s);
  }
  std::vector<Tensor> snapshot() {
    std::vector<Tensor> out;
    for (auto& c : caches) out.push_back(c.to(Device::cpu()));
    out.push_back(qk_cache.to(Device::cpu()));
    out.push_back(qkv.to(Device::cpu()));
    out.push_back(qkv2.to(Device::cpu()));
    return out;
  }
};

class GpuGraph : public ::testing::TestWithParam<bool> {};

TEST_P(GpuGraph, ReplayAfterInPlaceChangesMatchesEagerBitwise) {
  REQUIRE_GPU();
  GraphCase c(GetParam());
  DsparkContextKvWriter writer(c.layers);
  c.refill();
  CapturedGraph g([&](cudaStream_t st) { c.run(writer, st); });
  cudaStream_t s = g.stream;
  for (int round = 0; round < 3; ++round) {
    // Eager on fresh inputs ...
    c.refill();
    const Tensor qkv_in = c.qkv.to(Device::cpu()), qkv2_in = c.qkv2.to(Device::cpu());
    settle();
    c.run(writer, s);
    CUDA_OK(cudaStreamSynchronize(s));
    const auto eager = c.snapshot();
    // ... then the same inputs restored in place and the graph replayed.
    for (auto& cache : c.caches) cache.fill_bytes(0xFF);
    c.qk_cache.fill_bytes(0xFF);
    upload(c.qkv, qkv_in);
    upload(c.qkv2, qkv2_in);
    settle();
    CUDA_OK(cudaGraphLaunch(g.exec, s));
    CUDA_OK(cudaStreamSynchronize(s));
    const auto replay = c.snapshot();
    for (size_t i = 0; i < eager.size(); ++i)
      EXPECT_TRUE(same_bytes(eager[i], replay[i])) << "round " << round << " buffer " << i;
  }
  EXPECT_EQ(writer.table_builds(), 1);
}

INSTANTIATE_TEST_SUITE_P(CacheDtype, GpuGraph, ::testing::Values(false, true),
                         [](const auto& info) { return info.param ? "fp8" : "bf16"; });

// The producer a PDL-launched call depends on: it lets its dependents launch at once, then spins
// (about 40 us) before writing their inputs, so a dependent that read before its
// griddepcontrol.wait would see the stale ones.
__global__ void late_copy_kernel(uint4* dst, const uint4* src, int64_t n) {
  kernels::launch_dependents();
  if (threadIdx.x == 0) {
    const long long t0 = clock64();
    while (clock64() - t0 < 80000) {
    }
  }
  __syncthreads();
  for (int64_t i = threadIdx.x; i < n; i += blockDim.x) dst[i] = src[i];
}

// A late copy of `src` into `dst` (same size, a multiple of 16 bytes) on `st`.
void late_copy(const Tensor& dst, const Tensor& src, cudaStream_t st) {
  ASSERT_EQ(dst.nbytes(), src.nbytes());
  ASSERT_EQ(dst.nbytes() % 16, 0);
  late_copy_kernel<<<1, 256, 0, st>>>(static_cast<uint4*>(dst.data()), static_cast<const uint4*>(src.data()),
                                      dst.nbytes() / 16);
}

// enable_pdl on the writer and the QK insert: eager and captured in a graph, each call launched
// with PDL right after a kernel that writes its inputs late — the writer (bf16: its half-warp
// kernel; fp8: its quad kernel) after all_kv's copy, the QK insert (quad kernel) after qkv's and
// then again on its own output in place (a dependent of a dependent: each call lets the next
// launch at its start), the half-warp QK insert after qkv2's — the caches and rows equal those of
// plain launches on the final inputs, bit for bit.
TEST_P(GpuGraph, PdlLaunchesWaitForThePrecedingKernel) {
  REQUIRE_GPU();
  // fp8: the writer's quad kernel (its size and the GPU would pick the half-warp one), so that both
  // of its kernels' waits are exercised: the graph (captured now) and the first two rounds' eager
  // calls take the quad kernel, the last round's eager calls the half-warp one, whose e4m3
  // instances wait after loading the weights and scales (session 54).
  auto quad = std::make_unique<detail::ScopedEnv>("M3RT_WRITER_QUAD_MIN", GetParam() ? "1" : nullptr);
  GraphCase c(GetParam());
  DsparkContextKvWriter writer(c.layers);
  using G = GraphCase;
  const Device g = Device::cuda();
  Tensor all_kv_next = Tensor::empty({G::n, G::L, 2, G::nkv, 128}, DType::kBFloat16, g);
  Tensor qkv_next = Tensor::empty({G::T, (G::nq + 2 * G::nkv) * 128}, DType::kBFloat16, g);
  Tensor qkv2_next = Tensor::empty({G::T2, (G::nq + 2 * G::nkv) * 128}, DType::kBFloat16, g);
  auto calls = [&](cudaStream_t st, bool pdl) {  // with pdl: each after its inputs' late copy
    if (pdl) late_copy(c.all_kv, all_kv_next, st);
    c.write_kv(writer, st, pdl);
    if (pdl) late_copy(c.qkv, qkv_next, st);
    c.insert_qk(false, st, pdl);
    c.insert_qk(false, st, pdl);
    if (pdl) late_copy(c.qkv2, qkv2_next, st);
    c.insert_qk(true, st, pdl);
  };
  c.refill();
  CapturedGraph graph([&](cudaStream_t st) { calls(st, true); });
  cudaStream_t st = graph.stream;
  auto reset_outputs = [&] {
    for (auto& cache : c.caches) cache.fill_bytes(0xFF);
    c.qk_cache.fill_bytes(0xFF);
  };
  for (int round = 0; round < 3; ++round) {
    if (round == 2) quad.reset();
    c.refill();
    const Tensor all_kv_in = c.all_kv.to(Device::cpu()), qkv_in = c.qkv.to(Device::cpu()),
                 qkv2_in = c.qkv2.to(Device::cpu());
    settle();
    calls(st, false);  // the reference: plain launches on the final inputs
    CUDA_OK(cudaStreamSynchronize(st));
    const auto want = c.snapshot();
    EXPECT_FALSE(same_bytes(want[want.size() - 2], qkv_in)) << "round " << round;
    for (int mode = 0; mode < 2; ++mode) {  // eager, graph
      upload(all_kv_next, all_kv_in);
      upload(qkv_next, qkv_in);
      upload(qkv2_next, qkv2_in);
      c.all_kv.fill_bytes(0);  // stale inputs: zeros
      c.qkv.fill_bytes(0);
      c.qkv2.fill_bytes(0);
      reset_outputs();
      settle();
      if (mode == 0) calls(st, true);
      else CUDA_OK(cudaGraphLaunch(graph.exec, st));
      CUDA_OK(cudaStreamSynchronize(st));
      const auto got = c.snapshot();
      for (size_t i = 0; i < want.size(); ++i)
        EXPECT_TRUE(same_bytes(want[i], got[i]))
            << (mode ? "graph" : "eager") << " buffer " << i << ", round " << round;
    }
  }
}

// The QK insert on the GPU does not write a token whose position lies outside the RoPE table (the
// CPU path throws instead): its qkv row and its cache rows stay as they were, and every other token
// is written exactly as in a run where all positions are valid. T = 40 runs the half-warp kernel,
// T = 300 and 900 the quad kernel (1-2 and 3-4 tokens a warp through its 3-stage pipeline).
class GpuQkInsertPositions : public ::testing::TestWithParam<int64_t> {};

TEST_P(GpuQkInsertPositions, OutsideTheTableLeavesTheTokenUnwritten) {
  REQUIRE_GPU();
  constexpr int nq = 16, nkv = 4, rot = 64, bs = 128;
  constexpr int64_t max_pos = 4096;
  const int64_t T = GetParam(), nb = (T + bs - 1) / bs + 2, W = (nq + 2 * nkv) * 128;
  const Device g = Device::cuda();
  Rng rng(7);
  const Tensor qkv_in = detail::random_half({T, W}, DType::kBFloat16, rng, -3, 3);
  const Tensor qw = detail::random_half({128}, DType::kBFloat16, rng, -1, 1).to(g);
  const Tensor kw = detail::random_half({128}, DType::kBFloat16, rng, -1, 1).to(g);
  const Tensor table = detail::rope_table(max_pos, rot).to(g);
  const std::vector<int64_t> slots = detail::random_slots(T, nb * bs, 0, rng);  // distinct, all valid
  std::vector<int64_t> pos(static_cast<size_t>(T));
  for (auto& x : pos) x = rng.integer(0, max_pos - 1);
  std::vector<int64_t> bad = pos;
  const int64_t outside[] = {-1, max_pos, int64_t(1) << 40, -(int64_t(1) << 40) + 3};
  for (int64_t t = 2, i = 0; t < T; t += 5, ++i) bad[size_t(t)] = outside[i % 4];
  const Tensor slot_t = detail::int64_vector(slots).to(g);
  auto run = [&](const std::vector<int64_t>& positions, Tensor& qkv, Tensor& cache) {
    qkv = qkv_in.to(g);
    cache = Tensor::empty({nb, nkv, bs, 256}, DType::kBFloat16, g);
    cache.fill_bytes(0xFF);
    const Tensor p = detail::int64_vector(positions).to(g);
    settle();
    qknorm_rope_kv_insert({.qkv = qkv, .q_norm_weight = qw, .k_norm_weight = kw, .cos_sin_cache = table,
                           .positions = p, .num_heads = nq, .num_kv_heads = nkv, .rotary_dim = rot,
                           .eps = 1e-6f, .slot_mapping = slot_t, .kv_cache = cache,
                           .kv_cache_dtype = KvCacheDtype::kAuto}, nullptr);
    CUDA_OK(cudaDeviceSynchronize());
  };
  Tensor qkv_ok, cache_ok, qkv_bad, cache_bad;
  run(pos, qkv_ok, cache_ok);
  run(bad, qkv_bad, cache_bad);
  const Tensor a = qkv_ok.to(Device::cpu()), b = qkv_bad.to(Device::cpu());
  Tensor ca = cache_ok.to(Device::cpu());
  const Tensor cb = cache_bad.to(Device::cpu());
  int64_t written = 0, skipped = 0;
  for (int64_t t = 0; t < T; ++t) {
    const bool inside = bad[size_t(t)] == pos[size_t(t)];
    const uint16_t* want = (inside ? a : qkv_in).ptr<uint16_t>() + t * W;
    EXPECT_EQ(std::memcmp(b.ptr<uint16_t>() + t * W, want, size_t(W) * 2), 0) << "qkv row of token " << t;
    EXPECT_NE(std::memcmp(a.ptr<uint16_t>() + t * W, qkv_in.ptr<uint16_t>() + t * W, size_t(W) * 2), 0)
        << "token " << t << " was not written in the valid run";
    if (inside) {
      ++written;
      continue;
    }
    ++skipped;
    const int64_t blk = slots[size_t(t)] / bs, off = slots[size_t(t)] % bs;  // untouched: 0xFF bytes
    for (int h = 0; h < nkv; ++h) std::memset(ca.ptr<uint16_t>() + ((blk * nkv + h) * bs + off) * 256, 0xFF, 512);
  }
  EXPECT_GT(skipped, 0);
  EXPECT_GT(written, skipped);
  EXPECT_EQ(std::memcmp(ca.data(), cb.data(), size_t(ca.nbytes())), 0) << "cache";
}

INSTANTIATE_TEST_SUITE_P(Tokens, GpuQkInsertPositions, ::testing::Values(int64_t(40), int64_t(300), int64_t(900)),
                         [](const auto& info) {  // appended: "T" + std::string drew GCC 12's bogus -Wrestrict
                           return std::string("T").append(std::to_string(info.param));
                         });


// Calls with run-time claims (claim_counters): call kClaimCalls without counters (the static
// split) gives the reference (it must have written its outputs); then calls 0..kClaimCalls-1 with
// them, eager back to back on one stream (every other one launched with PDL, so a call starts
// while the one before it finishes), then the same calls captured in a graph and replayed twice. Each call writes its own outputs,
// which must equal the reference's bitwise, and the counters must be zero after each round.
// call(i, claims, pdl, stream) runs call i; reset() restores inputs and poisons outputs
// (synchronously); outputs(i) are call i's. `env` = `pct` (>= 0) forces the claimed share.
constexpr int kClaimCalls = 4;
void expect_claimed_calls_match(const std::function<void(int, bool, bool, cudaStream_t)>& call,
                                const std::function<void()>& reset,
                                const std::function<std::vector<Tensor>(int)>& outputs, const char* env, int pct,
                                const Tensor& counters) {
  const std::string forced = std::to_string(pct);
  const detail::ScopedEnv scoped(env, pct >= 0 ? forced.c_str() : nullptr);
  reset();
  call(kClaimCalls, false, false, nullptr);
  settle();
  std::vector<Tensor> want;
  for (const Tensor& t : outputs(kClaimCalls)) want.push_back(t.to(Device::cpu()));
  reset();  // the reference call wrote its outputs: they differ from the restored / poisoned ones
  bool wrote = false;
  for (size_t k = 0; k < want.size(); ++k) wrote = wrote || !same_bytes(outputs(kClaimCalls)[k], want[k]);
  EXPECT_TRUE(wrote) << "the static reference call left its outputs as they were";
  Tensor zeros = Tensor::empty({kClaimCounterInts}, DType::kInt32, Device::cuda());
  zeros.fill_bytes(0);
  CapturedGraph graph([&](cudaStream_t st) {
    for (int i = 0; i < kClaimCalls; ++i) call(i, true, i % 2 == 1, st);
  });
  for (int mode = 0; mode < 3; ++mode) {  // eager, graph, graph again
    reset();
    if (mode == 0) {
      for (int i = 0; i < kClaimCalls; ++i) call(i, true, i % 2 == 1, graph.stream);
    } else {
      CUDA_OK(cudaGraphLaunch(graph.exec, graph.stream));
    }
    CUDA_OK(cudaStreamSynchronize(graph.stream));
    for (int i = 0; i < kClaimCalls; ++i) {
      const std::vector<Tensor> got = outputs(i);
      for (size_t k = 0; k < got.size(); ++k)
        EXPECT_TRUE(same_bytes(got[k], want[k])) << "call " << i << ", output " << k << ", mode " << mode;
    }
    EXPECT_TRUE(same_bytes(counters, zeros)) << "counters after mode " << mode;
  }
}

// The token-indexed inputs of a claims test: a RoPE table, n positions in it, n slots in
// [0, num_slots) (every `pad`-th -1), and zeroed claim counters, all on the GPU.
struct ClaimCallInputs {
  Tensor table, positions, slots, counters;
  ClaimCallInputs(int64_t n, int64_t max_pos, int rot, int64_t num_slots, int pad, Rng& rng) {
    const Device g = Device::cuda();
    table = detail::rope_table(max_pos, rot).to(g);
    std::vector<int64_t> pos(static_cast<size_t>(n));
    for (auto& x : pos) x = rng.integer(0, max_pos - 1);
    positions = detail::int64_vector(pos).to(g);
    slots = detail::int64_vector(detail::random_slots(n, num_slots, pad, rng)).to(g);
    counters = Tensor::empty({kClaimCounterInts}, DType::kInt32, g);
    counters.fill_bytes(0);
  }
};

// The two ops' claims. Param: -1 the library's rule at its size (the QK insert T = 2600: the last
// 15% claimed on GPUs below the H200's DRAM bandwidth an SM, none on others; the writer n = 16400:
// 15% in claims of 4 token pairs, from 8192 tokens on GPUs below the H200's DRAM bandwidth an SM
// and from 16384 on others), 100 every token claimed (M3RT_QK_CLAIM_PCT / M3RT_WRITER_CLAIM_PCT) at
// that size and at 300 tokens (a warp's static part then empty).
class GpuClaims : public ::testing::TestWithParam<std::tuple<int, bool>> {};

TEST_P(GpuClaims, QkInsertCallsWriteWhatTheStaticSplitWritesAndLeaveTheCountersZero) {
  REQUIRE_GPU();
  const auto [pct, small] = GetParam();
  const int64_t T = small ? 300 : 2600;
  constexpr int nq = 64, nkv = 4, rot = 64, bs = 128;
  constexpr int64_t max_pos = 8192;
  const int64_t nb = (T + bs - 1) / bs + 2, W = (nq + 2 * nkv) * 128;
  const Device g = Device::cuda();
  Rng rng(11);
  const Tensor qkv_in = detail::random_half({T, W}, DType::kBFloat16, rng, -3, 3).to(g);
  const Tensor qw = detail::random_half({128}, DType::kBFloat16, rng, -1, 1).to(g);
  const Tensor kw = detail::random_half({128}, DType::kBFloat16, rng, -1, 1).to(g);
  const ClaimCallInputs in(T, max_pos, rot, nb * bs, 5, rng);
  const Tensor &table = in.table, &positions = in.positions, &slots = in.slots, &counters = in.counters;
  std::vector<Tensor> qkv, cache;  // call i's own (the last: the static reference's)
  for (int i = 0; i <= kClaimCalls; ++i) {
    qkv.push_back(Tensor::empty({T, W}, DType::kBFloat16, g));
    cache.push_back(Tensor::empty({nb, nkv, bs, 256}, DType::kBFloat16, g));
  }
  auto reset = [&] {
    for (int i = 0; i <= kClaimCalls; ++i) {
      CUDA_OK(cudaMemcpy(qkv[size_t(i)].data(), qkv_in.data(), size_t(qkv_in.nbytes()), cudaMemcpyDeviceToDevice));
      cache[size_t(i)].fill_bytes(0xFF);
    }
    settle();
  };
  auto call = [&](int i, bool claims, bool pdl, cudaStream_t st) {
    qknorm_rope_kv_insert({.qkv = qkv[size_t(i)], .q_norm_weight = qw, .k_norm_weight = kw, .cos_sin_cache = table,
                           .positions = positions, .num_heads = nq, .num_kv_heads = nkv, .rotary_dim = rot,
                           .eps = 1e-6f, .slot_mapping = slots, .kv_cache = cache[size_t(i)],
                           .enable_pdl = pdl, .claim_counters = claims ? counters.view() : TensorView{}},
                          st);
  };
  expect_claimed_calls_match(call, reset,
                             [&](int i) { return std::vector<Tensor>{qkv[size_t(i)], cache[size_t(i)]}; },
                             "M3RT_QK_CLAIM_PCT", pct, counters);
}

// The writer's claims at n tokens into bf16 or fp8 (e4m3, scales 0.5 / 2) caches.
void expect_writer_claims_match(int pct, int64_t n, bool fp8) {
  constexpr int L = 2, nkv = 2, rot = 64, bs = 64;
  constexpr int64_t max_pos = 16384;
  const int64_t nb = (n + bs - 1) / bs + 3;
  const Device g = Device::cuda();
  Rng rng(23);
  const Tensor all_kv = detail::random_half({n, L, 2, nkv, 128}, DType::kBFloat16, rng, -3, 3).to(g);
  const Tensor w = detail::random_half({L, 128}, DType::kBFloat16, rng, -1, 1).to(g);
  const ClaimCallInputs in(n, max_pos, rot, nb * bs, 7, rng);
  const Tensor &table = in.table, &positions = in.positions, &slots = in.slots, &counters = in.counters;
  // Call i's own caches and writer (the last: the static reference's).
  const Tensor k_scale = detail::scalar_f32(fp8 ? 0.5f : 1.f).to(g), v_scale = detail::scalar_f32(fp8 ? 2.f : 1.f).to(g);
  std::vector<std::vector<Tensor>> caches(kClaimCalls + 1);
  std::vector<std::unique_ptr<DsparkContextKvWriter>> writers;
  for (auto& c : caches) {
    std::vector<DsparkDraftLayerKv> layers;
    for (int l = 0; l < L; ++l) {
      c.push_back(Tensor::empty({nb, nkv, bs, 256}, fp8 ? DType::kUInt8 : DType::kBFloat16, g));
      layers.push_back({c.back(), fp8 ? KvCacheDtype::kFp8E4M3 : KvCacheDtype::kAuto, k_scale, v_scale});
    }
    writers.push_back(std::make_unique<DsparkContextKvWriter>(layers));
  }
  auto reset = [&] {
    for (auto& c : caches)
      for (auto& t : c) t.fill_bytes(0xFF);
    settle();
  };
  auto call = [&](int i, bool claims, bool pdl, cudaStream_t st) {
    (*writers[size_t(i)])({.all_kv = all_kv, .k_norm_weight = w, .eps = 1e-6f, .positions = positions,
                           .cos_sin_cache = table, .rotary_dim = rot, .slot_mapping = slots, .enable_pdl = pdl,
                           .claim_counters = claims ? counters.view() : TensorView{}},
                          st);
  };
  expect_claimed_calls_match(call, reset, [&](int i) { return caches[size_t(i)]; }, "M3RT_WRITER_CLAIM_PCT", pct,
                             counters);
}

TEST_P(GpuClaims, WriterCallsWriteWhatTheStaticSplitWritesAndLeaveTheCountersZero) {
  REQUIRE_GPU();
  const auto [pct, small] = GetParam();
  expect_writer_claims_match(pct, small ? 300 : 16400, false);
}

// fp8 caches: the rule at 32800 tokens (claims in the half-warp kernel on GPUs with less DRAM
// bandwidth an SM than the H200; there the quad kernel, which does not claim by the rule), every
// pair claimed at 8200 and 30% at 300 tokens (the half-warp kernel on every GPU).
class GpuWriterFp8Claims : public ::testing::TestWithParam<std::tuple<int, int64_t>> {};

TEST_P(GpuWriterFp8Claims, CallsWriteWhatTheStaticSplitWritesAndLeaveTheCountersZero) {
  REQUIRE_GPU();
  const auto [pct, n] = GetParam();
  expect_writer_claims_match(pct, n, true);
}

// A (pct, n) claims case's name: rule_n32800, pct100_n8200, ...
std::string claims_case_name(const ::testing::TestParamInfo<std::tuple<int, int64_t>>& info) {
  const int pct = std::get<0>(info.param);
  return (pct < 0 ? std::string("rule") : std::string("pct").append(std::to_string(pct)))
      .append("_n")
      .append(std::to_string(std::get<1>(info.param)));
}

INSTANTIATE_TEST_SUITE_P(Claims, GpuWriterFp8Claims,
                         ::testing::Values(std::tuple{-1, int64_t(32800)}, std::tuple{100, int64_t(8200)},
                                           std::tuple{30, int64_t(300)}),
                         claims_case_name);

// fp8 caches in the quad kernel (forced by M3RT_WRITER_QUAD_MIN), a unit (a warp's 2 tokens x 4
// pairs) a claim: its rule at 16400 (15% from 16384 tokens on GPUs below the H200's DRAM bandwidth
// an SM; none on others), every unit claimed at an odd token count, 30% at 8200 tokens.
class GpuWriterQuadClaims : public ::testing::TestWithParam<std::tuple<int, int64_t>> {};

TEST_P(GpuWriterQuadClaims, CallsWriteWhatTheStaticSplitWritesAndLeaveTheCountersZero) {
  REQUIRE_GPU();
  const auto [pct, n] = GetParam();
  const detail::ScopedEnv quad("M3RT_WRITER_QUAD_MIN", "1");
  expect_writer_claims_match(pct, n, true);
}

INSTANTIATE_TEST_SUITE_P(Claims, GpuWriterQuadClaims,
                         ::testing::Values(std::tuple{-1, int64_t(16400)}, std::tuple{100, int64_t(4101)},
                                           std::tuple{30, int64_t(8200)}),
                         claims_case_name);

INSTANTIATE_TEST_SUITE_P(Claims, GpuClaims,
                         ::testing::Values(std::tuple{-1, false}, std::tuple{100, false}, std::tuple{100, true}),
                         [](const auto& info) {
                           return std::string(std::get<0>(info.param) < 0 ? "rule" : "all")
                               .append(std::get<1>(info.param) ? "_small" : "_large");
                         });

// ------------------------------------------------------------------------------------------------
// Lightning indexer under CUDA graphs. Sizes stay fixed (the capture's shape key); lengths, block
// tables and queries change in place between replays.
struct IndexerGraphCase {
  static constexpr int H = 4, topk = 6, max_blocks = 20, B = 3, dql = 4;
  static constexpr int64_t pages = 64, T = 2 * 300;  // prefill: two requests, 600 tokens
  bool fp8;
  Rng rng{77};
  Tensor cache, dq, dseq, dtable, dout, pq, pcu, pseq, ptable, pout;

  explicit IndexerGraphCase(bool fp8_) : fp8(fp8_) {
    const Device g = Device::cuda();
    const DType dt = fp8 ? DType::kUInt8 : DType::kBFloat16;
    cache = Tensor::empty({pages, 128, 128}, dt, g);
    dq = Tensor::empty({B * dql, H, 128}, dt, g);
    dseq = Tensor::empty({B}, DType::kInt32, g);
    dtable = Tensor::empty({B, max_blocks}, DType::kInt32, g);
    dout = Tensor::empty({B * dql, H, topk}, DType::kInt32, g);
    pq = Tensor::empty({T, H, 128}, dt, g);
    pcu = Tensor::empty({3}, DType::kInt32, g);
    pseq = Tensor::empty({2}, DType::kInt32, g);
    ptable = Tensor::empty({2, max_blocks}, DType::kInt32, g);
    pout = Tensor::empty({T, H, topk}, DType::kInt32, g);
  }
  Tensor values(std::vector<int64_t> shape) {
    Tensor h = detail::random_half(shape, DType::kBFloat16, rng, -2, 2);
    if (!fp8) return h;
    Tensor e = Tensor::empty(shape, DType::kUInt8);
    for (int64_t i = 0; i < h.numel(); ++i) e.ptr<uint8_t>()[i] = float_to_e4m3(bf16_to_float(h.ptr<uint16_t>()[i]));
    return e;
  }
  static Tensor ints(const std::vector<int32_t>& v, std::vector<int64_t> shape) {
    Tensor t = Tensor::empty(shape, DType::kInt32);
    std::copy(v.begin(), v.end(), t.ptr<int32_t>());
    return t;
  }
  // New queries, keys, lengths and tables; pages nobody may read are NaN.
  void refill() {
    upload(cache, values({pages, 128, 128}));
    upload(dq, values({B * dql, H, 128}));
    upload(pq, values({T, H, 128}));
    std::vector<int32_t> perm(pages);
    for (int i = 0; i < pages; ++i) perm[size_t(i)] = i;
    std::shuffle(perm.begin(), perm.end(), rng.gen());
    std::vector<int32_t> dlen(B), dtab(B * max_blocks, -1), plen(2), ptab(2 * max_blocks, -1);
    dlen[0] = int32_t(rng.integer(1, 1000));
    dlen[1] = 0;  // a padded request
    dlen[2] = int32_t(rng.integer(1, 2000));
    const int q0 = int32_t(rng.integer(1, 299)), q1 = 300 * 2 - q0;
    plen[0] = q0 + int32_t(rng.integer(0, 700));  // chunked prefill: some context already cached
    plen[1] = q1;
    size_t next = 0;
    for (int b = 0; b < B; ++b)
      for (int j = 0; j < (dlen[size_t(b)] + 127) / 128; ++j) dtab[size_t(b * max_blocks + j)] = perm[next++ % pages];
    for (int b = 0; b < 2; ++b)
      for (int j = 0; j < (plen[size_t(b)] + 127) / 128; ++j) ptab[size_t(b * max_blocks + j)] = perm[next++ % pages];
    upload(dseq, ints(dlen, {B}));
    upload(dtable, ints(dtab, {B, max_blocks}));
    upload(pseq, ints(plen, {2}));
    upload(ptable, ints(ptab, {2, max_blocks}));
    upload(pcu, ints({0, q0, q0 + q1}, {3}));
    dout.fill_bytes(0x7F);
    pout.fill_bytes(0x7F);
  }
  IndexerConfig config() const {
    IndexerConfig c;
    c.num_index_heads = H;
    c.select = {topk, 1, 2};
    c.index_cache_dtype = fp8 ? KvCacheDtype::kFp8E4M3 : KvCacheDtype::kAuto;
    c.max_prefill_tokens = T;
    c.max_decode_seqs = B;
    c.max_decode_query_len = dql;
    c.max_blocks_per_seq = max_blocks;
    return c;
  }
  // The decode twice, the second call a programmatic dependent of the first (PDL on Hopper): it
  // reuses the scratch the first call's selection reads, so it must wait for that call to finish.
  void run(LightningIndexer& ix, cudaStream_t s) {
    for (bool pdl : {false, true})
      ix.decode({.index_q = dq, .index_cache = cache, .seq_lens = dseq, .block_table = dtable,
                 .decode_query_len = dql, .topk_out = dout, .enable_pdl = pdl}, s);
    ix.prefill({.index_q = pq, .index_cache = cache, .cu_seqlens_q = pcu, .seq_lens = pseq,
                .block_table = ptable, .max_query_len = int(T), .topk_out = pout}, s);
  }
};

// (fp8, portable): the portable kernels forced on Hopper too.
class GpuIndexerGraph : public ::testing::TestWithParam<std::tuple<bool, bool>> {};

TEST_P(GpuIndexerGraph, ReplayAfterInPlaceChangesMatchesEagerAndReference) {
  REQUIRE_GPU();
  IndexerGraphCase c(std::get<0>(GetParam()));
  struct Portable {
    explicit Portable(bool on) { indexer_force_portable(on); }
    ~Portable() { indexer_force_portable(false); }
  } portable(std::get<1>(GetParam()));
  LightningIndexer gpu(c.config(), Device::cuda());
  LightningIndexer cpu(c.config(), Device::cpu());
  c.refill();
  CapturedGraph g([&](cudaStream_t st) { c.run(gpu, st); });
  cudaStream_t s = g.stream;
  for (int round = 0; round < 4; ++round) {
    c.refill();
    settle();
    c.run(gpu, s);
    CUDA_OK(cudaStreamSynchronize(s));
    const Tensor eager_d = c.dout.to(Device::cpu()), eager_p = c.pout.to(Device::cpu());
    c.dout.fill_bytes(0x7F);
    c.pout.fill_bytes(0x7F);
    settle();
    CUDA_OK(cudaGraphLaunch(g.exec, s));
    CUDA_OK(cudaStreamSynchronize(s));
    EXPECT_TRUE(same_bytes(eager_d, c.dout)) << "decode, round " << round;
    EXPECT_TRUE(same_bytes(eager_p, c.pout)) << "prefill, round " << round;
    // The CPU reference's scores on the same inputs: every row a correct selection (set
    // comparison with ties resolved by those scores; src/ops/lightning_indexer/indexer_compare.h).
    const IndexerConfig cfg = c.config();
    const Tensor cache = c.cache.to(Device::cpu());
    const Tensor dq = c.dq.to(Device::cpu()), dseq = c.dseq.to(Device::cpu()), dtab = c.dtable.to(Device::cpu());
    const Tensor pq = c.pq.to(Device::cpu()), pcu = c.pcu.to(Device::cpu()), pseq = c.pseq.to(Device::cpu()),
                 ptab = c.ptable.to(Device::cpu());
    const Tensor got_d = c.dout.to(Device::cpu()), got_p = c.pout.to(Device::cpu());
    for (bool prefill : {false, true}) {
      const IndexerParams p =
          prefill ? indexer_call_params(cfg, pq, cache, pseq, ptab, TensorView{}, pcu, 0, int(c.T))
                  : indexer_call_params(cfg, dq, cache, dseq, dtab, TensorView{}, TensorView{}, c.dql, 0);
      const Tensor& got = prefill ? got_p : got_d;
      const auto r = detail::compare_indexer_topk(p, got.ptr<int32_t>(), int64_t(c.H) * c.topk,
                                                  detail::indexer_ref_row_scores(p), 1.0 / 4096);
      EXPECT_TRUE(r.pass()) << (prefill ? "prefill" : "decode") << ", round " << round << ": " << r.summary()
                            << "\n" << r.first_failures;
    }
  }
}

INSTANTIATE_TEST_SUITE_P(IndexDtype, GpuIndexerGraph, ::testing::Combine(::testing::Bool(), ::testing::Bool()),
                         [](const auto& info) {
                           return std::string(std::get<0>(info.param) ? "fp8" : "bf16") +
                                  (std::get<1>(info.param) ? "_portable" : "");
                         });

// The GPU selection (the warp routine the decode kernel's last CTA and the prefill selection kernel
// run) against the reference on given scores, bit for bit: no tolerance applies once the scores are
// fixed. Rows of 1 to 1100 blocks (past 1024: the long-row path; past 256: several chunks) under
// several selections, with patterns that reach every branch: random, a few distinct values (more
// than 64 keys pass the filter: the bit-by-bit threshold), NaN and -inf, all equal, all NaN, many
// copies of the maximum, a ramp (the best at the end), and signed zeros.
TEST(GpuIndexerSelect, RowsFromGivenScoresMatchTheReferenceExactly) {
  REQUIRE_GPU();
  const std::vector<int> nbs = {1, 2, 15, 16, 17, 18, 33, 64, 65, 100, 255, 256, 257, 300, 511, 512, 513,
                                777, 1023, 1024, 1025, 1100};
  const std::vector<IndexerSelection> sels = {{16, 0, 1}, {8, 2, 2}, {1, 0, 1}, {2, 1, 1}, {64, 0, 1},
                                              {64, 3, 2}, {33, 1, 1}, {17, 0, 1}, {32, 0, 1}};
  constexpr int H = 8;  // one pattern per head
  const int B = int(nbs.size()), max_blocks = 1100;
  Rng rng(20261201);
  std::vector<float> scores(size_t(B) * H * max_blocks, std::nanf(""));
  for (int b = 0; b < B; ++b) {
    for (int h = 0; h < H; ++h) {
      float* row = scores.data() + (size_t(b) * H + h) * max_blocks;
      const int nb = nbs[size_t(b)];
      for (int j = 0; j < nb; ++j) {
        const float u = rng.uniform(-1.f, 1.f);
        switch (h) {
          case 0: row[j] = u; break;
          case 1: row[j] = float(rng.integer(0, 2)); break;
          case 2: row[j] = u < -0.2f ? std::nanf("") : (u < 0.f ? -INFINITY : u); break;
          case 3: row[j] = 1.5f; break;
          case 4: row[j] = std::nanf(""); break;
          case 5: row[j] = rng.integer(0, 3) == 0 ? 0.75f : u * 0.75f; break;
          case 6: row[j] = float(j); break;
          default: row[j] = rng.integer(0, 1) ? (u < 0.f ? -0.f : 0.f) : u * 1e-3f; break;
        }
      }
    }
  }
  // One request per row length, one query token at the last position of its row length.
  std::vector<int32_t> cu(static_cast<size_t>(B) + 1), lens(static_cast<size_t>(B));
  for (int b = 0; b < B; ++b) {
    cu[size_t(b) + 1] = b + 1;
    lens[size_t(b)] = (nbs[size_t(b)] - 1) * kIndexBlockSize + 1 + int(rng.integer(0, kIndexBlockSize - 1));
  }
  const size_t out_n = size_t(B) * H * 64;
  DeviceBuffer<float> d_scores(scores.size());
  DeviceBuffer<int32_t> d_cu(cu.size()), d_lens(lens.size()), d_out(out_n);
  ASSERT_TRUE(d_scores && d_cu && d_lens && d_out) << "cudaMalloc";
  CUDA_OK(cudaMemcpy(d_scores.get(), scores.data(), scores.size() * 4, cudaMemcpyHostToDevice));
  CUDA_OK(cudaMemcpy(d_cu.get(), cu.data(), cu.size() * 4, cudaMemcpyHostToDevice));
  CUDA_OK(cudaMemcpy(d_lens.get(), lens.data(), lens.size() * 4, cudaMemcpyHostToDevice));
  int mismatched_rows = 0;
  for (const IndexerSelection& sel : sels) {
    IndexerParams p{};
    p.block_table_stride = max_blocks;
    p.max_blocks = max_blocks;
    p.seq_lens = d_lens.get();
    p.cu_seqlens_q = d_cu.get();
    p.num_seqs = B;
    p.num_tokens = B;
    p.max_query_len = 1;
    p.num_heads = H;
    p.topk = sel.topk;
    p.init_blocks = sel.init_blocks;
    p.local_blocks = sel.local_blocks;
    p.topk_out = d_out.get();
    p.topk_stride_t = int64_t(H) * sel.topk;
    p.scores = d_scores.get();
    CUDA_OK(cudaMemset(d_out.get(), 0x7F, out_n * 4));
    indexer_prefill_select_launch(p, nullptr);
    CUDA_OK(cudaDeviceSynchronize());
    std::vector<int32_t> got(size_t(B) * H * sel.topk), want(size_t(sel.topk));
    CUDA_OK(cudaMemcpy(got.data(), d_out.get(), got.size() * 4, cudaMemcpyDeviceToHost));
    for (int b = 0; b < B; ++b) {
      for (int h = 0; h < H; ++h) {
        const int nb = nbs[size_t(b)];
        indexer_select_ref(scores.data() + (size_t(b) * H + h) * max_blocks, nb, sel.topk, sel.init_blocks,
                           sel.local_blocks, want.data());
        const int32_t* g = got.data() + (size_t(b) * H + h) * sel.topk;
        if (!std::equal(want.begin(), want.end(), g)) {
          if (++mismatched_rows <= 5) {
            std::string w, gg;
            // Appended piece by piece: GCC 12 warns falsely on " " + s here (bug 105329).
            for (int i = 0; i < sel.topk; ++i) {
              w += ' ';
              w += std::to_string(want[size_t(i)]);
              gg += ' ';
              gg += std::to_string(g[i]);
            }
            ADD_FAILURE() << "topk " << sel.topk << " init " << sel.init_blocks << " local " << sel.local_blocks
                          << " nb " << nb << " pattern " << h << ": want" << w << "; got" << gg;
          }
        }
      }
    }
  }
  EXPECT_EQ(mismatched_rows, 0);
}


// ------------------------------------------------------------------------------------------------
// MSA decode under a CUDA graph: the plan's shape stays; lengths, top-k lists, block table and
// queries change in place between replays.
// Group 16 x dql 5: 80-row groups, split over clusters (on Hopper bf16 runs the wgmma loop); dql 1:
// msa_decode1_kernel, 16 splits per (request, KV head); dql 1 at batch 80 (bf16, 160 pairs) and 140
// (e4m3, 280 pairs): on an H200 msa_decode1_mixed_kernel, one or two rounds of 132 whole pairs and
// the rest (28 in quarters, 16 in halves) merged through global memory (msa_decode_mixed).
struct MsaDecodeCase {
  static constexpr int Hq = 32, Hkv = 2, K = 8, max_blocks = 12;
  bool fp8;
  int dql, B, pages;
  int64_t T;
  Rng rng{91};
  Device gd = Device::cuda();
  Tensor cache, q, topk, lens, table, out, lse, ks, vs;
  TensorView topk_hm;  // [Hkv, T, K] view of the [T, Hkv, K] buffer
  std::unique_ptr<MsaDecodePlan> plan;
  std::vector<int32_t> lens_h, table_h;  // the last refill's lengths and block table

  MsaDecodeCase(bool fp8_, int dql_, int batch = 3)
      : fp8(fp8_), dql(dql_), B(batch), pages(batch * max_blocks + 4), T(int64_t(batch) * dql_) {
    cache = Tensor::empty({pages, Hkv, 128, 256}, fp8 ? DType::kUInt8 : DType::kBFloat16, gd);
    q = Tensor::empty({T, Hq, 128}, DType::kBFloat16, gd);
    topk = Tensor::empty({T, Hkv, K}, DType::kInt32, gd);  // token-major, read transposed
    lens = Tensor::empty({B}, DType::kInt32, gd);
    table = Tensor::empty({B, max_blocks}, DType::kInt32, gd);
    out = Tensor::empty({T, Hq, 128}, DType::kBFloat16, gd);
    lse = Tensor::empty({T, Hq}, DType::kFloat32, gd);
    ks = detail::scalar_f32(0.8f).to(gd);
    vs = detail::scalar_f32(1.25f).to(gd);
    topk_hm = topk.view();
    topk_hm.shape[0] = Hkv, topk_hm.shape[1] = T;
    topk_hm.stride[0] = K, topk_hm.stride[1] = int64_t(Hkv) * K;
    plan = std::make_unique<MsaDecodePlan>(MsaDecodeShape{B, dql, Hq, Hkv, K, max_blocks, dtype()}, gd);
  }
  KvCacheDtype dtype() const { return fp8 ? KvCacheDtype::kFp8E4M3 : KvCacheDtype::kAuto; }
  static Tensor ints(const std::vector<int32_t>& v, std::vector<int64_t> shape) {
    Tensor h = Tensor::empty(shape, DType::kInt32);
    std::copy(v.begin(), v.end(), h.ptr<int32_t>());
    return h;
  }
  // New random inputs (a padded request, random ids with some out of range or repeated); out and
  // lse poisoned.
  void refill() {
    Tensor c = detail::random_half({pages, Hkv, 128, 256}, DType::kBFloat16, rng, -1, 1);
    if (fp8) {
      Tensor e = Tensor::empty({pages, Hkv, 128, 256}, DType::kUInt8);
      for (int64_t i = 0; i < c.numel(); ++i) e.ptr<uint8_t>()[i] = float_to_e4m3(2.f * bf16_to_float(c.ptr<uint16_t>()[i]));
      c = e;
    }
    upload(cache, c);
    upload(q, detail::random_half({T, Hq, 128}, DType::kBFloat16, rng, -1, 1));
    std::vector<int32_t> l(B), tab(B * max_blocks, -1), tk(T * Hkv * K, -1), perm(pages);
    for (int i = 0; i < pages; ++i) perm[size_t(i)] = i;
    std::shuffle(perm.begin(), perm.end(), rng.gen());
    for (int b = 0; b < B; ++b) l[size_t(b)] = b == 1 ? 0 : int32_t(rng.integer(1, 1500));  // request 1: padding
    size_t next = 0;
    for (int b = 0; b < B; ++b)
      for (int j = 0; j < (l[size_t(b)] + 127) / 128; ++j) tab[size_t(b * max_blocks + j)] = perm[next++];
    for (int64_t t = 0; t < T; ++t) {
      const int b = int(t / dql);
      const int64_t pos = int64_t(l[size_t(b)]) - dql + t % dql;
      const int nb = pos >= 0 ? int(pos / 128) + 1 : 0;
      for (int h = 0; h < Hkv; ++h)
        for (int i = 0; i < K; ++i)
          tk[size_t((t * Hkv + h) * K + i)] = nb > 0 ? int32_t(rng.integer(-1, nb)) : -1;
    }
    upload(lens, ints(l, {B}));
    upload(table, ints(tab, {B, max_blocks}));
    lens_h = l;
    table_h = tab;
    upload(topk, ints(tk, {T, Hkv, K}));
    poison();
  }
  void poison() {
    out.fill_bytes(0xFF);
    lse.fill_bytes(0xFF);
  }
  // The rows past seq_len of each request's last page become NaN (0xFF bytes), every KV head.
  void poison_tails() {
    const int64_t row = 256 * (fp8 ? 1 : 2);
    for (int b = 0; b < B; ++b) {
      const int l = lens_h[size_t(b)], r0 = l % 128;
      if (l == 0 || r0 == 0) continue;
      const int page = table_h[size_t(b * max_blocks + (l - 1) / 128)];
      for (int h = 0; h < Hkv; ++h)
        CUDA_OK(cudaMemset(static_cast<char*>(cache.data()) + ((int64_t(page) * Hkv + h) * 128 + r0) * row, 0xFF,
                           size_t((128 - r0) * row)));
    }
  }
  void run(cudaStream_t st, bool pdl = false) {
    plan->run({.q = q, .cache = {cache, dtype(), ks, vs}, .topk = topk_hm, .seq_lens = lens, .block_table = table,
               .softmax_scale = 0.0883883f, .out = out, .lse = lse, .enable_pdl = pdl},
              st);
  }
  // Every row written (no NaN poison left): padded rows are 0 with lse -inf.
  int64_t nan_outputs() const {
    const Tensor o = out.to(Device::cpu());
    int64_t nan = 0;
    for (int64_t i = 0; i < o.numel(); ++i) nan += std::isnan(bf16_to_float(o.ptr<uint16_t>()[i])) ? 1 : 0;
    return nan;
  }
};

class GpuMsaGraph : public ::testing::TestWithParam<std::tuple<bool, int, int>> {};

TEST_P(GpuMsaGraph, ReplayAfterInPlaceChangesMatchesEagerBitwise) {
  REQUIRE_GPU();
  MsaDecodeCase c(std::get<0>(GetParam()), std::get<1>(GetParam()), std::get<2>(GetParam()));
  c.refill();
  CapturedGraph graph([&](cudaStream_t st) { c.run(st); });
  for (int round = 0; round < 3; ++round) {
    c.refill();
    settle();
    c.run(graph.stream);
    CUDA_OK(cudaStreamSynchronize(graph.stream));
    const Tensor eager_out = c.out.to(Device::cpu()), eager_lse = c.lse.to(Device::cpu());
    c.poison();
    settle();
    CUDA_OK(cudaGraphLaunch(graph.exec, graph.stream));
    CUDA_OK(cudaStreamSynchronize(graph.stream));
    EXPECT_TRUE(same_bytes(eager_out, c.out)) << "out, round " << round;
    EXPECT_TRUE(same_bytes(eager_lse, c.lse)) << "lse, round " << round;
    EXPECT_EQ(c.nan_outputs(), 0) << "round " << round;
  }
}

// enable_pdl: eager and captured in a graph, right after a kernel that writes the call's queries
// and top-k lists late, the outputs equal those of a plain launch on the final inputs, bit for bit.
TEST_P(GpuMsaGraph, PdlLaunchWaitsForThePrecedingKernel) {
  REQUIRE_GPU();
  MsaDecodeCase c(std::get<0>(GetParam()), std::get<1>(GetParam()), std::get<2>(GetParam()));
  Tensor q_next = Tensor::empty({c.T, c.Hq, 128}, DType::kBFloat16, c.gd);
  Tensor topk_next = Tensor::empty({c.T, c.Hkv, c.K}, DType::kInt32, c.gd);
  auto chain = [&](cudaStream_t st) {  // the producer, then the call launched with PDL
    late_copy(c.q, q_next, st);
    late_copy(c.topk, topk_next, st);
    c.run(st, true);
  };
  cudaStream_t st = nullptr;
  CUDA_OK(cudaStreamCreateWithFlags(&st, cudaStreamNonBlocking));
  c.refill();
  CapturedGraph graph(chain);
  for (int round = 0; round < 3; ++round) {
    c.refill();
    settle();
    c.run(st);  // the reference: a plain launch on the final inputs
    CUDA_OK(cudaStreamSynchronize(st));
    const Tensor want_out = c.out.to(Device::cpu()), want_lse = c.lse.to(Device::cpu());
    EXPECT_EQ(c.nan_outputs(), 0) << "round " << round;
    for (int mode = 0; mode < 2; ++mode) {  // eager, graph
      CUDA_OK(cudaMemcpy(q_next.data(), c.q.data(), size_t(q_next.nbytes()), cudaMemcpyDeviceToDevice));
      CUDA_OK(cudaMemcpy(topk_next.data(), c.topk.data(), size_t(topk_next.nbytes()), cudaMemcpyDeviceToDevice));
      c.q.fill_bytes(0);     // stale queries: zeros
      c.topk.fill_bytes(0);  // stale ids: page 0 everywhere
      c.poison();
      settle();
      if (mode == 0) chain(st);
      else CUDA_OK(cudaGraphLaunch(graph.exec, st));
      CUDA_OK(cudaStreamSynchronize(st));
      EXPECT_TRUE(same_bytes(want_out, c.out)) << (mode ? "graph" : "eager") << " out, round " << round;
      EXPECT_TRUE(same_bytes(want_lse, c.lse)) << (mode ? "graph" : "eager") << " lse, round " << round;
    }
  }
  CUDA_OK(cudaStreamDestroy(st));
}

INSTANTIATE_TEST_SUITE_P(CacheDtypeDql, GpuMsaGraph,
                         ::testing::Values(std::tuple(false, 5, 3), std::tuple(true, 5, 3), std::tuple(true, 5, 67),
                                           std::tuple(false, 1, 3),
                                           std::tuple(true, 1, 3), std::tuple(false, 1, 80), std::tuple(true, 1, 140)),
                         [](const auto& info) {
                           return std::string(std::get<0>(info.param) ? "fp8" : "bf16") + "_dql" +
                                  std::to_string(std::get<1>(info.param)) + "_b" + std::to_string(std::get<2>(info.param));
                         });

// The two forms of the Hopper wgmma loop (verify and prefill groups of more than 64 rows): the
// copy-engine loop (tensor-map boxes, mbarriers; its warps skip the softmax of chunks their rows do
// not see) and the cp.async loop (M3RT_MSA_WG_TMA=0) write the same bits, e4m3 and bf16: the same
// chunks in the same order, the same arithmetic in the same order.
class GpuMsaLoops : public ::testing::TestWithParam<bool> {};

TEST_P(GpuMsaLoops, CopyEngineLoopMatchesCpAsyncLoopBitwise) {
  REQUIRE_GPU();
  if (!kernels::hopper_paths_run()) GTEST_SKIP() << "not a Hopper GPU or no sm_90a code in this build: no wgmma loop";
  cudaStream_t st = nullptr;
  CUDA_OK(cudaStreamCreateWithFlags(&st, cudaStreamNonBlocking));
  // 80-row groups (the wgmma loop): batch 3 splits each group over a cluster; batch 67 (134
  // (request, KV head) pairs) leaves them unsplit, where e4m3 runs the producer warpgroup's loop,
  // checked also against the copy-engine loop that converts in the row warps (M3RT_MSA_WS=0).
  for (const int batch : {3, 67}) {
    MsaDecodeCase c(GetParam(), 5, batch);
    std::vector<const char*> others{"M3RT_MSA_WG_TMA"};
    if (GetParam() && batch == 67) others.push_back("M3RT_MSA_WS");
    for (int round = 0; round < 3; ++round) {
      c.refill();
      c.run(st);
      CUDA_OK(cudaStreamSynchronize(st));
      const Tensor tma_out = c.out.to(Device::cpu()), tma_lse = c.lse.to(Device::cpu());
      EXPECT_EQ(c.nan_outputs(), 0) << "batch " << batch << ", round " << round;
      for (const char* other : others) {
        c.poison();
        {
          const detail::ScopedEnv off(other, "0");
          c.run(st);
          CUDA_OK(cudaStreamSynchronize(st));
        }
        EXPECT_TRUE(same_bytes(tma_out, c.out)) << other << "=0: out, batch " << batch << ", round " << round;
        EXPECT_TRUE(same_bytes(tma_lse, c.lse)) << other << "=0: lse, batch " << batch << ", round " << round;
      }
    }
  }
  CUDA_OK(cudaStreamDestroy(st));
}

INSTANTIATE_TEST_SUITE_P(CacheDtype, GpuMsaLoops, ::testing::Bool(),
                         [](const auto& info) { return std::string(info.param ? "fp8" : "bf16"); });

// e4m3 dql 1 with two 4-warp groups a CTA (forced here; by default copy-engine grids of 3/4 to one
// CTA an SM take them, unsplit or at two splits merged in a cluster of two): within the ops'
// tolerance of one group on the same inputs and splits (only the order of the key parts' sums
// differs), every row written, and a graph replay equal to eager bit for bit. Unsplit (against
// the rule's split grid) and at two splits (M3RT_MSA_SPLITS=2 for both: the cluster instance).
TEST(GpuMsaDecode1, TwoGroupsMatchOneGroupAndReplayBitwise) {
  REQUIRE_GPU();
  if (!kernels::hopper_paths_run()) GTEST_SKIP() << "not a Hopper GPU or no sm_90a code in this build: no copy-engine form";
  for (const char* splits : {static_cast<const char*>(nullptr), "2"}) {
    SCOPED_TRACE(splits ? "two splits" : "unsplit");
    const detail::ScopedEnv split_count("M3RT_MSA_SPLITS", splits);
    // The knob is read when a plan is made (its splits) and at each launch (the instance): every
    // construction and launch of a case runs under its own value.
    auto groups = [](const char* n, auto&& f) {
      const detail::ScopedEnv forced("M3RT_MSA_D1_GROUPS", n);
      f();
    };
    using C = MsaDecodeCase;
    auto plan_splits = [] { return msa_decode_splits(40, 1, C::Hq, C::Hkv, C::K, C::max_blocks, true); };
    groups("1", [&] { EXPECT_GT(plan_splits(), 1) << "one group: these 80 pairs are split"; });
    groups("2", [&] { EXPECT_EQ(plan_splits(), splits ? 2 : 1); });
    std::unique_ptr<MsaDecodeCase> one, two;
    groups("1", [&] { one = std::make_unique<MsaDecodeCase>(true, 1, 40); });  // the rule's splits
    groups("2", [&] { two = std::make_unique<MsaDecodeCase>(true, 1, 40); });  // unsplit, or the forced two
    cudaStream_t st = nullptr;
    CUDA_OK(cudaStreamCreateWithFlags(&st, cudaStreamNonBlocking));
    one->refill();  // both generators step together: every round gives both the same inputs
    two->refill();
    std::unique_ptr<CapturedGraph> graph;
    groups("2", [&] { graph = std::make_unique<CapturedGraph>([&](cudaStream_t s) { two->run(s); }); });
    for (int round = 0; round < 2; ++round) {
      one->refill();
      two->refill();
      settle();
      groups("1", [&] { one->run(st); });
      groups("2", [&] { two->run(st); });
      CUDA_OK(cudaStreamSynchronize(st));
      EXPECT_EQ(one->nan_outputs(), 0) << "round " << round;
      EXPECT_EQ(two->nan_outputs(), 0) << "round " << round;
      const Tensor o1 = one->out.to(Device::cpu()), o2 = two->out.to(Device::cpu());
      const Tensor l1 = one->lse.to(Device::cpu()), l2 = two->lse.to(Device::cpu());
      int64_t bad = 0;
      for (int64_t i = 0; i < o1.numel(); ++i) {
        const double a = bf16_to_float(o1.ptr<uint16_t>()[i]), b = bf16_to_float(o2.ptr<uint16_t>()[i]);
        if (std::fabs(a - b) > std::max(8e-4, 3 * 0x1p-8 * std::fabs(a)) && bad++ < 3)
          ADD_FAILURE() << "out element " << i << ": one group " << a << ", two groups " << b;
      }
      for (int64_t i = 0; i < l1.numel(); ++i) {
        const double a = l1.ptr<float>()[i], b = l2.ptr<float>()[i];
        if (!(a == b || std::fabs(a - b) <= 2.0 / 65536 * std::fabs(a)) && bad++ < 6)
          ADD_FAILURE() << "lse " << i << ": one group " << a << ", two groups " << b;
      }
      EXPECT_EQ(bad, 0) << "round " << round;
      two->poison();
      settle();
      CUDA_OK(cudaGraphLaunch(graph->exec, graph->stream));
      CUDA_OK(cudaStreamSynchronize(graph->stream));
      EXPECT_TRUE(same_bytes(o2, two->out)) << "out, round " << round;  // replay == eager
      EXPECT_TRUE(same_bytes(l2, two->lse)) << "lse, round " << round;
    }
    CUDA_OK(cudaStreamDestroy(st));
  }
}

// e4m3 dql-1 decode's two chunk loaders (msa_decode1_kernel's kTma form, the default on grids of at
// most 8 splits and 2-3 CTAs an SM, forced here on every grid; chunks as tensor-map boxes with the
// V rows past seq_len zeroed by their warp, and the cp.async form that zero-fills them) write the
// same bits, with every request's rows past seq_len NaN: batch 3 (16-split clusters), 67 (268
// (request, KV head) pairs in 2 splits, a cluster each) and 140 (the mixed grid).
TEST(GpuMsaDecode1, CopyEngineChunksMatchCpAsyncChunksBitwise) {
  REQUIRE_GPU();
  if (!kernels::hopper_paths_run()) GTEST_SKIP() << "not a Hopper GPU or no sm_90a code in this build: no copy-engine form";
  cudaStream_t st = nullptr;
  CUDA_OK(cudaStreamCreateWithFlags(&st, cudaStreamNonBlocking));
  for (const int batch : {3, 67, 140}) {
    MsaDecodeCase c(true, 1, batch);
    for (int round = 0; round < 2; ++round) {
      c.refill();
      c.poison_tails();
      Tensor want_out, want_lse;
      for (const char* form : {"2", "0"}) {
        c.poison();
        {
          const detail::ScopedEnv forced("M3RT_MSA_D1_TMA", form);  // 2: every e4m3 grid
          // One group either way (a GPU whose SM count puts a batch's pairs in d1_two_groups' range
          // would otherwise run two groups, a different order of sums, on the copy engine only).
          const detail::ScopedEnv one_group("M3RT_MSA_D1_GROUPS", "1");
          c.run(st);
          CUDA_OK(cudaStreamSynchronize(st));
        }
        EXPECT_EQ(c.nan_outputs(), 0) << "M3RT_MSA_D1_TMA=" << form << ", batch " << batch << ", round " << round;
        if (*form == '2') {
          want_out = c.out.to(Device::cpu());
          want_lse = c.lse.to(Device::cpu());
        } else {
          EXPECT_TRUE(same_bytes(want_out, c.out)) << "out, batch " << batch << ", round " << round;
          EXPECT_TRUE(same_bytes(want_lse, c.lse)) << "lse, batch " << batch << ", round " << round;
        }
      }
    }
  }
  CUDA_OK(cudaStreamDestroy(st));
}

// ------------------------------------------------------------------------------------------------
// Garbage device-resident indices, as a buggy engine could pass them (negative, past the tables and
// caches, 2^40; m3rt_test::wild_fill), with valid shapes: the host checks cannot see them, and every
// kernel must complete without a fault (its writes confined to the outputs and caches: memcheck over
// this test in gpu-check). The CPU path throws on such inputs (the RandomIndicesRunOrThrowUntouched
// tests). Eager calls, 6 rounds a case: the writer and the QK insert (both kernels each), the
// indexer's decode and prefill, MSA decode (dql 1 and 5) and MSA prefill, bf16 and e4m3.
TEST(GpuWildIndices, KernelsCompleteOnGarbageIndices) {
  REQUIRE_GPU();
  std::mt19937_64 g(2026);
  auto wild = [&](const Tensor& dev, int64_t lo, int64_t hi) {  // new contents, uploaded in place
    Tensor h = Tensor::empty(dev.view().sizes(), dev.view().dtype);
    m3rt_test::wild_fill(h.view(), g, lo, hi);
    upload(dev, h);
  };
  for (bool fp8 : {false, true}) {
    SCOPED_TRACE(fp8 ? "e4m3" : "bf16");
    GraphCase w(fp8);
    DsparkContextKvWriter writer(w.layers);
    IndexerGraphCase ix(fp8);
    LightningIndexer indexer(ix.config(), Device::cuda());
    for (int round = 0; round < 6; ++round) {
      w.refill();
      wild(w.positions, 0, GraphCase::max_pos - 1);
      wild(w.slots, -1, GraphCase::nb * GraphCase::bs - 1);
      for (const Tensor* t : {&w.qpos, &w.qpos2}) wild(*t, 0, GraphCase::max_pos - 1);
      for (const Tensor* t : {&w.qslots, &w.qslots2}) wild(*t, -1, GraphCase::nb * GraphCase::bs - 1);
      w.run(writer, nullptr);
      CUDA_OK(cudaDeviceSynchronize());
      ix.refill();
      wild(ix.dseq, 0, IndexerGraphCase::max_blocks * 128);
      wild(ix.dtable, 0, IndexerGraphCase::pages - 1);
      wild(ix.pcu, 0, IndexerGraphCase::T);
      wild(ix.pseq, 0, IndexerGraphCase::max_blocks * 128);
      wild(ix.ptable, 0, IndexerGraphCase::pages - 1);
      ix.run(indexer, nullptr);
      CUDA_OK(cudaDeviceSynchronize());
    }
    for (int dql : {1, 5}) {
      MsaDecodeCase d(fp8, dql);
      for (int round = 0; round < 6; ++round) {
        d.refill();
        wild(d.lens, 0, MsaDecodeCase::max_blocks * 128);
        wild(d.table, 0, d.pages - 1);
        wild(d.topk, -1, MsaDecodeCase::max_blocks);
        settle();
        d.run(nullptr);
        CUDA_OK(cudaDeviceSynchronize()) << "MSA decode dql " << dql << ", round " << round;
      }
    }
    // MSA prefill: 2 requests x 150 tokens, Hq 32 over Hkv 2 (group 16: the Hopper tiles), topk 8.
    constexpr int Hq = 32, Hkv = 2, K = 8, B = 2, max_blocks = 12, pages = 30;
    constexpr int64_t T = 300;
    const Device gd = Device::cuda();
    Tensor cache = Tensor::empty({pages, Hkv, 128, 256}, fp8 ? DType::kUInt8 : DType::kBFloat16, gd);
    Rng rng(5);
    Tensor q = detail::random_half({T, Hq, 128}, DType::kBFloat16, rng, -1, 1).to(gd);
    Tensor topk = Tensor::empty({T, Hkv, K}, DType::kInt32, gd), cu = Tensor::empty({B + 1}, DType::kInt32, gd);
    Tensor lens = Tensor::empty({B}, DType::kInt32, gd), table = Tensor::empty({B, max_blocks}, DType::kInt32, gd);
    Tensor out = Tensor::empty({T, Hq, 128}, DType::kBFloat16, gd), lse = Tensor::empty({T, Hq}, DType::kFloat32, gd);
    Tensor ks = detail::scalar_f32(0.8f).to(gd), vs = detail::scalar_f32(1.25f).to(gd);
    cache.fill_bytes(0x3C);
    TensorView topk_hm = topk.view();  // [Hkv, T, K] view of the token-major buffer
    topk_hm.shape[0] = Hkv, topk_hm.shape[1] = T;
    topk_hm.stride[0] = K, topk_hm.stride[1] = int64_t(Hkv) * K;
    for (int round = 0; round < 6; ++round) {
      wild(cu, 0, T);
      wild(lens, 0, max_blocks * 128);
      wild(table, 0, pages - 1);
      wild(topk, -1, max_blocks);
      settle();
      msa_prefill({.q = q, .cache = {cache, fp8 ? KvCacheDtype::kFp8E4M3 : KvCacheDtype::kAuto, ks, vs},
                   .topk = topk_hm, .cu_seqlens_q = cu, .seq_lens = lens, .block_table = table,
                   .max_query_len = int(T), .softmax_scale = 0.0883883f, .out = out, .lse = lse});
      CUDA_OK(cudaDeviceSynchronize()) << "MSA prefill, round " << round;
    }
  }
}

}  // namespace
