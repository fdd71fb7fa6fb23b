#!/usr/bin/env bash
# Quick start: install dependencies, build, and run the main job: `m3rt check` (every op's
# correctness self-test on fresh random inputs, on the CPU and on each GPU present), then one
# DSpark draft step on a generated tiny checkpoint (`m3rt draft`).
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/install-deps.sh
scripts/build.sh
"${BUILD_DIR:-build}/m3rt" check "$@"
exec "${BUILD_DIR:-build}/m3rt" draft
