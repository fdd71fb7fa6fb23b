// Internal: the last step of every op — run the CPU reference for CPU tensors, the CUDA launcher
// (on the tensors' device) for CUDA ones.
//
// defines: run_on_device, M3RT_LAUNCHER.
#pragma once

#include <type_traits>

#include "core/validate.h"

#ifdef M3RT_WITH_CUDA
#include "core/cuda_check.h"
// The launcher of an op, or nullptr in a build without CUDA (where launchers are not compiled).
#define M3RT_LAUNCHER(fn) (fn)
#else
#define M3RT_LAUNCHER(fn) (nullptr)
#endif

namespace m3rt::detail {

template <class Params>
void run_on_device(const char* op, Device device, const Params& p, void (*ref)(const Params&),
                   std::type_identity_t<void (*)(const Params&, CUstream_st*)> launch,
                   stream_t stream) {
  if (!device.is_cuda()) return ref(p);
  if (launch == nullptr) throw_arg_error(op, "device", device.str(), "m3rt was built without CUDA");
#ifdef M3RT_WITH_CUDA
  DeviceGuard guard(device.index);
  launch(p, stream);
#else
  (void)stream;
#endif
}

}  // namespace m3rt::detail
