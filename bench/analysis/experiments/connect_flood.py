"""How a flood of connects from one user delays another user's `gpuipc ls` on a shared broker.

A process that connects and closes in a loop keeps the broker's listen queue full. The broker used to accept until
that queue was empty before it served anything else, so a flooder could hold every other client off for seconds.
This runs each given gpuipcd in turn (a fresh runtime directory each), starts `--flooders` processes that connect
and close as uid 65534 (when run as root; else as this uid), and times `gpuipc ls` of this uid meanwhile, and once
with no flood.

    python connect_flood.py --gpuipcd old=/tmp/gpuipcd-old --gpuipcd new=build/bin/gpuipcd \
        [--cli build/bin/gpuipc] [--seconds 8] [--flooders 3] [--runs 2]

Prints one JSON object: per broker and run, the number of `ls` calls, their median, p99 and max seconds, the exit
codes seen, and the flooders' connects.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import socket
import statistics
import subprocess
import tempfile
import time


def flood(path: str, stop_at: float, counts) -> None:
    if os.getuid() == 0:
        os.setgid(65534)
        os.setuid(65534)
    n = 0
    while time.time() < stop_at:
        try:
            s = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
            s.connect(path)
            s.close()
            n += 1
        except OSError:
            pass
    counts.put(n)


def one_run(gpuipcd: str, cli: str, seconds: float, flooders: int) -> dict:
    with tempfile.TemporaryDirectory(prefix="gpuipc-flood-") as rt:
        os.chmod(rt, 0o755)  # the flooders' uid reaches the socket (0666) through it
        broker = subprocess.Popen([gpuipcd, "--runtime-dir", rt, "--idle-timeout-ms", "0"],
                                  stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        try:
            sock = os.path.join(rt, "broker.sock")
            deadline = time.time() + 5
            while not os.path.exists(sock) and time.time() < deadline:
                time.sleep(0.01)
            stop_at = time.time() + seconds
            counts: mp.Queue = mp.Queue()
            procs = [mp.Process(target=flood, args=(sock, stop_at, counts)) for _ in range(flooders)]
            for p in procs:
                p.start()
            time.sleep(0.5 if flooders else 0)
            env = dict(os.environ, GPUIPC_RUNTIME_DIR=rt)
            lat, rcs = [], set()
            while time.time() < stop_at - 0.5:
                t = time.perf_counter()
                r = subprocess.run([cli, "ls"], env=env, capture_output=True, timeout=120)
                lat.append(time.perf_counter() - t)
                rcs.add(r.returncode)
            connects = [counts.get() for _ in procs]
            for p in procs:
                p.join()
        finally:
            broker.terminate()
            broker.wait(10)
    lat.sort()
    return {
        "ls_calls": len(lat),
        "ls_median_s": round(statistics.median(lat), 4),
        "ls_p99_s": round(lat[min(len(lat) - 1, int(0.99 * len(lat)))], 4),
        "ls_max_s": round(lat[-1], 4),
        "ls_exit_codes": sorted(rcs),
        "flooder_connects": connects,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--gpuipcd", action="append", required=True, help="LABEL=PATH of a gpuipcd; repeat")
    ap.add_argument("--cli", default="build/bin/gpuipc")
    ap.add_argument("--seconds", type=float, default=8)
    ap.add_argument("--flooders", type=int, default=3)
    ap.add_argument("--runs", type=int, default=2)
    a = ap.parse_args()
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    out = {"commit": commit, "date": time.strftime("%Y-%m-%d"), "cpus": os.cpu_count(), "flooders": a.flooders,
           "flooders_uid": 65534 if os.getuid() == 0 else os.getuid(), "seconds": a.seconds, "brokers": {}}
    for spec in a.gpuipcd:
        label, path = spec.split("=", 1)
        out["brokers"][label] = {
            "path": path,
            "no_flood": one_run(path, a.cli, 3, 0),
            "flood": [one_run(path, a.cli, a.seconds, a.flooders) for _ in range(a.runs)],
        }
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
