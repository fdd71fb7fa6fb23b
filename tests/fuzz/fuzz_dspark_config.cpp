// libFuzzer target: the DSpark config.json reader on arbitrary text. Every input must either parse
// or raise m3rt::Error; a config that parses must survive dspark_config_json and read back to the
// same values. Build and run: scripts/fuzz.sh dspark_config. Interesting inputs are kept in
// tests/fuzz/corpus/dspark_config, which tests/test_dspark_config.cpp replays in CI.
#include <cstddef>
#include <cstdint>
#include <string_view>

#include "m3rt/dspark_config.h"
#include "m3rt/error.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  m3rt::DsparkConfig c;
  try {
    c = m3rt::parse_dspark_config(std::string_view(reinterpret_cast<const char*>(data), size), "fuzz");
  } catch (const m3rt::Error&) {
    return 0;
  }
  const m3rt::DsparkConfig back = m3rt::parse_dspark_config(m3rt::dspark_config_json(c), "round trip");
  if (back.num_layers != c.num_layers || back.hidden_size != c.hidden_size || back.vocab_size != c.vocab_size ||
      back.target_layer_ids != c.target_layer_ids || back.rotary_dim != c.rotary_dim || back.quant != c.quant ||
      back.rms_norm_eps != c.rms_norm_eps || back.rope_theta != c.rope_theta || back.sliding_window != c.sliding_window)
    __builtin_trap();
  return 0;
}
