#!/usr/bin/env bash
# Installs m3rt's build dependencies from Debian packages: a C++20 compiler, CMake, Ninja and
# GoogleTest/GoogleMock. Does nothing when they are already present. The CUDA toolkit (nvcc) is
# optional: without it the CPU library, CLI and tests build, and GPU tests are skipped.
set -euo pipefail
need=()
for pkg in g++ cmake ninja-build libgtest-dev libgmock-dev git; do
  dpkg -s "$pkg" >/dev/null 2>&1 || need+=("$pkg")
done
if ((${#need[@]})); then
  echo "install-deps: installing ${need[*]}"
  SUDO=""; [ "$(id -u)" -eq 0 ] || SUDO="sudo"
  $SUDO apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq "${need[@]}"
fi
if command -v nvcc >/dev/null 2>&1 || [ -x /usr/local/cuda/bin/nvcc ]; then
  echo "install-deps: CUDA compiler found; the kernels will be built"
else
  echo "install-deps: no CUDA compiler; building the CPU library only"
fi
