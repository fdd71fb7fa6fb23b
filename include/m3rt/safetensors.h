// m3rt/safetensors.h — reading and writing checkpoint shards in the safetensors format.
//
// defines: SafetensorsTensor, SafetensorsFile, SafetensorsWriteItem, write_safetensors.
//
// Layout of a file: an 8-byte little-endian header length N, N bytes of a JSON object, then the
// data region. The header maps each tensor name to {"dtype", "shape", "data_offsets": [begin, end]}
// (byte offsets into the data region); an optional "__metadata__" member maps strings to strings.
//
// SafetensorsFile memory-maps the file read-only and validates all of it before anything is used:
// the length prefix against the file size, the header as strict JSON (src/core/json.h), each entry's
// members, dtype name, shape (at most 6 dims, no negative or overflowing sizes), that its byte range
// holds exactly shape x dtype size bytes, lies inside the data region and is aligned to its element
// size, and that no two ranges overlap. Every problem is an m3rt::Error that names the file, the
// tensor and the rule ("safetensors tiny/draft.safetensors: tensor 'fc.weight': data_offsets
// [0, 96] hold 96 bytes, shape [4, 8] of BF16 needs 64"). Bytes between or after tensors are
// allowed; tensors may appear in any order.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "m3rt/tensor.h"

namespace m3rt {

struct SafetensorsTensor {
  std::string name;
  DType dtype;
  std::string dtype_name;       // as written in the file: "BF16", "F32", "F8_E4M3", "U8", ...
  std::vector<int64_t> shape;   // empty: a scalar
  uint64_t begin = 0, end = 0;  // byte range in the data region
};

class SafetensorsFile {
 public:
  // Maps and validates `path`; throws m3rt::Error on any problem (the file stays unmapped).
  explicit SafetensorsFile(const std::string& path);
  ~SafetensorsFile();
  SafetensorsFile(const SafetensorsFile&) = delete;
  SafetensorsFile& operator=(const SafetensorsFile&) = delete;

  const std::string& path() const { return path_; }
  // Tensors in header order.
  const std::vector<SafetensorsTensor>& tensors() const { return tensors_; }
  const std::vector<std::pair<std::string, std::string>>& metadata() const { return metadata_; }
  // The tensor named `name`, or nullptr.
  const SafetensorsTensor* find(std::string_view name) const;
  // A contiguous CPU view of the tensor's bytes in the mapping. READ-ONLY: the pages are mapped
  // without write permission. Valid while this object lives.
  TensorView view(const SafetensorsTensor& t) const;
  uint64_t file_size() const { return size_; }

 private:
  std::string path_;
  const uint8_t* base_ = nullptr;  // the mapping (nullptr for an empty file)
  uint64_t size_ = 0;
  uint64_t data_begin_ = 0;        // 8 + header length
  std::vector<SafetensorsTensor> tensors_;
  std::vector<std::pair<std::string, std::string>> metadata_;
};

// Safetensors dtype names m3rt reads and writes, and the mapping to DType: BF16, F16, F32, I32, I64,
// U8, F8_E4M3. Returns false for any other name.
bool safetensors_dtype(std::string_view name, DType* dtype);
const char* safetensors_dtype_name(DType dtype);

struct SafetensorsWriteItem {
  std::string name;
  TensorView tensor;  // a contiguous CPU tensor
};

// Writes a file the reader accepts: the header (entries in the given order, data laid out in that
// order, the header padded with spaces so that the data region starts 8-byte aligned), then the
// bytes. Throws m3rt::Error on a duplicate or empty name, a non-contiguous or non-CPU tensor, or an
// I/O failure.
void write_safetensors(const std::string& path, const std::vector<SafetensorsWriteItem>& items,
                       const std::vector<std::pair<std::string, std::string>>& metadata = {});

}  // namespace m3rt
