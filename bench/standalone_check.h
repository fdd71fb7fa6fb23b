// The standalone GPU programs under bench/ (no m3rt library): a CUDA call checked, its error
// printed with file:line, exit 1; the current device; a launch timed by events.
#pragma once

#include <cuda_runtime.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <vector>

#define CK(x)                                                               \
  do {                                                                      \
    cudaError_t e = (x);                                                    \
    if (e != cudaSuccess) {                                                 \
      std::printf("%s:%d %s\n", __FILE__, __LINE__, cudaGetErrorString(e)); \
      std::exit(1);                                                         \
    }                                                                       \
  } while (0)

// The current device's properties (no device: the error printed, exit 1).
inline cudaDeviceProp current_device() {
  int dev = 0;
  CK(cudaGetDevice(&dev));
  cudaDeviceProp prop{};
  CK(cudaGetDeviceProperties(&prop, dev));
  return prop;
}

// The median time in ms of `reps` calls of launch() (each enqueueing work on the default stream),
// each between two events, after `warmups` untimed calls; launch errors checked.
template <class F>
float median_ms(F&& launch, int warmups = 1, int reps = 5) {
  cudaEvent_t e0, e1;
  CK(cudaEventCreate(&e0));
  CK(cudaEventCreate(&e1));
  for (int i = 0; i < warmups; ++i) launch();
  CK(cudaGetLastError());
  CK(cudaDeviceSynchronize());
  std::vector<float> ms;
  for (int i = 0; i < reps; ++i) {
    CK(cudaEventRecord(e0));
    launch();
    CK(cudaEventRecord(e1));
    CK(cudaEventSynchronize(e1));
    float x = 0.f;
    CK(cudaEventElapsedTime(&x, e0, e1));
    ms.push_back(x);
  }
  CK(cudaGetLastError());
  CK(cudaEventDestroy(e0));
  CK(cudaEventDestroy(e1));
  std::sort(ms.begin(), ms.end());
  return ms[ms.size() / 2];
}
