// m3rt/tensor.h — non-owning tensor views and owning host/device tensors.
//
// defines: Device, TensorView, Tensor, stream_t, cuda_available, cuda_device_count.
//
// A TensorView is (pointer, dtype, shape, strides in elements, device). It never owns memory; ops
// take views. A Tensor owns a host (malloc) or CUDA (cudaMalloc) allocation and hands out views.
// Device code never sees either: launchers unpack views into params structs of raw pointers.
#pragma once

#include <cstdint>
#include <initializer_list>
#include <memory>
#include <string>
#include <vector>

#include "m3rt/dtype.h"

// The same incomplete type CUDA's cudaStream_t points to, so callers can pass a cudaStream_t
// without this header pulling in CUDA's headers.
struct CUstream_st;

namespace m3rt {

using stream_t = CUstream_st*;  // == cudaStream_t; nullptr is the legacy default stream

struct Device {
  enum class Kind : uint8_t { kCPU, kCUDA };
  Kind kind = Kind::kCPU;
  int index = 0;

  static Device cpu() { return {Kind::kCPU, 0}; }
  static Device cuda(int index = 0) { return {Kind::kCUDA, index}; }
  bool is_cuda() const { return kind == Kind::kCUDA; }
  bool operator==(const Device&) const = default;
  std::string str() const;  // "cpu", "cuda:0"
};

constexpr int kMaxDims = 6;

struct TensorView {
  void* data = nullptr;
  DType dtype = DType::kFloat32;
  Device device{};
  int ndim = 0;
  int64_t shape[kMaxDims] = {};
  int64_t stride[kMaxDims] = {};  // in elements

  // A contiguous (row-major) view of `data`.
  static TensorView contiguous(void* data, DType dtype, std::initializer_list<int64_t> shape,
                               Device device = Device::cpu());
  static TensorView contiguous(void* data, DType dtype, const std::vector<int64_t>& shape,
                               Device device = Device::cpu());

  bool defined() const { return ndim > 0 || data != nullptr; }
  int64_t numel() const;
  int64_t size(int d) const { return shape[d < 0 ? d + ndim : d]; }
  bool is_contiguous() const;
  std::vector<int64_t> sizes() const { return {shape, shape + ndim}; }
  std::string shape_str() const;    // "[4, 2, 128, 256]"
  std::string stride_str() const;   // "(65536, 32768, 256, 1)"
  std::string describe() const;     // "bfloat16[4, 2, 128, 256] on cuda:0"
  template <class T>
  T* ptr() const {
    return static_cast<T*>(data);
  }
  // A view of the same memory with a new shape; requires a contiguous view.
  TensorView reshaped(std::initializer_list<int64_t> new_shape) const;
  // A view narrowed to [start, start+length) along dim.
  TensorView narrowed(int dim, int64_t start, int64_t length) const;
};

// An owning tensor. Memory is uninitialized unless filled.
class Tensor {
 public:
  Tensor() = default;
  static Tensor empty(const std::vector<int64_t>& shape, DType dtype, Device device = Device::cpu());
  const TensorView& view() const { return view_; }
  operator const TensorView&() const { return view_; }  // NOLINT: tensors pass where views go
  void* data() const { return view_.data; }
  template <class T>
  T* ptr() const {
    return static_cast<T*>(view_.data);
  }
  int64_t numel() const { return view_.numel(); }
  int64_t nbytes() const { return view_.numel() * dtype_size(view_.dtype); }
  Device device() const { return view_.device; }
  // Copy to another device (synchronous).
  Tensor to(Device device) const;
  // Copy from a tensor of the same dtype and numel (synchronous; contiguous both).
  void copy_from(const Tensor& src);
  // Fill every byte with `byte` (0xFF poisons bf16, fp16, fp32 and e4m3 with NaN).
  void fill_bytes(uint8_t byte);

 private:
  std::shared_ptr<void> storage_;
  TensorView view_;
};

bool cuda_available();  // built with CUDA and at least one device present
int cuda_device_count();  // 0 when built without CUDA or no device
bool built_with_cuda();
std::string cuda_device_name(int index);

}  // namespace m3rt
