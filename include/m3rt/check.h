// m3rt/check.h — the self-test behind `m3rt check`: every op's correctness check on fresh random
// inputs, on the CPU and on each GPU present.
//
// On a GPU the op is compared with its CPU reference (outputs poisoned with NaN first, untouched
// memory compared bitwise). On the CPU the reference itself is compared with an fp64 evaluation of
// the spec's formulas. Errors are measured in units of the output dtype (bf16/fp16 ulps, e4m3
// codes), worst element reported with its coordinates.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "m3rt/tensor.h"

namespace m3rt {

struct CheckRow {
  std::string op;         // e.g. "dspark_context_kv_write"
  std::string variant;    // e.g. "fp8 L5 nkv4 bs128 rot64 n513"
  std::string device;     // "cpu", "cuda:0"
  std::string output;     // which output the row is about ("cache.K", "q_out", ...)
  double worst = 0;       // worst error in `unit`
  std::string unit;       // "bf16 ulp", "e4m3 code", "bits"
  std::string where;      // coordinates of the worst element, e.g. "[3, 1, 17, 64]"
  double tolerance = 0;   // in `unit`
  int64_t checked = 0;    // elements compared
  bool pass = false;
  std::string message;    // on failure or exception: what went wrong
};

struct CheckOptions {
  uint64_t seed = 0;   // 0: draw a fresh seed from the clock
  std::string filter;  // run only ops whose name contains this (one that matches none throws)
};

// Whether the op's check has GPU rows (false: no GPU path yet; GPU devices skip it).
bool check_op_has_gpu(const std::string& op);

// Runs every check on each device; never throws for an op failure (it becomes a failing row);
// throws m3rt::Error when options.filter matches no op.
std::vector<CheckRow> run_checks(const std::vector<Device>& devices, const CheckOptions& options,
                                 uint64_t* seed_used = nullptr);

// The op names that appear in the table.
std::vector<std::string> check_op_names();

}  // namespace m3rt
