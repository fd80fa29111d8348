#!/usr/bin/env bash
# Runs the wire-protocol decoder fuzz target for $1 seconds over the committed seed corpus.
# New interesting inputs go to a scratch corpus (not the committed one); crashes to fuzz/artifacts/.
set -euo pipefail
cd "$(dirname "$0")/.."
seconds=${1:-60}
scratch=$(mktemp -d)
trap 'rm -rf "$scratch"' EXIT
mkdir -p fuzz/artifacts
echo "fuzz: fuzz_proto_decode for ${seconds}s"
ASAN_OPTIONS=detect_leaks=1 ./build-fuzz/fuzz/fuzz_proto_decode -max_total_time="$seconds" -print_final_stats=1 \
  -artifact_prefix=fuzz/artifacts/ -max_len=65536 "$scratch" fuzz/corpus/proto 2>&1 | tail -n 15
