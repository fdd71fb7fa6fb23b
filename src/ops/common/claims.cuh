// Run-time work claims for the one-wave streaming kernels (the QK insert's quad kernel, the context
// writer's half-warp kernel): a warp walks its units of work [first, claim_from) by a fixed
// stride, then takes units of [claim_from, num) a claim at a time (one unit, or kGrain) from its
// grid column's counter, so warps on SMs that stream faster take more of the tail (a static equal
// split waits for the slowest SMs: docs/perf.md, "Session 50"). Each claim is issued one unit
// ahead of its use (lane 0's atomic; the value is waited for only where that unit's copies are
// issued), so its round trip overlaps the copies and the math of the unit before. The column's
// last warp to finish returns both of its counters to zero, so a buffer that starts at zero is
// zero again after every completed launch (a dependent launch's griddepcontrol.wait sees that too).
//
// Counters: claims[column] (claims taken past claim_from) and claims[columns + column] (the
// column's warps that have finished), 32-bit.
#pragma once

#include <climits>
#include <cstdint>

#include "core/cuda_check.h"        // env_int
#include "ops/common/claims_rule.h"  // the launchers' side: claim_counters_needed, first_claimed_unit
#include "ops/common/sm90.cuh"       // launch_pdl_or_plain

namespace m3rt::kernels {

// One warp's walk. Every member but `pending` is warp-uniform; next() and finish() are called by
// every lane of the warp together (they shuffle with the full mask). A claim takes kGrain units
// (claim c: units claim_from + c kGrain ...), the next claim issued as the last of them is taken.
template <int kGrain>
struct WarpUnitWalk {
  int next_static;    // the warp's next unit of the static part
  int static_end;     // claim_from (num when not claiming)
  int step;           // the static stride
  int claim_from;
  int num;            // units in all
  unsigned* counter;  // &claims[column]; nullptr: static only
  unsigned pending = 0;  // lane 0: the issued claim's value
  bool issued = false, exhausted = false;
  int grant_next = 0, grant_end = 0;  // the rest of the current claim's units (kGrain > 1)

  __device__ WarpUnitWalk(int first, int step_, int num_, unsigned* claims, int column, int claim_from_)
      : next_static(first), step(step_), claim_from(claim_from_), num(num_),
        counter(claims != nullptr && claim_from_ < num_ ? claims + column : nullptr) {
    static_end = counter != nullptr ? claim_from : num;
  }

  __device__ __forceinline__ void issue() {
    if ((threadIdx.x & 31) == 0) pending = atomicAdd(counter, 1u);
    issued = true;
  }

  // The warp's next unit, INT_MAX when it has none left.
  __device__ __forceinline__ int next() {
    if (next_static < static_end) {
      const int u = next_static;
      next_static += step;
      if (counter != nullptr && next_static >= static_end) issue();  // the next unit is a claim
      return u;
    }
    if (counter == nullptr || exhausted) return INT_MAX;
    if constexpr (kGrain > 1) {
      if (grant_next < grant_end) {
        const int u = grant_next++;
        if (grant_next == grant_end) issue();
        return u;
      }
    }
    if (!issued) issue();
    const int u = claim_from + int(__shfl_sync(0xffffffffu, pending, 0)) * kGrain;
    issued = false;
    if (u >= num) {
      exhausted = true;
      return INT_MAX;
    }
    if constexpr (kGrain > 1) {
      grant_next = u + 1;
      grant_end = min(u + kGrain, num);
      if (grant_next < grant_end) return u;
    }
    issue();
    return u;
  }

  // After the warp's last claim (next() returned INT_MAX): the column's last warp of `warps`
  // resets the column's counters. `columns`: the grid's column count.
  __device__ __forceinline__ void finish(int columns, unsigned warps) {
    if (counter == nullptr || (threadIdx.x & 31) != 0) return;
    __threadfence();  // this warp's claims are done before it counts itself finished
    unsigned* done = counter + columns;
    if (atomicAdd(done, 1u) + 1 == warps) {
      *counter = 0;
      *done = 0;
    }
  }
};

// The units of a warp's 3-stage pipeline: the one being computed and the two whose copies are in
// flight. Used as: u0 = first(), u1 = second() (the prologue's copies), then per computed unit
// copy(next_copy()) ... advance(), while current() < num; finish() after the loop.
// UnitPipe<false>: the static stride alone (two counters, as the kernels had before claims; the
// static instances keep their registers, and their loops are the old ones or a few instructions
// longer: the writer's quad kernel +1..9 SASS instructions, session 62); UnitPipe<true, kGrain>:
// WarpUnitWalk's units.
template <bool kClaims, int kGrain = 1>
struct UnitPipe {
  int cur, copy, step;  // the unit computed, the next to copy
  __device__ UnitPipe(int first_unit, int step_, int /*num*/, unsigned* /*claims*/, int /*column*/,
                      int /*claim_from*/)
      : cur(first_unit), copy(first_unit), step(step_) {}
  __device__ __forceinline__ int first() { return next_copy(); }
  __device__ __forceinline__ int second() { return next_copy(); }
  __device__ __forceinline__ int next_copy() {
    const int u = copy;
    copy += step;
    return u;
  }
  __device__ __forceinline__ void advance() { cur += step; }
  __device__ __forceinline__ int current() const { return cur; }
  __device__ __forceinline__ void finish(int, unsigned) {}
};

template <int kGrain>
struct UnitPipe<true, kGrain> {
  WarpUnitWalk<kGrain> walk;
  int cur = INT_MAX, ahead1 = INT_MAX, ahead2 = INT_MAX;
  __device__ UnitPipe(int first_unit, int step, int num, unsigned* claims, int column, int claim_from)
      : walk(first_unit, step, num, claims, column, claim_from) {}
  __device__ __forceinline__ int first() { return cur = walk.next(); }
  __device__ __forceinline__ int second() { return ahead1 = walk.next(); }
  __device__ __forceinline__ int next_copy() { return ahead2 = walk.next(); }
  __device__ __forceinline__ void advance() {
    cur = ahead1;
    ahead1 = ahead2;
  }
  __device__ __forceinline__ int current() const { return cur; }
  __device__ __forceinline__ void finish(int columns, unsigned warps) { walk.finish(columns, warps); }
};

// Host: one launch of a claiming op (params with claims, claim_from and pdl) over `units` units:
// `claiming` when the call claims (counters given, the rule of first_claimed_unit, or the
// investigation switch `pct_env` set), else `fixed` with claims cleared (the instance without the
// claims' code). Ops without a claiming instance for a case pass `fixed` twice and claimable false.
template <typename Params>
void launch_claiming_or_fixed(void (*claiming)(Params), void (*fixed)(Params), dim3 grid, int threads, Params p,
                              int64_t units, bool claimable, bool by_rule, int rule_pct, const char* pct_env,
                              cudaStream_t stream, const char* name) {
  p.claim_from = int(p.claims == nullptr ? units
                                         : first_claimed_unit(true, claimable, units, grid.x,
                                                              detail::env_int(pct_env, -1), by_rule, rule_pct));
  if (p.claim_from < units) return launch_pdl_or_plain(claiming, grid, threads, p, p.pdl, stream, name);
  p.claims = nullptr;
  launch_pdl_or_plain(fixed, grid, threads, p, p.pdl, stream, name);
}

}  // namespace m3rt::kernels
