// Internal: a fresh directory under the system temp dir (tests, `m3rt check`, `m3rt draft`'s
// generated checkpoint), removed with everything in it when the object goes out of scope.
#pragma once

#include <unistd.h>

#include <filesystem>
#include <string>
#include <system_error>

namespace m3rt::detail {

class TempDir {
 public:
  TempDir() {
    static int counter = 0;
    std::string name = "m3rt_tmp_";
    name += std::to_string(::getpid());
    name += "_";
    name += std::to_string(counter++);
    path_ = std::filesystem::temp_directory_path() / name;
    std::filesystem::create_directories(path_);
  }
  ~TempDir() {
    std::error_code ec;
    std::filesystem::remove_all(path_, ec);
  }
  TempDir(const TempDir&) = delete;
  TempDir& operator=(const TempDir&) = delete;
  std::string str() const { return path_.string(); }
  // The path of `name` inside the directory.
  std::string file(const std::string& name) const { return (path_ / name).string(); }
  std::string operator/(const std::string& name) const { return file(name); }

 private:
  std::filesystem::path path_;
};

}  // namespace m3rt::detail
