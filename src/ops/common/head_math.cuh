// Device helpers shared by the per-head kernels (context-K/V writer, QK-norm/RoPE/insert,
// reshape_and_cache): one 128-dim head is owned by 16 lanes of a warp (a "half-warp"), 8
// consecutive dims per lane, so every global access is 16 bytes (bf16) or 8 bytes (e4m3).
//
// Arithmetic uses the _rn intrinsics: no FMA contraction, so each step rounds exactly like the CPU
// reference's plain fp32 expressions (built with -ffp-contract=off). The 128-term sum of squares
// (8 per lane, then a butterfly xor 8, 4, 2, 1) is m3rt's canonical head order, which the CPU
// references use too (head_sum_of_squares in ref_common.h): results match them bit for bit.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp8.h>

#include <cstdint>
#include <string>
#include <type_traits>

#include "m3rt/error.h"
#include "ops/common/mma.cuh"

namespace m3rt::kernels {

constexpr int kLanesPerHead = 16;
// Shuffle mask for kernels whose warps stay converged (both halves run the same code path).
constexpr unsigned kFullMask = 0xffffffffu;
constexpr int kDimsPerLane = 8;
static_assert(kLanesPerHead * kDimsPerLane == 128, "one half-warp covers a 128-dim head");

// 8 bf16 (16 bytes) -> fp32.
__device__ __forceinline__ void unpack_bf16x8(const uint4& raw, float (&x)[8]) {
  const uint32_t w[4] = {raw.x, raw.y, raw.z, raw.w};
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    x[2 * i] = __uint_as_float(w[i] << 16);
    x[2 * i + 1] = __uint_as_float(w[i] & 0xffff0000u);
  }
}

// fp32 -> 8 bf16, round to nearest even.
__device__ __forceinline__ uint4 pack_bf16x8(const float (&x)[8]) {
  uint32_t w[4];
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const __nv_bfloat162 h = __floats2bfloat162_rn(x[2 * i], x[2 * i + 1]);
    w[i] = *reinterpret_cast<const uint32_t*>(&h);
  }
  return make_uint4(w[0], w[1], w[2], w[3]);
}

// Round each value to bf16 and back (the "materialized to bf16" boundary).
__device__ __forceinline__ void round_bf16x8(float (&x)[8]) { unpack_bf16x8(pack_bf16x8(x), x); }

// fp32 -> 8 e4m3fn (saturate to finite, round to nearest even).
__device__ __forceinline__ uint2 pack_e4m3x8(const float (&x)[8]) {
  uint32_t w[2];
#pragma unroll
  for (int i = 0; i < 2; ++i) {
    uint32_t lo = __nv_cvt_float2_to_fp8x2(make_float2(x[4 * i], x[4 * i + 1]), __NV_SATFINITE,
                                           __NV_E4M3);
    uint32_t hi = __nv_cvt_float2_to_fp8x2(make_float2(x[4 * i + 2], x[4 * i + 3]), __NV_SATFINITE,
                                           __NV_E4M3);
    w[i] = (lo & 0xffffu) | (hi << 16);
  }
  return make_uint2(w[0], w[1]);
}

// The quantizer's rare case (a scale outside [2^-60, 2^60]): IEEE divisions, out of line so that
// its code does not crowd the instruction cache of the kernels that inline the common cases (the
// fp8 writer's kernel shrank from 1556 to 944 instructions and ran 1.14x faster). A template: one
// definition per program without `inline`, which noinline would contradict.
template <int = 0>
__device__ __noinline__ uint2 e4m3_divide8(uint4 raw, float scale);

// e4m3(RN(x / scale)), as the reference computes it, without an IEEE division per element. With
// r = RN(1/scale) (once per scale) q = RN(x r) is within an ulp of x / scale, and one correction
// c = q - (q scale - x) r (Markstein's step, the residual exact by FMA) gives RN(x / scale) when
// nothing over- or underflows: for scale in [2^-60, 2^60] and |q| in [2^-12, 2^10]. Outside that
// range of q the e4m3 code needs no exact quotient: |x / scale| < 2^-10 rounds to a signed zero and
// > 464 saturates, and c keeps the quotient's sign there (the residual's form keeps a zero's sign);
// so only an overflowing q (inf - inf in the correction) must be avoided: x is first clamped to
// +-B, B = 1024 |scale| rounded up to bf16, which changes no code (|x| > B saturates either way).
// Three cases, chosen once per scale: a power-of-two scale (x r is exact: q is the quotient), the
// correction, and a scale outside [2^-60, 2^60] (the IEEE division). tests/test_gpu.cu checks the
// codes against __fdiv_rn for every bf16 x and 4015 scales, through both entry points.
struct E4m3Quantizer {
  enum Mode : uint32_t { kPow2, kCorrect, kDivide };
  float scale = 1.f, inv = 1.f;
  uint32_t bound2 = 0x7f807f80u;  // B as bf16x2 (both halves)
  Mode mode = kPow2;
  E4m3Quantizer() = default;
  __device__ explicit E4m3Quantizer(float s) {
    scale = s;
    inv = __frcp_rn(s);
    const float a = fabsf(s);
    mode = !(a >= 0x1p-60f && a <= 0x1p60f) ? kDivide : (__float_as_uint(a) & 0x7fffffu) == 0 ? kPow2 : kCorrect;
    const uint32_t b = (__float_as_uint(1024.f * a) + 0xffffu) >> 16;  // rounded up to bf16
    bound2 = b | (b << 16);
  }
  // The quotient's stand-in for kPow2 (any x) and kCorrect (a finite or NaN x with |x| <= B).
  __device__ __forceinline__ float quotient_clamped(float x) const {
    const float q = __fmul_rn(x, inv);
    if (mode == kPow2) return q;
    return __fmaf_rn(-__fmaf_rn(q, scale, -x), inv, q);
  }
  // A float whose e4m3 code equals that of RN(x / scale), for any x (the scalar form; the kernels
  // use the 8-wide one below).
  __device__ __forceinline__ float quotient(float x) const {
    if (mode == kDivide) return __fdiv_rn(x, scale);
    const float bound = __uint_as_float(bound2 << 16);
    if (mode == kCorrect && fabsf(x) > bound) x = copysignf(bound, x);  // NaN stays
    return quotient_clamped(x);
  }
  // 8 bf16 values (16 bytes) -> their 8 e4m3 codes; the clamp on bf16 pairs (NaN-propagating).
  __device__ __forceinline__ uint2 operator()(uint4 raw) const {
    if (mode == kDivide) return e4m3_divide8(raw, scale);
    if (mode == kCorrect) {
      const __nv_bfloat162 hi = *reinterpret_cast<const __nv_bfloat162*>(&bound2);
      const __nv_bfloat162 lo = __hneg2(hi);
      uint32_t* w = &raw.x;
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        const __nv_bfloat162 v = __hmin2_nan(__hmax2_nan(*reinterpret_cast<const __nv_bfloat162*>(&w[i]), lo), hi);
        w[i] = *reinterpret_cast<const uint32_t*>(&v);
      }
    }
    float q[8];
    unpack_bf16x8(raw, q);
#pragma unroll
    for (int i = 0; i < 8; ++i) q[i] = quotient_clamped(q[i]);
    return pack_e4m3x8(q);
  }
};

template <int>
__device__ __noinline__ uint2 e4m3_divide8(uint4 raw, float scale) {
  float q[8];
  unpack_bf16x8(raw, q);
#pragma unroll
  for (int i = 0; i < 8; ++i) q[i] = __fdiv_rn(q[i], scale);
  return pack_e4m3x8(q);
}

// Sum over the 16 lanes of one half-warp; `mask` names the half-warp's lanes.
__device__ __forceinline__ float half_warp_sum(float v, unsigned mask) {
#pragma unroll
  for (int m = kLanesPerHead / 2; m > 0; m >>= 1) v = __fadd_rn(v, __shfl_xor_sync(mask, v, m));
  return v;
}

// The sum of squares of 8 values in order (a lane's part of the canonical head order).
__device__ __forceinline__ float sum_of_squares8(const float (&x)[8]) {
  float ss = 0.f;
#pragma unroll
  for (int i = 0; i < 8; ++i) ss = __fadd_rn(ss, __fmul_rn(x[i], x[i]));
  return ss;
}

// 1 / sqrt(ss / 128 + eps) for a head's sum of squares, IEEE square root and division.
__device__ __forceinline__ float head_inv_rms(float ss, float eps) {
  return __fdiv_rn(1.f, __fsqrt_rn(__fadd_rn(__fmul_rn(ss, 1.f / 128.f), eps)));
}

// Gemma RMSNorm of one head in place: x * (1 / sqrt(mean(x^2) + eps)) * (1 + w), fp32.
// `w1` holds this lane's 8 factors 1 + w (gemma_weight_lane), computed once per kernel.
__device__ __forceinline__ void gemma_norm_head(float (&x)[8], const float (&w1)[8], float eps,
                                                unsigned mask) {
  const float inv_rms = head_inv_rms(half_warp_sum(sum_of_squares8(x), mask), eps);
#pragma unroll
  for (int i = 0; i < 8; ++i) x[i] = __fmul_rn(__fmul_rn(x[i], inv_rms), w1[i]);
}

// A lane's 8 norm factors 1 + w (fp32, rounded like the reference's 1.f + w) from its 8 bf16
// weights, as loaded (`raw`: a PDL kernel issues the load before its grid-dependency wait and
// converts after it) or from memory.
__device__ __forceinline__ void gemma_weight_factors(const uint4& raw, float (&w1)[8]) {
  unpack_bf16x8(raw, w1);
#pragma unroll
  for (int i = 0; i < 8; ++i) w1[i] = __fadd_rn(1.f, w1[i]);
}
__device__ __forceinline__ void gemma_weight_lane(const __nv_bfloat16* w_lane, float (&w1)[8]) {
  gemma_weight_factors(__ldg(reinterpret_cast<const uint4*>(w_lane)), w1);
}

// The cos/sin a lane needs for partial NeoX RoPE (R = kRotaryDim): dim i pairs with i + R/2 for
// i < R/2; dims >= R pass through. Lane j owns dims [8j, 8j+8): lanes j < R/16 hold first-half dims,
// lanes R/16 <= j < R/8 their partners, R/16 lanes away. Both read cos/sin at (j mod R/16) * 8.
// Split from the rotation so a kernel can issue these (position-dependent) loads for all its
// tokens at once. `row` is the position's table row [cos (R/2) | sin (R/2)].
struct RopeLane {
  uint4 cos, sin;
};
template <int kRotaryDim>
__device__ __forceinline__ bool rope_lane_rotates(int j) {
  return j < kRotaryDim / kDimsPerLane;
}
template <int kRotaryDim>
__device__ __forceinline__ RopeLane load_rope_lane(int j, const __nv_bfloat16* row) {
  constexpr int kHalf = kRotaryDim / 2, kPartner = kHalf / kDimsPerLane;
  const int i0 = (j % kPartner) * kDimsPerLane;
  return {__ldg(reinterpret_cast<const uint4*>(row + i0)),
          __ldg(reinterpret_cast<const uint4*>(row + kHalf + i0))};
}

// One NeoX rotation in fp32: a first-half dim x with its partner p (x c - p s), or a second-half
// dim (x c + p s).
__device__ __forceinline__ float rope_rotate(float x, float p, float c, float s, bool first) {
  return first ? __fsub_rn(__fmul_rn(x, c), __fmul_rn(p, s)) : __fadd_rn(__fmul_rn(x, c), __fmul_rn(p, s));
}

// Partial NeoX RoPE of one head in place, in fp32, with the lane's cos/sin (load_rope_lane; ignored
// on pass-through lanes). Every lane of the half-warp must call this (it shuffles).
template <int kRotaryDim>
__device__ __forceinline__ void rope_neox_head(float (&x)[8], int j, const RopeLane& cs,
                                               unsigned mask) {
  static_assert(kRotaryDim == 16 || kRotaryDim == 32 || kRotaryDim == 64, "rotary 16/32/64");
  constexpr int kPartner = kRotaryDim / 2 / kDimsPerLane;  // lanes between a dim and its partner
  float p[8];
#pragma unroll
  for (int i = 0; i < 8; ++i) p[i] = __shfl_xor_sync(mask, x[i], kPartner);
  if (!rope_lane_rotates<kRotaryDim>(j)) return;  // pass-through dims
  const bool first = j < kPartner;
  float c[8], s[8];
  unpack_bf16x8(cs.cos, c);
  unpack_bf16x8(cs.sin, s);
#pragma unroll
  for (int i = 0; i < 8; ++i) x[i] = rope_rotate(x[i], p[i], c[i], s[i], first);
}

// ---- Quad layout: one 128-dim head per 4 lanes (a "quad"). Lane q (0..3) of a quad owns the
// four 8-dim chunks q, q + 4, q + 8 and q + 12 (chunk c = dims [8c, 8c + 8)): the canonical norm
// order's first two butterfly levels (chunks xor 8, xor 4) and rotary 64's pairs (chunk c with
// c + 4) stay inside a lane, so per head a lane spends 2 shuffles on the norm and none on RoPE 64,
// and the per-head fixed work (square root, division, addresses) is paid by 4 lanes, not 16.
constexpr int kQuadLanes = 4;
constexpr int kQuadChunks = 4;  // chunks per lane
__device__ __forceinline__ int quad_chunk(int q, int k) { return q + kQuadLanes * k; }
// A 128-dim head's norm factors 1 + w in fp32 as its quad reads them: row[q][k] holds the 8 factors
// of chunk quad_chunk(q, k). Stores dims d and d + 1 (d even) from their bf16 pair `two`.
__device__ __forceinline__ void quad_norm_factors_store(float4 (&row)[kQuadLanes][kQuadChunks][2], int d,
                                                        uint32_t two) {
  const int c = d / 8, e = d % 8;
  float* dst = reinterpret_cast<float*>(&row[c % kQuadLanes][c / kQuadLanes][0]) + e;
  dst[0] = __fadd_rn(1.f, __uint_as_float(two << 16));
  dst[1] = __fadd_rn(1.f, __uint_as_float(two & 0xffff0000u));
}

// 1 / sqrt(mean(x^2) + eps) of one head in the quad layout, from the lane's 4 chunks of bf16
// (raw[k] = chunk q + 4k): head_sum_of_squares bit for bit (the same terms in the same order: the
// butterfly's levels xor 8 and xor 4 are in-lane, xor 2 and xor 1 shuffles), then gemma_norm_head's
// square root and division. Every lane of the quad returns it; `mask` names the quad's lanes.
__device__ __forceinline__ float quad_inv_rms(const uint4 (&raw)[kQuadChunks], float eps, unsigned mask) {
  float part[kQuadChunks];
#pragma unroll
  for (int k = 0; k < kQuadChunks; ++k) {
    float x[8];
    unpack_bf16x8(raw[k], x);
    part[k] = sum_of_squares8(x);
  }
  // xor 8: chunk q + 4k with q + 4k + 8 (k with k + 2); xor 4: chunk q with q + 4; then the lanes.
  float v = __fadd_rn(__fadd_rn(part[0], part[2]), __fadd_rn(part[1], part[3]));
  v = __fadd_rn(v, __shfl_xor_sync(mask, v, 2));
  v = __fadd_rn(v, __shfl_xor_sync(mask, v, 1));
  return head_inv_rms(v, eps);
}

// One chunk normed (gemma_norm_head's products): x = bf16 chunk * inv_rms * (1 + w), `w1` its 8
// factors as two float4 (e.g. in shared memory).
__device__ __forceinline__ void norm_chunk(const uint4& raw, float inv_rms, const float4 (&w1)[2], float (&x)[8]) {
  unpack_bf16x8(raw, x);
  const float w[8] = {w1[0].x, w1[0].y, w1[0].z, w1[0].w, w1[1].x, w1[1].y, w1[1].z, w1[1].w};
#pragma unroll
  for (int i = 0; i < 8; ++i) x[i] = __fmul_rn(__fmul_rn(x[i], inv_rms), w[i]);
}

// Partial NeoX RoPE in the quad layout (rope_neox_head's math), R = kRotaryDim, on the lane's
// chunks q (x0) and q + 4 (x1): R = 64 rotates x0 with x1 (no shuffle); R = 32 / 16 rotate x0 of
// lanes q < R/8 with lane q ^ (R/16)'s x0 (x1 passes through). `cs` is the lane's cos/sin: the
// table row's 8 entries at (q mod R/16) * 8 (load_rope_quad). Every lane of the quad must call
// this (R < 64 shuffles).
template <int kRotaryDim>
__device__ __forceinline__ bool quad_lane_rotates(int q) {
  return q < kRotaryDim / kDimsPerLane;  // R = 64: every lane (its chunks q and q + 4)
}
template <int kRotaryDim>
__device__ __forceinline__ RopeLane load_rope_quad(int q, const __nv_bfloat16* row) {
  constexpr int kHalf = kRotaryDim / 2, kPartner = kRotaryDim / 16;
  const int i0 = (q % kPartner) * kDimsPerLane;
  return {__ldg(reinterpret_cast<const uint4*>(row + i0)), __ldg(reinterpret_cast<const uint4*>(row + kHalf + i0))};
}
template <int kRotaryDim>
__device__ __forceinline__ void rope_neox_quad(float (&x0)[8], float (&x1)[8], int q, const RopeLane& cs,
                                               unsigned mask) {
  static_assert(kRotaryDim == 16 || kRotaryDim == 32 || kRotaryDim == 64, "rotary 16/32/64");
  float c[8], s[8];
  unpack_bf16x8(cs.cos, c);
  unpack_bf16x8(cs.sin, s);
  if constexpr (kRotaryDim == 64) {
#pragma unroll
    for (int i = 0; i < 8; ++i) {
      const float a = x0[i], b = x1[i];
      x0[i] = rope_rotate(a, b, c[i], s[i], true);
      x1[i] = rope_rotate(b, a, c[i], s[i], false);
    }
  } else {
    constexpr int kPartner = kRotaryDim / 16;  // lanes between chunk q and its partner
    float p[8];
#pragma unroll
    for (int i = 0; i < 8; ++i) p[i] = __shfl_xor_sync(mask, x0[i], kPartner);
    if (!quad_lane_rotates<kRotaryDim>(q)) return;
    const bool first = q < kPartner;
#pragma unroll
    for (int i = 0; i < 8; ++i) x0[i] = rope_rotate(x0[i], p[i], c[i], s[i], first);
  }
}

// Asynchronous global -> shared copies (cp.async, sm_80+): the bytes in flight occupy no
// registers, so a kernel can keep the next work item's rows loading while it computes. The
// overloads taking a 32-bit shared address (smem_u32) let a loop compute it once.
__device__ __forceinline__ void cp_async_16(uint32_t smem, const void* gmem) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(smem), "l"(gmem));
}
__device__ __forceinline__ void cp_async_8(uint32_t smem, const void* gmem) {
  asm volatile("cp.async.ca.shared.global [%0], [%1], 8;\n" ::"r"(smem), "l"(gmem));
}
__device__ __forceinline__ void cp_async_16(void* smem, const void* gmem) { cp_async_16(smem_u32(smem), gmem); }
__device__ __forceinline__ void cp_async_8(void* smem, const void* gmem) { cp_async_8(smem_u32(smem), gmem); }

// One 16-byte (8-byte) global store. A plain `*(uint4*)p = v` of a value assembled from scalars
// can reach the PTX as four 4-byte stores (seen for pack_bf16x8's results); these cannot.
__device__ __forceinline__ void store16(void* gmem, const uint4& v) {
  asm volatile("st.global.v4.b32 [%0], {%1, %2, %3, %4};\n" ::"l"(gmem), "r"(v.x), "r"(v.y), "r"(v.z),
               "r"(v.w) : "memory");
}
__device__ __forceinline__ void store8(void* gmem, const uint2& v) {
  asm volatile("st.global.v2.b32 [%0], {%1, %2};\n" ::"l"(gmem), "r"(v.x), "r"(v.y) : "memory");
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::); }
// Waits until at most `kPending` of this thread's committed groups are still in flight.
template <int kPending>
__device__ __forceinline__ void cp_async_wait() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(kPending));
}

// Where a paged-cache row lives: [block, head, offset, 0..255] with slot = block * bs + offset.
__device__ __forceinline__ int64_t cache_row_offset(int64_t slot, int block_size_log2,
                                                    int64_t stride_block, int64_t stride_head,
                                                    int head) {
  const int64_t block = slot >> block_size_log2;
  const int64_t offset = slot & ((int64_t(1) << block_size_log2) - 1);
  return block * stride_block + head * stride_head + offset * 256;
}
// The same row in 32-bit arithmetic, as a byte pointer (the writer's and the QK insert's
// launchers check that slots and a block's bytes stay below 2^31): `lane` points at this lane's
// elements of its head at slot 0, block_bytes is the block stride in bytes, offset_mask the block
// size - 1 (both hoisted out of the token loop by the caller).
template <int kElemBytes>
__device__ __forceinline__ char* cache_row_at(char* lane, uint32_t slot, int block_size_log2, uint32_t block_bytes,
                                              uint32_t offset_mask) {
  return lane + uint64_t(slot >> block_size_log2) * block_bytes + ((slot & offset_mask) * 256u) * kElemBytes;
}

// Store 8 bf16 values of one lane into a cache row half (K or V): unchanged (bf16 cache: the bits
// as they are) or as e4m3(x / scale).
template <bool kFp8>
__device__ __forceinline__ void store_cache_copy(void* cache, int64_t elem_offset, const uint4& raw,
                                                 const E4m3Quantizer& quant) {
  if constexpr (kFp8) {
    store8(static_cast<uint8_t*>(cache) + elem_offset, quant(raw));
  } else {
    store16(static_cast<__nv_bfloat16*>(cache) + elem_offset, raw);
  }
}

// Calls f(std::integral_constant<int, R>{}) for the supported rotary dims R = 16, 32, 64; any other
// value (validation lets none through) is an error naming the launcher.
template <class F>
void dispatch_rotary_dim(int rotary_dim, const char* launcher, F&& f) {
  switch (rotary_dim) {
    case 16: return f(std::integral_constant<int, 16>{});
    case 32: return f(std::integral_constant<int, 32>{});
    case 64: return f(std::integral_constant<int, 64>{});
  }
  throw Error(std::string(launcher) + ": rotary_dim " + std::to_string(rotary_dim) +
              " has no kernel (16, 32, 64)");
}

}  // namespace m3rt::kernels
