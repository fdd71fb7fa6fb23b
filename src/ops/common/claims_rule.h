// The host side of run-time work claims (claims.cuh): which unit a launch claims from. CUDA-free,
// so the CPU tests check the rule that the launchers of the QK insert and the context writer share.
#pragma once

#include <algorithm>
#include <cstdint>

#include "m3rt/ops.h"  // kClaimCounterInts

namespace m3rt::kernels {

// Counters a launch with `columns` grid columns needs (claims.cuh's layout: a claim counter and a
// finished-warp counter a column).
constexpr int64_t claim_counters_needed(int64_t columns) { return 2 * columns; }

// The first unit of `units` a launch claims, `units` when it claims none: with counters given, a
// call that may claim and a grid whose `columns` fit kClaimCounterInts, the last `forced_pct`% of
// the units (an investigation switch's value; -1: unset), else the last `rule_pct`% when the op's
// rule holds (`by_rule`, e.g. a token count from its threshold), else none.
constexpr int64_t first_claimed_unit(bool have_counters, bool claimable, int64_t units, int64_t columns,
                                     int forced_pct, bool by_rule, int rule_pct) {
  if (!have_counters || !claimable || claim_counters_needed(columns) > kClaimCounterInts) return units;
  const int pct = forced_pct >= 0 ? std::min(forced_pct, 100) : by_rule ? rule_pct : 0;
  return units - units * pct / 100;
}

}  // namespace m3rt::kernels
