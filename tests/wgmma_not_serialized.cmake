# ctest script: compiles one CUDA source for sm_90a as the library does and fails when ptxas
# reports that it serialized a kernel's warpgroup MMAs ("wgmma.mma_async instructions are
# serialized due to ...", advisories C7510-C7520: a wait after every wgmma). Nothing else shows
# it: results stay correct, only the Hopper loops run slower (a pipelined MSA loop lost 26-31% so
# in session 14; docs/perf.md). Variables: NVCC, ROOT (the source tree), SRC, OUT (the cubin).
execute_process(
  COMMAND ${NVCC} -cubin -o ${OUT} -std=c++20 -O3 -DNDEBUG -DM3RT_WITH_CUDA=1 -DM3RT_SM90A_CODE=1
          -I${ROOT}/include -I${ROOT}/src -gencode=arch=compute_90a,code=sm_90a -Xcompiler=-ffp-contract=off
          ${SRC}
  RESULT_VARIABLE rc OUTPUT_VARIABLE out ERROR_VARIABLE err)
if(NOT rc EQUAL 0)
  message(FATAL_ERROR "nvcc failed on ${SRC} (exit ${rc}):\n${err}")
endif()
string(REGEX MATCHALL "[^\n]*wgmma[^\n]*serialized[^\n]*" hits "${out}\n${err}")
if(hits)
  list(LENGTH hits n)
  string(REPLACE ";" "\n" lines "${hits}")
  message(FATAL_ERROR "ptxas serialized wgmma instructions in ${n} kernel(s) of ${SRC}:\n${lines}")
endif()
message(STATUS "${SRC}: no serialized wgmma")
