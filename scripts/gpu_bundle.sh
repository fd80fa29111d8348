#!/usr/bin/env bash
# Packs the programs and ctest files of build/ (stripped) into .gpu/bundle.tar.xz, for the GPU machine, whose
# image lacks this project's build dependencies: carry .gpu and run scripts/gpu_check.sh there.
set -euo pipefail
cd "$(dirname "$0")/.."
[ -d build/bin ] || { echo "build/ is not built: run make build first" >&2; exit 1; }
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
echo "$(pwd)" > "$stage/build/SOURCE_DIR"
tar -C "$stage" -cJf .gpu/bundle.tar.xz build
ls -la .gpu/bundle.tar.xz
