#!/usr/bin/env bash
# On a GPU machine: A/B timing of libm3rt builds that share one CLI (a kernel change measured against
# its base in the same run; docs/perf.md, Method, "Exact changes"). Each LIB is a directory holding a
# libm3rt.so.0; BIN a build directory (or a copy) with m3rt and m3rt_msa_hash. For each library:
# m3rt_msa_hash (lines compared with the first library's), then, REPS times in turn, the MSA prefill
# rows of each context in PREFILL (M3RT_BENCH_MSA_PREFILL_ONLY, independent lists) and the quick
# bench's verify rows; GATE=1 adds, for every library but the first, the gate a token-tile change
# took in session 43: `m3rt check --filter msa`, the tile forced onto decode (M3RT_MSA_TOKEN_TILE=2),
# its cp.async form (M3RT_MSA_TT_TMA=0), and memcheck, racecheck and synccheck on the prefill checks. Logs under $OUT (default /tmp/m3rt-ab), one summary line a run.
#   scripts/ab-libs.sh BIN LIB...      e.g. scripts/ab-libs.sh build-h .dev/libs/R .dev/libs/X
# Environment: REPS (default 2), PREFILL (default "32 8", contexts in K tokens), GATE.
set -uo pipefail
[ $# -ge 2 ] || { sed -n 2,10p "$0"; exit 2; }
bin=$(cd "$1" && pwd); shift
OUT=${OUT:-/tmp/m3rt-ab}
mkdir -p "$OUT"
SAN=$(command -v compute-sanitizer || ls /usr/local/cuda*/bin/compute-sanitizer 2>/dev/null | head -1)
t0=$SECONDS
log() { echo "$* t=$((SECONDS - t0))" | tee -a "$OUT/summary.txt"; }
with() { local d=$1; shift; LD_LIBRARY_PATH="$(cd "$d" && pwd)${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}" "$@"; }
log "$(nvidia-smi --query-gpu=name,clocks.max.sm --format=csv,noheader 2>&1 | head -1)"
first=$(basename "$1")
for lib in "$@"; do
  n=$(basename "$lib")
  with "$lib" "$bin/m3rt_msa_hash" >"$OUT/hash-$n.txt" 2>&1
  rc=$?
  if [ $rc -ne 0 ]; then same="FAILED: $(tail -1 "$OUT/hash-$n.txt")"
  elif cmp -s "$OUT/hash-$first.txt" "$OUT/hash-$n.txt"; then same="same bits as $first"
  else same="DIFFERENT bits from $first"; fi
  log "hash $n rc=$rc $same"
done
for rep in $(seq "${REPS:-2}"); do
  for ctx in ${PREFILL:-32 8}; do
    for lib in "$@"; do
      n=$(basename "$lib")
      f="$OUT/prefill-$ctx-$rep-$n.txt"
      M3RT_BENCH_MSA_PREFILL_ONLY=$ctx:0 with "$lib" "$bin/m3rt" bench --filter msa_attention >"$f" 2>&1
      log "$rep $n ${ctx}K $(grep -E '^msa_attention +prefill' "$f" | awk '{printf "%s %s %s us (%s TF) | ", $3, $4, $5, $11}')"
    done
  done
  for lib in "$@"; do
    n=$(basename "$lib")
    f="$OUT/quick-$rep-$n.txt"
    with "$lib" "$bin/m3rt" bench --quick --filter msa_attention --json "$OUT/quick-$rep-$n.json" >"$f" 2>&1
    log "$rep $n quick $(grep -E '^msa_attention +verify' "$f" | awk '$7 == "p16" {printf "%s p16 %s us %s | ", $4, $8, $11; next} {printf "%s %s us %s | ", $4, $7, $10}')"
  done
done
if [ -n "${GATE:-}" ]; then
  for lib in "${@:2}"; do
    n=$(basename "$lib")
    for v in "msa" "msa_decode M3RT_MSA_TOKEN_TILE=2" "msa_prefill M3RT_MSA_TT_TMA=0"; do
      read -r filt setting <<<"$v"
      f="$OUT/check-$n-$filt${setting:+-${setting%%=*}}.txt"
      with "$lib" env $setting "$bin/m3rt" check --device cuda --filter "$filt" >"$f" 2>&1
      log "check $n --filter $filt $setting rc=$? $(grep -E 'passed' "$f" | tail -1)"
    done
    if [ -n "$SAN" ]; then
      for tool in memcheck racecheck synccheck; do
        with "$lib" "$SAN" --tool $tool --error-exitcode 9 "$bin/m3rt" check --device cuda --filter msa_prefill \
          >"$OUT/$tool-$n.txt" 2>&1
        log "$tool $n rc=$? $(grep -E 'ERROR SUMMARY|RACECHECK SUMMARY' "$OUT/$tool-$n.txt")"
      done
    fi
  done
fi
