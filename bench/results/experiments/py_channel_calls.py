#!/usr/bin/env python3
"""Where a zero-copy channel round trip's Python time goes: each call of the path timed alone, in one process.

    python3 bench/results/experiments/py_channel_calls.py [--iters N] [--host] [--commit SHA]

A one-slot channel with its producer and its consumer handle in this process, each on a torch stream of its own
(non-blocking, as python_handoff.py's zero-copy phase; --host: a host channel, no torch). Each iteration runs the
round trip's calls in order, timing every one: acquire, slot.tensor(), publish_array, recv, msg.tensor(), release;
the streams stay idle, so no call waits for the other side (the library writes the words from the host). Then the
same calls on the binding alone (gpuipc._gpuipc.Channel: what the library and nanobind cost), and the stream
accessors. Prints medians in us as JSON.
"""
import argparse
import json
import os
import statistics
import sys
import tempfile
import time


def timed(fn, n):
    ts = []
    for _ in range(n):
        t0 = time.perf_counter_ns()
        fn()
        ts.append(time.perf_counter_ns() - t0)
    return statistics.median(ts) / 1e3


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--iters", type=int, default=5000)
    ap.add_argument("--host", action="store_true")
    ap.add_argument("--commit", default=None, help="the commit the measured gpuipc was built at (recorded as is)")
    a = ap.parse_args()
    rt = tempfile.mkdtemp(prefix="gpuipc-calls-", dir="/tmp")
    os.environ["GPUIPC_RUNTIME_DIR"] = rt
    torch = None
    if not a.host:
        import torch

        torch.cuda.set_device(0)
        torch.zeros(1, device="cuda")
    import gpuipc
    from gpuipc._streams import stream_handle

    nbytes = 1 << 20
    name = f"calls-{os.getpid()}"
    kind = "host" if a.host else "device"
    import subprocess

    # The commit of the wheel measured: the caller knows it (a copy of the tree on a GPU machine may carry a stale
    # .git, so git is not asked).
    out = {"suite": "experiment py_channel_calls.py", "commit": a.commit,
           "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "kind": kind, "iters": a.iters}
    try:
        tx = gpuipc.Channel.create(name, slots=1, slot_bytes=nbytes, kind=kind)
        rx = gpuipc.Channel.open(name, "consumer")
        ps = torch.cuda.Stream() if torch else None
        cs = torch.cuda.Stream() if torch else None
        parts = {k: [] for k in ("acquire", "slot_tensor", "publish_array", "recv", "msg_tensor", "release")}
        clock = time.perf_counter_ns
        for i in range(a.iters + 100):
            t0 = clock()
            slot = tx.acquire(stream=ps, timeout=10)
            t1 = clock()
            v = slot.tensor("uint8", (nbytes,)) if torch else slot.as_array("uint8", (nbytes,))
            t2 = clock()
            slot.publish_array("uint8", (nbytes,), stream=ps)
            t3 = clock()
            msg = rx.recv(stream=cs, timeout=10)
            t4 = clock()
            w = msg.tensor() if torch else msg.array
            t5 = clock()
            msg.release(stream=cs)
            t6 = clock()
            del v, w
            if i >= 100:
                for k, (x, y) in zip(parts, ((t0, t1), (t1, t2), (t2, t3), (t3, t4), (t4, t5), (t5, t6))):
                    parts[k].append((y - x) / 1e3)
        out["calls_us"] = {k: statistics.median(v) for k, v in parts.items()}
        out["calls_total_us"] = sum(out["calls_us"].values())
        # The binding alone: the same four library calls without the Python layer.
        p, c = tx._ch, rx._ch
        hp, hc = stream_handle(ps), stream_handle(cs)
        header = tx._headers and next(iter(tx._headers.values()))[1] or b""
        raw = {k: [] for k in ("acquire", "publish", "receive", "release")}
        for i in range(a.iters + 100):
            t0 = clock()
            _, seq = p.acquire(hp, 10.0)
            t1 = clock()
            p.publish(header, nbytes, hp, seq)
            t2 = clock()
            _, _, mseq = c.receive(hc, 10.0)
            t3 = clock()
            c.release(hc, mseq)
            t4 = clock()
            if i >= 100:
                for k, (x, y) in zip(raw, ((t0, t1), (t1, t2), (t2, t3), (t3, t4))):
                    raw[k].append((y - x) / 1e3)
        out["binding_us"] = {k: statistics.median(v) for k, v in raw.items()}
        out["binding_total_us"] = sum(out["binding_us"].values())
        out["clock_us"] = timed(lambda: None, a.iters)
        if torch:
            out["stream_us"] = {
                "stream_handle": timed(lambda: stream_handle(ps), a.iters),
                "s.cuda_stream": timed(lambda: ps.cuda_stream, a.iters),
                "s.__cuda_stream__()": timed(lambda: ps.__cuda_stream__(), a.iters)
                if hasattr(ps, "__cuda_stream__") else None,
            }
        out["device"] = torch.cuda.get_device_name(0) if torch else "host"
        if torch:
            smi = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                                 capture_output=True, text=True)
            out["driver"] = smi.stdout.strip().splitlines()[0] if smi.returncode == 0 and smi.stdout.strip() else None
        rx.close()
        tx.close()
        gpuipc.Channel.unlink(name)
    finally:
        from gpuipc._broker import stop_broker

        stop_broker(rt)
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    sys.exit(main())
