#!/bin/bash
# Runs ParentOnlyFd.ASignalHandlerThatForksWhileItsThreadHoldsTheGateDoesNotHang over and over, two at a time, with two
# busy loops beside them, and dumps the thread stacks of a child that hangs (gdb). Usage: from the repository root,
# after `make build`: bash bench/analysis/experiments/fork_handler_stress.sh [RUNS]; the report goes to /tmp/fh/hang.txt.
mkdir -p /tmp/fh && rm -f /tmp/fh/stop /tmp/fh/hang.txt
B=$PWD/build/tests/unit_test_os_fd
F='ParentOnlyFd.ASignalHandlerThatForksWhileItsThreadHoldsTheGateDoesNotHang'
for k in 1 2; do (while [ ! -f /tmp/fh/stop ]; do :; done) & done
watch() {
  while [ ! -f /tmp/fh/stop ]; do
    sleep 1
    for p in $(pgrep -f "unit_test_os_fd"); do
      e=$(ps -o etimes= -p $p | tr -d ' ')
      pp=$(ps -o ppid= -p $p | tr -d ' ')
      [ -z "$e" ] && continue
      if [ "$e" -ge 6 ] && pgrep -f unit_test_os_fd | grep -qx "$pp"; then
        echo "== hung child $p (parent $pp) at $(date)" >> /tmp/fh/hang.txt
        for t in /proc/$p/task/*; do echo "task $t: $(cat $t/stat | cut -d' ' -f3) wchan=$(cat $t/wchan)" >> /tmp/fh/hang.txt; done
        gdb -p $p -batch -ex "thread apply all bt" 2>&1 | grep -v '^\[New' >> /tmp/fh/hang.txt
        touch /tmp/fh/stop
      fi
    done
  done
}
watch &
n=0
while [ ! -f /tmp/fh/stop ] && [ $n -lt ${1:-400} ]; do
  $B --gtest_filter=$F > /dev/null 2>&1 & $B --gtest_filter=$F > /dev/null 2>&1; wait %4 2>/dev/null
  n=$((n+2))
done
echo "runs: $n" >> /tmp/fh/hang.txt
touch /tmp/fh/stop; sleep 2; wait
