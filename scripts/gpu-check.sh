#!/usr/bin/env bash
# On a GPU machine: build, run every test (GPU ones included), `m3rt check` (also with the
# sync-check switch; the MSA and indexer checks also from an sm_80-only build), compute-sanitizer
# (memcheck, racecheck, initcheck, synccheck) on the GPU checks and the graph test (and three of
# them on the access-pattern probe's `once` mode), then every benchmark. Logs go to $OUT (default
# /tmp/m3rt-gpu); a short table is printed last. Exit status: non-zero if any step failed.
# SKIP_BENCH=1 stops before the benchmarks (to split a run over two device calls: then
# `m3rt bench --json` alone). To split it further (a device call has 10 minutes): STEPS, an
# extended regex, runs only the steps whose names match (the others are listed as skipped), and
# SKIP_BUILD=1 takes the binaries already in $BUILD_DIR (and $BUILD_DIR-sm80 for the sm_80 step)
# instead of building them — e.g. built elsewhere and copied without their object files by
# scripts/gpu-prebuilt.sh (to build-gpu-prebuilt[-sm80]):
#   SKIP_BUILD=1 BUILD_DIR=build-gpu-prebuilt STEPS='^(ctest|check.*)$' scripts/gpu-check.sh
#   SKIP_BUILD=1 BUILD_DIR=build-gpu-prebuilt STEPS='^sanitizer' scripts/gpu-check.sh
# (with SKIP_BUILD the ctest step runs every $BUILD_DIR/tests/test_* binary itself).
set -uo pipefail
cd "$(dirname "$0")/.."
. scripts/gpu-builds.sh
OUT=${OUT:-/tmp/m3rt-gpu}
BUILD_DIR=${BUILD_DIR:-build-gpu}
mkdir -p "$OUT"
export PATH=$PATH:/usr/local/cuda/bin
SAN=$(command -v compute-sanitizer || ls /usr/local/cuda*/bin/compute-sanitizer 2>/dev/null | head -1)
STEPS=${STEPS:-.}
declare -a NAMES RESULTS
step() {  # step NAME LOGFILE CMD...: runs CMD, appends its output to LOGFILE, records PASS/FAIL
  local name=$1 logf=$2; shift 2
  if ! [[ $name =~ $STEPS ]]; then
    NAMES+=("$name"); RESULTS+=("skipped (STEPS)")
    return 0
  fi
  echo "== $name: $*" >>"$OUT/$logf"
  local t0=$SECONDS
  "$@" >>"$OUT/$logf" 2>&1
  local rc=$?
  NAMES+=("$name"); RESULTS+=("$([ $rc -eq 0 ] && echo PASS || echo "FAIL(rc=$rc)") $((SECONDS - t0))s")
  return $rc
}

nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem,clocks.max.sm --format=csv >"$OUT/summary.txt" 2>&1
COMMIT=${M3RT_GIT_COMMIT:-$(git rev-parse --short=12 HEAD 2>/dev/null || echo unknown)}
echo "commit $COMMIT  $(date -u +%FT%TZ)" >>"$OUT/summary.txt"
if [ -n "${SKIP_BUILD:-}" ]; then
  export LD_LIBRARY_PATH=$(cd "$BUILD_DIR" && pwd)${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}  # its libm3rt
  export M3RT_SOURCE_DIR=$PWD  # the fuzz corpora the tests replay (tests/source_dir.h)
  [ -x "$BUILD_DIR/m3rt" ] || { echo "SKIP_BUILD=1: no $BUILD_DIR/m3rt" | tee -a "$OUT/summary.txt"; exit 1; }
  NAMES+=("build"); RESULTS+=("skipped (SKIP_BUILD: $BUILD_DIR)")
else
  step build build.log m3rt_build_default "$BUILD_DIR" || { tail -40 "$OUT/build.log"; exit 1; }
fi
run_test_binaries() {  # every test binary in $BUILD_DIR/tests; non-zero if one fails
  local t rc=0 n=0
  for t in "$BUILD_DIR"/tests/test_*; do
    [ -f "$t" ] && [ -x "$t" ] || continue
    n=$((n + 1))
    "$t" || rc=1
  done
  echo "$n test binaries, rc $rc"
  return $rc
}
if [ -n "${SKIP_BUILD:-}" ]; then  # a copied build's CTest files name the paths it was built at
  step ctest ctest.log run_test_binaries
else
  step ctest ctest.log bash -c "cd $BUILD_DIR && ctest --output-on-failure -j 4"
fi
step check check.log "$BUILD_DIR/m3rt" check
step check-mma-sync check.log env M3RT_MSA_WGMMA=0 "$BUILD_DIR/m3rt" check --device cuda --filter msa
# The bf16 wgmma loop fed by cp.async (the copy-engine form is the default).
step check-wg-cp check.log env M3RT_MSA_WG_TMA=0 "$BUILD_DIR/m3rt" check --device cuda --filter msa
# Unsplit e4m3 groups with the row warps converting (the producer warpgroup is the default).
step check-no-producer check.log env M3RT_MSA_WS=0 "$BUILD_DIR/m3rt" check --device cuda --filter msa
# Group 16 on the wgmma tiles instead of the per-token tile (prefill and verify, both page types),
# and the per-token tile on every unsplit decode from dql 2.
step check-no-token-tile check.log env M3RT_MSA_TOKEN_TILE=0 "$BUILD_DIR/m3rt" check --device cuda --filter msa
step check-token-tile-decode check.log env M3RT_MSA_TOKEN_TILE=2 "$BUILD_DIR/m3rt" check --device cuda --filter msa_decode
# dql 1 on the general kernel (msa_decode1_kernel replaced it there), and the split decode's
# global-memory merge instead of the cluster one.
step check-msa-general check.log env M3RT_MSA_DECODE1=0 "$BUILD_DIR/m3rt" check --device cuda --filter msa_decode
step check-global-merge check.log env M3RT_MSA_CLUSTER=0 "$BUILD_DIR/m3rt" check --device cuda --filter msa_decode
# e4m3 dql 1 with its chunks by the copy engine on every grid (the default takes it on grids of
# up to 3 CTAs an SM and at most 8 splits), and by cp.async on every grid.
step check-d1-copy-engine check.log env M3RT_MSA_D1_TMA=2 "$BUILD_DIR/m3rt" check --device cuda --filter msa_decode
step check-d1-cp-async check.log env M3RT_MSA_D1_TMA=0 "$BUILD_DIR/m3rt" check --device cuda --filter msa_decode
# e4m3 dql 1 with two 4-warp groups a CTA on every copy-engine grid (the default takes them on grids
# of 3/4 to one CTA an SM, unsplit or at two splits): unsplit, so with the copy engine on every e4m3
# grid, and at two splits (the cluster instance).
step check-d1-two-groups check.log env M3RT_MSA_D1_GROUPS=2 "$BUILD_DIR/m3rt" check --device cuda --filter msa_decode
step check-d1-two-groups-tma check.log env M3RT_MSA_D1_GROUPS=2 M3RT_MSA_D1_TMA=2 "$BUILD_DIR/m3rt" check --device cuda --filter msa_decode
step check-d1-two-groups-split check.log env M3RT_MSA_D1_GROUPS=2 M3RT_MSA_SPLITS=2 "$BUILD_DIR/m3rt" check --device cuda --filter msa_decode
# dql 1 with the split grid where the plan would take the mixed one.
step check-msa-split-grid check.log env M3RT_MSA_MIXED=0 "$BUILD_DIR/m3rt" check --device cuda --filter msa_decode
step check-sync check.log env M3RT_SYNC_CHECK=1 "$BUILD_DIR/m3rt" check --device cuda
# Fixed MSA calls hashed through the public API (the lines to diff against another build's).
step msa-hash check.log "$BUILD_DIR/m3rt_msa_hash"
# A build without sm_90a code (sm_80 SASS + compute_80 PTX) must take the portable paths on Hopper.
check_sm80() {  # built here unless SKIP_BUILD; the CLI with its own libm3rt
  local d=$BUILD_DIR-sm80
  if [ -n "${SKIP_BUILD:-}" ]; then test -x "$d/m3rt" || return 1; else m3rt_build_sm80 "$d" >/dev/null || return 1; fi
  local run=(env "LD_LIBRARY_PATH=$d${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}" "$d/m3rt")
  "${run[@]}" check --device cuda --filter msa && "${run[@]}" check --device cuda --filter indexer
}
step check-sm80-build check.log check_sm80
if [ -n "$SAN" ]; then
  for tool in memcheck racecheck initcheck synccheck; do
    step "sanitizer-$tool" sanitizer.log "$SAN" --tool "$tool" --error-exitcode 9 "$BUILD_DIR/m3rt" check --device cuda
  done
  step sanitizer-graph sanitizer.log "$SAN" --tool memcheck --error-exitcode 9 "$BUILD_DIR/tests/test_gpu" --gtest_filter='*Graph*:GpuWild*'
  step sanitizer-drafter sanitizer.log "$SAN" --tool memcheck --error-exitcode 9 "$BUILD_DIR/tests/test_dspark_model" --gtest_filter='DsparkModelGpu.*'
  # The access-pattern probe's kernels, each launched once (its timed mode is too slow under racecheck).
  for tool in memcheck racecheck synccheck; do
    step "sanitizer-probe-$tool" sanitizer.log "$SAN" --tool "$tool" --error-exitcode 9 "$BUILD_DIR/m3rt_access_ceiling" once
  done
else
  NAMES+=("sanitizer"); RESULTS+=("NOT RUN (compute-sanitizer not found)")
fi
cuobjdump --dump-resource-usage "$BUILD_DIR/libm3rt.so" >"$OUT/resource.txt" 2>&1
# SASS instruction mix of the two benchmarked kernels (sm_90a), for docs/perf.md.
cuobjdump --dump-sass "$BUILD_DIR/libm3rt.so" 2>/dev/null | awk '
  /Function : /{name=$3; keep=(name ~ /dspark_context_kv_kernelILi64ELb[01]E|qknorm_rope_kv_insert_kernelILi64ELNS_13QkvInsertModeE1E/)}
  keep && /^ +\/\*[0-9a-f]+\*\/ +[A-Z@]/ {op=$2; if (op ~ /^@/) op=$3; sub(/\..*/, "", op); count[name" "op]++; total[name]++}
  END {for (k in total) print "SASS", total[k], k; for (k in count) print "OP", count[k], k}' | sort -k2,2nr >>"$OUT/resource.txt"
step draft-gpu draft.log "$BUILD_DIR/m3rt" draft --device cuda --requests 4 --temperature 0.8
[ -n "${SKIP_BENCH:-}" ] || step bench bench.log "$BUILD_DIR/m3rt" bench --json "$OUT/bench.json" ${BENCH_ARGS:-}
[ -n "${SKIP_BENCH:-}" ] || step access-ceiling bench.log "$BUILD_DIR/m3rt_access_ceiling"
[ -n "${SKIP_BENCH:-}" ] || step fp8-wgmma-precision bench.log "$BUILD_DIR/m3rt_fp8_wgmma_precision"
[ -n "${SKIP_BENCH:-}" ] || step prefill-stream-probe bench.log "$BUILD_DIR/m3rt_prefill_stream_probe"
[ -n "${SKIP_BENCH:-}" ] || step mma-sync-ceiling bench.log "$BUILD_DIR/m3rt_mma_sync_ceiling"
[ -n "${SKIP_BENCH:-}" ] || step wgmma-ceiling bench.log "$BUILD_DIR/m3rt_wgmma_ceiling"

{
  echo
  grep -E "tests passed|tests failed" "$OUT/ctest.log" 2>/dev/null | tail -1
  grep -E "passed, [0-9]+ failed" "$OUT/check.log" 2>/dev/null | tail -2
  grep -E "ERROR SUMMARY" "$OUT/sanitizer.log" 2>/dev/null
  echo
  [ -f "$OUT/bench.log" ] && sed -n '/^op /,$p' "$OUT/bench.log"
  echo
  printf '%-20s %s\n' step result
  for i in "${!NAMES[@]}"; do printf '%-20s %s\n' "${NAMES[$i]}" "${RESULTS[$i]}"; done
} | tee -a "$OUT/summary.txt"
for r in "${RESULTS[@]}"; do [[ $r == PASS* || $r == skipped* ]] || exit 1; done
