// Safetensors reading (mmap + validation) and writing. Format and rules: include/m3rt/safetensors.h.
#include "m3rt/safetensors.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <bit>
#include <cerrno>
#include <cstring>
#include <fstream>
#include <limits>
#include <set>

#include "core/json.h"
#include "m3rt/error.h"
#include "model/safetensors_parse.h"

namespace m3rt {

static_assert(std::endian::native == std::endian::little, "safetensors lengths are little-endian");

namespace {

constexpr uint64_t kMaxHeaderBytes = uint64_t(100) << 20;  // the format's own limit (100 MB)

struct DtypeName {
  const char* name;
  DType dtype;
};
constexpr DtypeName kDtypes[] = {
    {"BF16", DType::kBFloat16}, {"F16", DType::kFloat16}, {"F32", DType::kFloat32}, {"I32", DType::kInt32},
    {"I64", DType::kInt64},     {"U8", DType::kUInt8},    {"F8_E4M3", DType::kFloat8E4M3},
};

std::string supported_dtypes() {
  std::string s;
  for (const DtypeName& d : kDtypes) s += std::string(s.empty() ? "" : ", ") + d.name;
  return s;
}

std::string range_str(uint64_t a, uint64_t b) {
  std::string s = "[";  // appended piece by piece: GCC 12 warns falsely on "[" + to_string (bug 105329)
  s += std::to_string(a);
  s += ", ";
  s += std::to_string(b);
  s += "]";
  return s;
}

std::string shape_str(const std::vector<int64_t>& shape) {
  std::string s = "[";
  for (size_t i = 0; i < shape.size(); ++i) s += (i ? ", " : "") + std::to_string(shape[i]);
  return s + "]";
}

}  // namespace

bool safetensors_dtype(std::string_view name, DType* dtype) {
  for (const DtypeName& d : kDtypes)
    if (name == d.name) {
      *dtype = d.dtype;
      return true;
    }
  return false;
}

const char* safetensors_dtype_name(DType dtype) {
  for (const DtypeName& d : kDtypes)
    if (d.dtype == dtype) return d.name;
  return "?";
}

SafetensorsContents parse_safetensors(const uint8_t* base, uint64_t size, const std::string& path) {
  auto fail = [&](const std::string& what) { throw Error("safetensors " + path + ": " + what); };
  SafetensorsContents out;
  if (size < 8 || base == nullptr)
    fail("file is " + std::to_string(size) + " bytes, shorter than the 8-byte header length");
  uint64_t n = 0;
  std::memcpy(&n, base, 8);
  if (n > size - 8)
    fail("header length " + std::to_string(n) + " runs past the end of the file (" + std::to_string(size) +
         " bytes)");
  if (n > kMaxHeaderBytes) fail("header length " + std::to_string(n) + " exceeds the format's 100 MB limit");
  out.data_begin = 8 + n;
  const uint64_t data_size = size - out.data_begin;
  const detail::Json header =
      detail::parse_json(std::string_view(reinterpret_cast<const char*>(base + 8), n), "safetensors " + path + " header");
  if (!header.is_object())
    fail(std::string("header is a JSON ") + detail::Json::kind_name(header.kind()) + ", expected an object");
  for (const auto& [name, entry] : header.as_object("header")) {
    const std::string where = "tensor '" + name + "'";
    if (name == "__metadata__") {
      if (!entry.is_object()) fail("__metadata__ is not an object");
      for (const auto& [k, v] : entry.as_object("__metadata__")) {
        if (!v.is_string()) fail("__metadata__ '" + k + "' is not a string");
        out.metadata.emplace_back(k, v.as_string(k));
      }
      continue;
    }
    if (name.empty()) fail("a tensor has an empty name");
    if (!entry.is_object()) fail(where + ": entry is a JSON " + detail::Json::kind_name(entry.kind()) + ", expected an object");
    for (const auto& [k, v] : entry.as_object(where)) {
      (void)v;
      if (k != "dtype" && k != "shape" && k != "data_offsets") fail(where + ": unknown member '" + k + "'");
    }
    const detail::Json* dt = entry.find("dtype");
    const detail::Json* sh = entry.find("shape");
    const detail::Json* off = entry.find("data_offsets");
    if (!dt) fail(where + ": missing 'dtype'");
    if (!sh) fail(where + ": missing 'shape'");
    if (!off) fail(where + ": missing 'data_offsets'");
    SafetensorsTensor t;
    t.name = name;
    if (!dt->is_string()) fail(where + ": dtype is not a string");
    t.dtype_name = dt->as_string(where);
    if (!safetensors_dtype(t.dtype_name, &t.dtype))
      fail(where + ": dtype '" + t.dtype_name + "' is not one m3rt reads (" + supported_dtypes() + ")");
    if (!sh->is_array()) fail(where + ": shape is not an array");
    const auto& dims = sh->as_array(where);
    if (dims.size() > size_t(kMaxDims))
      fail(where + ": shape has " + std::to_string(dims.size()) + " dims, at most " + std::to_string(kMaxDims) +
           " are supported");
    const uint64_t esize = uint64_t(dtype_size(t.dtype));
    uint64_t bytes = esize;
    for (const detail::Json& d : dims) {
      if (!d.is_number()) fail(where + ": shape entries must be integers");
      int64_t v = 0;
      try {
        v = d.as_int(where + " shape");
      } catch (const Error&) {
        fail(where + ": shape entries must be integers");
      }
      if (v < 0) fail(where + ": shape " + sh->dump() + " has a negative size");
      t.shape.push_back(v);
      if (v != 0 && bytes > std::numeric_limits<uint64_t>::max() / uint64_t(v))
        fail(where + ": shape " + sh->dump() + " is too large");
      bytes *= uint64_t(v);
    }
    if (!off->is_array() || off->as_array(where).size() != 2)
      fail(where + ": data_offsets must be an array of two integers");
    int64_t b = 0, e = 0;
    try {
      b = off->as_array(where)[0].as_int(where);
      e = off->as_array(where)[1].as_int(where);
    } catch (const Error&) {
      fail(where + ": data_offsets must be an array of two integers");
    }
    if (b < 0 || e < b) fail(where + ": data_offsets " + off->dump() + " are not an ordered pair of offsets");
    t.begin = uint64_t(b);
    t.end = uint64_t(e);
    if (t.end > data_size)
      fail(where + ": data_offsets " + range_str(t.begin, t.end) + " run past the data region (" +
           std::to_string(data_size) + " bytes)");
    if (t.end - t.begin != bytes)
      fail(where + ": data_offsets " + range_str(t.begin, t.end) + " hold " + std::to_string(t.end - t.begin) +
           " bytes, shape " + shape_str(t.shape) + " of " + t.dtype_name + " needs " + std::to_string(bytes));
    if ((out.data_begin + t.begin) % esize != 0)
      fail(where + ": data at file offset " + std::to_string(out.data_begin + t.begin) + " is not aligned to its " +
           std::to_string(esize) + "-byte elements");
    out.tensors.push_back(std::move(t));
  }
  // No two non-empty ranges overlap.
  std::vector<const SafetensorsTensor*> by_begin;
  for (const SafetensorsTensor& t : out.tensors)
    if (t.end > t.begin) by_begin.push_back(&t);
  std::sort(by_begin.begin(), by_begin.end(),
            [](const SafetensorsTensor* a, const SafetensorsTensor* b) { return a->begin < b->begin; });
  for (size_t i = 1; i < by_begin.size(); ++i)
    if (by_begin[i]->begin < by_begin[i - 1]->end)
      fail("tensors '" + by_begin[i - 1]->name + "' " + range_str(by_begin[i - 1]->begin, by_begin[i - 1]->end) +
           " and '" + by_begin[i]->name + "' " + range_str(by_begin[i]->begin, by_begin[i]->end) + " overlap");
  return out;
}

SafetensorsFile::SafetensorsFile(const std::string& path) : path_(path) {
  auto fail = [&](const std::string& what) { throw Error("safetensors " + path + ": " + what); };
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) fail(std::string("cannot open: ") + std::strerror(errno));
  struct stat st{};
  if (::fstat(fd, &st) != 0) {
    const int e = errno;
    ::close(fd);
    fail(std::string("cannot stat: ") + std::strerror(e));
  }
  if (!S_ISREG(st.st_mode)) {
    ::close(fd);
    fail("not a regular file");
  }
  size_ = uint64_t(st.st_size);
  if (size_ < 8) {  // nothing to map; the parser gives the error
    ::close(fd);
    parse_safetensors(nullptr, size_, path);
  }
  void* map = ::mmap(nullptr, size_, PROT_READ, MAP_PRIVATE, fd, 0);
  const int map_errno = errno;
  ::close(fd);
  if (map == MAP_FAILED) fail(std::string("cannot map: ") + std::strerror(map_errno));
  base_ = static_cast<const uint8_t*>(map);
  try {
    SafetensorsContents c = parse_safetensors(base_, size_, path);
    data_begin_ = c.data_begin;
    tensors_ = std::move(c.tensors);
    metadata_ = std::move(c.metadata);
  } catch (...) {
    ::munmap(const_cast<uint8_t*>(base_), size_);
    base_ = nullptr;
    throw;
  }
}

SafetensorsFile::~SafetensorsFile() {
  if (base_) ::munmap(const_cast<uint8_t*>(base_), size_);
}

const SafetensorsTensor* SafetensorsFile::find(std::string_view name) const {
  for (const SafetensorsTensor& t : tensors_)
    if (t.name == name) return &t;
  return nullptr;
}

TensorView SafetensorsFile::view(const SafetensorsTensor& t) const {
  return TensorView::contiguous(const_cast<uint8_t*>(base_ + data_begin_ + t.begin), t.dtype, t.shape);
}

void write_safetensors(const std::string& path, const std::vector<SafetensorsWriteItem>& items,
                       const std::vector<std::pair<std::string, std::string>>& metadata) {
  auto fail = [&](const std::string& what) { throw Error("write_safetensors " + path + ": " + what); };
  std::set<std::string> names;
  for (const SafetensorsWriteItem& it : items) {
    if (it.name.empty() || it.name == "__metadata__") fail("invalid tensor name '" + it.name + "'");
    if (!names.insert(it.name).second) fail("duplicate tensor name '" + it.name + "'");
    if (it.tensor.device.is_cuda()) fail("tensor '" + it.name + "' is on " + it.tensor.device.str() + "; write CPU tensors");
    if (!it.tensor.is_contiguous()) fail("tensor '" + it.name + "' is not contiguous");
  }
  // Data in order of decreasing element size, so every tensor starts aligned with no gaps.
  std::vector<size_t> order(items.size());
  for (size_t i = 0; i < order.size(); ++i) order[i] = i;
  std::stable_sort(order.begin(), order.end(), [&](size_t a, size_t b) {
    return dtype_size(items[a].tensor.dtype) > dtype_size(items[b].tensor.dtype);
  });
  std::vector<uint64_t> begin(items.size());
  uint64_t offset = 0;
  for (size_t i : order) {
    begin[i] = offset;
    offset += uint64_t(items[i].tensor.numel() * dtype_size(items[i].tensor.dtype));
  }
  std::vector<std::pair<std::string, detail::Json>> members;
  if (!metadata.empty()) {
    std::vector<std::pair<std::string, detail::Json>> meta;
    for (const auto& [k, v] : metadata) meta.emplace_back(k, detail::Json::string(v));
    members.emplace_back("__metadata__", detail::Json::object(std::move(meta)));
  }
  for (size_t i = 0; i < items.size(); ++i) {
    const TensorView& t = items[i].tensor;
    std::vector<detail::Json> shape;
    for (int d = 0; d < t.ndim; ++d) shape.push_back(detail::Json::integer(t.shape[d]));
    const uint64_t bytes = uint64_t(t.numel() * dtype_size(t.dtype));
    using detail::Json;
    Json offsets = Json::array({Json::integer(int64_t(begin[i])), Json::integer(int64_t(begin[i] + bytes))});
    members.emplace_back(items[i].name, Json::object({{"dtype", Json::string(safetensors_dtype_name(t.dtype))},
                                                      {"shape", Json::array(std::move(shape))},
                                                      {"data_offsets", std::move(offsets)}}));
  }
  std::string header = detail::Json::object(std::move(members)).dump();
  while ((8 + header.size()) % 8 != 0) header.push_back(' ');
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  if (!out) fail(std::string("cannot create: ") + std::strerror(errno));
  const uint64_t n = header.size();
  out.write(reinterpret_cast<const char*>(&n), 8);
  out.write(header.data(), std::streamsize(header.size()));
  for (size_t i : order) {
    const TensorView& t = items[i].tensor;
    out.write(static_cast<const char*>(t.data), std::streamsize(t.numel() * dtype_size(t.dtype)));
  }
  out.close();
  if (!out) fail("write failed");
}

}  // namespace m3rt
