#!/usr/bin/env bash
# Fuzzes one of m3rt's untrusted-input readers with libFuzzer (+ ASan + UBSan) for SECONDS (default
# 180), then merges what it found into tests/fuzz/corpus/TARGET (minimized: only inputs that add
# coverage are kept). TARGET: safetensors (the safetensors validation and its JSON parser, default)
# or dspark_config (the draft config.json reader). Needs clang with libFuzzer (Debian: clang).
#   scripts/fuzz.sh [TARGET] [SECONDS]
set -euo pipefail
cd "$(dirname "$0")/.."
TARGET=${1:-safetensors}
SECONDS_TO_RUN=${2:-180}
case "$TARGET" in
  safetensors) SOURCES="src/model/safetensors.cpp"; DICT=tests/fuzz/safetensors.dict ;;
  dspark_config) SOURCES="src/model/dspark_config.cpp"; DICT=tests/fuzz/dspark_config.dict ;;
  *) echo "fuzz.sh: unknown target '$TARGET' (safetensors, dspark_config)" >&2; exit 2 ;;
esac
OUT=${OUT:-/tmp/m3rt-fuzz}/$TARGET
mkdir -p "$OUT/new" "$OUT/merged"
CORPUS=tests/fuzz/corpus/$TARGET
clang++ -std=c++20 -O1 -g -fsanitize=fuzzer,address,undefined -fno-sanitize-recover=undefined \
  -Iinclude -Isrc "tests/fuzz/fuzz_$TARGET.cpp" $SOURCES src/core/json.cpp src/core/error.cpp \
  src/core/dtype.cpp src/core/tensor.cpp -o "$OUT/fuzz"
"$OUT/fuzz" -max_total_time="$SECONDS_TO_RUN" -max_len=4096 -dict="$DICT" "$OUT/new" "$CORPUS"
# Keep a minimal set that covers what both the old corpus and the new finds cover.
rm -f "$OUT/merged"/*
"$OUT/fuzz" -merge=1 "$OUT/merged" "$CORPUS" "$OUT/new"
rm -f "$CORPUS"/*
cp "$OUT/merged"/* "$CORPUS"/
echo "fuzz $TARGET: corpus now $(ls "$CORPUS" | wc -l) inputs"
