# CUDA kernels are compiled to a fatbinary (Hopper machine code plus PTX for newer GPUs) and embedded into
# the programs that launch them through the run-time-loaded driver (cuModuleLoadData + cuLaunchKernel).
# Nothing links the CUDA runtime, so every binary starts on a machine without a driver.
set(GPUIPC_HAVE_KERNELS OFF)
if(GPUIPC_BUILD_KERNELS)
  find_program(GPUIPC_NVCC nvcc HINTS $ENV{CUDA_HOME}/bin /usr/local/cuda/bin)
  if(GPUIPC_NVCC)
    set(GPUIPC_HAVE_KERNELS ON)
  else()
    message(STATUS "nvcc not found: GPU kernels (GPU tests, benchmarks, GPU demo) are not built")
  endif()
endif()
set(GPUIPC_CUDA_ARCHS "80;90" CACHE STRING "SASS targets for the embedded kernels (PTX of the last one is embedded too)")

function(gpuipc_add_fatbin symbol source)
  set(fatbin "${CMAKE_CURRENT_BINARY_DIR}/${symbol}.fatbin")
  set(gencode "")
  foreach(arch ${GPUIPC_CUDA_ARCHS})
    list(APPEND gencode "-gencode=arch=compute_${arch},code=sm_${arch}")
    set(last ${arch})
  endforeach()
  list(APPEND gencode "-gencode=arch=compute_${last},code=compute_${last}")
  add_custom_command(
    OUTPUT "${fatbin}"
    COMMAND ${GPUIPC_NVCC} -fatbin -std=c++17 -O3 ${gencode} -I${PROJECT_SOURCE_DIR}/include -o "${fatbin}" "${source}"
    DEPENDS "${source}"
    COMMENT "nvcc -fatbin ${symbol}")
  gpuipc_embed_file(src "${fatbin}" ${symbol})
  set(${symbol}_SOURCE "${src}" PARENT_SCOPE)
endfunction()
