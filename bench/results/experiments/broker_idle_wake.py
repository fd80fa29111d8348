#!/usr/bin/env python3
"""How long a broker round trip (a Segment.stat) takes after the broker has been idle for a while.

    python3 bench/results/experiments/broker_idle_wake.py [GPUIPC_BROKER_POLL_US values, e.g. 0 1000]

A private broker and one host segment; stat it back to back, then after idle gaps of 0.05 ms to 100 ms (15 times
each; medians). With arguments, once per GPUIPC_BROKER_POLL_US value, each with a broker of its own (the client and
the broker both read it). On virtual machines whose idle CPUs halt (cpuidle driver "haltpoll", printed), a broker idle for
longer than the halt-polling window answers only once its CPU is woken: the first call of a fresh process (what
`gpuipc bench weights` times in its open) meets an idle broker.
"""
import os
import statistics
import tempfile
import time


def main():
    import sys
    import subprocess

    if len(sys.argv) > 1:  # one child per value: the client reads the variable once per process
        for v in sys.argv[1:]:
            print(f"GPUIPC_BROKER_POLL_US={v}", flush=True)
            subprocess.run([sys.executable, __file__], env=dict(os.environ, GPUIPC_BROKER_POLL_US=v), check=True)
        return
    rt = tempfile.mkdtemp(prefix="gpuipc-wake-", dir="/tmp")
    os.environ["GPUIPC_RUNTIME_DIR"] = rt
    import gpuipc
    from gpuipc._broker import stop_broker

    try:
        seg = gpuipc.Segment.create("wake", 4096)
        driver = "?"
        try:
            with open("/sys/devices/system/cpu/cpuidle/current_driver") as f:
                driver = f.read().strip()
        except OSError:
            pass
        print(f"cpuidle driver: {driver}; {os.cpu_count()} CPUs")
        for gap in (0, 0.00005, 0.0001, 0.0003, 0.001, 0.003, 0.01, 0.1):
            ts = []
            for _ in range(15):
                if gap:
                    time.sleep(gap)
                t = time.perf_counter()
                gpuipc.Segment.stat("wake")
                ts.append((time.perf_counter() - t) * 1e6)
            print(f"idle {gap * 1e3:6.2f} ms before: stat median {statistics.median(ts):6.0f} us, min {min(ts):5.0f} us")
        seg.close()
        gpuipc.Segment.unlink("wake")
    finally:
        stop_broker(rt)


if __name__ == "__main__":
    main()
