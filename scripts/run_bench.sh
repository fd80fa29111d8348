#!/usr/bin/env bash
# make bench: every benchmark suite, results to bench/results/ (see docs/benchmarks.md). Needs a GPU.
set -euo pipefail
cd "$(dirname "$0")/.."
exec ./build/bin/gpuipc bench all --out-dir bench/results "$@"
