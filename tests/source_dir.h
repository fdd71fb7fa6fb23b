// The source tree whose files (the fuzzers' corpora) a test reads: $M3RT_SOURCE_DIR when set, for
// binaries run away from where they were built (scripts/gpu-check.sh with SKIP_BUILD=1), else the
// tree they were built from (the M3RT_SOURCE_DIR compile definition).
#pragma once

#include <cstdlib>
#include <filesystem>

inline std::filesystem::path m3rt_source_dir() {
  const char* env = std::getenv("M3RT_SOURCE_DIR");
  return env && *env ? std::filesystem::path(env) : std::filesystem::path(M3RT_SOURCE_DIR);
}
