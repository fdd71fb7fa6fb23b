// Internal: the validation of a safetensors file's bytes, separate from the mapping so that tests
// and the fuzzer (tests/fuzz/fuzz_safetensors.cpp) run it on buffers.
#pragma once

#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "m3rt/safetensors.h"

namespace m3rt {

struct SafetensorsContents {
  uint64_t data_begin = 0;  // 8 + header length
  std::vector<SafetensorsTensor> tensors;
  std::vector<std::pair<std::string, std::string>> metadata;
};

// Validates `size` bytes at `base` as a safetensors file (rules: include/m3rt/safetensors.h);
// throws m3rt::Error naming `path`.
SafetensorsContents parse_safetensors(const uint8_t* base, uint64_t size, const std::string& path);

}  // namespace m3rt
