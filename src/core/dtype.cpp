// Host element-type conversions; see m3rt/dtype.h for the contract each matches.
#include "m3rt/dtype.h"

#include <cmath>

namespace m3rt {

const char* dtype_name(DType dtype) {
  switch (dtype) {
    case DType::kBFloat16: return "bfloat16";
    case DType::kFloat16: return "float16";
    case DType::kFloat32: return "float32";
    case DType::kInt32: return "int32";
    case DType::kInt64: return "int64";
    case DType::kUInt8: return "uint8";
    case DType::kFloat8E4M3: return "float8_e4m3fn";
  }
  return "?";
}

int64_t dtype_size(DType dtype) {
  switch (dtype) {
    case DType::kBFloat16:
    case DType::kFloat16: return 2;
    case DType::kFloat32:
    case DType::kInt32: return 4;
    case DType::kInt64: return 8;
    case DType::kUInt8:
    case DType::kFloat8E4M3: return 1;
  }
  return 0;
}

float fp16_to_float(uint16_t h) {
  const uint32_t sign = uint32_t(h & 0x8000) << 16;
  const uint32_t exp = (h >> 10) & 0x1f, man = h & 0x3ff;
  if (exp == 0x1f) return bits_float(sign | 0x7f800000u | (man << 13));  // inf / NaN
  if (exp == 0) {
    const float mag = std::ldexp(float(man), -24);  // subnormal (or zero)
    return sign ? -mag : mag;
  }
  return bits_float(sign | ((exp + 112) << 23) | (man << 13));
}

uint16_t float_to_fp16(float x) {
  const uint32_t u = float_bits(x);
  const uint16_t sign = uint16_t((u >> 16) & 0x8000);
  const uint32_t a = u & 0x7fffffffu;
  if (a > 0x7f800000u) return 0x7fff;                     // NaN, canonical like CUDA
  if (a >= 0x477ff000u) return uint16_t(sign | 0x7c00);   // >= 65520 rounds to inf
  if (a < 0x38800000u) {                                  // below 2^-14: subnormal range
    // Units of 2^-24; the scaling is exact and nearbyint rounds half to even.
    return uint16_t(sign | uint16_t(std::nearbyint(bits_float(a) * 16777216.0f)));
  }
  uint32_t h = ((((a >> 23) - 127 + 15) << 10) | ((a & 0x7fffffu) >> 13));
  const uint32_t rem = a & 0x1fffu;
  if (rem > 0x1000u || (rem == 0x1000u && (h & 1u))) ++h;  // a carry moves into the exponent
  return uint16_t(sign | h);
}

uint8_t float_to_e4m3(float x) {
  const uint32_t u = float_bits(x);
  const uint8_t sign = uint8_t((u >> 31) << 7);
  const uint32_t a = u & 0x7fffffffu;
  if (a > 0x7f800000u) return 0x7f;  // NaN: Hopper's cvt.rn.satfinite.e4m3x2 drops the sign
  // 464 = 448 + half an ulp; 464 itself rounds to even (448). Inf saturates too.
  if (a >= 0x43e80000u) return uint8_t(0x7e | sign);
  const float mag = bits_float(a);
  if (a < 0x3c800000u) {  // below 2^-6: subnormal, units of 2^-9 (8 of them is 2^-6, code 0x08)
    return uint8_t(sign | uint8_t(std::nearbyint(mag * 512.0f)));
  }
  int e = int(a >> 23) - 127;                         // 2^e <= mag < 2^(e+1), e in [-6, 8]
  float m = std::nearbyint(std::ldexp(mag, 3 - e));   // in [8, 16]
  if (m == 16.0f) {
    m = 8.0f;
    ++e;
  }
  return uint8_t(sign | uint8_t(((e + 7) << 3) | (int(m) - 8)));
}

}  // namespace m3rt
