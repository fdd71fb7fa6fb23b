// m3rt/dtype.h — element types and host conversions that match CUDA's bit for bit.
//
// defines: DType, dtype_name, dtype_size, bf16/fp16/e4m3 <-> float host conversions.
//
// The conversions are the ones the kernels use on the device, written for the host:
//   float -> bf16   round-to-nearest-even, NaN -> 0x7FFF          (__float2bfloat16_rn)
//   float -> fp16   round-to-nearest-even, overflow -> inf, NaN -> 0x7FFF (__float2half_rn)
//   float -> e4m3   OCP e4m3fn, round-to-nearest-even, saturate to +-448 (inf too), NaN -> 0x7F
//                   (__nv_cvt_float_to_fp8(x, __NV_SATFINITE, __NV_E4M3) on sm_89+, which is
//                   cvt.rn.satfinite.e4m3x2.f32; CUDA's software path for older GPUs keeps a NaN's
//                   sign, 0xFF, the only difference — measured on an H200, tests/test_gpu.cu)
// tests/test_dtype.cpp checks them exhaustively on the host; the GPU test compares them with the
// device intrinsics over every bf16 value and a dense sweep of floats.
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>

namespace m3rt {

enum class DType : uint8_t {
  kBFloat16,
  kFloat16,
  kFloat32,
  kInt32,
  kInt64,
  kUInt8,
  kFloat8E4M3,  // OCP e4m3fn, one byte per element
};

const char* dtype_name(DType dtype);
int64_t dtype_size(DType dtype);

inline uint32_t float_bits(float x) {
  uint32_t u;
  std::memcpy(&u, &x, 4);
  return u;
}
inline float bits_float(uint32_t u) {
  float x;
  std::memcpy(&x, &u, 4);
  return x;
}

// ---- bf16 ----
inline float bf16_to_float(uint16_t h) { return bits_float(uint32_t(h) << 16); }
inline uint16_t float_to_bf16(float x) {
  uint32_t u = float_bits(x);
  if ((u & 0x7fffffffu) > 0x7f800000u) return 0x7fff;  // NaN, canonical like CUDA
  uint32_t lsb = (u >> 16) & 1u;
  u += 0x7fffu + lsb;  // round to nearest even on the dropped 16 bits (inf stays inf)
  return uint16_t(u >> 16);
}
inline float round_bf16(float x) { return bf16_to_float(float_to_bf16(x)); }

// ---- fp16 ----
float fp16_to_float(uint16_t h);
uint16_t float_to_fp16(float x);

// ---- fp8 e4m3fn: 1 sign, 4 exponent (bias 7), 3 mantissa bits; no inf, 0x7F/0xFF are NaN ----
constexpr float kE4M3Max = 448.0f;
inline float e4m3_to_float(uint8_t v) {
  const uint32_t sign = v >> 7, exp = (v >> 3) & 0xf, man = v & 0x7;
  float mag;
  if (exp == 0xf && man == 0x7) {
    mag = NAN;
  } else if (exp == 0) {
    mag = std::ldexp(float(man), -9);  // subnormal: man/8 * 2^-6
  } else {
    mag = std::ldexp(float(8 + man), int(exp) - 10);  // (1 + man/8) * 2^(exp-7)
  }
  return sign ? -mag : mag;
}
uint8_t float_to_e4m3(float x);  // saturating, round-to-nearest-even

}  // namespace m3rt
