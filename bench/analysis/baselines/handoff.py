#!/usr/bin/env python3
"""Baselines for gpuipc's channel handoff: what users do today to hand a GPU buffer to another process.

    python3 bench/analysis/baselines/handoff.py --impl torch|cudacore --bytes 1048576 --iters 1000

One round trip = the producer sends the (same) buffer -> the consumer process receives it (importing it) and
acknowledges -> the producer receives the acknowledgement. Prints one JSON line last:
{"impl", "bytes", "iters", "p50_us", "p99_us", "min_us", "mean_us"} or {"error": ...}.
`gpuipc bench channels` runs this beside its own handoff in the same run (bench/suites/suite_channels.cpp).
"""
import argparse
import statistics
import sys
import time

import report

WARMUP = 50


def summarize(samples_us):
    s = sorted(samples_us)
    return {"p50_us": statistics.median(s), "p99_us": report.quantile(s, 0.99), "min_us": s[0],
            "mean_us": statistics.fmean(s)}


# --- torch.multiprocessing ------------------------------------------------------------------------------------
def torch_consumer(q_in, q_ack, n):
    import torch
    torch.cuda.set_device(0)
    for i in range(n):
        t = q_in.get()  # rebuilds the tensor from its CUDA IPC handle (torch caches the opened handle)
        assert t.is_cuda
        q_ack.put(i)
        del t


def run_torch(nbytes, iters):
    import torch
    import torch.multiprocessing as mp
    ctx = mp.get_context("spawn")
    q_in, q_ack = ctx.Queue(), ctx.Queue()
    p = ctx.Process(target=torch_consumer, args=(q_in, q_ack, iters + WARMUP))
    p.start()
    buf = torch.empty(nbytes, dtype=torch.uint8, device="cuda:0")
    buf.fill_(1)
    torch.cuda.synchronize()
    samples = []
    for i in range(iters + WARMUP):
        t0 = time.perf_counter()
        q_in.put(buf)
        q_ack.get()
        if i >= WARMUP:
            samples.append((time.perf_counter() - t0) * 1e6)
    p.join(timeout=60)
    return summarize(samples)


# --- cuda.core IPC-enabled memory pools -----------------------------------------------------------------------
def _cuda_core():
    try:
        import cuda.core as cc
        getattr(cc, "DeviceMemoryResource")
        return cc
    except (ImportError, AttributeError):
        import cuda.core.experimental as cc
        return cc


def cudacore_consumer(mr, q_in, q_ack, n):
    cc = _cuda_core()
    dev = cc.Device(0)
    dev.set_current()
    for i in range(n):
        b = q_in.get()  # imports the pool allocation through the mapped memory resource
        assert b.size > 0
        q_ack.put(i)
        del b


def run_cudacore(nbytes, iters):
    import multiprocessing as mp
    # cuda.core checks the *global* start method before it pickles a memory resource or buffer for IPC.
    mp.set_start_method("spawn", force=True)
    cc = _cuda_core()
    ctx = mp.get_context("spawn")
    dev = cc.Device(0)
    dev.set_current()
    mr = cc.DeviceMemoryResource(dev, options=cc.DeviceMemoryResourceOptions(ipc_enabled=True, max_size=256 << 20))
    q_in, q_ack = ctx.Queue(), ctx.Queue()
    p = ctx.Process(target=cudacore_consumer, args=(mr, q_in, q_ack, iters + WARMUP))
    p.start()
    stream = dev.create_stream()
    buf = mr.allocate(nbytes, stream=stream)
    stream.sync()
    samples = []
    for i in range(iters + WARMUP):
        t0 = time.perf_counter()
        q_in.put(buf)
        q_ack.get()
        if i >= WARMUP:
            samples.append((time.perf_counter() - t0) * 1e6)
    p.join(timeout=60)
    return summarize(samples)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--impl", choices=["torch", "cudacore"], required=True)
    ap.add_argument("--bytes", type=int, default=1 << 20)
    ap.add_argument("--iters", type=int, default=1000)
    a = ap.parse_args()
    out = {"impl": a.impl, "bytes": a.bytes, "iters": a.iters}
    def body():
        res = run_torch(a.bytes, a.iters) if a.impl == "torch" else run_cudacore(a.bytes, a.iters)
        if a.impl == "torch":
            import torch
            res["version"] = torch.__version__
        else:
            try:
                from importlib.metadata import version
                res["version"] = version("cuda-core")
            except Exception:  # noqa: BLE001 - informational only
                pass
        return res

    return report.finish(out, body)

if __name__ == "__main__":
    sys.exit(main())
