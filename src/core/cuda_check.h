// Internal: checked CUDA calls and launches. Only built when M3RT_WITH_CUDA is defined.
//
// defines: M3RT_CUDA_CHECK (throws m3rt::Error with file:line and CUDA's message),
//          M3RT_LAUNCH_CHECK (last error after a launch; with the sync-check switch on, also a
//          stream synchronize, skipped while the stream is capturing), DeviceGuard.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>
#include <cstdlib>
#include <string>

#include "core/scoped_env.h"
#include "m3rt/error.h"

namespace m3rt::detail {

[[noreturn]] void throw_cuda_error(cudaError_t err, const char* expr, const char* file, int line);
void check_launch(cudaStream_t stream, const char* kernel, const char* file, int line);

// Makes `device` current for the scope (ops run on the device their tensors live on).
class DeviceGuard {
 public:
  explicit DeviceGuard(int device);
  ~DeviceGuard();
  DeviceGuard(const DeviceGuard&) = delete;
  DeviceGuard& operator=(const DeviceGuard&) = delete;

 private:
  int prev_ = -1;
};

// What the launchers plan with on the current device, read once per device (the attribute
// queries are host time on every launch otherwise).
struct DeviceLimits {
  int sms = 0;          // multiprocessors
  int smem_per_sm = 0;  // shared memory an SM holds, bytes
  int smem_optin = 0;   // the most dynamic shared memory a block may opt in to, bytes
  int cc_major = 0;     // compute capability, major
  // DRAM bandwidth by the device's specification (memory clock x bus width, double data rate),
  // bytes a second; 0 where the device does not report it.
  double dram_bytes_per_s = 0;
  // Less DRAM bandwidth an SM than kLeanDramBytesPerSm by specification: the H100 SXM (25 GB/s an
  // SM), not the H200 (36). Launchers whose best shape follows the bytes an SM must move pick by it
  // (the MSA dql-1 bf16 split count, the context writer's e4m3 kernel); false when unknown.
  bool lean_dram_per_sm() const;
};
// Between the H100 SXM's 25e9 and the H200's 36e9 DRAM bytes a second an SM.
inline constexpr double kLeanDramBytesPerSm = 30e9;
inline bool DeviceLimits::lean_dram_per_sm() const {
  return dram_bytes_per_s > 0 && dram_bytes_per_s < kLeanDramBytesPerSm * double(sms);
}
DeviceLimits device_limits();

// Multiprocessors of the current device: kernels that walk their work in a loop launch one wave,
// multiprocessors x resident blocks per SM.
inline int multiprocessor_count() { return device_limits().sms; }

// The grid of a kernel whose blocks walk their work in a loop: x_blocks columns and, per column,
// enough blocks to fill the GPU once (`resident` blocks fit at a time over all columns), no more
// than there are `steps` of work, at most 65535.
inline dim3 one_wave_grid(int x_blocks, int64_t steps, int64_t resident) {
  const int64_t per_column = resident / x_blocks > 1 ? resident / x_blocks : 1;
  const int64_t y = steps < per_column ? steps : per_column;
  return dim3(unsigned(x_blocks), unsigned(y < 65535 ? y : 65535));
}

// Raises kernel `fn`'s dynamic shared-memory limit on the current device to `smem` bytes when no
// call before asked as much there (the limit is a per-device function attribute; calls may come
// from several host threads, one per GPU). `fn`: a __global__ function's address.
void raise_smem_limit(const void* fn, int smem);

// The launchers' environment switches (benchmarks and checks): `NAME=0` turns a path off; a
// numeric override replaces a tuned value when set and non-empty.
bool switched_off(const char* name);
int env_int(const char* name, int fallback);

// cudaOccupancyMaxActiveBlocksPerMultiprocessor for kernel `fn` on the current device, cached per
// (device, kernel, block size, dynamic shared memory): launchers that size one-wave grids ask on
// every call, and the query costs microseconds of host time. Raise `fn`'s shared-memory limit first.
int max_active_blocks_per_sm(const void* fn, int threads, int smem);

// A cudaLaunchKernelEx configuration with the launch attributes the Hopper kernels use: clusters of
// `cluster_z` blocks along the grid's z (when > 1) and programmatic dependent launch (`pdl`: the
// kernel may start while the previous one on the stream finishes; it waits for it with
// griddepcontrol.wait). `lc` points into this object, so it is neither copied nor moved.
struct LaunchEx {
  cudaLaunchConfig_t lc{};
  cudaLaunchAttribute attrs[2]{};
  LaunchEx(dim3 grid, dim3 block, size_t smem, cudaStream_t stream, unsigned cluster_z, bool pdl) {
    lc.gridDim = grid;
    lc.blockDim = block;
    lc.dynamicSmemBytes = smem;
    lc.stream = stream;
    unsigned n = 0;
    if (cluster_z > 1) {
      attrs[n].id = cudaLaunchAttributeClusterDimension;
      attrs[n].val.clusterDim.x = 1, attrs[n].val.clusterDim.y = 1, attrs[n].val.clusterDim.z = cluster_z;
      ++n;
    }
    if (pdl) {
      attrs[n].id = cudaLaunchAttributeProgrammaticStreamSerialization;
      attrs[n].val.programmaticStreamSerializationAllowed = 1;
      ++n;
    }
    lc.attrs = attrs;
    lc.numAttrs = n;
  }
  LaunchEx(const LaunchEx&) = delete;
  LaunchEx& operator=(const LaunchEx&) = delete;
};

}  // namespace m3rt::detail

#define M3RT_CUDA_CHECK(expr)                                                   \
  do {                                                                          \
    const cudaError_t m3rt_err_ = (expr);                                       \
    if (m3rt_err_ != cudaSuccess)                                               \
      ::m3rt::detail::throw_cuda_error(m3rt_err_, #expr, __FILE__, __LINE__);   \
  } while (0)

#define M3RT_LAUNCH_CHECK(stream, kernel) \
  ::m3rt::detail::check_launch((stream), (kernel), __FILE__, __LINE__)
