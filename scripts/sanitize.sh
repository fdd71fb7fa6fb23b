#!/usr/bin/env bash
# The CPU library, CLI and tests built with AddressSanitizer and UndefinedBehaviorSanitizer (GCC,
# no CUDA) into ${BUILD_DIR:-build-asan}, then every CPU test under CTest: a memory error, a leak
# or undefined behaviour in the references, validation, checkpoint loading, the drafter's CPU model
# or the CLI fails its test. (The package test is left out: its consumer is built without the
# sanitizer runtime, which then refuses to load.) GPU code is covered by compute-sanitizer in
# scripts/gpu-check.sh instead.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/install-deps.sh
BUILD_DIR=${BUILD_DIR:-build-asan}
flags="-fsanitize=address,undefined -fno-sanitize-recover=undefined -fno-omit-frame-pointer"
cmake -S . -B "$BUILD_DIR" -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo -DM3RT_WITH_CUDA=OFF -DM3RT_BUILD_TESTS=ON \
  -DCMAKE_CXX_FLAGS="$flags" -DCMAKE_EXE_LINKER_FLAGS="$flags" -DCMAKE_SHARED_LINKER_FLAGS="$flags" >/dev/null
cmake --build "$BUILD_DIR" -j "${JOBS:-$(nproc)}"
cd "$BUILD_DIR"
ASAN_OPTIONS=detect_leaks=1:abort_on_error=0 UBSAN_OPTIONS=print_stacktrace=1 \
  ctest --output-on-failure -j "${JOBS:-$(nproc)}" -E '^package_find_package$'
