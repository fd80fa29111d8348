#!/usr/bin/env bash
# Runs each fuzz target for $1 seconds over its committed seed corpus: the wire-protocol decoder
# (fuzz_proto_decode, fuzz/corpus/proto), BlockRef decoding (fuzz_block_ref, fuzz/corpus/block_ref), the
# shared-memory control blocks under a peer's scribbles (fuzz_shm, fuzz/corpus/shm) and the broker's registry fed
# sessions of requests (fuzz_broker, fuzz/corpus/broker). An input that runs longer than 10 s counts as a crash (a
# hang). New interesting inputs go to a scratch corpus (not the committed one);
# crashes to fuzz/artifacts/.
set -euo pipefail
cd "$(dirname "$0")/.."
seconds=${1:-60}
mkdir -p fuzz/artifacts
for pair in fuzz_proto_decode:proto fuzz_block_ref:block_ref fuzz_shm:shm fuzz_broker:broker; do
  target=${pair%%:*}
  corpus=fuzz/corpus/${pair##*:}
  scratch=$(mktemp -d)
  echo "fuzz: $target for ${seconds}s"
  ASAN_OPTIONS=detect_leaks=1 "./build-fuzz/fuzz/$target" -max_total_time="$seconds" -timeout=10 -print_final_stats=1 \
    -artifact_prefix=fuzz/artifacts/ -max_len=65536 "$scratch" "$corpus" 2>&1 | tail -n 15
  rm -rf "$scratch"
done
