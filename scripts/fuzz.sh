#!/usr/bin/env bash
# Fuzzes the safetensors reader (and its JSON parser) with libFuzzer for SECONDS (default 180),
# then merges what it found into tests/fuzz/corpus/safetensors (minimized: only inputs that add
# coverage are kept). Needs clang with libFuzzer (Debian: clang, libclang-rt-dev).
set -euo pipefail
cd "$(dirname "$0")/.."
SECONDS_TO_RUN=${1:-180}
OUT=${OUT:-/tmp/m3rt-fuzz}
mkdir -p "$OUT/new"
CORPUS=tests/fuzz/corpus/safetensors
clang++ -std=c++20 -O1 -g -fsanitize=fuzzer,address,undefined -fno-sanitize-recover=undefined \
  -Iinclude -Isrc tests/fuzz/fuzz_safetensors.cpp src/model/safetensors.cpp src/core/json.cpp \
  src/core/error.cpp src/core/dtype.cpp src/core/tensor.cpp -o "$OUT/fuzz_safetensors"
"$OUT/fuzz_safetensors" -max_total_time="$SECONDS_TO_RUN" -max_len=4096 -dict=tests/fuzz/safetensors.dict \
  "$OUT/new" "$CORPUS"
# Keep a minimal set that covers what both the old corpus and the new finds cover.
mkdir -p "$OUT/merged"
rm -f "$OUT/merged"/*
"$OUT/fuzz_safetensors" -merge=1 "$OUT/merged" "$CORPUS" "$OUT/new"
rm -f "$CORPUS"/*
cp "$OUT/merged"/* "$CORPUS"/
echo "fuzz: corpus now $(ls "$CORPUS" | wc -l) inputs"
