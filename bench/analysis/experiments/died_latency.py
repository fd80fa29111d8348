"""How long after a SIGKILL a watcher hears `died`, for a process that holds a name and, optionally, GPU memory.

The broker reports a holder's death once its process has exited (not when its socket closes: a connection also
closes while its process runs). A killed GPU process exits only after its driver teardown, so its watchers hear of
it later than of a CPU process's. This measures both, per trial: the kill, the event's broker timestamp (unix_ns),
and when waitpid returned in this process.

    python died_latency.py [--trials 5] [--gib 8] [--gpu]

Needs the installed `gpuipc` package, its `gpuipc` CLI on PATH (or GPUIPC_CLI), and torch for --gpu. Prints one
JSON object.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import time

import gpuipc

HOLDER = r"""
import sys, time, gpuipc
name, gib = sys.argv[1], float(sys.argv[2])
seg = gpuipc.Segment.open(name)
if gib > 0:
    import torch
    x = torch.empty(int(gib * (1 << 30)), dtype=torch.uint8, device="cuda")
    x.fill_(1)
    torch.cuda.synchronize()
print("ready", flush=True)
time.sleep(3600)
"""


def one_trial(name: str, gib: float, cli: str) -> dict:
    watch = subprocess.Popen([cli, "watch", "--json", "--timeout", "120", name], stdout=subprocess.PIPE, text=True)
    assert watch.stdout is not None
    while json.loads(watch.stdout.readline()).get("event") != "watching":  # a line per holder, then `watching`
        pass
    holder = subprocess.Popen([sys.executable, "-c", HOLDER, name, str(gib)], stdout=subprocess.PIPE, text=True)
    assert holder.stdout is not None
    if holder.stdout.readline().strip() != "ready":
        raise RuntimeError("the holder did not start")
    joined = json.loads(watch.stdout.readline())
    if joined.get("event") != "joined":
        raise RuntimeError(f"expected a join, got {joined}")
    kill_ns = time.time_ns()
    os.kill(holder.pid, signal.SIGKILL)
    holder.wait()
    reaped_ns = time.time_ns()
    died = json.loads(watch.stdout.readline())
    watch.terminate()
    watch.wait()
    if died.get("event") != "died":
        raise RuntimeError(f"expected a death, got {died}")
    return {"died_ms": (died["unix_ns"] - kill_ns) / 1e6, "reaped_ms": (reaped_ns - kill_ns) / 1e6}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--trials", type=int, default=5)
    ap.add_argument("--gib", type=float, default=8.0, help="GPU memory the holder allocates (with --gpu)")
    ap.add_argument("--gpu", action="store_true")
    args = ap.parse_args()
    cli = os.environ.get("GPUIPC_CLI", "gpuipc")
    name = f"died-latency-{os.getpid()}"
    seg = gpuipc.Segment.create(name, 4096)
    try:
        runs = [one_trial(name, args.gib if args.gpu else 0.0, cli) for _ in range(args.trials)]
    finally:
        seg.close()
        gpuipc.Segment.unlink(name)
    out = {
        "holder": f"GPU process holding {args.gib} GiB" if args.gpu else "CPU process",
        "trials": runs,
        "died_ms_median": statistics.median(r["died_ms"] for r in runs),
        "reaped_ms_median": statistics.median(r["reaped_ms"] for r in runs),
    }
    print(json.dumps(out))


if __name__ == "__main__":
    main()
