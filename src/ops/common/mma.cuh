// Tensor-core and async-copy helpers shared by the attention-side kernels (lightning indexer, MSA):
// the m16n8k16 MMA with fp32 accumulation, exact e4m3 -> f16 pair conversion, shared-memory
// addresses and zero-filling cp.async.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>

#include <cstdint>

namespace m3rt::kernels {

// Two e4m3 codes (the low 16 bits of `two`) -> an f16 pair, exactly (every e4m3 value is an f16).
__device__ __forceinline__ uint32_t e4m3x2_to_f16x2(uint32_t two) {
  const __half2_raw h =
      __nv_cvt_fp8x2_to_halfraw2(static_cast<__nv_fp8x2_storage_t>(two & 0xffffu), __NV_E4M3);
  return uint32_t(h.x) | (uint32_t(h.y) << 16);
}

// Four e4m3 codes -> two f16 pairs (lo from bytes 0-1, hi from bytes 2-3), exactly. On sm_89+ the
// high pair is converted in place (the conversion reads the register's upper half: no shift).
__device__ __forceinline__ void e4m3x4_to_f16x2x2(uint32_t four, uint32_t& lo, uint32_t& hi) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 890
  asm("{\n .reg .b16 l, h;\n mov.b32 {l, h}, %2;\n cvt.rn.f16x2.e4m3x2 %0, l;\n cvt.rn.f16x2.e4m3x2 %1, h;\n}\n"
      : "=r"(lo), "=r"(hi)
      : "r"(four));
#else
  lo = e4m3x2_to_f16x2(four);
  hi = e4m3x2_to_f16x2(four >> 16);
#endif
}

// d += A B on m16n8k16 tensor cores, fp32 accumulation; inputs f16 (kF16) or bf16 pairs.
template <bool kF16>
__device__ __forceinline__ void mma_16816(float (&d)[4], uint32_t a0, uint32_t a1, uint32_t a2, uint32_t a3,
                                          uint32_t b0, uint32_t b1) {
  if constexpr (kF16) {
    asm("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
        "{%0,%1,%2,%3};\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
  } else {
    asm("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
        "{%0,%1,%2,%3};\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
  }
}

__device__ __forceinline__ uint32_t smem_u32(const void* ptr) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(ptr));
}

// Four 8x8 16-bit matrices from shared memory (lanes 8i..8i+7 give matrix i's row addresses):
// thread l gets row l / 4, elements 2 (l % 4) and + 1 of each (trans: of each matrix's transpose).
__device__ __forceinline__ void ldsm_x4(uint32_t addr, uint32_t& r0, uint32_t& r1, uint32_t& r2, uint32_t& r3) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r0), "=r"(r1), "=r"(r2), "=r"(r3)
               : "r"(addr));
}
__device__ __forceinline__ void ldsm_x4_trans(uint32_t addr, uint32_t& r0, uint32_t& r1, uint32_t& r2,
                                              uint32_t& r3) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r0), "=r"(r1), "=r"(r2), "=r"(r3)
               : "r"(addr));
}
// The transpose of an 8x8 16-bit matrix held one pair a thread (row l / 4, columns 2 (l % 4), + 1)
// in the same distribution: an MMA accumulator block's rows become a B fragment's columns.
__device__ __forceinline__ uint32_t movmatrix_trans(uint32_t x) {
  uint32_t y;
  asm volatile("movmatrix.sync.aligned.m8n8.trans.b16 %0, %1;\n" : "=r"(y) : "r"(x));
  return y;
}
// Two floats as a bf16 pair (round to nearest even), a in the low half.
__device__ __forceinline__ uint32_t bf16x2_bits(float a, float b) {
  const __nv_bfloat162 h = __floats2bfloat162_rn(a, b);
  return *reinterpret_cast<const uint32_t*>(&h);
}

// cp.async of 16 bytes; src_bytes 0 writes 16 zero bytes without reading.
__device__ __forceinline__ void cp_async_16z(void* smem, const void* gmem, int src_bytes) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(smem_u32(smem)), "l"(gmem), "r"(src_bytes));
}

// A column of an m16n8 accumulator block (a lane's element c of rows lane / 4 and + 8) reduced
// over its rows: op across the 8 lanes with the same lane % 4 (xor 4, 8, 16), whole warp.
template <class Op>
__device__ __forceinline__ float reduce_accumulator_column(float v, Op op) {
  v = op(v, __shfl_xor_sync(0xffffffffu, v, 4));
  v = op(v, __shfl_xor_sync(0xffffffffu, v, 8));
  return op(v, __shfl_xor_sync(0xffffffffu, v, 16));
}

}  // namespace m3rt::kernels
