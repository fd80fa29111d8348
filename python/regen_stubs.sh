#!/usr/bin/env bash
# Regenerates the committed stubs python/gpuipc/_gpuipc.pyi with nanobind's stubgen, after `make test`: from the
# wheel it built (build-py/ci; WHEEL=path for another), the numpy that tests/package/check_wheel.sh keeps
# (build-py/pydeps-cpXY) and the pinned nanobind of scripts/build_wheel.sh's tools (build-py/env-cpXY; cpXY of PYTHON,
# default python3). With GPUIPC_INSTALLED=1, PYTHON's own environment provides gpuipc and nanobind instead.
set -euo pipefail
cd "$(dirname "$0")/.."
python=${PYTHON:-python3}
if [ "${GPUIPC_INSTALLED:-0}" = 1 ]; then
  env_python=$python
else
  cp=$("$python" -c 'import sys; print("cp%d%d" % sys.version_info[:2])')
  env_python=build-py/env-$cp/bin/python
  wheel=${WHEEL:-$(ls build-py/ci/gpuipc-*.whl)}
  site=$(mktemp -d)
  trap 'rm -rf "$site"' EXIT
  "$env_python" -m pip install -q --no-index --find-links "build-py/pydeps-$cp" --target "$site" "$wheel"
  export PYTHONPATH="$site${PYTHONPATH:+:$PYTHONPATH}"
fi
"$env_python" -m nanobind.stubgen -q -P -m gpuipc._gpuipc -o python/gpuipc/_gpuipc.pyi
echo "wrote python/gpuipc/_gpuipc.pyi (nanobind $("$env_python" -c 'import nanobind; print(nanobind.__version__)'))"
