// Hopper (sm_90) helpers shared by the lightning indexer and the MSA attention kernel: mbarriers,
// bulk copies, and warpgroup MMA (shared-memory matrix descriptors for the
// 128-byte-swizzled layouts, fences, wgmma with the A operand in registers, fp32 accumulation).
//
// The 128-byte swizzle: a matrix stored as rows of 128 bytes (64 16-bit elements) in atoms of 8
// rows (1024 bytes, 1024-aligned); 16-byte chunk q of row n sits at chunk q ^ (n % 8) of its row.
// A 128-dim row of keys or values is two such regions (dims 0-63 and 64-127).
//  - K-major B (keys x dims, the reduction over dims: Q K^T): 8-row groups 1024 bytes apart; a
//    16-dim k-step starts 32 bytes further into the atom.
//  - MN-major B (keys x dims, the reduction over keys: P V, `tnsp` = 1): the leading offset is
//    the distance between 64-dim regions, the stride offset the distance between 8-key groups.
// PTX ISA, "Asynchronous Warpgroup Level Matrix Multiply-Accumulate", matrix descriptor format.
#pragma once

#include <cstdint>

#include "core/cuda_check.h"
#include "ops/common/mma.cuh"

namespace m3rt::kernels {

// Whether this build carries sm_90a code (CMake defines M3RT_SM90A_CODE when M3RT_CUDA_GENCODE has
// an sm_90a or compute_90a target). Without it the kernels' Hopper paths are compiled out (their
// code is guarded by __CUDA_ARCH_FEAT_SM90_ALL or __CUDA_ARCH__ >= 900 and a Hopper GPU would run
// PTX JIT-compiled from compute_80), so the launchers pick the portable paths on every GPU.
#ifdef M3RT_SM90A_CODE
constexpr bool kBuiltForSm90a = true;
#else
constexpr bool kBuiltForSm90a = false;
#endif

// Host: whether the current device runs the Hopper paths (a compute capability 9 GPU and a build
// with sm_90a code). The one decision the launchers of the MSA and indexer kernels share.
inline bool hopper_paths_run() { return kBuiltForSm90a && detail::device_limits().cc_major == 9; }

// mbarriers (shared::cta) and a bulk copy that completes on one.
[[maybe_unused]] __device__ __forceinline__ void mbar_init(uint64_t* bar, uint32_t count) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" ::"r"(smem_u32(bar)), "r"(count) : "memory");
}
[[maybe_unused]] __device__ __forceinline__ void mbar_arrive(uint64_t* bar) {
  asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];\n" ::"r"(smem_u32(bar)) : "memory");
}
// `count` arrivals at once (sm_90): one thread arriving for its warp.
[[maybe_unused]] __device__ __forceinline__ void mbar_arrive(uint64_t* bar, uint32_t count) {
  asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0], %1;\n" ::"r"(smem_u32(bar)), "r"(count) : "memory");
}
[[maybe_unused]] __device__ __forceinline__ void mbar_arrive_expect_tx(uint64_t* bar, uint32_t bytes) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;\n" ::"r"(smem_u32(bar)), "r"(bytes)
               : "memory");
}
[[maybe_unused]] __device__ __forceinline__ void mbar_wait(uint64_t* bar, uint32_t parity) {
  uint32_t done = 0;
  do {
    asm volatile(
        "{\n.reg .pred p;\nmbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\nselp.u32 %0, 1, 0, p;\n}\n"
        : "=r"(done)
        : "r"(smem_u32(bar)), "r"(parity)
        : "memory");
  } while (!done);
}
// Global -> shared bulk copy (16-byte aligned, size a multiple of 16), completing on `bar`.
[[maybe_unused]] __device__ __forceinline__ void bulk_copy_to_shared(void* dst, const void* src, uint32_t bytes,
                                                                     uint64_t* bar) {
  asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];\n" ::"r"(
                   smem_u32(dst)),
               "l"(src), "r"(bytes), "r"(smem_u32(bar))
               : "memory");
}
// Global -> shared box of a 4-D tensor map (cp.async.bulk.tensor, the map's swizzle applied),
// completing on `bar`; coordinates in elements, innermost first. `map`: the address of a
// CUtensorMap in a __grid_constant__ kernel parameter.
[[maybe_unused]] __device__ __forceinline__ void tma_load_4d(void* dst, const void* map, int c0, int c1, int c2, int c3,
                                                             uint64_t* bar) {
  asm volatile(
      "cp.async.bulk.tensor.4d.shared::cluster.global.tile.mbarrier::complete_tx::bytes [%0], [%1, {%2, %3, %4, %5}], "
      "[%6];\n" ::"r"(smem_u32(dst)),
      "l"(map), "r"(c0), "r"(c1), "r"(c2), "r"(c3), "r"(smem_u32(bar))
      : "memory");
}
// mbarrier initializations visible to the async proxy (the copy engine) before its first copy.
[[maybe_unused]] __device__ __forceinline__ void fence_mbarrier_init() {
  asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
}
// Named barrier `id` (1..15; 0 is __syncthreads') over `threads` threads, a multiple of 32: wait
// for all of them, or arrive without waiting (a hand-off to the warps that wait on it).
[[maybe_unused]] __device__ __forceinline__ void named_bar_sync(int id, int threads) {
  asm volatile("bar.sync %0, %1;\n" ::"r"(id), "r"(threads) : "memory");
}
[[maybe_unused]] __device__ __forceinline__ void named_bar_arrive(int id, int threads) {
  asm volatile("bar.arrive %0, %1;\n" ::"r"(id), "r"(threads) : "memory");
}
// A warpgroup's register budget, raised or lowered (sm_90a; every warp of the warpgroup executes
// it; the kernel's launch bounds fix the count at entry).
template <int kRegs>
__device__ __forceinline__ void setmaxnreg_inc() {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;\n" ::"n"(kRegs));
#endif
}
template <int kRegs>
__device__ __forceinline__ void setmaxnreg_dec() {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;\n" ::"n"(kRegs));
#endif
}
// Programmatic dependent launch: wait until the grids this one depends on have completed and
// their writes are visible (a no-op for a grid launched without the attribute), and let the next
// grid on the stream, if launched with it, be scheduled. No-ops before sm_90.
[[maybe_unused]] __device__ __forceinline__ void grid_dependency_wait() {
#if __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.wait;\n" ::: "memory");
#endif
}
// Read-only loads that stay where the source puts them relative to grid_dependency_wait: a PDL
// kernel's loads of parameters the preceding kernel does not write, issued before the wait so that
// they overlap that kernel's tail. Volatile asm keeps its order among volatile asm in the compiler
// (a plain __ldg may be sunk below the wait to its first use); ptxas, which schedules
// griddepcontrol.wait ahead of independent loads in the same basic block, keeps them ahead only
// if the wait is in a block of its own: grid_dependency_wait_after_loads.
[[maybe_unused]] __device__ __forceinline__ uint4 ldg_before_wait(const uint4* p) {
  uint4 v;
  asm volatile("ld.global.nc.v4.u32 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
               : "l"(p));
  return v;
}
[[maybe_unused]] __device__ __forceinline__ float ldg_before_wait(const float* p) {
  float v;
  asm volatile("ld.global.nc.f32 %0, [%1];\n" : "=f"(v) : "l"(p));
  return v;
}
// The wait that follows ldg_before_wait loads: in a branch (its own basic block, so that ptxas
// keeps it after them), taken only by a PDL launch (for others the wait is a no-op anyway).
[[maybe_unused]] __device__ __forceinline__ void grid_dependency_wait_after_loads(bool pdl) {
  if (pdl) grid_dependency_wait();
}
[[maybe_unused]] __device__ __forceinline__ void launch_dependents() {
#if __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.launch_dependents;\n" ::: "memory");
#endif
}
// Host: one checked launch of kernel(args...): through cudaLaunchKernelEx as clusters of cluster_z
// CTAs along z and / or as a programmatic dependent (`pdl`: the kernel calls grid_dependency_wait
// before its first global read), else a plain launch. Callers pass pdl only where the Hopper paths run.
template <typename... KernelArgs, typename... Args>
void launch_kernel(void (*kernel)(KernelArgs...), dim3 grid, unsigned threads, size_t smem, unsigned cluster_z,
                   bool pdl, cudaStream_t stream, const char* name, const Args&... args) {
  if (cluster_z > 1 || pdl) {
    const detail::LaunchEx ex(grid, dim3(threads), smem, stream, cluster_z, pdl);
    M3RT_CUDA_CHECK(cudaLaunchKernelEx(&ex.lc, kernel, args...));
  } else {
    kernel<<<grid, threads, smem, stream>>>(args...);
  }
  M3RT_LAUNCH_CHECK(stream, name);
}
// kernel(p) with static shared memory only, as a programmatic dependent when `pdl` and the Hopper
// paths run (else plain: other GPUs and builds without sm_90a code ignore the option).
template <typename Params>
void launch_pdl_or_plain(void (*kernel)(Params), dim3 grid, int threads, const Params& p, bool pdl,
                         cudaStream_t stream, const char* name) {
  launch_kernel(kernel, grid, unsigned(threads), 0, 1, pdl && hopper_paths_run(), stream, name, p);
}
// Generic-proxy shared-memory writes (cp.async, st.shared) ordered before async-proxy reads (wgmma).
[[maybe_unused]] __device__ __forceinline__ void fence_proxy_async() {
  asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
}
[[maybe_unused]] __device__ __forceinline__ void wgmma_fence() { asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory"); }
[[maybe_unused]] __device__ __forceinline__ void wgmma_commit() {
  asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory");
}
template <int kPending>
__device__ __forceinline__ void wgmma_wait() {
  asm volatile("wgmma.wait_group.sync.aligned %0;\n" ::"n"(kPending) : "memory");
}
[[maybe_unused]] __device__ __forceinline__ void wgmma_wait_all() { wgmma_wait<0>(); }

// Descriptor of a 128-byte-swizzled operand at shared address `addr` (16-byte units; the
// 14-bit fields cover 256 KB).
__device__ __forceinline__ uint64_t sw128_desc(uint32_t addr, uint32_t leading_bytes, uint32_t stride_bytes) {
  return uint64_t((addr & 0x3FFFF) >> 4) | (uint64_t(leading_bytes >> 4) << 16) |
         (uint64_t(stride_bytes >> 4) << 32) | (uint64_t(1) << 62);
}
// K-major: 8-row groups 1024 bytes apart (the leading offset is unused for swizzled K-major).
__device__ __forceinline__ uint64_t sw128_desc(uint32_t addr) { return sw128_desc(addr, 16, 1024); }

#define M3RT_WGMMA_ACC8 "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7])
#define M3RT_WGMMA_ACC16                                                                                           \
  M3RT_WGMMA_ACC8, "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), \
      "+f"(d[15])
#define M3RT_WGMMA_ACC32                                                                                            \
  M3RT_WGMMA_ACC16, "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), \
      "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]),    \
      "+f"(d[31])
#define M3RT_WGMMA_ACC64 \
  M3RT_WGMMA_ACC32, "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), \
      "+f"(d[39]), "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), \
      "+f"(d[47]), "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), \
      "+f"(d[55]), "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), \
      "+f"(d[63])
#define M3RT_WGMMA_REGS8 "{%0, %1, %2, %3, %4, %5, %6, %7}"
#define M3RT_WGMMA_REGS16 "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15}"
#define M3RT_WGMMA_REGS32                                                                                            \
  "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, " \
  "%24, %25, %26, %27, %28, %29, %30, %31}"
#define M3RT_WGMMA_REGS64                                                                                            \
  "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, " \
  "%24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, "   \
  "%46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63}"

// d (+)= A B, wgmma m64nNk16 (N = 16, 32, 64 or 128): A = four 16-bit pair registers per thread
// (the m16n8k16 A fragment of the thread's warp's 16 rows), B by descriptor; kF16 selects f16 over
// bf16 inputs; kTransB reads B MN-major; kAccumulate false overwrites d.
#define M3RT_WGMMA_BODY(N, REGS, A0, A1, A2, A3, ACCUM, DESC, TNSP, TYPE, ACC)                                   \
  asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %" #ACCUM ", 0;\n"                                                 \
               "wgmma.mma_async.sync.aligned.m64n" #N "k16.f32." TYPE "." TYPE " " REGS ", {%" #A0 ", %" #A1        \
               ", %" #A2 ", %" #A3 "}, %" #DESC ", p, 1, 1, %" #TNSP ";\n}\n"                                       \
               : ACC                                                                                                 \
               : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(int(kAccumulate)), "l"(desc), "n"(int(kTransB)))

template <int N, bool kF16, bool kTransB = false, bool kAccumulate = true>
__device__ __forceinline__ void wgmma_m64k16(float (&d)[N / 2], const uint32_t (&a)[4], uint64_t desc) {
  static_assert(N == 16 || N == 32 || N == 64 || N == 128, "m64n{16,32,64,128}k16");
  if constexpr (N == 16 && kF16)
    M3RT_WGMMA_BODY(16, M3RT_WGMMA_REGS8, 8, 9, 10, 11, 12, 13, 14, "f16", M3RT_WGMMA_ACC8);
  else if constexpr (N == 16)
    M3RT_WGMMA_BODY(16, M3RT_WGMMA_REGS8, 8, 9, 10, 11, 12, 13, 14, "bf16", M3RT_WGMMA_ACC8);
  else if constexpr (N == 32 && kF16)
    M3RT_WGMMA_BODY(32, M3RT_WGMMA_REGS16, 16, 17, 18, 19, 20, 21, 22, "f16", M3RT_WGMMA_ACC16);
  else if constexpr (N == 32)
    M3RT_WGMMA_BODY(32, M3RT_WGMMA_REGS16, 16, 17, 18, 19, 20, 21, 22, "bf16", M3RT_WGMMA_ACC16);
  else if constexpr (N == 128 && kF16)
    M3RT_WGMMA_BODY(128, M3RT_WGMMA_REGS64, 64, 65, 66, 67, 68, 69, 70, "f16", M3RT_WGMMA_ACC64);
  else if constexpr (N == 128)
    M3RT_WGMMA_BODY(128, M3RT_WGMMA_REGS64, 64, 65, 66, 67, 68, 69, 70, "bf16", M3RT_WGMMA_ACC64);
  else if constexpr (kF16)
    M3RT_WGMMA_BODY(64, M3RT_WGMMA_REGS32, 32, 33, 34, 35, 36, 37, 38, "f16", M3RT_WGMMA_ACC32);
  else
    M3RT_WGMMA_BODY(64, M3RT_WGMMA_REGS32, 32, 33, 34, 35, 36, 37, 38, "bf16", M3RT_WGMMA_ACC32);
}

// d = A B^T over 128 dims (kAccumulate: d += A B^T): 8 k-steps of wgmma m64nNk16, the first
// overwriting d unless kAccumulate. A: the thread's fragments a[s] of dims 16 s ..; B: N rows of
// 128 dims in the K-major 128-byte-swizzled image at shared address `b` (dims 0-63, then 64-127
// `half_bytes` further).
template <int N, bool kF16, bool kAccumulate = false>
__device__ __forceinline__ void wgmma_k128(float (&d)[N / 2], const uint32_t (&a)[8][4], uint32_t b,
                                           uint32_t half_bytes) {
  wgmma_m64k16<N, kF16, false, kAccumulate>(d, a[0], sw128_desc(b));
#pragma unroll
  for (int s = 1; s < 8; ++s) wgmma_m64k16<N, kF16>(d, a[s], sw128_desc(b + (s / 4) * half_bytes + (s % 4) * 32));
}

#undef M3RT_WGMMA_BODY
#undef M3RT_WGMMA_REGS64
#undef M3RT_WGMMA_REGS32
#undef M3RT_WGMMA_REGS16
#undef M3RT_WGMMA_REGS8
#undef M3RT_WGMMA_ACC64
#undef M3RT_WGMMA_ACC32
#undef M3RT_WGMMA_ACC16
#undef M3RT_WGMMA_ACC8

}  // namespace m3rt::kernels
