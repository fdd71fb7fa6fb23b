// Internal: ScopedEnv, an environment variable set for a scope (no CUDA; the launchers' switches
// read the environment at each launch, core/cuda_check.h).
#pragma once

#include <cstdlib>

namespace m3rt::detail {

// Sets environment variable `name` to `value` for a scope (benchmarks and tests switching a
// launcher's path); unset when the scope ends, however it ends. value nullptr: no-op.
class ScopedEnv {
 public:
  ScopedEnv(const char* name, const char* value) : name_(value ? name : nullptr) {
    if (name_) setenv(name_, value, 1);
  }
  ~ScopedEnv() {
    if (name_) unsetenv(name_);
  }
  ScopedEnv(const ScopedEnv&) = delete;
  ScopedEnv& operator=(const ScopedEnv&) = delete;

 private:
  const char* name_;
};

}  // namespace m3rt::detail
