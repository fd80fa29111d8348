#!/usr/bin/env bash
# On a GPU machine: runs each C++ example in its device mode as examples/cpp/README.md shows it, with a private
# broker, and prints "$ command" before each program's output (the README's "GPU output" blocks come from this).
#   scripts/examples_gpu.sh [BIN_DIR]   (default build/bin)
set -uo pipefail
bin=$(cd "${1:-build/bin}" && pwd)
work=$(mktemp -d /tmp/gpuipc-examples.XXXXXX)
export GPUIPC_RUNTIME_DIR=$work/run GPUIPC_DAEMON=$bin/gpuipcd PATH=$bin:$PATH
rc=0
show() {  # show COMMAND...: print it as typed, run it with a time limit, keep the worst exit code
  echo "\$ $*" | sed "s|$work|/tmp/x|g"
  timeout 240 "$@" 2>&1 | sed "s|$work|/tmp/x|g"
  local code=${PIPESTATUS[0]}
  [ "$code" -eq 0 ] || { echo "(exit $code)"; rc=1; }
  echo
}
mkdir -p "$work/handoff"
echo "\$ gpuipc-example-producer --dir /tmp/x/handoff &"
gpuipc-example-producer --dir "$work/handoff" > "$work/producer.log" 2>&1 &
producer=$!
show gpuipc-example-consumer --dir "$work/handoff"
wait "$producer" || rc=1
echo "(the producer's output)"; sed "s|$work|/tmp/x|g" "$work/producer.log"; echo
show gpuipc-example-master --kind device --spawn 3 --crash-one
show gpuipc-example-pipeline --kind device --frames 5000 --compare
show gpuipc-example-benchmark --mib 256 --reps 20
show gpuipc-example-intra --kind device
show gpuipc-example-supervisor --kind device --jobs 40 --kills 2
gpuipc daemon --stop > /dev/null 2>&1
rm -rf "$work"
exit $rc
