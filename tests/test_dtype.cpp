// Host element-type conversions (include/m3rt/dtype.h, src/core/dtype.cpp) against an independent
// derivation written here: each format's codes are decoded from their bit fields with ldexp, and a
// float is encoded by searching the sorted table of non-negative finite values for the nearest one
// (ties to the even code), with the format's overflow rule on top:
//   bf16  RNE, NaN -> 0x7FFF, overflow and inf -> inf
//   fp16  RNE, |x| >= 65520 -> inf, NaN -> 0x7FFF, subnormals
//   e4m3  OCP e4m3fn, RNE, |x| > 448 (inf too) -> 448, NaN -> 0x7F (Hopper's cvt drops the sign)
// Inputs: a strided sweep over all 2^32 float bit patterns, every midpoint between adjacent codes
// and the floats just below/above it, and named specials. All codes round-trip decode -> encode.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <limits>
#include <string>
#include <vector>

#include "m3rt/dtype.h"

namespace {

using m3rt::bits_float;
using m3rt::float_bits;

// An IEEE-like binary format: exp_bits exponent bits (bias 2^(e-1)-1), man_bits mantissa bits.
// Non-negative finite codes are 0 .. num_finite-1, ordered by value, so code == table index.
struct Format {
  const char* name;
  int exp_bits, man_bits;
  bool e4m3fn;  // OCP e4m3fn: no inf, only S.1111.111 is NaN
  int num_finite;

  // Decode a non-negative code (sign bit clear) from its fields; NaN and inf as doubles.
  double decode_mag(uint32_t code) const {
    const uint32_t man = code & ((1u << man_bits) - 1), exp = code >> man_bits;
    const int bias = (1 << (exp_bits - 1)) - 1;
    const uint32_t exp_max = (1u << exp_bits) - 1;
    if (e4m3fn && exp == exp_max && man == (1u << man_bits) - 1) return NAN;
    if (!e4m3fn && exp == exp_max) return man ? NAN : INFINITY;
    if (exp == 0) return std::ldexp(double(man), 1 - bias - man_bits);
    return std::ldexp(double((1u << man_bits) + man), int(exp) - bias - man_bits);
  }
  double decode(uint32_t code) const {
    const uint32_t sign_bit = 1u << (exp_bits + man_bits);
    const double m = decode_mag(code & (sign_bit - 1));
    return (code & sign_bit) ? -m : m;
  }
  std::vector<double> table() const {
    std::vector<double> t;
    for (int c = 0; c < num_finite; ++c) t.push_back(decode_mag(uint32_t(c)));
    return t;
  }
};

const Format kBf16{"bf16", 8, 7, false, 0x7f80};
const Format kFp16{"fp16", 5, 10, false, 0x7c00};
const Format kE4m3{"e4m3", 4, 3, true, 0x7f};

// Index of the nearest entry of `t` to a >= 0 (ties to the even index). `above` is the value the
// next code would have if the exponent range continued; a result of t.size() means "past the
// largest finite value". Comparisons are exact: 2a and (t[i] + t[i+1]) are exact in double.
int nearest_index(const std::vector<double>& t, double above, double a) {
  const size_t hi = size_t(std::upper_bound(t.begin(), t.end(), a) - t.begin());
  if (hi == 0) return 0;
  const size_t lo = hi - 1;
  if (t[lo] == a) return int(lo);
  const double hv = hi < t.size() ? t[hi] : above;
  const double twice = 2.0 * a, mid2 = t[lo] + hv;
  if (twice < mid2) return int(lo);
  if (twice > mid2) return int(hi);
  return int(lo % 2 == 0 ? lo : hi);
}

struct Oracle {
  std::vector<double> bf16 = kBf16.table(), fp16 = kFp16.table(), e4m3 = kE4m3.table();

  uint16_t to_bf16(float x) const {
    if (std::isnan(x)) return 0x7fff;
    const uint16_t sign = std::signbit(x) ? 0x8000 : 0;
    if (std::isinf(x)) return sign | 0x7f80;
    return sign | uint16_t(nearest_index(bf16, std::ldexp(1.0, 128), std::fabs(double(x))));
  }
  uint16_t to_fp16(float x) const {
    if (std::isnan(x)) return 0x7fff;
    const uint16_t sign = std::signbit(x) ? 0x8000 : 0;
    if (std::isinf(x)) return sign | 0x7c00;
    return sign | uint16_t(nearest_index(fp16, 65536.0, std::fabs(double(x))));
  }
  uint8_t to_e4m3(float x) const {
    const uint8_t sign = std::signbit(x) ? 0x80 : 0;
    if (std::isnan(x)) return 0x7f;
    const double a = std::fabs(double(x));
    if (a > 448.0) return sign | 0x7e;  // satfinite, inf included
    return sign | uint8_t(std::min(nearest_index(e4m3, 512.0, a), 0x7e));
  }
};

const Oracle& oracle() {
  static const Oracle o;
  return o;
}

std::string hex(uint32_t v) {
  char buf[16];
  std::snprintf(buf, sizeof buf, "0x%08x", v);
  return buf;
}

// Checks all three encoders on one float; returns the number of mismatches (reported once each).
int check_float(float x) {
  int bad = 0;
  const Oracle& o = oracle();
  if (m3rt::float_to_bf16(x) != o.to_bf16(x)) {
    ADD_FAILURE() << "float_to_bf16(" << x << " = " << hex(float_bits(x))
                  << ") = " << hex(m3rt::float_to_bf16(x)) << ", expected " << hex(o.to_bf16(x));
    ++bad;
  }
  if (m3rt::float_to_fp16(x) != o.to_fp16(x)) {
    ADD_FAILURE() << "float_to_fp16(" << x << " = " << hex(float_bits(x))
                  << ") = " << hex(m3rt::float_to_fp16(x)) << ", expected " << hex(o.to_fp16(x));
    ++bad;
  }
  if (m3rt::float_to_e4m3(x) != o.to_e4m3(x)) {
    ADD_FAILURE() << "float_to_e4m3(" << x << " = " << hex(float_bits(x))
                  << ") = " << hex(m3rt::float_to_e4m3(x)) << ", expected " << hex(o.to_e4m3(x));
    ++bad;
  }
  return bad;
}

// x, -x, and the floats one step below and above each.
int check_around(float x, int max_failures = 20) {
  int bad = 0;
  for (float s : {x, -x}) {
    for (float y : {s, std::nextafter(s, -INFINITY), std::nextafter(s, INFINITY)}) {
      bad += check_float(y);
      if (bad >= max_failures) return bad;
    }
  }
  return bad;
}

// Midpoints between adjacent non-negative finite codes (exact in float for these formats), plus
// the midpoint between the largest finite value and the next power-of-two step.
std::vector<float> midpoints(const std::vector<double>& t, double above) {
  std::vector<float> m;
  for (size_t i = 0; i + 1 < t.size(); ++i) m.push_back(float((t[i] + t[i + 1]) / 2));
  m.push_back(float((t.back() + above) / 2));
  return m;
}

// ---- decoders ----------------------------------------------------------------------------------

TEST(Dtype, Bf16DecodeEveryCode) {
  for (uint32_t c = 0; c < 0x10000; ++c) {
    const double want = kBf16.decode(c);
    const float got = m3rt::bf16_to_float(uint16_t(c));
    if (std::isnan(want)) {
      ASSERT_TRUE(std::isnan(got)) << "bf16 code " << hex(c);
    } else {
      ASSERT_EQ(double(got), want) << "bf16 code " << hex(c);
      ASSERT_EQ(std::signbit(got), (c & 0x8000) != 0) << "bf16 code " << hex(c);
    }
  }
}

TEST(Dtype, Fp16DecodeEveryCode) {
  for (uint32_t c = 0; c < 0x10000; ++c) {
    const double want = kFp16.decode(c);
    const float got = m3rt::fp16_to_float(uint16_t(c));
    if (std::isnan(want)) {
      ASSERT_TRUE(std::isnan(got)) << "fp16 code " << hex(c);
    } else {
      ASSERT_EQ(double(got), want) << "fp16 code " << hex(c);
      ASSERT_EQ(std::signbit(got), (c & 0x8000) != 0) << "fp16 code " << hex(c);
    }
  }
}

TEST(Dtype, E4m3DecodeEveryCode) {
  for (uint32_t c = 0; c < 0x100; ++c) {
    const double want = kE4m3.decode(c);
    const float got = m3rt::e4m3_to_float(uint8_t(c));
    if (std::isnan(want)) {
      ASSERT_TRUE(std::isnan(got)) << "e4m3 code " << hex(c);
    } else {
      ASSERT_EQ(double(got), want) << "e4m3 code " << hex(c);
      ASSERT_EQ(std::signbit(got), (c & 0x80) != 0) << "e4m3 code " << hex(c);
    }
  }
  // Landmarks of the format, stated independently of the field decoder above.
  EXPECT_EQ(m3rt::e4m3_to_float(0x7e), 448.0f);
  EXPECT_EQ(m3rt::e4m3_to_float(0xfe), -448.0f);
  EXPECT_EQ(m3rt::e4m3_to_float(0x38), 1.0f);
  EXPECT_EQ(m3rt::e4m3_to_float(0x08), 0x1p-6f);  // smallest normal
  EXPECT_EQ(m3rt::e4m3_to_float(0x01), 0x1p-9f);  // smallest subnormal
  EXPECT_EQ(m3rt::e4m3_to_float(0x07), 7 * 0x1p-9f);
  EXPECT_TRUE(std::isnan(m3rt::e4m3_to_float(0x7f)));
  EXPECT_TRUE(std::isnan(m3rt::e4m3_to_float(0xff)));
  EXPECT_TRUE(std::signbit(m3rt::e4m3_to_float(0x80)));
  EXPECT_EQ(kE4m3.table().back(), 448.0);
}

// ---- encoders ----------------------------------------------------------------------------------

TEST(Dtype, EncodeStridedSweepOfAllFloats) {
  // ~16.7M floats at a prime stride: every exponent, many mantissas, both signs, NaNs and infs.
  constexpr uint64_t kStride = 257;
  int bad = 0;
  for (uint64_t u = 0; u <= 0xffffffffull && bad < 20; u += kStride)
    bad += check_float(bits_float(uint32_t(u)));
  // Also the low-mantissa neighbourhood of every exponent (subnormals of every format included).
  for (uint32_t e = 0; e < 256 && bad < 20; ++e)
    for (uint32_t m = 0; m < 64; ++m)
      for (uint32_t s : {0u, 0x80000000u}) bad += check_float(bits_float(s | (e << 23) | m));
  EXPECT_EQ(bad, 0);
}

TEST(Dtype, Bf16EncodeAtEveryMidpoint) {
  int bad = 0;
  for (float m : midpoints(oracle().bf16, std::ldexp(1.0, 128))) {
    bad += check_around(m, 20 - bad);
    if (bad >= 20) break;
  }
  EXPECT_EQ(bad, 0);
}

TEST(Dtype, Fp16EncodeAtEveryMidpoint) {
  int bad = 0;
  for (float m : midpoints(oracle().fp16, 65536.0)) {
    bad += check_around(m, 20 - bad);
    if (bad >= 20) break;
  }
  EXPECT_EQ(bad, 0);
}

TEST(Dtype, E4m3EncodeAtEveryMidpoint) {
  int bad = 0;
  for (float m : midpoints(oracle().e4m3, 512.0)) bad += check_around(m);
  EXPECT_EQ(bad, 0);
}

TEST(Dtype, NamedSpecialValues) {
  const float inf = std::numeric_limits<float>::infinity();
  const float qnan = std::numeric_limits<float>::quiet_NaN();
  const float snan = bits_float(0x7f800001u), neg_nan = bits_float(0xffc00000u);
  // Every named value through the oracle comparison...
  for (float x : {0.0f,         -0.0f,
                  448.0f,       464.0f,
                  480.0f,       449.0f,
                  65504.0f,     65519.99f,
                  65520.0f,     inf,
                  qnan,         snan,
                  neg_nan,      0x1p-149f,
                  0x1p-126f,    0x1p-127f,
                  0x1p-24f,     0x1p-25f,
                  0x1p-10f,     0x1p-9f,
                  0x1p-10f * 3, std::numeric_limits<float>::max()})
    EXPECT_EQ(check_around(x), 0) << "around " << x;

  // ... and the decisive ones spelled out, so a wrong oracle cannot hide a wrong library.
  EXPECT_EQ(m3rt::float_to_e4m3(448.0f), 0x7e);
  EXPECT_EQ(m3rt::float_to_e4m3(464.0f), 0x7e);  // tie between 448 and 480: even -> 448
  EXPECT_EQ(m3rt::float_to_e4m3(480.0f), 0x7e);  // saturates
  EXPECT_EQ(m3rt::float_to_e4m3(1e30f), 0x7e);
  EXPECT_EQ(m3rt::float_to_e4m3(-inf), 0xfe);
  EXPECT_EQ(m3rt::float_to_e4m3(inf), 0x7e);
  EXPECT_EQ(m3rt::float_to_e4m3(qnan), 0x7f);
  EXPECT_EQ(m3rt::float_to_e4m3(neg_nan), 0x7f);
  EXPECT_EQ(m3rt::float_to_e4m3(-0.0f), 0x80);
  EXPECT_EQ(m3rt::float_to_e4m3(0x1p-10f), 0x00);      // half the smallest subnormal: tie -> 0
  EXPECT_EQ(m3rt::float_to_e4m3(0x1p-10f * 3), 0x02);  // 1.5 units: tie -> even (2)
  EXPECT_EQ(m3rt::float_to_e4m3(17.0f), 0x58);         // 16|18 tie -> 16 (even mantissa)
  EXPECT_EQ(m3rt::float_to_e4m3(19.0f), 0x5a);         // 18|20 tie -> 20 (even mantissa)

  EXPECT_EQ(m3rt::float_to_bf16(qnan), 0x7fff);
  EXPECT_EQ(m3rt::float_to_bf16(neg_nan), 0x7fff);
  EXPECT_EQ(m3rt::float_to_bf16(snan), 0x7fff);
  EXPECT_EQ(m3rt::float_to_bf16(inf), 0x7f80);
  EXPECT_EQ(m3rt::float_to_bf16(-inf), 0xff80);
  EXPECT_EQ(m3rt::float_to_bf16(std::numeric_limits<float>::max()), 0x7f80);  // rounds up to inf
  EXPECT_EQ(m3rt::float_to_bf16(bits_float(0x3f808000u)), 0x3f80);            // tie, even stays
  EXPECT_EQ(m3rt::float_to_bf16(bits_float(0x3f818000u)), 0x3f82);            // tie, odd rounds up

  EXPECT_EQ(m3rt::float_to_fp16(65504.0f), 0x7bff);
  EXPECT_EQ(m3rt::float_to_fp16(std::nextafter(65520.0f, 0.0f)), 0x7bff);
  EXPECT_EQ(m3rt::float_to_fp16(65520.0f), 0x7c00);
  EXPECT_EQ(m3rt::float_to_fp16(-65520.0f), 0xfc00);
  EXPECT_EQ(m3rt::float_to_fp16(inf), 0x7c00);
  EXPECT_EQ(m3rt::float_to_fp16(qnan), 0x7fff);
  EXPECT_EQ(m3rt::float_to_fp16(neg_nan), 0x7fff);
  EXPECT_EQ(m3rt::float_to_fp16(0x1p-24f), 0x0001);
  EXPECT_EQ(m3rt::float_to_fp16(0x1p-25f), 0x0000);  // tie -> 0
  EXPECT_EQ(m3rt::float_to_fp16(std::nextafter(0x1p-25f, 1.0f)), 0x0001);
  EXPECT_EQ(m3rt::float_to_fp16(-0.0f), 0x8000);
  EXPECT_EQ(m3rt::float_to_fp16(0x1p-14f), 0x0400);  // smallest normal
  EXPECT_EQ(m3rt::float_to_fp16(std::nextafter(0x1p-14f, 0.0f)), 0x0400);
}

// ---- round trips -------------------------------------------------------------------------------

TEST(Dtype, Bf16RoundTripEveryCode) {
  for (uint32_t c = 0; c < 0x10000; ++c) {
    if ((c & 0x7fff) > 0x7f80) continue;  // NaN
    ASSERT_EQ(m3rt::float_to_bf16(m3rt::bf16_to_float(uint16_t(c))), c) << "bf16 code " << hex(c);
  }
  EXPECT_EQ(m3rt::float_to_bf16(m3rt::bf16_to_float(0x7fc1)), 0x7fff);  // NaN canonicalized
}

TEST(Dtype, Fp16RoundTripEveryCode) {
  for (uint32_t c = 0; c < 0x10000; ++c) {
    if ((c & 0x7fff) > 0x7c00) continue;  // NaN
    ASSERT_EQ(m3rt::float_to_fp16(m3rt::fp16_to_float(uint16_t(c))), c) << "fp16 code " << hex(c);
  }
  EXPECT_EQ(m3rt::float_to_fp16(m3rt::fp16_to_float(0xfe01)), 0x7fff);
}

TEST(Dtype, E4m3RoundTripEveryCode) {
  for (uint32_t c = 0; c < 0x100; ++c) {
    if ((c & 0x7f) == 0x7f) {  // either NaN encodes to the canonical 0x7F
      EXPECT_EQ(m3rt::float_to_e4m3(m3rt::e4m3_to_float(uint8_t(c))), 0x7f);
      continue;
    }
    EXPECT_EQ(m3rt::float_to_e4m3(m3rt::e4m3_to_float(uint8_t(c))), c) << "e4m3 code " << hex(c);
  }
}

TEST(Dtype, NamesAndSizes) {
  EXPECT_STREQ(m3rt::dtype_name(m3rt::DType::kBFloat16), "bfloat16");
  EXPECT_STREQ(m3rt::dtype_name(m3rt::DType::kFloat8E4M3), "float8_e4m3fn");
  EXPECT_EQ(m3rt::dtype_size(m3rt::DType::kBFloat16), 2);
  EXPECT_EQ(m3rt::dtype_size(m3rt::DType::kFloat16), 2);
  EXPECT_EQ(m3rt::dtype_size(m3rt::DType::kFloat32), 4);
  EXPECT_EQ(m3rt::dtype_size(m3rt::DType::kInt32), 4);
  EXPECT_EQ(m3rt::dtype_size(m3rt::DType::kInt64), 8);
  EXPECT_EQ(m3rt::dtype_size(m3rt::DType::kUInt8), 1);
  EXPECT_EQ(m3rt::dtype_size(m3rt::DType::kFloat8E4M3), 1);
}

}  // namespace
