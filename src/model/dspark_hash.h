// Internal: the counter-based hashes the drafter draws its randomness from, shared by the host
// (CPU reference, random weights) and the device (Markov loop, random weights), so both produce
// the same bits without shared state.
//
// defines: splitmix64, gumbel_uniform, gumbel_noise, uniform_pm1.
#pragma once

#include <cmath>
#include <cstdint>

#ifdef __CUDACC__
#define M3RT_HD __host__ __device__
#else
#define M3RT_HD
#endif

namespace m3rt::detail {

// One splitmix64 round (Steele, Lea, Flood 2014): a bijective 64-bit mix.
M3RT_HD inline uint64_t splitmix64(uint64_t x) {
  x += 0x9e3779b97f4a7c15ull;
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ull;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebull;
  return x ^ (x >> 31);
}

// u in (0, 1), never 0 or 1, keyed by (seed, position, token).
M3RT_HD inline double gumbel_uniform(uint64_t seed, int64_t position, int64_t token) {
  const uint64_t h = splitmix64(splitmix64(splitmix64(seed) ^ uint64_t(position)) ^ uint64_t(token));
  return (double(h >> 11) + 0.5) * 0x1p-53;
}

// -log(-log(u)) in double.
M3RT_HD inline double gumbel_noise(uint64_t seed, int64_t position, int64_t token) {
  const double u = gumbel_uniform(seed, position, token);
  return -log(-log(u));
}

// Uniform in [-1, 1) with 24 random bits, keyed by (seed, index): exact in fp32.
M3RT_HD inline float uniform_pm1(uint64_t seed, uint64_t index) {
  const uint64_t h = splitmix64(splitmix64(seed) ^ index);
  return float(int64_t(h >> 40) - (int64_t(1) << 23)) * 0x1p-23f;
}

}  // namespace m3rt::detail
