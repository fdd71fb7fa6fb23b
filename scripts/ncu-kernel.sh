#!/usr/bin/env bash
# Profiles one launch of one kernel with Nsight Compute (full set, source correlation) and prints
# the headline metrics, the pipes' utilization, the warps' stall reasons and the hottest source
# lines (scripts/ncu-lines.py). For the GPU machine; every CUDA target is built with -lineinfo
# (cmake/m3rt_cuda.cmake), so the source lines are there.
#   scripts/ncu-kernel.sh NAME KERNEL_SUBSTRING SKIP CMD...
# NAME labels the report ($OUT/NAME.ncu-rep when OUT is set, else /tmp), KERNEL_SUBSTRING is a part
# of the kernel's mangled name, SKIP how many matching launches to pass over first; the application
# is stopped once that launch is profiled.
set -uo pipefail
name=$1 kernel=$2 skip=$3; shift 3
NCU=$(ls /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | tail -1)
[ -n "$NCU" ] || NCU=$(command -v ncu)
[ -n "$NCU" ] || NCU=$(ls /usr/local/cuda*/bin/ncu 2>/dev/null | tail -1)
[ -n "$NCU" ] || { echo "ncu-kernel: no ncu found"; exit 1; }
dir=${OUT:-/tmp}
"$NCU" --kill yes --clock-control none --kernel-name-base mangled -k "regex:$kernel" -s "$skip" -c 1 \
  --set full --import-source yes -f -o "$dir/$name" "$@" >"$dir/$name.ncu.log" 2>&1 || { tail -20 "$dir/$name.ncu.log"; exit 1; }
echo "=== $name"
"$NCU" -i "$dir/$name.ncu-rep" --page details --print-units base 2>/dev/null | grep -E \
  "Grid Size|Block Size|Registers Per|Duration|DRAM Throughput|Memory Throughput|Compute \(SM\) Throughput|Executed Ipc Active|Issue Slots Busy|Achieved Occupancy|No Eligible|Warp Cycles Per Issued|Executed Instructions  |L1/TEX Hit|L2 Hit" | sed 's/  */ /g'
# Which pipe binds and what the warps wait on: each pipe's share of its peak and the stall reasons
# per issued instruction (raw metrics of the full set), those above 1% / 0.05.
"$NCU" -i "$dir/$name.ncu-rep" --page raw --print-units base 2>/dev/null | grep -E \
  "sm__(pipe|inst_executed_pipe)_[a-z0-9_]+\.avg\.pct_of_peak_sustained_active|smsp__average_warps_issue_stalled_[a-z_]+_per_issue_active\.ratio" |
  awk '{v = $NF; gsub(",", "", v); if ((index($1, "pct") && v + 0 > 1) || (index($1, "ratio") && v + 0 > 0.05)) print $1, v}'
PYTHONPATH=$(dirname "$NCU")/extras/python python3 "$(dirname "$0")/ncu-lines.py" "$dir/$name.ncu-rep" 30 \
  $(git -C "$(dirname "$0")/.." ls-files 'src/*.cu' 'src/*.cuh' | sed "s|^|$(dirname "$0")/../|")
