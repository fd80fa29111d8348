#!/usr/bin/env bash
# On the GPU machine, after scripts/gpu_bundle.sh here: every GPU check and benchmark of a release, in one go.
# Needs .gpu (the bundle) and build-py/wheelhouse (the cp312 wheel of `PYTHON=python3.12 make wheel`; WHEEL=path for
# another) carried. Results: $OUT/results.tar.gz with quick/ (gpuipc bench all --quick), full/ (segments, channels,
# python, pools at full length) and logs/.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/gpuipc-out}
work=$(mktemp -d)
mkdir -p "$work/quick" "$work/full" "$work/logs"
python=${PYTHON:-/opt/torch/.venv/bin/python3}
# The Python module, for the python suite and the Python GPU tests.
site=$(mktemp -d)
"$python" -m pip install -q --no-index --no-deps --target "$site" "${WHEEL:-$(ls build-py/wheelhouse/gpuipc-*.whl)}"
(OUT="$work/logs" PYTHON="$python" WHEEL="${WHEEL:-}" timeout 300 bash python/run_gpu_tests.sh -q -rs > /dev/null 2>&1)
echo "python GPU tests: $(tail -n 1 "$work/logs/pytest-python.log")"
scripts/gpu_check.sh doctor tests demo | tail -n 4
start=$(date +%s)
PYTHONPATH="$site" ./build/bin/gpuipc bench all --quick --no-progress --out-dir "$work/quick" > "$work/logs/bench-all-quick.log" 2>&1
echo "bench all --quick: exit $? in $(( $(date +%s) - start )) s" | tee -a "$work/logs/bench-all-quick.log"
PYTHONPATH="$site" PATH="$(dirname "$python"):$PATH" ./build/bin/gpuipc bench segments channels python pools --no-progress \
  --out-dir "$work/full" > "$work/logs/bench-full.log" 2>&1
echo "bench segments channels python pools: exit $?"
grep -h "note:" "$work/logs/bench-full.log" | head -n 30
tar -czf "$OUT/results.tar.gz" -C "$work" quick full logs
