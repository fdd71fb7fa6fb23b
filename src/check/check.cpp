// m3rt::run_checks: the registry of op checks and the loop over devices.
#include <chrono>

#include "check/check_cases.h"
#include "core/validate.h"
#include "m3rt/check.h"
#include "m3rt/error.h"

namespace m3rt {

namespace {
struct Entry {
  const char* op;
  void (*fn)(detail::CheckContext&);
  bool gpu = true;  // false: the op has no GPU path yet; GPU devices skip it
};
// Table order is the order of `m3rt check`'s rows.
constexpr Entry kChecks[] = {
    {"reshape_and_cache", detail::check_reshape_and_cache},
    {"gemma_rms_norm", detail::check_gemma_rms_norm},
    {"swiglu_oai", detail::check_swiglu_oai},
    {"dspark_context_kv_write", detail::check_dspark_context_kv_write},
    {"qknorm_rope_kv_insert", detail::check_qknorm_rope_kv_insert},
    {"indexer_prefill", detail::check_indexer_prefill},
    {"indexer_decode", detail::check_indexer_decode},
    {"msa_prefill", detail::check_msa_prefill},
    {"msa_decode", detail::check_msa_decode},
    {"dspark_draft", detail::check_dspark_draft, true},
};
}  // namespace

std::vector<std::string> check_op_names() {
  std::vector<std::string> names;
  for (const Entry& e : kChecks) names.emplace_back(e.op);
  return names;
}

bool check_op_has_gpu(const std::string& op) {
  for (const Entry& e : kChecks)
    if (op == e.op) return e.gpu;
  return false;
}

std::vector<CheckRow> run_checks(const std::vector<Device>& devices, const CheckOptions& options,
                                 uint64_t* seed_used) {
  detail::require_filter_matches("check", options.filter, check_op_names());
  uint64_t seed = options.seed;
  if (seed == 0)
    seed = uint64_t(std::chrono::high_resolution_clock::now().time_since_epoch().count()) | 1u;
  if (seed_used) *seed_used = seed;
  std::vector<CheckRow> rows;
  for (const Device& dev : devices) {
    detail::Rng rng(seed);  // the same inputs on every device
    for (const Entry& e : kChecks) {
      if (!options.filter.empty() && std::string(e.op).find(options.filter) == std::string::npos)
        continue;
      if (dev.is_cuda() && !e.gpu) continue;
      detail::CheckContext ctx{dev, rng, rows, e.op, ""};
      const size_t before = rows.size();
      try {
        e.fn(ctx);
      } catch (const std::exception& ex) {
        CheckRow row;
        row.op = ctx.op;
        row.variant = ctx.variant;
        row.device = dev.str();
        row.output = "(exception)";
        row.pass = false;
        row.message = ex.what();
        rows.push_back(row);
      }
      if (rows.size() == before) {
        CheckRow row{e.op, "", dev.str(), "(none)"};
        row.message = "the check produced no comparison";
        rows.push_back(row);
      }
    }
  }
  return rows;
}

}  // namespace m3rt
