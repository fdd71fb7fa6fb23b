// Tensor views, owning tensors, the device queries and the sync-check switch.
#include "m3rt/tensor.h"

#include <algorithm>
#include <atomic>
#include <cstdlib>
#include <cstring>
#include <mutex>
#include <sstream>
#include <vector>

#include "m3rt/error.h"
#include "m3rt/ops.h"

#ifdef M3RT_WITH_CUDA
#include "core/cuda_check.h"
#endif

namespace m3rt {

std::string Device::str() const {
  return kind == Kind::kCPU ? std::string("cpu") : "cuda:" + std::to_string(index);
}

namespace {
template <class It>
TensorView make_contiguous(void* data, DType dtype, It begin, It end, Device device) {
  TensorView v;
  v.data = data;
  v.dtype = dtype;
  v.device = device;
  v.ndim = int(end - begin);
  if (v.ndim > kMaxDims) {
    throw_arg_error("TensorView", "ndim", std::to_string(v.ndim),
                    "at most " + std::to_string(kMaxDims) + " dims are supported");
  }
  int i = 0;
  for (It it = begin; it != end; ++it) v.shape[i++] = *it;
  int64_t s = 1;
  for (int d = v.ndim - 1; d >= 0; --d) {
    v.stride[d] = s;
    s *= v.shape[d];
  }
  return v;
}

std::string join(const int64_t* a, int n, char open, char close) {
  std::ostringstream os;
  os << open;
  for (int i = 0; i < n; ++i) os << (i ? ", " : "") << a[i];
  os << close;
  return os.str();
}
}  // namespace

TensorView TensorView::contiguous(void* data, DType dtype, std::initializer_list<int64_t> shape,
                                  Device device) {
  return make_contiguous(data, dtype, shape.begin(), shape.end(), device);
}
TensorView TensorView::contiguous(void* data, DType dtype, const std::vector<int64_t>& shape,
                                  Device device) {
  return make_contiguous(data, dtype, shape.begin(), shape.end(), device);
}

int64_t TensorView::numel() const {
  int64_t n = 1;
  for (int d = 0; d < ndim; ++d) n *= shape[d];
  return n;
}

bool TensorView::is_contiguous() const {
  int64_t s = 1;
  for (int d = ndim - 1; d >= 0; --d) {
    if (shape[d] != 1 && stride[d] != s) return false;
    s *= shape[d];
  }
  return true;
}

std::string TensorView::shape_str() const { return join(shape, ndim, '[', ']'); }
std::string TensorView::stride_str() const { return join(stride, ndim, '(', ')'); }
std::string TensorView::describe() const {
  if (!defined()) return "(none)";
  return std::string(dtype_name(dtype)) + shape_str() + " on " + device.str();
}

TensorView TensorView::reshaped(std::initializer_list<int64_t> new_shape) const {
  if (!is_contiguous()) {
    throw_arg_error("TensorView::reshaped", "strides", stride_str(), "needs a contiguous view");
  }
  TensorView v = contiguous(data, dtype, new_shape, device);
  if (v.numel() != numel()) {
    throw_arg_error("TensorView::reshaped", "shape", v.shape_str(),
                    "must hold " + std::to_string(numel()) + " elements like " + shape_str());
  }
  return v;
}

TensorView TensorView::narrowed(int dim, int64_t start, int64_t length) const {
  if (dim < 0) dim += ndim;
  if (dim < 0 || dim >= ndim || start < 0 || length < 0 || start + length > shape[dim]) {
    throw_arg_error("TensorView::narrowed", "range",
                    "dim " + std::to_string(dim) + " [" + std::to_string(start) + ", " +
                        std::to_string(start + length) + ")",
                    "must lie inside " + shape_str());
  }
  TensorView v = *this;
  v.data = static_cast<char*>(data) + start * stride[dim] * dtype_size(dtype);
  v.shape[dim] = length;
  return v;
}

Tensor Tensor::empty(const std::vector<int64_t>& shape, DType dtype, Device device) {
  Tensor t;
  t.view_ = TensorView::contiguous(nullptr, dtype, shape, device);
  const int64_t bytes = std::max<int64_t>(t.view_.numel() * dtype_size(dtype), 1);
  if (device.is_cuda()) {
#ifdef M3RT_WITH_CUDA
    detail::DeviceGuard guard(device.index);
    void* p = nullptr;
    M3RT_CUDA_CHECK(cudaMalloc(&p, size_t(bytes)));
    t.storage_ = std::shared_ptr<void>(p, [](void* q) { cudaFree(q); });
#else
    throw_arg_error("Tensor::empty", "device", device.str(), "m3rt was built without CUDA");
#endif
  } else {
    // 256-byte alignment like cudaMalloc, so host views meet the same alignment rules.
    void* p = std::aligned_alloc(256, size_t((bytes + 255) / 256 * 256));
    if (!p) throw Error("Tensor::empty: out of host memory for " + std::to_string(bytes) + " bytes");
    t.storage_ = std::shared_ptr<void>(p, [](void* q) { std::free(q); });
  }
  t.view_.data = t.storage_.get();
  return t;
}

void Tensor::copy_from(const Tensor& src) {
  if (src.view_.dtype != view_.dtype || src.numel() != numel()) {
    throw_arg_error("Tensor::copy_from", "src", src.view_.describe(),
                    "must have the dtype and element count of " + view_.describe());
  }
  const size_t bytes = size_t(nbytes());
  if (!src.device().is_cuda() && !device().is_cuda()) {
    std::memcpy(data(), src.data(), bytes);
    return;
  }
#ifdef M3RT_WITH_CUDA
  M3RT_CUDA_CHECK(cudaMemcpy(data(), src.data(), bytes, cudaMemcpyDefault));
#else
  throw Error("Tensor::copy_from: m3rt was built without CUDA");
#endif
}

Tensor Tensor::to(Device device) const {
  Tensor t = empty(view_.sizes(), view_.dtype, device);
  t.copy_from(*this);
  return t;
}

void Tensor::fill_bytes(uint8_t byte) {
  if (device().is_cuda()) {
#ifdef M3RT_WITH_CUDA
    M3RT_CUDA_CHECK(cudaMemset(data(), byte, size_t(nbytes())));
#else
    throw Error("Tensor::fill_bytes: m3rt was built without CUDA");
#endif
  } else {
    std::memset(data(), byte, size_t(nbytes()));
  }
}

bool built_with_cuda() {
#ifdef M3RT_WITH_CUDA
  return true;
#else
  return false;
#endif
}

int cuda_device_count() {
#ifdef M3RT_WITH_CUDA
  int n = 0;
  if (cudaGetDeviceCount(&n) != cudaSuccess) {
    (void)cudaGetLastError();  // no driver / no device: clear the sticky-free error and say 0
    return 0;
  }
  return n;
#else
  return 0;
#endif
}

bool cuda_available() { return cuda_device_count() > 0; }

std::string cuda_device_name(int index) {
#ifdef M3RT_WITH_CUDA
  cudaDeviceProp prop{};
  M3RT_CUDA_CHECK(cudaGetDeviceProperties(&prop, index));
  return prop.name;
#else
  (void)index;
  return "";
#endif
}

namespace {
std::atomic<int> g_sync_check{-1};  // -1: not yet read from the environment
}

void set_sync_check(bool on) { g_sync_check = on ? 1 : 0; }
bool sync_check() {
  int v = g_sync_check.load();
  if (v < 0) {
    const char* env = std::getenv("M3RT_SYNC_CHECK");
    v = (env && env[0] && env[0] != '0') ? 1 : 0;
    g_sync_check = v;
  }
  return v == 1;
}

#ifdef M3RT_WITH_CUDA
namespace detail {

void throw_cuda_error(cudaError_t err, const char* expr, const char* file, int line) {
  throw Error(std::string("CUDA error ") + cudaGetErrorName(err) + " (" + cudaGetErrorString(err) +
              ") in " + expr + " at " + file + ":" + std::to_string(line));
}

void check_launch(cudaStream_t stream, const char* kernel, const char* file, int line) {
  const cudaError_t err = cudaGetLastError();
  if (err != cudaSuccess) throw_cuda_error(err, kernel, file, line);
  if (sync_check()) {
    cudaStreamCaptureStatus status = cudaStreamCaptureStatusNone;
    M3RT_CUDA_CHECK(cudaStreamIsCapturing(stream, &status));
    if (status == cudaStreamCaptureStatusNone) {
      const cudaError_t serr = cudaStreamSynchronize(stream);
      if (serr != cudaSuccess) throw_cuda_error(serr, kernel, file, line);
    }
  }
}

DeviceLimits device_limits() {
  auto query = [](int dev) {
    DeviceLimits l;
    M3RT_CUDA_CHECK(cudaDeviceGetAttribute(&l.sms, cudaDevAttrMultiProcessorCount, dev));
    M3RT_CUDA_CHECK(cudaDeviceGetAttribute(&l.smem_per_sm, cudaDevAttrMaxSharedMemoryPerMultiprocessor, dev));
    M3RT_CUDA_CHECK(cudaDeviceGetAttribute(&l.smem_optin, cudaDevAttrMaxSharedMemoryPerBlockOptin, dev));
    M3RT_CUDA_CHECK(cudaDeviceGetAttribute(&l.cc_major, cudaDevAttrComputeCapabilityMajor, dev));
    int mem_khz = 0, bus_bits = 0;  // a device that reports neither keeps 0 (rules then keep their defaults)
    if (cudaDeviceGetAttribute(&mem_khz, cudaDevAttrMemoryClockRate, dev) == cudaSuccess &&
        cudaDeviceGetAttribute(&bus_bits, cudaDevAttrGlobalMemoryBusWidth, dev) == cudaSuccess)
      l.dram_bytes_per_s = 2.0 * mem_khz * 1e3 * bus_bits / 8.0;
    (void)cudaGetLastError();
    return l;
  };
  constexpr int kCached = 64;  // devices beyond it are queried on every call
  static std::once_flag once[kCached];
  static DeviceLimits cache[kCached];
  int dev = 0;
  M3RT_CUDA_CHECK(cudaGetDevice(&dev));
  if (dev >= kCached) return query(dev);
  std::call_once(once[dev], [&] { cache[dev] = query(dev); });  // a throw leaves it to the next call
  return cache[dev];
}

void raise_smem_limit(const void* fn, int smem) {
  int dev = 0;
  M3RT_CUDA_CHECK(cudaGetDevice(&dev));
  struct Raised {
    int dev;
    const void* fn;
    int smem;
  };
  static std::mutex mu;
  static std::vector<Raised> raised;
  const std::lock_guard<std::mutex> lock(mu);
  auto it = std::find_if(raised.begin(), raised.end(), [&](const Raised& r) { return r.dev == dev && r.fn == fn; });
  if (it != raised.end() && it->smem >= smem) return;
  M3RT_CUDA_CHECK(cudaFuncSetAttribute(fn, cudaFuncAttributeMaxDynamicSharedMemorySize, smem));
  if (it == raised.end())
    raised.push_back({dev, fn, smem});
  else
    it->smem = smem;
}

bool switched_off(const char* name) {
  const char* env = std::getenv(name);
  return env && std::string(env) == "0";
}
int env_int(const char* name, int fallback) {
  const char* env = std::getenv(name);
  return env && *env ? std::atoi(env) : fallback;
}

int max_active_blocks_per_sm(const void* fn, int threads, int smem) {
  int dev = 0;
  M3RT_CUDA_CHECK(cudaGetDevice(&dev));
  struct Known {
    int dev;
    const void* fn;
    int threads, smem, blocks;
  };
  static std::mutex mu;
  static std::vector<Known> known;
  const std::lock_guard<std::mutex> lock(mu);
  for (const Known& k : known)
    if (k.dev == dev && k.fn == fn && k.threads == threads && k.smem == smem) return k.blocks;
  int blocks = 0;
  M3RT_CUDA_CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&blocks, fn, threads, size_t(smem)));
  known.push_back({dev, fn, threads, smem, blocks});
  return blocks;
}

DeviceGuard::DeviceGuard(int device) {
  int cur = 0;
  M3RT_CUDA_CHECK(cudaGetDevice(&cur));
  if (cur != device) {
    M3RT_CUDA_CHECK(cudaSetDevice(device));
    prev_ = cur;
  }
}
DeviceGuard::~DeviceGuard() {
  if (prev_ >= 0) cudaSetDevice(prev_);
}

}  // namespace detail
#endif

}  // namespace m3rt
