# The commit a build measures: the full sha of SOURCE_DIR's HEAD, "-dirty" appended when the tree has changes
# (anything outside bench/results/, untracked files too); "unknown" when SOURCE_DIR is not the top of a git work tree
# (an unpacked sdist inside another checkout would otherwise name that checkout). COMMIT, when given, is taken as is
# (scripts/build_wheel.sh passes the checkout's to the wheel it builds from an sdist). OUTPUT: a header (#define
# GPUIPC_BENCH_GIT_COMMIT), a .cpp (gpuipc::py::build_commit()) or a .txt (the sha alone); rewritten only when it
# changes.
if(DEFINED COMMIT AND NOT COMMIT STREQUAL "")
  set(sha "${COMMIT}")
else()
  execute_process(COMMAND git -C ${SOURCE_DIR} rev-parse --show-toplevel HEAD OUTPUT_VARIABLE lines
                  OUTPUT_STRIP_TRAILING_WHITESPACE RESULT_VARIABLE rc ERROR_QUIET)
  string(REPLACE "\n" ";" lines "${lines}")
  list(LENGTH lines n)
  set(sha "unknown")
  if(rc EQUAL 0 AND n EQUAL 2)
    list(GET lines 0 top)
    list(GET lines 1 head)
    file(REAL_PATH "${SOURCE_DIR}" here)
    file(REAL_PATH "${top}" top)
    if(here STREQUAL top)
      set(sha "${head}")
      # The whole tree: testkit/'s kernels, examples/, python/, CMakeLists.txt and cmake/ (flags, architectures) are
      # measured as much as src/; untracked files too (CONFIGURE_DEPENDS globs compile new sources). Results apart.
      execute_process(COMMAND git -C ${SOURCE_DIR} status --porcelain -- . ":(exclude)bench/results"
                      OUTPUT_VARIABLE dirty OUTPUT_STRIP_TRAILING_WHITESPACE ERROR_QUIET)
      if(NOT dirty STREQUAL "")
        set(sha "${sha}-dirty")
      endif()
    endif()
  endif()
endif()
if(OUTPUT MATCHES "\\.txt$")
  set(content "${sha}\n")
elseif(OUTPUT MATCHES "\\.cpp$")
  # A source file instead of a header (for a front end that includes only its own folder and include/): the
  # function its caller declares.
  set(content "namespace gpuipc::py {\nconst char* build_commit() noexcept { return \"${sha}\"; }\n}  // namespace gpuipc::py\n")
else()
  set(content "#pragma once\n#define GPUIPC_BENCH_GIT_COMMIT \"${sha}\"\n")
endif()
if(EXISTS ${OUTPUT})
  file(READ ${OUTPUT} old)
endif()
if(NOT "${old}" STREQUAL "${content}")
  file(WRITE ${OUTPUT} "${content}")
endif()
