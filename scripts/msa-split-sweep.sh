#!/usr/bin/env bash
# On a GPU machine: the dql-1 decode split sweep behind msa_decode_splits' rules (msa_attention.cu;
# docs/perf.md, msa_attention, "Session 49"). For each batch in BATCHES (32K context, M3 TP1 shapes)
# and each split count in SPLITS, bf16 and e4m3, the decode bench row (M3RT_BENCH_MSA_DECODE_ONLY,
# M3RT_MSA_SPLITS), ROUNDS times; then one table a dtype: the rule's count and time, the best count
# and time, the rule's slowdown against the best, and every count's time (the best of the rounds).
#   scripts/msa-split-sweep.sh BIN      BIN: a build directory (or a copy) holding m3rt and libm3rt.so.0
# Environment: BATCHES (default 1,2,3,4,6,8,10,12,16,20,24,28,32,40,48,56,64), SPLITS (default
# "1 2 3 4 5 6 7 8 10 12 14 16"), ROUNDS (default 2), OUT (logs; default /tmp/m3rt-split-sweep).
set -uo pipefail
[ $# -eq 1 ] || { sed -n 2,9p "$0"; exit 2; }
bin=$(cd "$1" && pwd)
OUT=${OUT:-/tmp/m3rt-split-sweep}
mkdir -p "$OUT"
BATCHES=${BATCHES:-1,2,3,4,6,8,10,12,16,20,24,28,32,40,48,56,64}
SPLITS=${SPLITS:-1 2 3 4 5 6 7 8 10 12 14 16}
for r in $(seq 1 "${ROUNDS:-2}"); do
  for s in rule $SPLITS; do
    env_s=$s; [ "$s" = rule ] && env_s=
    LD_LIBRARY_PATH="$bin${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}" M3RT_MSA_SPLITS=$env_s M3RT_BENCH_MSA_DECODE_ONLY=1 \
      M3RT_BENCH_MSA_BATCHES=$BATCHES timeout 120 "$bin/m3rt" bench --filter msa_attention >"$OUT/sweep-$r-$s.txt" 2>&1 ||
      echo "round $r splits $s: rc=$?"
  done
done
head -1 "$OUT/sweep-1-rule.txt"
python3 - "$OUT" "$SPLITS" <<'PY'
import collections, glob, re, sys
out, counts = sys.argv[1], sys.argv[2].split()
t = collections.defaultdict(list)  # (dtype, batch, splits or "rule") -> us over the rounds
rule = {}
row = re.compile(r"msa_attention\s+decode (bf16|fp8) B(\d+) ctx32K\s+([\d.]+)\s+\d+\s+\d+\s+[\d.]+%\s+(.*)")
for f in glob.glob(out + "/sweep-*-*.txt"):
    s = f.rsplit("-", 1)[1][:-4]
    for line in open(f):
        m = row.match(line)
        if not m:
            continue
        dt, b = m.group(1), int(m.group(2))
        t[(dt, b, s)].append(float(m.group(3)))
        if s == "rule":
            n = re.search(r"(\d+) splits", m.group(4))
            rule[(dt, b)] = n.group(1) if n else "mixed"
for dt in ("bf16", "fp8"):
    print(f"{dt}: batch, rule (splits us), best (splits us), rule / best, then us at splits " + " ".join(counts))
    for b in sorted({k[1] for k in t if k[0] == dt}):
        if not t[(dt, b, "rule")]:
            continue
        have = [c for c in counts if t[(dt, b, c)]]
        best = min(have, key=lambda c: min(t[(dt, b, c)]))
        r, bt = min(t[(dt, b, "rule")]), min(t[(dt, b, best)])
        cells = " ".join(f"{min(t[(dt, b, c)]):7.2f}" if t[(dt, b, c)] else "      -" for c in counts)
        print(f"  B{b:<4d} {rule[(dt, b)]:>5s} {r:8.2f}  {best:>3s} {bt:8.2f}  {r / bt:.3f}  {cells}")
PY
