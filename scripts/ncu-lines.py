#!/usr/bin/env python3
"""Per-source-line warp samples of the first kernel in an Nsight Compute report.

Usage (on the GPU machine, with the report of `ncu --set full --import-source yes -o R ...`):
    PYTHONPATH=/opt/nvidia/nsight-compute/<version>/extras/python scripts/ncu-lines.py R.ncu-rep [top]

Prints the `top` source lines (default 40) by PC-sampling warp samples, with their share of the
kernel's samples, the top stall reasons of each line, and the source text. Lines come from the
report's source correlation (build with -lineinfo).
"""
import collections
import sys

import ncu_report


def main():
    path = sys.argv[1]
    top = int(sys.argv[2]) if len(sys.argv) > 2 else 40
    ctx = ncu_report.load_report(path)
    act = ctx.range_by_idx(0).action_by_idx(0)
    names = [n for n in act.metric_names() if n.startswith("smsp__pcsamp_warps_issue_stalled_")
             and not n.endswith("_not_issued")]
    per_line = collections.Counter()
    reasons = collections.defaultdict(collections.Counter)
    for name in names:
        m = act.metric_by_name(name)
        if m is None or not m.has_correlation_ids():
            continue
        ids = m.correlation_ids()
        for i in range(m.num_instances()):
            v = m.as_uint64(i)
            if v == 0:
                continue
            info = act.source_info(ids.as_uint64(i))
            key = (info.file_name().split("/")[-1], info.line()) if info else ("?", 0)
            per_line[key] += v
            reasons[key][name.replace("smsp__pcsamp_warps_issue_stalled_", "")] += v
    total = sum(per_line.values()) or 1
    files = {}
    print(f"{act.name()}: {total} samples over {len(per_line)} lines")
    for (f, line), v in per_line.most_common(top):
        if f not in files:
            try:
                files[f] = open(next(p for p in sys.argv[3:] if p.split("/")[-1] == f)).read().split("\n")
            except (StopIteration, OSError):
                files[f] = []
        src = files[f][line - 1].strip() if 0 < line <= len(files[f]) else ""
        why = ", ".join(f"{r} {100 * c / v:.0f}%" for r, c in reasons[(f, line)].most_common(3))
        print(f"{100 * v / total:5.1f}%  {f}:{line:<5} [{why}]  {src[:110]}")


if __name__ == "__main__":
    main()
