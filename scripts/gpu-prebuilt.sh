#!/usr/bin/env bash
# On a machine with nvcc but no GPU: build what scripts/gpu-check.sh runs (its default build and
# the sm_80-only one) and copy the binaries alone, without object files, to DEST (default
# build-gpu-prebuilt, git-ignored) and DEST-sm80: ~54 MB, small enough to carry to a GPU machine.
# There: SKIP_BUILD=1 BUILD_DIR=DEST STEPS=... scripts/gpu-check.sh (see its header).
set -euo pipefail
cd "$(dirname "$0")/.."
DEST=${1:-build-gpu-prebuilt}
B=${BUILD_DIR:-build-prebuilt}
. scripts/gpu-builds.sh
export M3RT_GIT_COMMIT=${M3RT_GIT_COMMIT:-$(git rev-parse --short=12 HEAD 2>/dev/null || echo unknown)}
m3rt_build_default "$B"
m3rt_build_sm80 "$B-sm80"
rm -rf "$DEST" "$DEST-sm80"
mkdir -p "$DEST/tests" "$DEST-sm80"
cp -P "$B"/libm3rt.so* "$B/m3rt" "$B/m3rt_access_ceiling" "$B/m3rt_fp8_wgmma_precision" "$B/m3rt_prefill_stream_probe" \
  "$B/m3rt_mma_sync_ceiling" "$B/m3rt_wgmma_ceiling" "$B/m3rt_msa_hash" "$DEST/"
for t in "$B"/tests/test_*; do
  if [ -f "$t" ] && [ -x "$t" ]; then cp "$t" "$DEST/tests/"; fi
done
cp -P "$B-sm80"/libm3rt.so* "$B-sm80/m3rt" "$DEST-sm80/"
echo "$M3RT_GIT_COMMIT" >"$DEST/COMMIT"
du -sh "$DEST" "$DEST-sm80"
