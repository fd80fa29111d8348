#!/usr/bin/env bash
# Packs the programs and ctest files of build/ (stripped) into .gpu/bundle.tar.xz, for the GPU machine, whose
# image lacks this project's build dependencies: carry .gpu and run scripts/gpu_check.sh there.
set -euo pipefail
cd "$(dirname "$0")/.."
[ -d build/bin ] || { echo "build/ is not built: run make build first" >&2; exit 1; }
# Results name the commit they measured: the build must be of a clean, committed tree, built after the commit.
head=$(git rev-parse HEAD)
if [ -n "$(git status --porcelain -- . ':(exclude)bench/results')" ]; then
  echo "uncommitted changes (or untracked files) outside bench/results: commit, rebuild, then bundle" >&2; exit 1
fi
built=$(sed -n 's/.*GPUIPC_BENCH_GIT_COMMIT "\(.*\)"/\1/p' build/bench/bench_commit.hpp 2>/dev/null)
if [ -n "$built" ] && [ "$built" != "$head" ]; then
  echo "build/ embeds commit $built but HEAD is $head: rebuild (cmake --build --preset default) first" >&2; exit 1
fi
# Lists every test here once, so that each test binary has its gtest list (PRE_TEST discovery writes it at the
# first ctest run that sees the binary; a test never run here would have none).
ctest --test-dir build -N > /dev/null
stage=$(mktemp -d)
trap 'rm -rf "$stage"' EXIT
mkdir -p "$stage/build/bin" "$stage/build/tests" .gpu
cp build/CTestTestfile.cmake "$stage/build/"
for f in build/bin/*; do strip -o "$stage/$f" "$f"; done
for f in build/tests/*; do
  case "$f" in
    *.cmake) cp "$f" "$stage/$f" ;;
    *) if [ -f "$f" ] && [ -x "$f" ]; then strip -o "$stage/$f" "$f"; fi ;;
  esac
done
# gtest's test lists (written when the tests were built): newer than the stripped copies, or ctest would list the
# tests again there with this machine's GoogleTestAddTests.cmake, which the GPU image lacks.
sleep 1
touch "$stage"/build/tests/*_tests.cmake
echo "$(pwd)" > "$stage/build/SOURCE_DIR"
tar -C "$stage" -cJf .gpu/bundle.tar.xz build
ls -la .gpu/bundle.tar.xz
