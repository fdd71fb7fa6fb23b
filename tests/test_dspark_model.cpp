// The DSpark draft model on the CPU (m3rt/dspark_model.h) against the independent plain reference of
// the same math (src/model/dspark_oracle.h, written from ../shared/spec/dspark.md, sharing no code
// with the model or its ops): context K/V, the draft block through every layer,
// head_hidden and logits (bf16 tolerance), greedy draft tokens (identical wherever the reference's
// top-2 margin is clear), on the tiny checkpoint, bf16 and MXFP8, with and without padding.
// GPU (skipped with a message without one): the GPU model against the CPU model on the same inputs
// (head rows and logits within bf16 tolerance, tokens identical wherever the CPU's top-2 key margin
// is clear, greedy and sampled, probabilities and confidences close), graph replay == eager bitwise
// over several calls with changed inputs and batch sizes, invalid device-side inputs flagged.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "m3rt/dspark_checkpoint.h"
#include "m3rt/dspark_heads.h"
#include "m3rt/dspark_model.h"
#include "m3rt/error.h"
#include "model/dspark_oracle.h"
#include "core/scoped_env.h"
#include "core/temp_dir.h"

namespace {

using namespace m3rt;
using m3rt::detail::TempDir;
using Vec = std::vector<float>;  // the oracle's rows

float rbf(float x) { return bf16_to_float(float_to_bf16(x)); }

// ---- the test ----------------------------------------------------------------------------------
struct Scenario {
  std::vector<int64_t> ctx_len;  // per request: context positions [0, len) cached; anchor at len
  std::vector<int32_t> anchors;  // < 0: padding
};

void run(DsparkQuant quant, const Scenario& sc, uint64_t seed, int sliding_window = 4096) {
  TempDir dir;
  DsparkConfig cfg = tiny_dspark_config(quant);
  cfg.sliding_window = sliding_window;
  make_tiny_dspark_checkpoint(dir.str(), cfg, {quant, seed});
  const DsparkCheckpoint ck(dir.str(), {dir / "target/model.safetensors"});
  const int64_t R = int64_t(sc.anchors.size()), N = cfg.block_size, H = cfg.hidden_size, V = cfg.vocab_size;
  const int64_t n_t = int64_t(cfg.target_layer_ids.size());
  constexpr int kPage = 128;
  const int max_blocks = 8;
  DsparkModel model(ck, {.num_cache_blocks = int(R) * max_blocks});
  detail::DsparkOracle ref(ck);
  std::mt19937_64 rng(seed * 77 + 1);
  std::uniform_real_distribution<float> u(-1.f, 1.f);
  // Block tables: request r owns pages [r * max_blocks, (r + 1) * max_blocks), reversed.
  Tensor table = Tensor::empty({R, max_blocks}, DType::kInt32);
  for (int64_t r = 0; r < R; ++r)
    for (int b = 0; b < max_blocks; ++b) table.ptr<int32_t>()[r * max_blocks + b] = int32_t((r + 1) * max_blocks - 1 - b);
  auto slot = [&](int64_t r, int64_t pos) {
    return int64_t(table.ptr<int32_t>()[r * max_blocks + pos / kPage]) * kPage + pos % kPage;
  };
  // Context rows of every request in one precompute call.
  int64_t T = 0;
  for (int64_t len : sc.ctx_len) T += len;
  Tensor hidden = Tensor::empty({T, n_t * H}, DType::kBFloat16), pos = Tensor::empty({T}, DType::kInt64),
         slots = Tensor::empty({T}, DType::kInt64);
  int64_t t = 0;
  for (int64_t r = 0; r < R; ++r)
    for (int64_t p = 0; p < sc.ctx_len[size_t(r)]; ++p, ++t) {
      Vec row(static_cast<size_t>(n_t * H));
      for (int64_t i = 0; i < n_t * H; ++i)
        row[size_t(i)] = rbf(u(rng)), hidden.ptr<uint16_t>()[t * n_t * H + i] = float_to_bf16(row[size_t(i)]);
      pos.ptr<int64_t>()[t] = p;
      slots.ptr<int64_t>()[t] = slot(r, p);
      ref.context(row, p, int(r));
    }
  model.precompute_context(hidden, pos, slots);
  // The draft step.
  Tensor anchors = Tensor::empty({R}, DType::kInt32), apos = Tensor::empty({R}, DType::kInt64),
         bslots = Tensor::empty({R, N}, DType::kInt64), temps = Tensor::empty({R}, DType::kFloat32),
         seeds = Tensor::empty({R}, DType::kInt64), tokens = Tensor::empty({R, N}, DType::kInt32),
         conf = Tensor::empty({R, N}, DType::kFloat32), head = Tensor::empty({R * N, H}, DType::kBFloat16),
         logits = Tensor::empty({R, N, V}, DType::kBFloat16);
  for (int64_t r = 0; r < R; ++r) {
    anchors.ptr<int32_t>()[r] = sc.anchors[size_t(r)];
    apos.ptr<int64_t>()[r] = sc.ctx_len[size_t(r)];
    temps.ptr<float>()[r] = 0.f;
    seeds.ptr<int64_t>()[r] = 0;
    for (int64_t j = 0; j < N; ++j) bslots.ptr<int64_t>()[r * N + j] = slot(r, sc.ctx_len[size_t(r)] + j);
  }
  model.draft({.anchor_tokens = anchors, .anchor_positions = apos, .block_slots = bslots, .block_table = table,
               .temperatures = temps, .seeds = seeds, .draft_tokens = tokens, .confidence = conf,
               .head_hidden = head, .base_logits = logits});
  for (int64_t r = 0; r < R; ++r) {
    if (sc.anchors[size_t(r)] < 0) {
      for (int64_t j = 0; j < N; ++j) EXPECT_EQ(tokens.ptr<int32_t>()[r * N + j], -1);
      continue;
    }
    std::vector<Vec> rh, rl;
    ref.block(int(r), sc.anchors[size_t(r)], sc.ctx_len[size_t(r)], rh, rl);
    double head_err = 0, head_max = 0, logit_err = 0, logit_max = 0;
    for (int64_t j = 0; j < N; ++j) {
      for (int64_t i = 0; i < H; ++i) {
        const double got = bf16_to_float(head.ptr<uint16_t>()[(r * N + j) * H + i]);
        head_err = std::max(head_err, std::fabs(got - rh[size_t(j)][size_t(i)]));
        head_max = std::max(head_max, std::fabs(double(rh[size_t(j)][size_t(i)])));
      }
      for (int64_t v = 0; v < V; ++v) {
        const double got = bf16_to_float(logits.ptr<uint16_t>()[(r * N + j) * V + v]);
        logit_err = std::max(logit_err, std::fabs(got - rl[size_t(j)][size_t(v)]));
        logit_max = std::max(logit_max, std::fabs(double(rl[size_t(j)][size_t(v)])));
      }
    }
    // About two bf16 ulps of the largest value (measured: one): the model and the reference round
    // at the same points but may differ by an ulp where sums are ordered differently.
    EXPECT_LE(head_err, 0.01 * head_max) << "request " << r;
    EXPECT_LE(logit_err, 0.01 * logit_max) << "request " << r;
    // Greedy drafts: the oracle's own Markov loop on its logits, compared while its top-2 margin is
    // clearly above the logits' error (the model and the oracle draft the same sequence).
    const std::vector<int32_t> want = ref.greedy_drafts(sc.anchors[size_t(r)], rl, float(4 * logit_err + 0.05));
    int compared = 0;
    for (int64_t j = 0; j < N && want[size_t(j)] != -2; ++j, ++compared)
      EXPECT_EQ(tokens.ptr<int32_t>()[r * N + j], want[size_t(j)]) << "request " << r << " step " << j;
    EXPECT_GT(compared, 0) << "no step with a clear margin in request " << r;
  }
}

TEST(DsparkModel, MatchesThePlainReferenceBf16) { run(DsparkQuant::kBFloat16, {{150, 300}, {17, 420}}, 3); }

TEST(DsparkModel, MatchesThePlainReferenceMxfp8WithPaddingAndAWindow) {
  // Window 200: request 0's block rows (positions 260..266) see only the last ~200 keys.
  run(DsparkQuant::kMxfp8, {{260, 40, 10}, {5, -1, 999}}, 4, 200);
}

TEST(DsparkModel, BadArguments) {
  TempDir dir;
  make_tiny_dspark_checkpoint(dir.str(), tiny_dspark_config());
  const DsparkCheckpoint ck(dir.str(), {dir / "target/model.safetensors"});
  EXPECT_THROW(DsparkModel(ck, {.num_cache_blocks = 0}), Error);
  DsparkModel m(ck, {.num_cache_blocks = 4});
  Tensor hidden = Tensor::empty({2, 100}, DType::kBFloat16), pos = Tensor::empty({2}, DType::kInt64);
  EXPECT_THROW(m.precompute_context(hidden, pos, pos), Error);  // wrong width
  Tensor anchors = Tensor::empty({1}, DType::kInt32), apos = Tensor::empty({1}, DType::kInt64),
         bslots = Tensor::empty({1, 7}, DType::kInt64), table = Tensor::empty({1, 1}, DType::kInt32),
         temps = Tensor::empty({1}, DType::kFloat32), seeds = Tensor::empty({1}, DType::kInt64),
         tokens = Tensor::empty({1, 7}, DType::kInt32);
  anchors.ptr<int32_t>()[0] = 5;
  apos.ptr<int64_t>()[0] = 200;  // needs 2 blocks, the table has 1
  table.ptr<int32_t>()[0] = 0;
  temps.ptr<float>()[0] = 0.f;
  seeds.ptr<int64_t>()[0] = 0;
  for (int j = 0; j < 7; ++j) bslots.ptr<int64_t>()[j] = 200 + j;
  DsparkDraftArgs a{.anchor_tokens = anchors, .anchor_positions = apos, .block_slots = bslots, .block_table = table,
                    .temperatures = temps, .seeds = seeds, .draft_tokens = tokens};
  EXPECT_THROW(m.draft(a), Error);
  anchors.ptr<int32_t>()[0] = 1000;  // = vocab size
  apos.ptr<int64_t>()[0] = 10;
  EXPECT_THROW(m.draft(a), Error);
}

// Random weights at the config's sizes: the floor's byte count, and a draft that runs end to end.
TEST(DsparkModel, RandomWeightsDraftAndCountTheirBytes) {
  DsparkConfig cfg = tiny_dspark_config(DsparkQuant::kBFloat16);
  DsparkModel m(cfg, {.num_cache_blocks = 4}, 3);
  const int64_t H = cfg.hidden_size, F = cfg.ffn_size, D = cfg.head_dim, V = cfg.vocab_size;
  const int64_t per_layer = 2 * H + 2 * D + (cfg.num_heads + 2 * cfg.num_kv_heads) * D * H + H * cfg.num_heads * D +
                            2 * F * H + H * F;
  const int64_t conf = H + cfg.markov_rank + 1;
  EXPECT_EQ(m.draft_weight_bytes(),
            2 * (cfg.num_layers * per_layer + H + conf + V * H + int64_t(cfg.block_size) * V * cfg.markov_rank));
  Tensor anchors = Tensor::empty({1}, DType::kInt32), apos = Tensor::empty({1}, DType::kInt64),
         bslots = Tensor::empty({1, 7}, DType::kInt64), table = Tensor::empty({1, 1}, DType::kInt32),
         temps = Tensor::empty({1}, DType::kFloat32), seeds = Tensor::empty({1}, DType::kInt64),
         tokens = Tensor::empty({1, 7}, DType::kInt32);
  anchors.ptr<int32_t>()[0] = 5, apos.ptr<int64_t>()[0] = 3, table.ptr<int32_t>()[0] = 2;
  temps.ptr<float>()[0] = 0.f, seeds.ptr<int64_t>()[0] = 0;
  for (int j = 0; j < 7; ++j) bslots.ptr<int64_t>()[j] = 2 * 128 + 3 + j;
  m.draft({.anchor_tokens = anchors, .anchor_positions = apos, .block_slots = bslots, .block_table = table,
           .temperatures = temps, .seeds = seeds, .draft_tokens = tokens});
  for (int j = 0; j < 7; ++j) {
    EXPECT_GE(tokens.ptr<int32_t>()[j], 0);
    EXPECT_LT(tokens.ptr<int32_t>()[j], V);
  }
}

// ---- GPU ---------------------------------------------------------------------------------------

#define REQUIRE_GPU()                                                                    \
  do {                                                                                   \
    if (!cuda_available()) GTEST_SKIP() << "no CUDA device present; GPU test not run"; \
  } while (0)

// One drafting scenario's host inputs, and the outputs a model produced for them.
struct DraftIo {
  Tensor anchors, apos, bslots, table, temps, seeds;
  Tensor tokens, probs, conf, head, logits;
};

DraftIo make_io(const DsparkConfig& c, const std::vector<int64_t>& ctx, const std::vector<int32_t>& anchors,
                const std::vector<float>& temps, int max_blocks) {
  const int64_t R = int64_t(anchors.size()), N = c.block_size, V = c.vocab_size, H = c.hidden_size;
  DraftIo io;
  io.anchors = Tensor::empty({R}, DType::kInt32), io.apos = Tensor::empty({R}, DType::kInt64);
  io.bslots = Tensor::empty({R, N}, DType::kInt64), io.table = Tensor::empty({R, max_blocks}, DType::kInt32);
  io.temps = Tensor::empty({R}, DType::kFloat32), io.seeds = Tensor::empty({R}, DType::kInt64);
  for (int64_t r = 0; r < R; ++r) {
    io.anchors.ptr<int32_t>()[r] = anchors[size_t(r)];
    io.apos.ptr<int64_t>()[r] = ctx[size_t(r)];
    io.temps.ptr<float>()[r] = temps[size_t(r)];
    io.seeds.ptr<int64_t>()[r] = 1000 + r;
    for (int b = 0; b < max_blocks; ++b) io.table.ptr<int32_t>()[r * max_blocks + b] = int32_t((r + 1) * max_blocks - 1 - b);
    for (int64_t j = 0; j < N; ++j) {
      const int64_t p = ctx[size_t(r)] + j;
      io.bslots.ptr<int64_t>()[r * N + j] = int64_t(io.table.ptr<int32_t>()[r * max_blocks + p / 128]) * 128 + p % 128;
    }
  }
  io.tokens = Tensor::empty({R, N}, DType::kInt32), io.probs = Tensor::empty({R, N, V}, DType::kFloat32);
  io.conf = Tensor::empty({R, N}, DType::kFloat32), io.head = Tensor::empty({R * N, H}, DType::kBFloat16);
  io.logits = Tensor::empty({R, N, V}, DType::kBFloat16);
  return io;
}

// Runs one draft call on `model` (host inputs copied to its device, outputs poisoned, copied back).
DraftIo draft_on(DsparkModel& model, const DraftIo& in) {
  const Device d = model.options().device;
  auto on = [&](const Tensor& t) { return d.is_cuda() ? t.to(d) : t; };
  auto poisoned = [&](const Tensor& t) {
    Tensor x = Tensor::empty(t.view().sizes(), t.view().dtype, d);
    x.fill_bytes(0xff);  // NaN for floats, -1 for ints
    return x;
  };
  DraftIo out = in;
  Tensor tokens = poisoned(in.tokens), probs = poisoned(in.probs), conf = poisoned(in.conf), head = poisoned(in.head),
         logits = poisoned(in.logits);
  model.draft({.anchor_tokens = on(in.anchors), .anchor_positions = on(in.apos), .block_slots = on(in.bslots),
               .block_table = on(in.table), .temperatures = on(in.temps), .seeds = on(in.seeds), .draft_tokens = tokens,
               .draft_probs = probs, .confidence = conf, .head_hidden = head, .base_logits = logits});
  auto back = [](const Tensor& t) { return t.to(Device::cpu()); };
  out.tokens = back(tokens), out.probs = back(probs), out.conf = back(conf), out.head = back(head);
  out.logits = back(logits);
  return out;
}

// Context rows [0, ctx[r]) of every request through precompute_context (random hidden states).
void fill_context(DsparkModel& model, const std::vector<int64_t>& ctx, int max_blocks, uint64_t seed) {
  const DsparkConfig& c = model.config();
  const int64_t W = int64_t(c.target_layer_ids.size()) * c.hidden_size;
  int64_t T = 0;
  for (int64_t len : ctx) T += len;
  Tensor hidden = Tensor::empty({T, W}, DType::kBFloat16), pos = Tensor::empty({T}, DType::kInt64),
         slots = Tensor::empty({T}, DType::kInt64);
  std::mt19937_64 rng(seed);
  std::uniform_real_distribution<float> u(-1.f, 1.f);
  int64_t t = 0;
  for (size_t r = 0; r < ctx.size(); ++r)
    for (int64_t p = 0; p < ctx[r]; ++p, ++t) {
      for (int64_t i = 0; i < W; ++i) hidden.ptr<uint16_t>()[t * W + i] = float_to_bf16(u(rng));
      pos.ptr<int64_t>()[t] = p;
      slots.ptr<int64_t>()[t] = int64_t((int64_t(r) + 1) * max_blocks - 1 - p / 128) * 128 + p % 128;
    }
  const Device d = model.options().device;
  model.precompute_context(d.is_cuda() ? hidden.to(d) : hidden, d.is_cuda() ? pos.to(d) : pos,
                           d.is_cuda() ? slots.to(d) : slots);
}

// The tokens a Markov loop over `base` [N][V] (bf16 values) must draw while the top-2 key margin
// exceeds `min_gap`; -2 from the first unclear step on.
std::vector<int32_t> clear_tokens(const DsparkCheckpoint& ck, const float* base, int32_t anchor, float T,
                                  uint64_t seed, int64_t pos0, double min_gap) {
  const DsparkConfig& c = ck.config();
  const int64_t N = c.block_size, V = c.vocab_size, rank = c.markov_rank;
  const TensorView w1 = ck.dspark("markov_head.markov_w1.weight"), w2 = ck.dspark("markov_head.markov_w2.weight");
  std::vector<int32_t> out(size_t(N), -2);
  int32_t prev = anchor;
  for (int64_t i = 0; i < N; ++i) {
    double best = -INFINITY, second = -INFINITY;
    int32_t arg = -1;
    for (int64_t v = 0; v < V; ++v) {
      float bias = 0.f;
      for (int64_t k = 0; k < rank; ++k)
        bias += bf16_to_float(w1.ptr<const uint16_t>()[prev * rank + k]) * bf16_to_float(w2.ptr<const uint16_t>()[v * rank + k]);
      const float l = rbf(base[i * V + v] + rbf(bias));
      const double key = T == 0.f ? double(l) : double(l) / double(T) + dspark_gumbel(seed, pos0 + i, v);
      if (key > best) second = best, best = key, arg = int32_t(v);
      else second = std::max(second, key);
    }
    if (best - second <= min_gap) break;
    out[size_t(i)] = prev = arg;
  }
  return out;
}

TEST(DsparkModelGpu, MatchesTheCpuModel) {
  REQUIRE_GPU();
  for (DsparkQuant quant : {DsparkQuant::kBFloat16, DsparkQuant::kMxfp8}) {
    TempDir dir;
    const DsparkConfig cfg = tiny_dspark_config(quant);
    make_tiny_dspark_checkpoint(dir.str(), cfg, {quant, 11});
    const DsparkCheckpoint ck(dir.str(), {dir / "target/model.safetensors"});
    const int max_blocks = 8;
    const std::vector<int64_t> ctx = {150, 300, 17, 5};
    const std::vector<int32_t> anchors = {40, 7, -1, 998};
    const std::vector<float> temps = {0.f, 0.7f, 0.f, 1.3f};
    const int64_t R = 4, N = cfg.block_size, V = cfg.vocab_size, H = cfg.hidden_size;
    DsparkModel cpu(ck, {.num_cache_blocks = int(R) * max_blocks});
    DsparkModel gpu(ck, {.num_cache_blocks = int(R) * max_blocks, .device = Device::cuda(), .max_batch = 8});
    fill_context(cpu, ctx, max_blocks, 5);
    fill_context(gpu, ctx, max_blocks, 5);
    const DraftIo io = make_io(cfg, ctx, anchors, temps, max_blocks);
    const DraftIo want = draft_on(cpu, io), got = draft_on(gpu, io);
    gpu.check_input_errors();
    for (int64_t r = 0; r < R; ++r) {
      SCOPED_TRACE("quant " + std::to_string(int(quant)) + " request " + std::to_string(r));
      if (anchors[size_t(r)] < 0) {
        for (int64_t j = 0; j < N; ++j) {
          EXPECT_EQ(got.tokens.ptr<int32_t>()[r * N + j], -1);
          EXPECT_EQ(got.conf.ptr<float>()[r * N + j], 0.f);
        }
        continue;
      }
      double head_err = 0, head_max = 0, logit_err = 0, logit_max = 0;
      std::vector<float> base(size_t(N * V));
      for (int64_t j = 0; j < N; ++j) {
        for (int64_t i = 0; i < H; ++i) {
          const int64_t k = (r * N + j) * H + i;
          const double a = bf16_to_float(got.head.ptr<uint16_t>()[k]), b = bf16_to_float(want.head.ptr<uint16_t>()[k]);
          head_err = std::max(head_err, std::fabs(a - b)), head_max = std::max(head_max, std::fabs(b));
        }
        for (int64_t v = 0; v < V; ++v) {
          const int64_t k = (r * N + j) * V + v;
          const double a = bf16_to_float(got.logits.ptr<uint16_t>()[k]), b = bf16_to_float(want.logits.ptr<uint16_t>()[k]);
          logit_err = std::max(logit_err, std::fabs(a - b)), logit_max = std::max(logit_max, std::fabs(b));
          base[size_t(j * V + v)] = float(b);
        }
      }
      // bf16 tolerance: a few ulps of the largest value (GEMM sums ordered differently, per layer).
      EXPECT_LE(head_err, 0.02 * head_max);
      EXPECT_LE(logit_err, 0.02 * logit_max);
      const float T = temps[size_t(r)];
      const std::vector<int32_t> clear = clear_tokens(ck, base.data(), anchors[size_t(r)], T, uint64_t(1000 + r),
                                                      ctx[size_t(r)], (4 * logit_err + 0.05) / (T == 0.f ? 1.0 : T));
      int compared = 0;
      bool same_prefix = true;
      for (int64_t j = 0; j < N; ++j) {
        const int32_t g = got.tokens.ptr<int32_t>()[r * N + j], w = want.tokens.ptr<int32_t>()[r * N + j];
        EXPECT_GE(g, 0);
        EXPECT_LT(g, V);
        if (clear[size_t(j)] != -2) {
          EXPECT_EQ(g, clear[size_t(j)]) << "step " << j;
          ++compared;
        }
        if (!same_prefix) continue;
        // Where both drafted the same prefix, the step's distribution and confidence agree.
        double perr = 0, psum = 0;
        for (int64_t v = 0; v < V; ++v) {
          const int64_t k = (r * N + j) * V + v;
          perr = std::max(perr, double(std::fabs(got.probs.ptr<float>()[k] - want.probs.ptr<float>()[k])));
          psum += got.probs.ptr<float>()[k];
        }
        EXPECT_NEAR(psum, 1.0, 1e-4) << "step " << j;
        EXPECT_LE(perr, T == 0.f ? 0.0 : 0.05) << "step " << j;
        EXPECT_NEAR(got.conf.ptr<float>()[r * N + j], want.conf.ptr<float>()[r * N + j], 5e-3) << "step " << j;
        same_prefix = g == w;
      }
      EXPECT_GT(compared, 0) << "no step with a clear margin";
    }
  }
}

// The device's random weights are the host's (one hash): the two models' head rows agree.
TEST(DsparkModelGpu, RandomWeightsMatchTheCpuModel) {
  REQUIRE_GPU();
  const DsparkConfig cfg = tiny_dspark_config(DsparkQuant::kBFloat16);
  const int max_blocks = 4;
  DsparkModel cpu(cfg, {.num_cache_blocks = 2 * max_blocks}, 21);
  DsparkModel gpu(cfg, {.num_cache_blocks = 2 * max_blocks, .device = Device::cuda(), .max_batch = 2}, 21);
  EXPECT_EQ(cpu.draft_weight_bytes(), gpu.draft_weight_bytes());
  fill_context(cpu, {40, 90}, max_blocks, 3);
  fill_context(gpu, {40, 90}, max_blocks, 3);
  const DraftIo io = make_io(cfg, {40, 90}, {3, 4}, {0.f, 0.f}, max_blocks);
  const DraftIo a = draft_on(cpu, io), b = draft_on(gpu, io);
  double err = 0, mx = 0;
  for (int64_t i = 0; i < a.head.numel(); ++i) {
    const double x = bf16_to_float(a.head.ptr<uint16_t>()[i]), y = bf16_to_float(b.head.ptr<uint16_t>()[i]);
    err = std::max(err, std::fabs(x - y)), mx = std::max(mx, std::fabs(x));
  }
  EXPECT_GT(mx, 0.0);
  EXPECT_LE(err, 0.02 * mx);
}

// A long context (8300 rows) written with run-time claims on the model's counters (15%, forced by
// M3RT_WRITER_CLAIM_PCT: the writer's rule claims bf16 from 8192 tokens on an H100, from 16384 on an
// H200) writes the caches a static split writes (M3RT_WRITER_CLAIM_PCT=0), bitwise; then again with
// other hidden states (the counters reset by the first call).
TEST(DsparkModelGpu, LongPrecomputeWithClaimsEqualsTheStaticSplitBitwise) {
  REQUIRE_GPU();
  const DsparkConfig cfg = tiny_dspark_config(DsparkQuant::kBFloat16);
  const int max_blocks = 40;
  const std::vector<int64_t> ctx = {5000, 3300};
  const DsparkModelOptions o{.num_cache_blocks = 2 * max_blocks, .device = Device::cuda(), .max_batch = 2};
  DsparkModel claimed(cfg, o, 31), fixed(cfg, o, 31);
  for (uint64_t seed : {8, 9}) {
    {
      const detail::ScopedEnv no_claims("M3RT_WRITER_CLAIM_PCT", "0");
      fill_context(fixed, ctx, max_blocks, seed);
    }
    {
      const detail::ScopedEnv claims("M3RT_WRITER_CLAIM_PCT", "15");
      fill_context(claimed, ctx, max_blocks, seed);
    }
    for (int l = 0; l < cfg.num_layers; ++l) {
      const Tensor a = claimed.kv_cache(l).to(Device::cpu()), b = fixed.kv_cache(l).to(Device::cpu());
      int64_t written = 0;  // context rows' K and V elements: rarely 0
      for (int64_t i = 0; i < b.numel(); ++i) written += b.ptr<uint16_t>()[i] != 0;
      EXPECT_GE(written, 8300 * cfg.num_kv_heads * 256 * 9 / 10) << "layer " << l;
      EXPECT_EQ(std::memcmp(a.data(), b.data(), size_t(a.nbytes())), 0) << "seed " << seed << ", layer " << l;
    }
  }
}

TEST(DsparkModelGpu, GraphReplayEqualsEagerBitwise) {
  REQUIRE_GPU();
  TempDir dir;
  const DsparkConfig cfg = tiny_dspark_config(DsparkQuant::kBFloat16);
  make_tiny_dspark_checkpoint(dir.str(), cfg, {DsparkQuant::kBFloat16, 12});
  const DsparkCheckpoint ck(dir.str(), {dir / "target/model.safetensors"});
  const int max_blocks = 8, R = 4;
  // Untuned GEMMs: the two models must pick the same algorithms (tuned choices may differ).
  DsparkModelOptions o{.num_cache_blocks = R * max_blocks, .device = Device::cuda(), .max_batch = 8,
                       .tune_gemms = false};
  DsparkModel graph(ck, o);
  o.use_graphs = false;
  DsparkModel eager(ck, o);
  const std::vector<int64_t> ctx = {300, 129, 700, 64};
  fill_context(graph, ctx, max_blocks, 9);
  fill_context(eager, ctx, max_blocks, 9);
  // Calls of 4, 3 (same padded size: a replay with new inputs), 1 and 4 requests.
  const std::vector<std::vector<int32_t>> calls = {{5, 6, 7, 8}, {100, -1, 300}, {17}, {1, 2, 3, 4}};
  for (size_t i = 0; i < calls.size(); ++i) {
    const size_t n = calls[i].size();
    const std::vector<int64_t> c(ctx.begin(), ctx.begin() + long(n));
    const std::vector<float> temps(n, i % 2 ? 0.9f : 0.f);
    const DraftIo io = make_io(cfg, c, calls[i], temps, max_blocks);
    const DraftIo a = draft_on(graph, io), b = draft_on(eager, io);
    for (const auto& [x, y] : {std::pair{&a.tokens, &b.tokens}, {&a.probs, &b.probs}, {&a.conf, &b.conf},
                               {&a.head, &b.head}, {&a.logits, &b.logits}})
      EXPECT_EQ(std::memcmp(x->data(), y->data(), size_t(x->nbytes())), 0) << "call " << i;
  }
  EXPECT_EQ(graph.graphs_captured(), 2);  // padded sizes 4 and 1
  EXPECT_EQ(eager.graphs_captured(), 0);
  for (int l = 0; l < cfg.num_layers; ++l) {
    const Tensor x = graph.kv_cache(l).to(Device::cpu()), y = eager.kv_cache(l).to(Device::cpu());
    EXPECT_EQ(std::memcmp(x.data(), y.data(), size_t(x.nbytes())), 0) << "cache of layer " << l;
  }
  // Tuned GEMMs: the first call at a size runs eagerly (and tunes), the next replays the graph;
  // the same inputs give the same bits.
  o.use_graphs = true, o.tune_gemms = true;
  DsparkModel tuned(ck, o);
  fill_context(tuned, ctx, max_blocks, 9);
  const DraftIo io = make_io(cfg, ctx, {5, 6, 7, 8}, {0.f, 0.9f, 0.f, 0.5f}, max_blocks);
  const DraftIo a = draft_on(tuned, io), b = draft_on(tuned, io);
  EXPECT_EQ(tuned.graphs_captured(), 1);
  for (const auto& [x, y] : {std::pair{&a.tokens, &b.tokens}, {&a.probs, &b.probs}, {&a.conf, &b.conf},
                             {&a.head, &b.head}, {&a.logits, &b.logits}})
    EXPECT_EQ(std::memcmp(x->data(), y->data(), size_t(x->nbytes())), 0) << "tuned: replay vs first call";
}

TEST(DsparkModelGpu, InvalidDeviceInputsDraftPaddingAndThrowOnCheck) {
  REQUIRE_GPU();
  TempDir dir;
  const DsparkConfig cfg = tiny_dspark_config(DsparkQuant::kBFloat16);
  make_tiny_dspark_checkpoint(dir.str(), cfg, {DsparkQuant::kBFloat16, 13});
  const DsparkCheckpoint ck(dir.str(), {dir / "target/model.safetensors"});
  const int max_blocks = 4;
  DsparkModel gpu(ck, {.num_cache_blocks = 2 * max_blocks, .device = Device::cuda(), .max_batch = 2});
  auto expect_error = [&](const std::string& what) {
    try {
      gpu.check_input_errors();
      ADD_FAILURE() << "no error for " << what;
    } catch (const Error& e) {
      EXPECT_NE(std::string(e.what()).find(what), std::string::npos) << e.what();
    }
    EXPECT_NO_THROW(gpu.check_input_errors());  // reported once
  };
  DraftIo io = make_io(cfg, {10, 20}, {5, int32_t(cfg.vocab_size)}, {0.f, 0.f}, max_blocks);
  DraftIo out = draft_on(gpu, io);
  EXPECT_GE(out.tokens.ptr<int32_t>()[0], 0);
  for (int j = 0; j < cfg.block_size; ++j) EXPECT_EQ(out.tokens.ptr<int32_t>()[cfg.block_size + j], -1);
  expect_error("anchor_tokens[1]");
  io = make_io(cfg, {10, 20}, {5, 6}, {0.f, 0.f}, max_blocks);
  io.table.ptr<int32_t>()[max_blocks] = 99;  // request 1, block 0: outside the cache
  draft_on(gpu, io);
  expect_error("block_table[1][0]");
  io = make_io(cfg, {10, 20}, {5, 6}, {-1.f, 0.f}, max_blocks);
  draft_on(gpu, io);
  expect_error("temperatures[0]");
  // Host-side checks still throw at the call.
  io = make_io(cfg, {10, 20, 30}, {5, 6, 7}, {0.f, 0.f, 0.f}, max_blocks);
  EXPECT_THROW(draft_on(gpu, io), Error);  // 3 requests > max_batch 2
}

}  // namespace
