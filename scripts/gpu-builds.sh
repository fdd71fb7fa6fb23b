# Sourced by gpu-check.sh and gpu-prebuilt.sh (from the repository root): the two builds that
# gpu-check.sh runs. M3RT_GIT_COMMIT, when set, names the commit in their binaries.
# The default build (sm_90a + sm_80 + compute_80 PTX), tests included, in directory $1.
m3rt_build_default() {
  cmake -S . -B "$1" -G Ninja -DCMAKE_BUILD_TYPE=Release -DM3RT_BUILD_TESTS=ON \
    -DM3RT_GIT_COMMIT="${M3RT_GIT_COMMIT:-}" && cmake --build "$1" -j "$(nproc)"
}
# A build without sm_90a code (sm_80 SASS + compute_80 PTX), the CLI alone, in directory $1.
m3rt_build_sm80() {
  cmake -S . -B "$1" -G Ninja -DCMAKE_BUILD_TYPE=Release -DM3RT_BUILD_TESTS=OFF \
    '-DM3RT_CUDA_GENCODE=-gencode=arch=compute_80,code=sm_80;-gencode=arch=compute_80,code=compute_80' \
    -DM3RT_GIT_COMMIT="${M3RT_GIT_COMMIT:-}" && cmake --build "$1" -j "$(nproc)" --target m3rt
}
