#!/usr/bin/env bash
# Regenerates the committed stubs python/gpuipc/_gpuipc.pyi from the installed module with nanobind's stubgen.
# Use the interpreter of the environment gpuipc is installed in (default: .venv, as `make test` builds it).
set -euo pipefail
cd "$(dirname "$0")/.."
python=${PYTHON:-.venv/bin/python}
"$python" -m nanobind.stubgen -q -P -m gpuipc._gpuipc -o python/gpuipc/_gpuipc.pyi
echo "wrote python/gpuipc/_gpuipc.pyi (nanobind $("$python" -c 'import nanobind; print(nanobind.__version__)'))"
