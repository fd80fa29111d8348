execute_process(COMMAND git -C ${SOURCE_DIR} rev-parse HEAD OUTPUT_VARIABLE sha OUTPUT_STRIP_TRAILING_WHITESPACE
                RESULT_VARIABLE rc ERROR_QUIET)
if(NOT rc EQUAL 0 OR sha STREQUAL "")
  set(sha "unknown")
else()
  # The whole tree: testkit/'s kernels, examples/, python/, CMakeLists.txt and cmake/ (flags, architectures) are
  # measured as much as src/; untracked files too (CONFIGURE_DEPENDS globs compile new sources). Results apart.
  execute_process(COMMAND git -C ${SOURCE_DIR} status --porcelain -- . ":(exclude)bench/results"
                  OUTPUT_VARIABLE dirty OUTPUT_STRIP_TRAILING_WHITESPACE ERROR_QUIET)
  if(NOT dirty STREQUAL "")
    set(sha "${sha}-dirty")
  endif()
endif()
set(content "#pragma once\n#define GPUIPC_BENCH_GIT_COMMIT \"${sha}\"\n")
if(EXISTS ${OUTPUT})
  file(READ ${OUTPUT} old)
endif()
if(NOT "${old}" STREQUAL "${content}")
  file(WRITE ${OUTPUT} "${content}")
endif()
