#!/usr/bin/env bash
# Builds m3rt with its tests and runs them under CTest. GPU tests skip (reported as skipped)
# when no GPU is present.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/install-deps.sh
scripts/build.sh -DM3RT_BUILD_TESTS=ON
cd "${BUILD_DIR:-build}"
ctest --output-on-failure -j "${JOBS:-$(nproc)}"
