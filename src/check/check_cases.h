// Internal: the per-op checks behind m3rt::run_checks, one per op in src/ops/<op>/check_<op>.cpp
// (shared helpers: check/check_helpers.h).
#pragma once

#include <string>
#include <vector>

#include "check/check_util.h"
#include "m3rt/check.h"

namespace m3rt::detail {

struct CheckContext {
  Device device;
  Rng& rng;
  std::vector<CheckRow>& rows;
  std::string op;
  std::string variant;
};

void check_reshape_and_cache(CheckContext& c);
void check_gemma_rms_norm(CheckContext& c);
void check_swiglu_oai(CheckContext& c);
void check_dspark_context_kv_write(CheckContext& c);
void check_qknorm_rope_kv_insert(CheckContext& c);
void check_indexer_prefill(CheckContext& c);  // src/ops/lightning_indexer/check_lightning_indexer.cpp
void check_indexer_decode(CheckContext& c);
void check_msa_prefill(CheckContext& c);  // src/ops/msa_attention/check_msa_attention.cpp
void check_msa_decode(CheckContext& c);
void check_dspark_draft(CheckContext& c);  // src/model/check_dspark_draft.cpp

}  // namespace m3rt::detail
