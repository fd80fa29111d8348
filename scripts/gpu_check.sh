#!/usr/bin/env bash
# On the GPU machine: unpack the bundle made by scripts/gpu_bundle.sh and run GPU checks, logs under $OUT
# (at most 8 files come back: env.log, doctor.json, gpu-tests.log, demo.log, bench.log, <suite>-*.json).
#   scripts/gpu_check.sh [doctor] [tests [REGEX]] [demo] [bench SUITE...]
# On two GPUs: scripts/gpu_check.sh doctor tests MultiGpu bench multigpu (docs/multigpu.md).
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/gpuipc-out}
mkdir -p "$OUT"
if [ -f .gpu/bundle.tar.xz ] && [ ! -d build/bin ]; then
  tar -xJf .gpu/bundle.tar.xz
fi
# ctest files name the build folder by the absolute path it was generated at.
src=$(cat build/SOURCE_DIR)
if [ "$src" != "$(pwd)" ] && [ ! -e "$src" ]; then mkdir -p "$(dirname "$src")" && ln -s "$(pwd)" "$src"; fi
export GPUIPC_DAEMON=$(pwd)/build/bin/gpuipcd
# The GPU-to-GPU links too (NVLink, PCIe): the multigpu tests and suite depend on them; gpuipc doctor reports them.
{ nvidia-smi; nvidia-smi -q | grep -i -E "compute mode|mig mode" ; nvidia-smi topo -m; uname -a; } > "$OUT/env.log" 2>&1
rc=0
while [ $# -gt 0 ]; do
  case "$1" in
    doctor)
      ./build/bin/gpuipc doctor --json > "$OUT/doctor.json" 2>> "$OUT/env.log"; echo "doctor --json: exit $?"
      { echo "== gpuipc doctor"; ./build/bin/gpuipc doctor; echo "exit $?"; } >> "$OUT/env.log" 2>&1 ;;
    tests)
      regex=""
      if [ $# -gt 1 ] && [[ "$2" != doctor && "$2" != demo && "$2" != bench ]]; then regex="$2"; shift; fi
      (cd "$src/build" && ctest -L gpu ${regex:+-R "$regex"} --output-on-failure --timeout 300 -j 4) \
        > "$OUT/gpu-tests.log" 2>&1 || rc=1
      tail -n 30 "$OUT/gpu-tests.log" ;;
    demo)
      ./build/bin/gpuipc demo > "$OUT/demo.log" 2>&1 || rc=1; cat "$OUT/demo.log" ;;
    bench)
      shift
      for s in "$@"; do
        { echo "== gpuipc bench $s"; ./build/bin/gpuipc bench "$s" --no-progress --out-dir "$OUT"; echo "exit $?"; } \
          >> "$OUT/bench.log" 2>&1 || rc=1
      done
      cat "$OUT/bench.log"
      break ;;
  esac
  shift
done
exit $rc
