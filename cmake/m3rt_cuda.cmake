# CUDA detection and per-target flags.
#   M3RT_CUDA_ENABLED   ON when the CUDA language and toolkit are available and wanted.
#   m3rt_set_flags(tgt) warnings, -ffp-contract=off for C++ (CPU references round as written),
#                       -lineinfo and ptxas spill/local-memory warnings for CUDA.
set(M3RT_CUDA_ENABLED OFF)
if(NOT M3RT_WITH_CUDA STREQUAL "OFF")
  include(CheckLanguage)
  if(NOT CMAKE_CUDA_COMPILER AND EXISTS /usr/local/cuda/bin/nvcc)
    set(CMAKE_CUDA_COMPILER /usr/local/cuda/bin/nvcc)
  endif()
  check_language(CUDA)
  if(CMAKE_CUDA_COMPILER)
    # The -gencode list below is the architecture selection; keep CMake from adding its own.
    set(CMAKE_CUDA_ARCHITECTURES OFF)
    enable_language(CUDA)
    find_package(CUDAToolkit REQUIRED)
    # CMake 3.25 predates nvcc's C++20 support in its tables; nvcc 12+ takes -std=c++20.
    if(NOT CMAKE_CUDA20_STANDARD_COMPILE_OPTION)
      set(CMAKE_CUDA20_STANDARD_COMPILE_OPTION "-std=c++20")
      set(CMAKE_CUDA20_EXTENSION_COMPILE_OPTION "-std=c++20")
    endif()
    set(CMAKE_CUDA_STANDARD 20)
    set(CMAKE_CUDA_STANDARD_REQUIRED ON)
    set(M3RT_CUDA_ENABLED ON)
    message(STATUS "m3rt: CUDA ${CMAKE_CUDA_COMPILER_VERSION}, ${M3RT_CUDA_GENCODE}")
  elseif(M3RT_WITH_CUDA STREQUAL "ON")
    message(FATAL_ERROR "M3RT_WITH_CUDA=ON but no CUDA compiler was found (set CMAKE_CUDA_COMPILER)")
  else()
    message(STATUS "m3rt: no CUDA compiler found; building the CPU library and CLI only")
  endif()
endif()

function(m3rt_set_flags tgt)
  set(cxx_flags -Wall -Wextra -Wno-missing-field-initializers -ffp-contract=off)
  set(cuda_flags -lineinfo ${M3RT_CUDA_GENCODE} -Xptxas=--warn-on-spills,--warn-on-local-memory-usage
                 -Xcompiler=-Wall,-ffp-contract=off)
  target_compile_options(${tgt} PRIVATE "$<$<COMPILE_LANGUAGE:CXX>:${cxx_flags}>"
                                        "$<$<COMPILE_LANGUAGE:CUDA>:${cuda_flags}>")
endfunction()

# Targets whose code asks kernels::hopper_paths_run() (src/ops/common/sm90.cuh) learn whether this
# build carries sm_90a code, so that they answer as the library's launchers do.
function(m3rt_sm90a_code tgt)
  if(M3RT_CUDA_GENCODE MATCHES "(sm|compute)_90a")
    target_compile_definitions(${tgt} PRIVATE M3RT_SM90A_CODE=1)
  endif()
endfunction()
