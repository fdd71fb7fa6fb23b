// Exhaustive host check of the e4m3 quantizer's two-term quotient (branch e4m3-two-term,
// src/ops/common/head_math.cuh E4m3Quantizer): for a scale s, h = RZ(1/s), r = RN(1 - h s) (exact:
// FMA), l = RN(r / s) (l = RN(h 2^-60) when r = 0, i.e. s a power of two), and per bf16 x
// q = RN(x h + RN(x l)). Claim: e4m3(q) == e4m3(RN(x / s)) for every bf16 x and every s in
// [2^-60, 2^60]. Scaling s by 2^k scales h, l and q by 2^-k exactly (l stays normal there), so the
// check covers every significand of s in [1, 2) and every bf16 significand x over the binades where the
// code can depend on the quotient's low bits: x / s in [2^-14, 2^11) (below 2^-10 both round to a
// signed zero; from 464 both saturate; a negative x mirrors a positive one). Plus x = 0 and x = inf.
// RN(x / s) is computed in double and rounded to float: x / s is never within 2^-53 relative of a float
// midpoint unless on it (x has 8 significant bits, s 24), so the double rounding is exact.
// Build: g++ -O2 -march=native -std=c++20 -Iinclude FILE src/core/dtype.cpp -lpthread
// Usage: PROGRAM [stride [threads [div|mul]]]  (stride 1: every significand of s; "mul": l = RN(r h),
// the cheaper form, which fails: one code differs, s = 0x1.fffffep+0, x = 2^-9)
// Session 65 (2 threads, ~5 min): "stride 1, l = r / s: 26860322816 checks, 275 fp32 quotients differ,
// 0 e4m3 codes differ"; with "mul": 650 quotients and 1 code differ.
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <thread>
#include <vector>

#include "m3rt/dtype.h"

namespace {
float from_bits(uint32_t u) {
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}
}  // namespace

int main(int argc, char** argv) {
  const int stride = argc > 1 ? std::atoi(argv[1]) : 1;
  const int threads = argc > 2 ? std::atoi(argv[2]) : 2;
  const bool div = !(argc > 3 && std::string(argv[3]) == "mul");
  std::atomic<uint64_t> checks{0}, fdiff{0}, cdiff{0};
  auto work = [&](int tid) {
    uint64_t c = 0, fd = 0, cd = 0;
    for (uint32_t m = uint32_t(tid) * stride; m < (1u << 23); m += uint32_t(stride) * threads) {
      const float s = from_bits(0x3f800000u | m);
      const double d = 1.0 / double(s);
      float h = float(d);
      if (double(h) > d) h = std::nextafter(h, 0.f);  // RZ
      const float r = std::fma(-h, s, 1.f);
      const float l = r != 0.f ? (div ? r / s : r * h) : h * 0x1p-60f;
      auto one = [&](float x) {
        const float ref = float(double(x) / double(s));
        const float q = std::fma(x, h, x * l);
        ++c;
        if (q != ref && !(std::isnan(q) && std::isnan(ref))) {
          ++fd;
          if (m3rt::float_to_e4m3(q) != m3rt::float_to_e4m3(ref) && ++cd <= 5)
            std::printf("code differs: s=%a x=%a ref=%a q=%a\n", s, x, ref, q);
        }
      };
      for (int e = -21; e <= 3; ++e)
        for (int k = 128; k < 256; ++k) one(std::ldexp(float(k), e));  // 8 significant bits: bf16
      one(0.f);
      one(INFINITY);
    }
    checks += c;
    fdiff += fd;
    cdiff += cd;
  };
  std::vector<std::thread> pool;
  for (int i = 0; i < threads; ++i) pool.emplace_back(work, i);
  for (auto& t : pool) t.join();
  std::printf("stride %d, l = %s: %llu checks, %llu fp32 quotients differ, %llu e4m3 codes differ\n", stride,
              div ? "r / s" : "r h", (unsigned long long)checks, (unsigned long long)fdiff,
              (unsigned long long)cdiff);
  return cdiff == 0 ? 0 : 1;
}
