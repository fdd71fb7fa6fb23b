// libFuzzer target: the safetensors validation (and the JSON parser under it) on arbitrary bytes.
// Every input must either parse or raise m3rt::Error; anything else (a crash, a sanitizer report,
// another exception) is a bug. Build and run: scripts/fuzz.sh. Interesting inputs are kept in
// tests/fuzz/corpus/safetensors, which tests/test_safetensors.cpp replays in CI.
#include <cstddef>
#include <cstdint>

#include "m3rt/error.h"
#include "model/safetensors_parse.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  try {
    const m3rt::SafetensorsContents c = m3rt::parse_safetensors(data, size, "fuzz");
    // A file that parses must keep its promises: every range inside the buffer.
    for (const m3rt::SafetensorsTensor& t : c.tensors)
      if (t.end < t.begin || c.data_begin + t.end > size) __builtin_trap();
  } catch (const m3rt::Error&) {
  }
  return 0;
}
