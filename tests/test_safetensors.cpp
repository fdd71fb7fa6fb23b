// Safetensors reader and writer: round trips of every dtype m3rt reads, and each malformed-file
// rule raising its own error (never a crash). The fuzzer's corpus (tests/fuzz/corpus/safetensors)
// replays here too: every input either parses or raises m3rt::Error.
#include <gtest/gtest.h>

#include <cstdint>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <random>
#include <unistd.h>
#include <string>
#include <vector>

#include "m3rt/error.h"
#include "core/temp_dir.h"
#include "m3rt/safetensors.h"
#include "model/safetensors_parse.h"
#include "source_dir.h"

namespace {

using namespace m3rt;
namespace fs = std::filesystem;

using m3rt::detail::TempDir;

// A file made of a header length, header text and data bytes, as given.
std::string raw_file(uint64_t n, const std::string& header, const std::string& data) {
  std::string bytes(8, '\0');
  std::memcpy(bytes.data(), &n, 8);
  bytes += header;
  bytes += data;
  return bytes;
}
// The same with the header padded by spaces so that the data starts 8-byte aligned, as writers do.
std::string raw_file(std::string header, const std::string& data) {
  while (header.size() % 8 != 0) header.push_back(' ');
  return raw_file(header.size(), header, data);
}

// The error message parsing `bytes` raises ("" when it parses).
std::string parse_error(const std::string& bytes) {
  try {
    parse_safetensors(reinterpret_cast<const uint8_t*>(bytes.data()), bytes.size(), "t.safetensors");
  } catch (const Error& e) {
    return e.what();
  }
  return "";
}

#define EXPECT_PARSE_ERROR(bytes, fragment)                                          \
  do {                                                                               \
    const std::string msg_ = parse_error(bytes);                                     \
    EXPECT_NE(msg_.find(fragment), std::string::npos) << "message: '" << msg_ << "'"; \
    EXPECT_NE(msg_.find("t.safetensors"), std::string::npos) << msg_;                \
  } while (0)

TEST(Safetensors, RoundTripsEveryDtypeAndMetadata) {
  TempDir dir;
  std::mt19937 rng(7);
  struct Item {
    std::string name;
    DType dtype;
    std::vector<int64_t> shape;
  };
  const std::vector<Item> specs = {
      {"a.bf16", DType::kBFloat16, {3, 5}},      {"b.u8", DType::kUInt8, {7}},       // odd byte count
      {"c.f32", DType::kFloat32, {2, 3, 4}},      {"d.e4m3", DType::kFloat8E4M3, {4, 32}},
      {"e.i64", DType::kInt64, {3}},              {"f.i32.scalar", DType::kInt32, {}},
      {"g.f16.empty", DType::kFloat16, {0, 4}},   {"h.six.dims", DType::kBFloat16, {1, 2, 1, 2, 1, 3}},
  };
  std::vector<Tensor> tensors;
  std::vector<SafetensorsWriteItem> items;
  for (const Item& s : specs) {
    Tensor t = Tensor::empty(s.shape, s.dtype);
    auto* b = static_cast<uint8_t*>(t.data());
    for (int64_t i = 0; i < t.nbytes(); ++i) b[i] = uint8_t(rng());
    tensors.push_back(t);
    items.push_back({s.name, t});
  }
  const std::string path = dir.file("x.safetensors");
  write_safetensors(path, items, {{"format", "pt"}, {"who", "m3rt test"}});
  SafetensorsFile f(path);
  ASSERT_EQ(f.tensors().size(), specs.size());
  for (size_t i = 0; i < specs.size(); ++i) {
    const SafetensorsTensor& t = f.tensors()[i];  // header order = written order
    EXPECT_EQ(t.name, specs[i].name);
    EXPECT_EQ(t.dtype, specs[i].dtype);
    EXPECT_EQ(t.dtype_name, safetensors_dtype_name(specs[i].dtype));
    EXPECT_EQ(t.shape, specs[i].shape);
    const TensorView v = f.view(t);
    EXPECT_EQ(v.numel(), tensors[i].numel());
    EXPECT_EQ(reinterpret_cast<uintptr_t>(v.data) % uintptr_t(dtype_size(t.dtype)), 0u) << t.name;
    EXPECT_EQ(std::memcmp(v.data, tensors[i].data(), size_t(tensors[i].nbytes())), 0) << t.name;
    EXPECT_EQ(f.find(t.name), &t);
  }
  EXPECT_EQ(f.find("missing"), nullptr);
  ASSERT_EQ(f.metadata().size(), 2u);
  EXPECT_EQ(f.metadata()[1].first, "who");
  EXPECT_EQ(f.metadata()[1].second, "m3rt test");
}

TEST(Safetensors, WriterRefusesBadItems) {
  TempDir dir;
  Tensor t = Tensor::empty({2}, DType::kFloat32);
  EXPECT_THROW(write_safetensors(dir.file("a"), {{"x", t}, {"x", t}}), Error);
  EXPECT_THROW(write_safetensors(dir.file("b"), {{"", t}}), Error);
  Tensor m = Tensor::empty({4, 4}, DType::kFloat32);
  EXPECT_THROW(write_safetensors(dir.file("c"), {{"strided", m.view().narrowed(1, 0, 2)}}), Error);
  EXPECT_THROW(write_safetensors("/nonexistent-dir/x.safetensors", {{"x", t}}), Error);
}

TEST(Safetensors, FileErrorsNameThePath) {
  TempDir dir;
  try {
    SafetensorsFile f(dir.file("absent.safetensors"));
    FAIL() << "no error";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("absent.safetensors: cannot open"), std::string::npos) << e.what();
  }
  const std::string short_path = dir.file("short.safetensors");
  std::ofstream(short_path, std::ios::binary) << "abc";
  EXPECT_THROW(SafetensorsFile{short_path}, Error);
  const std::string empty_path = dir.file("empty.safetensors");
  std::ofstream(empty_path, std::ios::binary).flush();
  EXPECT_THROW(SafetensorsFile{empty_path}, Error);
}

const std::string kOk = R"({"w":{"dtype":"F32","shape":[2],"data_offsets":[0,8]}})";

TEST(Safetensors, EachMalformedFileHasItsOwnError) {
  const std::string data8(8, '\x01');
  ASSERT_EQ(parse_error(raw_file(kOk, data8)), "");
  EXPECT_PARSE_ERROR(std::string("\x05\0\0", 3), "shorter than the 8-byte header length");
  EXPECT_PARSE_ERROR(raw_file(1000, kOk, data8), "runs past the end of the file");
  EXPECT_PARSE_ERROR(raw_file(kOk.substr(0, 20), ""), "JSON error at byte");
  EXPECT_PARSE_ERROR(raw_file(R"({"w":{"dtype":"F32","shape":[2],"data_offsets":[0,8]},})", data8), "JSON error");
  EXPECT_PARSE_ERROR(raw_file(R"([1,2])", ""), "expected an object");
  EXPECT_PARSE_ERROR(raw_file(R"({"w":{"dtype":"F64","shape":[1],"data_offsets":[0,8]}})", data8),
                     "dtype 'F64' is not one m3rt reads");
  EXPECT_PARSE_ERROR(raw_file(R"({"w":{"dtype":"Q4_K","shape":[1],"data_offsets":[0,8]}})", data8),
                     "dtype 'Q4_K'");
  EXPECT_PARSE_ERROR(raw_file(R"({"w":{"dtype":"F32","shape":[3],"data_offsets":[0,8]}})", data8),
                     "hold 8 bytes, shape [3] of F32 needs 12");
  EXPECT_PARSE_ERROR(raw_file(R"({"w":{"dtype":"F32","shape":[4],"data_offsets":[0,16]}})", data8),
                     "run past the data region (8 bytes)");
  EXPECT_PARSE_ERROR(raw_file(R"({"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]},)"
                              R"("b":{"dtype":"F32","shape":[1],"data_offsets":[4,8]}})",
                              data8),
                     "overlap");
  EXPECT_PARSE_ERROR(raw_file(R"({"w":{"dtype":"F32","data_offsets":[0,8]}})", data8), "missing 'shape'");
  EXPECT_PARSE_ERROR(raw_file(R"({"w":{"shape":[2],"data_offsets":[0,8]}})", data8), "missing 'dtype'");
  EXPECT_PARSE_ERROR(raw_file(R"({"w":{"dtype":"F32","shape":[2]}})", data8), "missing 'data_offsets'");
  EXPECT_PARSE_ERROR(raw_file(R"({"w":{"dtype":"F32","shape":[2],"data_offsets":[0,8],"x":1}})", data8),
                     "unknown member 'x'");
  EXPECT_PARSE_ERROR(raw_file(R"({"w":{"dtype":"F32","shape":[-2],"data_offsets":[0,8]}})", data8),
                     "negative size");
  EXPECT_PARSE_ERROR(raw_file(R"({"w":{"dtype":"F32","shape":[1.5],"data_offsets":[0,8]}})", data8),
                     "shape entries must be integers");
  EXPECT_PARSE_ERROR(raw_file(R"({"w":{"dtype":"F32","shape":[2],"data_offsets":[8,0]}})", data8),
                     "not an ordered pair");
  EXPECT_PARSE_ERROR(raw_file(R"({"w":{"dtype":"F32","shape":[2],"data_offsets":[0]}})", data8),
                     "two integers");
  EXPECT_PARSE_ERROR(raw_file(R"({"w":{"dtype":"U8","shape":[1,1,1,1,1,1,1],"data_offsets":[0,1]}})", data8),
                     "at most 6");
  EXPECT_PARSE_ERROR(raw_file(R"({"w":{"dtype":"U8","shape":[4294967296,4294967296],"data_offsets":[0,1]}})",
                              data8),
                     "too large");
  EXPECT_PARSE_ERROR(raw_file(R"({"w":{"dtype":"BF16","shape":[1],"data_offsets":[1,3]}})", data8),
                     "not aligned");
  EXPECT_PARSE_ERROR(raw_file(R"({"":{"dtype":"F32","shape":[2],"data_offsets":[0,8]}})", data8), "empty name");
  EXPECT_PARSE_ERROR(raw_file(R"({"w":{"dtype":"F32","shape":[2],"data_offsets":[0,8]},)"
                              R"("w":{"dtype":"F32","shape":[2],"data_offsets":[0,8]}})",
                              data8),
                     "duplicate key");
  EXPECT_PARSE_ERROR(raw_file(R"({"__metadata__":{"k":1}})", ""), "__metadata__ 'k' is not a string");
  EXPECT_PARSE_ERROR(raw_file(R"({"w":7})", ""), "expected an object");
}

TEST(Safetensors, EmptyHeaderAndEmptyTensorsParse) {
  EXPECT_EQ(parse_error(raw_file("{}", "")), "");
  EXPECT_EQ(parse_error(raw_file("{}  ", "")), "");  // space padding, as writers add
  // Zero-size tensors may share an offset with anything.
  EXPECT_EQ(parse_error(raw_file(R"({"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]},)"
                                 R"("b":{"dtype":"F32","shape":[0],"data_offsets":[4,4]}})",
                                 std::string(8, '\0'))),
            "");
}

// Every input of the fuzzer's corpus parses or raises m3rt::Error (the fuzzer found these
// interesting; replaying them keeps the coverage in CI).
TEST(Safetensors, FuzzCorpusNeverCrashes) {
  const fs::path corpus = m3rt_source_dir() / "tests" / "fuzz" / "corpus" / "safetensors";
  ASSERT_TRUE(fs::is_directory(corpus)) << corpus;
  int files = 0;
  for (const auto& entry : fs::directory_iterator(corpus)) {
    std::ifstream in(entry.path(), std::ios::binary);
    const std::string bytes((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
    (void)parse_error(bytes);  // any exception other than m3rt::Error fails the test
    ++files;
  }
  EXPECT_GT(files, 10);
}

}  // namespace
