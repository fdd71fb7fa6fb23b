// m3rt: the command-line tool.
//   m3rt check [--device cpu|cuda|all] [--seed N] [--filter OP]   correctness self-test
//   m3rt bench [--filter OP] [--json FILE] [--quick]              GPU benchmarks
//   m3rt make-tiny-draft DIR [--mxfp8] [--seed N]                   a small random DSpark checkpoint
//   m3rt draft [--checkpoint DIR [--target FILE]...] [--requests R] [--context N] [--temperature T]
//              [--seed N] [--mxfp8] [--device auto|cpu|cuda|cuda:N]   draft tokens (CPU or GPU model)
//   m3rt version
// Every error becomes one line on stderr and a non-zero exit.
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <ctime>
#include <filesystem>
#include <fstream>
#include <random>
#include <iostream>
#include <memory>
#include <string>
#include <vector>

#include "core/temp_dir.h"
#include "core/validate.h"
#include "m3rt/check.h"
#include "m3rt/dspark_checkpoint.h"
#include "m3rt/dspark_model.h"
#include "m3rt/error.h"
#include "m3rt/tensor.h"

#ifdef M3RT_WITH_CUDA
#include "bench.h"
#endif

#include "m3rt_git_commit.h"  // M3RT_GIT_COMMIT, written at build time (cmake/git_commit.cmake)

namespace {

using namespace m3rt;

const char* kUsage =
    "usage: m3rt <command> [options]\n"
    "  check [--device cpu|cuda|all] [--seed N] [--filter OP]\n"
    "        run every op's correctness check on fresh random inputs (default: all devices);\n"
    "        --filter OP: the ops whose name contains OP (one that matches none is an error)\n"
    "  bench [--filter OP] [--json FILE] [--quick]\n"
    "        GPU benchmarks: us, bytes, GB/s, % of the measured copy ceiling, ratios to baselines\n"
    "  make-tiny-draft DIR [--mxfp8] [--seed N]\n"
    "        write a small random DSpark draft checkpoint in the real format (config.json,\n"
    "        draft.safetensors, target/model.safetensors) and load it back to check it\n"
    "  draft [--checkpoint DIR [--target FILE]...] [--requests R] [--context N] [--temperature T]\n"
    "        [--seed N] [--mxfp8] [--device auto|cpu|cuda|cuda:N]\n"
    "        run the DSpark drafter on a checkpoint (default: a tiny generated one) with synthetic\n"
    "        target hidden states: drafted tokens, confidences, per-stage times. auto (default): the\n"
    "        GPU model (CUDA graph replay) when a GPU is present, else the CPU model\n"
    "  version\n";

struct Args {
  std::vector<std::string> v;
  size_t i = 0;
  bool more() const { return i < v.size(); }
  std::string next(const std::string& flag) {
    if (i >= v.size()) throw Error("option " + flag + " needs a value");
    return v[i++];
  }
};

uint64_t parse_u64(const std::string& flag, const std::string& s) {
  try {
    size_t pos = 0;
    const unsigned long long x = std::stoull(s, &pos, 0);
    if (pos != s.size()) throw std::invalid_argument(s);
    return x;
  } catch (const std::exception&) {
    throw Error("option " + flag + " = '" + s + "': expected a non-negative integer");
  }
}

std::string fmt(const char* f, double x) {
  char buf[64];
  std::snprintf(buf, sizeof(buf), f, x);
  return buf;
}

int cmd_check(Args& a) {
  std::string device = "all";
  CheckOptions opt;
  while (a.more()) {
    const std::string f = a.next("");
    if (f == "--device") device = a.next(f);
    else if (f == "--seed") opt.seed = parse_u64(f, a.next(f));
    else if (f == "--filter") opt.filter = a.next(f);
    else throw Error("check: unknown option '" + f + "'");
  }
  std::vector<Device> devices;
  const int n = cuda_device_count();
  if (device == "cpu" || device == "all") devices.push_back(Device::cpu());
  if (device == "cuda" || device == "all")
    for (int i = 0; i < n; ++i) devices.push_back(Device::cuda(i));
  if (device.rfind("cuda:", 0) == 0) {
    const int idx = int(parse_u64("--device", device.substr(5)));
    if (idx >= n) throw Error("check: --device " + device + ": " + std::to_string(n) + " CUDA device(s) present");
    devices.push_back(Device::cuda(idx));
  }
  if (device != "cpu" && device != "all" && device != "cuda" && device.rfind("cuda:", 0) != 0)
    throw Error("check: --device '" + device + "': expected cpu, cuda, cuda:N or all");
  if (device == "cuda" && n == 0)
    throw Error(std::string("check: --device cuda: no CUDA device") +
                (built_with_cuda() ? " is present" : " (m3rt was built without CUDA)"));
  uint64_t seed = 0;
  const auto rows = run_checks(devices, opt, &seed);
  std::printf("m3rt check  seed %llu  devices:", (unsigned long long)seed);
  for (const auto& d : devices)
    std::printf(" %s%s", d.str().c_str(), d.is_cuda() ? (" (" + cuda_device_name(d.index) + ")").c_str() : "");
  if (device == "all" && n == 0)
    std::printf("  [no CUDA device%s: GPU checks not run]", built_with_cuda() ? "" : ", built without CUDA");
  std::printf("\n%-26s %-44s %-7s %-24s %10s %-16s %9s %s\n", "op", "variant", "device", "output",
              "worst", "at", "tol", "result");
  int failed = 0;
  for (const auto& r : rows) {
    std::printf("%-26s %-44s %-7s %-24s %10s %-16s %9s %s\n", r.op.c_str(), r.variant.c_str(),
                r.device.c_str(), r.output.c_str(), fmt("%.0f", r.worst).c_str(), r.where.c_str(),
                (fmt("%.0f ", r.tolerance) + (r.unit == "exact" ? "" : r.unit.substr(r.unit.find(' ') + 1))).c_str(),
                r.pass ? "PASS" : "FAIL");
    if (!r.pass) {
      ++failed;
      std::printf("    %s\n", r.message.c_str());
    }
  }
  std::printf("%zu passed, %d failed\n", rows.size() - failed, failed);
  return failed ? 1 : 0;
}

int cmd_bench(Args& a) {
  std::string filter, json;
  bool quick = false;
  while (a.more()) {
    const std::string f = a.next("");
    if (f == "--filter") filter = a.next(f);
    else if (f == "--json") json = a.next(f);
    else if (f == "--quick") quick = true;
    else throw Error("bench: unknown option '" + f + "'");
  }
#ifdef M3RT_WITH_CUDA
  detail::require_filter_matches("bench", filter, bench::bench_op_names());  // before any GPU work
  if (cuda_device_count() == 0) throw Error("bench: no CUDA device is present");
  bench::BenchEnv env;
  env.gpu = cuda_device_name(0);
  env.quick = quick;
  env.copy_gbps = bench::measure_copy_ceiling_gbps();
  char date[32];
  const std::time_t now = std::time(nullptr);
  std::strftime(date, sizeof(date), "%Y-%m-%dT%H:%M:%SZ", std::gmtime(&now));
  std::printf("m3rt bench  %s  commit %s  %s  copy ceiling %.0f GB/s (read+write, measured)\n",
              env.gpu.c_str(), M3RT_GIT_COMMIT, date, env.copy_gbps);
  const auto rows = bench::run_benches(env, filter);
  std::printf("%-28s %-34s %10s %12s %9s %7s  %s\n", "op", "variant", "us", "bytes", "GB/s", "%ceil", "ratios");
  for (const auto& r : rows) {
    std::string ratios;
    for (const auto& [name, x] : r.ratios) ratios += name + " " + fmt("%.2fx", x) + "  ";
    std::printf("%-28s %-34s %10.2f %12.0f %9.0f %6.1f%%%s  %s%s\n", r.op.c_str(), r.variant.c_str(), r.us,
                r.bytes, r.gbps, r.pct_ceiling, r.ceiling == "gemm" ? " of GEMM" : "", ratios.c_str(),
                r.note.c_str());
  }
  if (!json.empty()) {
    std::ofstream out(json);
    if (!out) throw Error("bench: --json '" + json + "': cannot open for writing");
    out << "{\"gpu\": \"" << env.gpu << "\", \"commit\": \"" << M3RT_GIT_COMMIT << "\", \"date\": \""
        << date << "\", \"copy_ceiling_gbps\": " << env.copy_gbps << ", \"gemm_bf16_tflops\": " << env.gemm_tflops
        << ", \"rows\": [\n";
    for (size_t i = 0; i < rows.size(); ++i) {
      const auto& r = rows[i];
      out << "  {\"op\": \"" << r.op << "\", \"variant\": \"" << r.variant << "\", \"us\": " << r.us
          << ", \"bytes\": " << r.bytes << ", \"gbps\": " << r.gbps << ", \"tflops\": " << r.tflops
          << ", \"ceiling\": \"" << r.ceiling << "\", \"pct_ceiling\": " << r.pct_ceiling
          << ", \"ratios\": {";
      for (size_t k = 0; k < r.ratios.size(); ++k)
        out << (k ? ", " : "") << "\"" << r.ratios[k].first << "\": " << r.ratios[k].second;
      out << "}, \"note\": \"" << r.note << "\"}" << (i + 1 < rows.size() ? "," : "") << "\n";
    }
    out << "]}\n";
  }
  return 0;
#else
  (void)quick;
  throw Error("bench: m3rt was built without CUDA; benchmarks need a GPU build");
#endif
}

int cmd_make_tiny_draft(Args& a) {
  std::string dir;
  TinyDraftOptions opt;
  while (a.more()) {
    const std::string flag = a.next("");
    if (flag == "--mxfp8") opt.quant = DsparkQuant::kMxfp8;
    else if (flag == "--seed") opt.seed = parse_u64(flag, a.next(flag));
    else if (!flag.empty() && flag[0] == '-') throw Error("make-tiny-draft: unknown option '" + flag + "'");
    else if (dir.empty()) dir = flag;
    else throw Error("make-tiny-draft: one directory expected, got '" + dir + "' and '" + flag + "'");
  }
  if (dir.empty()) throw Error("make-tiny-draft: missing the output directory (m3rt make-tiny-draft DIR)");
  const DsparkConfig c = tiny_dspark_config(opt.quant);
  make_tiny_dspark_checkpoint(dir, c, opt);
  const DsparkCheckpoint ck(dir, {dir + "/target/model.safetensors"});
  std::printf("wrote %s: %zu draft tensors (%s linears), 2 target tensors; %d layers, hidden %d, %d/%d heads, "
              "vocab %d, block %d\n",
              dir.c_str(), dspark_draft_layout(c).size(), opt.quant == DsparkQuant::kMxfp8 ? "MXFP8" : "bf16",
              ck.config().num_layers, ck.config().hidden_size, ck.config().num_heads, ck.config().num_kv_heads,
              ck.config().vocab_size, ck.config().block_size);
  return 0;
}

// A random tiny checkpoint in a scratch directory, removed with the object.
struct TinyCheckpointDir {
  detail::TempDir tmp;
  std::string dir = tmp.str();
  TinyCheckpointDir(DsparkQuant quant, uint64_t seed) {
    make_tiny_dspark_checkpoint(dir, tiny_dspark_config(quant), {quant, seed});
  }
};

int cmd_draft(Args& a) {
  std::string dir;
  std::vector<std::string> targets;
  int64_t requests = 2, context = 300;
  float temperature = 0.f;
  uint64_t seed = 1;
  DsparkQuant quant = DsparkQuant::kBFloat16;
  std::string device_name = "auto";
  while (a.more()) {
    const std::string flag = a.next("");
    if (flag == "--checkpoint") dir = a.next(flag);
    else if (flag == "--device") device_name = a.next(flag);
    else if (flag == "--target") targets.push_back(a.next(flag));
    else if (flag == "--requests") requests = int64_t(parse_u64(flag, a.next(flag)));
    else if (flag == "--context") context = int64_t(parse_u64(flag, a.next(flag)));
    else if (flag == "--seed") seed = parse_u64(flag, a.next(flag));
    else if (flag == "--mxfp8") quant = DsparkQuant::kMxfp8;
    else if (flag == "--temperature") {
      const std::string v = a.next(flag);
      char* end = nullptr;
      temperature = std::strtof(v.c_str(), &end);
      if (end == v.c_str() || *end != '\0' || !(temperature >= 0.f) || !std::isfinite(temperature))
        throw Error("draft: --temperature = '" + v + "': expected a finite number >= 0");
    } else {
      throw Error("draft: unknown option '" + flag + "'");
    }
  }
  if (requests < 1 || requests > 64) throw Error("draft: --requests = " + std::to_string(requests) + ": supported 1..64");
  if (context < 1 || context > 32768) throw Error("draft: --context = " + std::to_string(context) + ": supported 1..32768");
  Device dev = Device::cpu();
  if (device_name == "auto") {
    if (cuda_available()) dev = Device::cuda(0);
  } else if (device_name == "cuda" || device_name.rfind("cuda:", 0) == 0) {
    const int idx = device_name == "cuda" ? 0 : int(parse_u64("--device", device_name.substr(5)));
    if (idx >= cuda_device_count())
      throw Error("draft: --device " + device_name + ": " + std::to_string(cuda_device_count()) +
                  " CUDA device(s) present" + (built_with_cuda() ? "" : " (m3rt was built without CUDA)"));
    dev = Device::cuda(idx);
  } else if (device_name != "cpu") {
    throw Error("draft: --device '" + device_name + "': expected auto, cpu, cuda or cuda:N");
  }
  std::unique_ptr<TinyCheckpointDir> tiny;
  if (dir.empty()) {
    if (!targets.empty()) throw Error("draft: --target needs --checkpoint");
    tiny = std::make_unique<TinyCheckpointDir>(quant, seed);
    dir = tiny->dir;
  }
  if (targets.empty()) targets.push_back((std::filesystem::path(dir) / "target" / "model.safetensors").string());
  const DsparkCheckpoint ck(dir, targets);
  const DsparkConfig& c = ck.config();
  const int64_t N = c.block_size, H = c.hidden_size, nt = int64_t(c.target_layer_ids.size());
  const int64_t pages = (context + N + 127) / 128;
  DsparkModel model(ck, {.num_cache_blocks = int(requests * pages), .device = dev, .max_batch = int(requests)});
  auto on = [&](const Tensor& t) { return dev.is_cuda() ? t.to(dev) : t; };
  std::mt19937_64 rng(seed);
  std::uniform_real_distribution<float> unit(-1.f, 1.f);
  // Synthetic target hidden states for every request's context, then one draft step.
  const int64_t T = requests * context;
  Tensor hidden = Tensor::empty({T, nt * H}, DType::kBFloat16), pos = Tensor::empty({T}, DType::kInt64),
         slots = Tensor::empty({T}, DType::kInt64), table = Tensor::empty({requests, pages}, DType::kInt32);
  for (int64_t i = 0; i < hidden.numel(); ++i) hidden.ptr<uint16_t>()[i] = float_to_bf16(unit(rng));
  for (int64_t r = 0; r < requests; ++r)
    for (int64_t b = 0; b < pages; ++b) table.ptr<int32_t>()[r * pages + b] = int32_t(r * pages + b);
  for (int64_t r = 0; r < requests; ++r)
    for (int64_t p = 0; p < context; ++p) {
      pos.ptr<int64_t>()[r * context + p] = p;
      slots.ptr<int64_t>()[r * context + p] = (r * pages + p / 128) * 128 + p % 128;
    }
  model.precompute_context(on(hidden), on(pos), on(slots));
  const double precompute_ms = model.last_timings().precompute_ms;
  Tensor anchors = Tensor::empty({requests}, DType::kInt32), apos = Tensor::empty({requests}, DType::kInt64),
         bslots = Tensor::empty({requests, N}, DType::kInt64), temps = Tensor::empty({requests}, DType::kFloat32),
         seeds = Tensor::empty({requests}, DType::kInt64), tokens = Tensor::empty({requests, N}, DType::kInt32),
         probs = Tensor::empty({requests, N, c.vocab_size}, DType::kFloat32);
  Tensor conf = c.confidence_head ? Tensor::empty({requests, N}, DType::kFloat32) : Tensor();
  for (int64_t r = 0; r < requests; ++r) {
    anchors.ptr<int32_t>()[r] = int32_t(rng() % uint64_t(c.vocab_size));
    apos.ptr<int64_t>()[r] = context;
    temps.ptr<float>()[r] = temperature;
    seeds.ptr<int64_t>()[r] = int64_t(seed + uint64_t(r));
    for (int64_t j = 0; j < N; ++j)
      bslots.ptr<int64_t>()[r * N + j] = (r * pages + (context + j) / 128) * 128 + (context + j) % 128;
  }
  Tensor tokens_d = on(tokens), probs_d = on(probs), conf_d = conf.data() ? on(conf) : Tensor();
  const Tensor anchors_d = on(anchors), apos_d = on(apos), bslots_d = on(bslots), table_d = on(table),
               temps_d = on(temps), seeds_d = on(seeds);
  const DsparkDraftArgs args{.anchor_tokens = anchors_d, .anchor_positions = apos_d, .block_slots = bslots_d,
                             .block_table = table_d, .temperatures = temps_d, .seeds = seeds_d,
                             .draft_tokens = tokens_d, .draft_probs = probs_d, .confidence = conf_d};
  model.draft(args);
  // On a GPU the first call captured the step's graph: time a second call, a replay (it writes
  // the same block K/V again and drafts the same tokens).
  if (dev.is_cuda()) model.draft(args);
  model.check_input_errors();
  if (dev.is_cuda()) {
    tokens = tokens_d.to(Device::cpu()), probs = probs_d.to(Device::cpu());
    if (conf.data()) conf = conf_d.to(Device::cpu());
  }
  std::printf("checkpoint %s: %d layers, hidden %d, %d/%d heads, vocab %d, block %lld, %s; %lld requests, context %lld, "
              "temperature %g; %s model\n",
              tiny ? "(tiny, generated)" : dir.c_str(), c.num_layers, c.hidden_size, c.num_heads, c.num_kv_heads,
              c.vocab_size, (long long)N, c.quant == DsparkQuant::kMxfp8 ? "MXFP8" : "bf16", (long long)requests,
              (long long)context, double(temperature), dev.str().c_str());
  for (int64_t r = 0; r < requests; ++r) {
    std::printf("request %lld  anchor %d  drafts:", (long long)r, anchors.ptr<int32_t>()[r]);
    for (int64_t j = 0; j < N; ++j) {
      const int32_t t = tokens.ptr<int32_t>()[r * N + j];
      std::printf(" %d(p=%.3f", t, double(probs.ptr<float>()[(r * N + j) * c.vocab_size + t]));
      if (conf.data()) std::printf(",c=%.3f", double(conf.ptr<float>()[r * N + j]));
      std::printf(")");
    }
    std::printf("\n");
  }
  const DsparkModel::Timings& tm = model.last_timings();
  std::printf("times (%s, ms): context precompute %.3f (%lld rows) | draft step%s %.3f: backbone %.3f, final norm + "
              "LM head %.3f, Markov + confidence %.3f\n",
              dev.is_cuda() ? "GPU events" : "CPU model, host clock", precompute_ms, (long long)T,
              dev.is_cuda() ? " (graph replay)" : "", tm.draft_ms, tm.backbone_ms, tm.lm_head_ms, tm.heads_ms);
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  Args a;
  for (int i = 1; i < argc; ++i) a.v.emplace_back(argv[i]);
  try {
    if (!a.more() || a.v[0] == "--help" || a.v[0] == "-h" || a.v[0] == "help") {
      std::fputs(kUsage, a.more() ? stdout : stderr);
      return a.more() ? 0 : 2;
    }
    const std::string cmd = a.next("");
    if (cmd == "check") return cmd_check(a);
    if (cmd == "bench") return cmd_bench(a);
    if (cmd == "make-tiny-draft") return cmd_make_tiny_draft(a);
    if (cmd == "draft") return cmd_draft(a);
    if (cmd == "version") {
      std::printf("m3rt 0.1.0 (commit %s, %s)\n", M3RT_GIT_COMMIT, built_with_cuda() ? "CUDA" : "CPU only");
      return 0;
    }
    throw Error("unknown command '" + cmd + "' (try: m3rt --help)");
  } catch (const std::exception& e) {
    std::fprintf(stderr, "m3rt: error: %s\n", e.what());
    return 1;
  }
}
