// m3rt/error.h — the one exception type of the library.
//
// defines: Error, throw_arg_error, M3RT_CHECK_ARG.
//
// Library code throws; only the CLI decides to exit. Messages name the op, the argument, its value
// and what is supported: "reshape_and_cache: kv_cache.shape = [4, 2, 96, 256]: block size must be a
// power of two (16, 32, 64, 128, ...)".
#pragma once

#include <stdexcept>
#include <string>
#include <string_view>

namespace m3rt {

class Error : public std::runtime_error {
 public:
  explicit Error(const std::string& what) : std::runtime_error(what) {}
};

[[noreturn]] void throw_arg_error(std::string_view op, std::string_view arg, std::string_view value,
                                  std::string_view supported);

}  // namespace m3rt

// Throws m3rt::Error("<op>: <arg> = <value>: <supported>") when cond is false.
#define M3RT_CHECK_ARG(cond, op, arg, value, supported)              \
  do {                                                               \
    if (!(cond)) ::m3rt::throw_arg_error((op), (arg), (value), (supported)); \
  } while (0)
