#!/usr/bin/env bash
# Runs the Python tests (GPU ones included) on a machine without internet, from a wheel built elsewhere: the
# manylinux wheel of `PYTHON=python3.12 make wheel` (scripts/build_wheel.sh), or WHEEL=path for another, and
# pytest's wheels in the same folder where the interpreter lacks pytest.
# Installs nothing into the interpreter's environment: packages go to a private folder on PYTHONPATH, so the
# interpreter's own torch / cupy / jax / numpy are used. Results (JUnit XML and the log) go to $OUT when set.
#   [PYTHON=/opt/torch/.venv/bin/python3] [WHEEL=build-py/wheelhouse/gpuipc-*.whl] bash python/run_gpu_tests.sh [pytest args]
set -euo pipefail
cd "$(dirname "$0")/.."
python=${PYTHON:-/opt/torch/.venv/bin/python3}
wheels=${WHEELHOUSE:-build-py/wheelhouse}
if [ -n "${WHEEL:-}" ]; then
  wheel=$WHEEL
else
  found=("$wheels"/gpuipc-*.whl)
  [ ${#found[@]} -eq 1 ] && [ -f "${found[0]}" ] || { echo "want one gpuipc wheel in $wheels (or WHEEL=path): ${found[*]}" >&2; exit 1; }
  wheel=${found[0]}
fi
target=$(mktemp -d /tmp/gpuipc-py-XXXXXX)
"$python" -m pip install -q --no-index --no-deps --target "$target" "$wheel"
if ! "$python" -c 'import pytest' 2>/dev/null; then
  "$python" -m pip install -q --no-index --no-deps --target "$target" "$(dirname "$wheel")"/{pytest,pluggy,iniconfig,packaging,pygments}-*.whl
fi
export PYTHONPATH="$target${PYTHONPATH:+:$PYTHONPATH}"
"$python" -c 'import gpuipc, sys; print("gpuipc from", gpuipc.__file__, "python", sys.version.split()[0])'
echo "wheel $(basename "$wheel"); glibc $(ldd --version 2>&1 | head -n 1 | awk '{print $NF}')"
out=${OUT:-$target}
set +e
"$python" -m pytest tests/python -q -rs --junitxml="$out/pytest-python.xml" "$@" 2>&1 | tee "$out/pytest-python.log"
rc=${PIPESTATUS[0]}
exit "$rc"
