#!/usr/bin/env bash
# Runs the Python tests (GPU ones included) on a machine without internet, from a wheelhouse built elsewhere:
#   build-py/wheelhouse/gpuipc-*-cp312-abi3-*.whl (python/README.md says how) and pytest's wheels.
# Installs nothing into the interpreter's environment: packages go to a private folder on PYTHONPATH, so the
# interpreter's own torch / cupy / jax / numpy are used. Results (JUnit XML and the log) go to $OUT when set.
#   PYTHON=/opt/torch/.venv/bin/python3 bash python/run_gpu_tests.sh [pytest args]
set -euo pipefail
cd "$(dirname "$0")/.."
python=${PYTHON:-/opt/torch/.venv/bin/python3}
wheels=${WHEELHOUSE:-build-py/wheelhouse}
target=$(mktemp -d /tmp/gpuipc-py-XXXXXX)
"$python" -m pip install -q --no-index --no-deps --target "$target" "$wheels"/gpuipc-*.whl
if ! "$python" -c 'import pytest' 2>/dev/null; then
  "$python" -m pip install -q --no-index --no-deps --target "$target" "$wheels"/{pytest,pluggy,iniconfig,packaging,pygments}-*.whl
fi
export PYTHONPATH="$target${PYTHONPATH:+:$PYTHONPATH}"
"$python" -c 'import gpuipc, sys; print("gpuipc from", gpuipc.__file__, "python", sys.version.split()[0])'
out=${OUT:-$target}
set +e
"$python" -m pytest tests/python -q -rs --junitxml="$out/pytest-python.xml" "$@" 2>&1 | tee "$out/pytest-python.log"
rc=${PIPESTATUS[0]}
exit "$rc"
