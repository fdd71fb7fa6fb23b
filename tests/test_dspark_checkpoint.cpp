// DSpark checkpoints: the tiny generator's output round-trips through the loader (bf16 and MXFP8),
// the layout matches the spec's real M3.1 tensor count, and each broken checkpoint (missing,
// unknown, duplicated, mis-shaped or mis-typed tensor; missing target tensor, config or shard)
// raises its own error naming the tensor.
#include <gtest/gtest.h>
#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <string>
#include <vector>

#include "m3rt/dspark_checkpoint.h"
#include "m3rt/error.h"
#include "core/temp_dir.h"

namespace {

using namespace m3rt;
namespace fs = std::filesystem;

using m3rt::detail::TempDir;

std::string error_of(const std::function<void()>& f) {
  try {
    f();
  } catch (const Error& e) {
    return e.what();
  }
  return "";
}

#define EXPECT_ERROR_HAS(stmt, fragment)                                           \
  do {                                                                             \
    const std::string msg_ = error_of([&] { stmt; });                               \
    EXPECT_NE(msg_.find(fragment), std::string::npos) << "message: '" << msg_ << "'"; \
  } while (0)

std::string target_file(const TempDir& d) { return d / "target/model.safetensors"; }

TEST(DsparkCheckpoint, RealM31LayoutHas97Tensors) {
  const DsparkConfig c = m31_dspark_config(DsparkQuant::kMxfp8);
  const std::vector<DsparkTensorSpec> l = dspark_draft_layout(c);
  EXPECT_EQ(l.size(), 97u);  // dspark.md §1: the released checkpoint's tensor count
  auto find = [&](const std::string& n) -> const DsparkTensorSpec* {
    for (const auto& s : l)
      if (s.name == n) return &s;
    return nullptr;
  };
  const auto* fc = find("language_model.model.dspark.fc.weight");
  ASSERT_NE(fc, nullptr);
  EXPECT_EQ(fc->shape, (std::vector<int64_t>{6144, 30720}));
  const auto* conf = find("language_model.model.dspark.confidence_head.proj.weight");
  ASSERT_NE(conf, nullptr);
  EXPECT_EQ(conf->shape, (std::vector<int64_t>{1, 6400}));
  const auto* q = find("language_model.model.dspark.layers.4.decoder_layer.self_attn.q_proj.weight");
  ASSERT_NE(q, nullptr);
  EXPECT_EQ(q->dtype, DType::kFloat8E4M3);
  EXPECT_EQ(q->shape, (std::vector<int64_t>{8192, 6144}));
  const auto* qs = find("language_model.model.dspark.layers.4.decoder_layer.self_attn.q_proj.weight_scale_inv");
  ASSERT_NE(qs, nullptr);
  EXPECT_EQ(qs->shape, (std::vector<int64_t>{8192, 192}));
  EXPECT_EQ(dspark_target_layout(c)[0].shape, (std::vector<int64_t>{200064, 6144}));
}

class TinyCheckpoint : public ::testing::TestWithParam<DsparkQuant> {};

TEST_P(TinyCheckpoint, RoundTripsThroughTheLoader) {
  TempDir d;
  const DsparkConfig c = tiny_dspark_config(GetParam());
  make_tiny_dspark_checkpoint(d.str(), c, {GetParam(), 5});
  DsparkCheckpoint ck(d.str(), {target_file(d)});
  EXPECT_EQ(ck.config().num_layers, c.num_layers);
  EXPECT_EQ(ck.config().quant, c.quant);
  for (const DsparkTensorSpec& s : dspark_draft_layout(c)) {
    const TensorView v = ck.tensor(s.name);
    EXPECT_EQ(v.dtype, s.dtype) << s.name;
    EXPECT_EQ(v.sizes(), s.shape) << s.name;
  }
  for (const DsparkTensorSpec& s : dspark_target_layout(c)) EXPECT_EQ(ck.tensor(s.name).sizes(), s.shape);
  EXPECT_EQ(ck.dspark("fc.weight").data, ck.tensor("language_model.model.dspark.fc.weight").data);
  EXPECT_THROW(ck.tensor("nope"), Error);
  // Same seed, same bytes: the generator is deterministic.
  TempDir d2;
  make_tiny_dspark_checkpoint(d2.str(), c, {GetParam(), 5});
  DsparkCheckpoint ck2(d2.str(), {target_file(d2)});
  for (const DsparkTensorSpec& s : dspark_draft_layout(c)) {
    const TensorView a = ck.tensor(s.name), b = ck2.tensor(s.name);
    EXPECT_EQ(std::memcmp(a.data, b.data, size_t(a.numel() * dtype_size(a.dtype))), 0) << s.name;
  }
  if (GetParam() == DsparkQuant::kMxfp8) {
    // Dequantized weights stay within the generator's range sqrt(3 / fan_in) (plus rounding).
    const TensorView w = ck.dspark("layers.1.decoder_layer.mlp.down_proj.weight");
    const TensorView s = ck.dspark("layers.1.decoder_layer.mlp.down_proj.weight_scale_inv");
    const int64_t cols = w.shape[1];
    const float bound = std::sqrt(3.f / float(cols)) * 1.07f;
    float mx = 0.f;
    for (int64_t i = 0; i < w.numel(); ++i) {
      const float scale = std::ldexp(1.f, int(s.ptr<uint8_t>()[(i / cols) * (cols / 32) + (i % cols) / 32]) - 127);
      const float v = e4m3_to_float(w.ptr<uint8_t>()[i]) * scale;
      ASSERT_TRUE(std::isfinite(v));
      mx = std::max(mx, std::fabs(v));
    }
    EXPECT_LE(mx, bound);
    EXPECT_GT(mx, bound * 0.5f);
  }
}

INSTANTIATE_TEST_SUITE_P(Quant, TinyCheckpoint, ::testing::Values(DsparkQuant::kBFloat16, DsparkQuant::kMxfp8),
                         [](const auto& info) { return info.param == DsparkQuant::kMxfp8 ? "mxfp8" : "bf16"; });

// Rewrites the draft shard of `d` through `edit` (items of the original shard, viewed in place).
void rewrite_draft(const TempDir& d, const std::function<void(std::vector<SafetensorsWriteItem>&)>& edit,
                   const std::string& out_name = "draft.safetensors") {
  const std::string src = d / "draft.safetensors", tmp = d / "draft.tmp";
  {
    SafetensorsFile f(src);
    std::vector<SafetensorsWriteItem> items;
    for (const SafetensorsTensor& t : f.tensors()) items.push_back({t.name, f.view(t)});
    edit(items);
    write_safetensors(tmp, items);
  }
  fs::remove(src);
  fs::rename(tmp, d / out_name);
}

TEST(DsparkCheckpoint, EachBrokenCheckpointHasItsOwnError) {
  const DsparkConfig c = tiny_dspark_config();
  const std::string w1 = "language_model.model.dspark.markov_head.markov_w1.weight";
  Tensor odd = Tensor::empty({3, 3}, DType::kBFloat16);
  std::memset(odd.data(), 0, size_t(odd.nbytes()));
  {
    TempDir d;
    make_tiny_dspark_checkpoint(d.str(), c);
    rewrite_draft(d, [&](auto& items) {
      items.erase(std::remove_if(items.begin(), items.end(), [&](const auto& it) { return it.name == w1; }),
                  items.end());
    });
    EXPECT_ERROR_HAS(DsparkCheckpoint(d.str(), {target_file(d)}), "missing tensor '" + w1 + "'");
  }
  {
    TempDir d;
    make_tiny_dspark_checkpoint(d.str(), c);
    rewrite_draft(d, [&](auto& items) { items.push_back({"language_model.model.dspark.extra.weight", odd}); });
    EXPECT_ERROR_HAS(DsparkCheckpoint(d.str(), {target_file(d)}), "unknown tensor 'language_model.model.dspark.extra");
  }
  {
    TempDir d;
    make_tiny_dspark_checkpoint(d.str(), c);
    rewrite_draft(d, [&](auto& items) {
      for (auto& it : items)
        if (it.name == w1) it.tensor = odd;
    });
    EXPECT_ERROR_HAS(DsparkCheckpoint(d.str(), {target_file(d)}), "'" + w1 + "' is BF16 [3, 3], the config needs BF16 [1000, 32]");
  }
  {
    TempDir d;
    make_tiny_dspark_checkpoint(d.str(), c);
    Tensor f32 = Tensor::empty({1000, 32}, DType::kFloat32);
    std::memset(f32.data(), 0, size_t(f32.nbytes()));
    rewrite_draft(d, [&](auto& items) {
      for (auto& it : items)
        if (it.name == w1) it.tensor = f32;
    });
    EXPECT_ERROR_HAS(DsparkCheckpoint(d.str(), {target_file(d)}), "is F32 [1000, 32], the config needs BF16");
  }
  {
    TempDir d;  // the same tensor in two shards
    make_tiny_dspark_checkpoint(d.str(), c);
    {
      SafetensorsFile f(d / "draft.safetensors");
      write_safetensors(d / "extra.safetensors", {{w1, f.view(*f.find(w1))}});
    }
    EXPECT_ERROR_HAS(DsparkCheckpoint(d.str(), {target_file(d)}), "is in both");
  }
  {
    TempDir d;
    make_tiny_dspark_checkpoint(d.str(), c);
    EXPECT_ERROR_HAS(DsparkCheckpoint(d.str(), {}), "no target file holds 'language_model.model.embed_tokens.weight'");
    fs::remove(d / "config.json");
    EXPECT_ERROR_HAS(DsparkCheckpoint(d.str(), {target_file(d)}), "config.json");
  }
  {
    TempDir d;
    make_tiny_dspark_checkpoint(d.str(), c);
    fs::remove(d / "draft.safetensors");
    EXPECT_ERROR_HAS(DsparkCheckpoint(d.str(), {target_file(d)}), "no *.safetensors file");
  }
  {
    TempDir d;  // a config that does not match the shard: the first mismatch is reported by name
    make_tiny_dspark_checkpoint(d.str(), c);
    DsparkConfig bigger = c;
    bigger.ffn_size = 1024;
    std::ofstream(d / "config.json") << dspark_config_json(bigger);
    EXPECT_ERROR_HAS(DsparkCheckpoint(d.str(), {target_file(d)}), "the config needs BF16 [1024, 256]");
  }
}

}  // namespace
