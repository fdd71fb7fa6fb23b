#!/usr/bin/env python3
"""The innermost loop around a kernel's MMAs, counted in its SASS (no GPU needed).

Usage: scripts/sass-loop.py FILE KERNEL [--mma REGEX] [--top N]

FILE is a shared library or cubin (disassembled with cuobjdump: on PATH, in $CUDA_HOME/bin, or
named by $CUOBJDUMP; the PyPI wheel nvidia-cuda-cuobjdump has one) or a text file of
`cuobjdump -sass` output. KERNEL is a substring of exactly one function's mangled name. The loop is
the shortest backward branch whose body holds every instruction matching --mma (default: HMMA or
HGMMA). Prints the loop's address range, its instruction and MMA counts and its opcodes by count.

The count is static: a body with branches (a token that skips a chunk, a request's last chunk)
counts every path once. docs/perf.md (Method, "Instruction budget") turns it into a bound: at a
target rate, an SM has `FLOP an iteration x SMs x clock / rate` cycles an iteration and issues at
most four warp instructions a cycle.
"""
import argparse
import collections
import os
import re
import shutil
import subprocess
import sys


def sass_text(path):
    with open(path, "rb") as f:
        head = f.read(4)
    if head != b"\x7fELF":
        with open(path, encoding="utf-8", errors="replace") as f:
            return f.read()
    tool = os.environ.get("CUOBJDUMP") or shutil.which("cuobjdump")
    if not tool and os.environ.get("CUDA_HOME"):
        cand = os.path.join(os.environ["CUDA_HOME"], "bin", "cuobjdump")
        tool = cand if os.path.exists(cand) else None
    if not tool:
        sys.exit("sass-loop: no cuobjdump (PATH, $CUDA_HOME/bin or $CUOBJDUMP); or pass `cuobjdump -sass` output")
    return subprocess.run([tool, "-sass", path], check=True, capture_output=True, text=True).stdout


def function_body(text, kernel):
    parts = text.split("Function : ")[1:]
    hits = [p for p in parts if kernel in p.split("\n", 1)[0]]
    if len(hits) != 1:
        names = [p.split("\n", 1)[0].strip() for p in hits]
        sys.exit(f"sass-loop: KERNEL {kernel!r} matches {len(hits)} functions (need one): {names[:6]}")
    return hits[0].split("\n", 1)[0].strip(), hits[0]


def instructions(body):
    out = []
    for line in body.split("\n"):
        m = re.match(r"\s*/\*([0-9a-f]{4,})\*/\s+(.*?)\s*;", line)
        if m:
            out.append((int(m.group(1), 16), m.group(2)))
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("file")
    ap.add_argument("kernel")
    ap.add_argument("--mma", default=r"\bH(G)?MMA\b")
    ap.add_argument("--top", type=int, default=24)
    a = ap.parse_args()
    name, body = function_body(sass_text(a.file), a.kernel)
    ins = instructions(body)
    mma = [addr for addr, s in ins if re.search(a.mma, s)]
    if not mma:
        sys.exit(f"sass-loop: no instruction of {name} matches --mma {a.mma!r}")
    lo, hi = min(mma), max(mma)
    loop = None
    for addr, s in ins:
        m = re.search(r"\bBRA(?:\.\w+)*\s+(?:!?U?P\w+,\s*)?0x([0-9a-f]+)", s)
        if m:
            target = int(m.group(1), 16)
            if target <= lo and addr >= hi and (loop is None or addr - target < loop[1] - loop[0]):
                loop = (target, addr)
    if loop is None:
        sys.exit(f"sass-loop: no backward branch of {name} encloses its MMAs")
    body_ins = [s for addr, s in ins if loop[0] <= addr <= loop[1]]
    ops = collections.Counter()
    for s in body_ins:
        s = re.sub(r"^@!?U?P\w+\s+", "", s)
        ops[s.split()[0].split(".")[0]] += 1
    n_mma = sum(1 for s in body_ins if re.search(a.mma, s))
    print(f"{name}\nloop {loop[0]:#x}-{loop[1]:#x}: {len(body_ins)} instructions, {n_mma} MMAs")
    print("  " + ", ".join(f"{op} {n}" for op, n in ops.most_common(a.top)))


if __name__ == "__main__":
    main()
