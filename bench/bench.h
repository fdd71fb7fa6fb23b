// The shared benchmark harness: ceilings, timing, rows. Every op's bench (src/ops/<op>/bench_*.cu)
// uses it, so the timing rules live in one place:
//   - the copy ceiling is measured in the same run (a large device-to-device copy, bytes read +
//     written over time; the driver runs it on a copy engine, not on the SMs: docs/perf.md, Method);
//   - each timing is the median of several repeats of a CUDA-graph replay of `reps` calls, after a
//     warm-up; callers rotate input sets larger than L2 so repeats do not hit in cache;
//   - bytes are decimal (1 GB/s = 1e9 B/s).
#pragma once

#include <cstdint>
#include <functional>
#include <random>
#include <string>
#include <vector>

#include "m3rt/tensor.h"

struct CUstream_st;

namespace m3rt::bench {

struct BenchRow {
  std::string op, variant;
  double us = 0;            // median time per call
  double bytes = 0;         // bytes the call must move
  double gbps = 0;          // bytes / us
  double pct_ceiling = 0;   // of the binding ceiling: gbps / copy ceiling, or tflops / GEMM rate
  double tflops = 0;        // compute-bound rows: effective FLOPs / us
  std::string ceiling = "copy";  // which ceiling pct_ceiling refers to: "copy" or "gemm"
  std::vector<std::pair<std::string, double>> ratios;  // "vs unfused": baseline_us / us
  std::string note;
};

struct BenchEnv {
  std::string gpu;
  double copy_gbps = 0;  // measured device-to-device copy, read + write
  bool quick = false;    // fewer repeats (smoke test)
  double gemm_tflops = 0;  // measured bf16 GEMM rate (cuBLAS), filled by benches that need it
};

double measure_copy_ceiling_gbps();
// A large bf16 GEMM (8192^3, fp32 accumulation, cuBLAS) timed in this run: dense TFLOP/s.
double measure_gemm_tflops();

// Median microseconds per call of `call(i, stream)`, where i cycles over the input sets, timed as
// graph replays of `calls_per_graph` calls (graph=false: eager launches in a loop).
double time_us(const std::function<void(int, CUstream_st*)>& call, int num_sets, bool graph,
               const BenchEnv& env, int calls_per_graph = 20);

// Host microseconds a call of `call(i, stream)` takes to enqueue (eager, no graph): the median over
// 7 rounds of `calls` calls, each round started on an idle stream; `calls` small enough that the
// launch queue never fills (then the time is the host's alone). host_us_empty_launch: the same for
// an empty kernel's launch, the floor of any eager call.
double host_us_per_call(const std::function<void(int, CUstream_st*)>& call, int num_sets, int calls);
double host_us_empty_launch();
// "; host X us a call (an empty kernel's launch Y)", for a row's note.
std::string host_cost_note(const std::function<void(int, CUstream_st*)>& call, int num_sets, int calls);

// Fills n bf16 values with a hash of (seed, index) mapped to [lo, hi] (never zeros-only data).
void fill_uniform_bf16(void* p, int64_t n, uint64_t seed, float lo, float hi);

// Per-set device index vectors for `sets` calls of `n` tokens: random positions in [0, max_pos)
// and slots laid out as an engine's (consecutive tokens fill a block, blocks in shuffled order),
// disjoint across sets; `num_blocks` is the cache size they need.
struct IndexSets {
  std::vector<Tensor> positions, slots;  // [sets] x int64 [n], on the GPU
  int64_t num_blocks = 0;
};
IndexSets make_index_sets(int sets, int64_t n, int block_size, int64_t max_pos, std::mt19937_64& rng);

// Whether environment variable `name` is set to something (an empty value counts as unset).
bool env_set(const char* name);
// Environment variable `name` as a comma-separated list of integers in [lo, hi] (`what` names them
// in the error, an m3rt::Error); empty when unset or empty.
std::vector<int> env_int_list(const char* name, long lo, long hi, const char* what);

// How many input sets to rotate so that together they exceed 3x the L2 (60 MB on an H200).
int sets_beyond_l2(double bytes_per_set, int max_sets = 32);

// The read floor of a byte count with no structure: median µs of a contiguous read of `bytes`
// from `buf` (call i reads at offset i x bytes, so `buf` must hold num_sets x bytes), 8 CTAs of 256
// threads an SM, four 16-byte loads in flight a thread; graph replays as time_us.
double time_contiguous_read_us(const void* buf, double bytes, int num_sets, const BenchEnv& env);
inline constexpr const char* kContiguousReadNote =
    "the same bytes read contiguously (8 CTAs of 256 threads an SM, 4 x 16 B in flight a thread)";
// A bound measured beside `call` in the same run (a read floor): `call`'s row with `suffix` added
// to its variant, timed at `us` over the same bytes, the ratio floor / call, and `note`.
BenchRow floor_row(const BenchRow& call, const char* suffix, double us, const char* note, const BenchEnv& env);
// `call`'s row timed again at `us` with enable_pdl (back-to-back calls in the graph, each a
// programmatic dependent of the one before): variant + " pdl", ratio "vs without pdl".
BenchRow pdl_row(const BenchRow& call, double us, const BenchEnv& env);

std::vector<BenchRow> bench_dspark_context_kv(const BenchEnv& env);
std::vector<BenchRow> bench_qknorm_rope_kv_insert(const BenchEnv& env);
std::vector<BenchRow> bench_lightning_indexer(BenchEnv& env);
std::vector<BenchRow> bench_msa_attention(BenchEnv& env);
std::vector<BenchRow> bench_msa_attention_draft(BenchEnv& env);  // the drafter's attention shape
std::vector<BenchRow> bench_dspark_draft(BenchEnv& env);  // src/model/bench_dspark_draft.cu

// The bench op names, in the order of the rows; run_benches runs each whose name contains
// `filter` (throws m3rt::Error, listing them, when it matches none).
std::vector<std::string> bench_op_names();
std::vector<BenchRow> run_benches(BenchEnv& env, const std::string& filter);

}  // namespace m3rt::bench
