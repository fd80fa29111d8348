#!/usr/bin/env python3
"""Load model weights once; let several worker processes use them, with no copy.

The server builds its model under ``gpuipc.torch.MemPool``, so every parameter is born in shareable GPU memory,
and shares the state dict under one name with ``gpuipc.share_tensors``: by reference, nothing is copied. Each
worker process opens it with ``gpuipc.open_tensors`` (one call: the index, one pool join, one mapping per pool
chunk; the tensors are views, mapped read-only), loads it into its own model with
``load_state_dict(..., assign=True)`` (the parameters become those views) and runs a forward pass, whose output
matches the server's bit for bit.

Needs a GPU and PyTorch 2.6 or later (for versioned updates see rl_weight_sync.py).

    python examples/python/weights_server.py --workers 3
    python examples/python/weights_server.py --workers 2 --mib 16
"""

from __future__ import annotations

import argparse
import hashlib
import multiprocessing
import os
import sys
import time
from concurrent.futures import ProcessPoolExecutor

import gpuipc

WIDTH = 1024  # each layer is a WIDTH x WIDTH bf16 Linear: 2 MiB


def why_no_gpu() -> str:
    """'' when torch sees a GPU, else why not."""
    try:
        import torch
    except ImportError:
        return "PyTorch is not installed"
    if not torch.cuda.is_available():
        return "torch sees no CUDA device"
    return ""


def build(torch, layers: int):
    """The model: `layers` Linear + GELU blocks (its weights come from the seed; workers build it on 'meta')."""
    torch.manual_seed(1234)
    blocks = []
    for _ in range(layers):
        blocks += [torch.nn.Linear(WIDTH, WIDTH), torch.nn.GELU()]
    return torch.nn.Sequential(*blocks)


def forward_digest(torch, model) -> str:
    x = torch.arange(16 * WIDTH, device="cuda", dtype=torch.float32).reshape(16, WIDTH).sin().to(torch.bfloat16)
    with torch.no_grad():
        y = model(x)
    torch.cuda.synchronize()
    return hashlib.sha256(y.float().cpu().numpy().tobytes()).hexdigest()


def worker(name: str, layers: int, digest: str, wid: int) -> str:
    """Opens the weights, loads them into a model without copying them, checks its output; returns a report."""
    import torch

    torch.cuda.set_device(0)
    torch.zeros(1, device="cuda")  # the CUDA context, before the clock
    t0 = time.perf_counter()
    weights = gpuipc.open_tensors(name, device=0, wait=30)  # dict of torch tensors: views of the server's memory
    t1 = time.perf_counter()
    with torch.device("meta"):
        model = build(torch, layers)  # no memory: every parameter comes from `weights`
    model.load_state_dict(weights, assign=True)
    t2 = time.perf_counter()
    same = all(p.data_ptr() == weights[k].data_ptr() for k, p in model.state_dict().items())
    ok = forward_digest(torch, model) == digest
    t3 = time.perf_counter()
    if not (same and ok):
        raise RuntimeError(f"worker {wid}: {'output differs from the server' if same else 'a parameter was copied'}")
    mib = sum(t.numel() * t.element_size() for t in weights.values()) / (1 << 20)
    return (f"worker {wid} (pid {os.getpid()}): opened {len(weights)} tensors, {mib:.1f} MiB, read-only, in "
            f"{1e3 * (t1 - t0):.2f} ms; load_state_dict(assign=True) {1e3 * (t2 - t1):.2f} ms; forward "
            f"{1e3 * (t3 - t2):.1f} ms, output equal to the server's bit for bit")


def run_workers(fn, jobs: list) -> list:
    """fn(*job) for each job, each in a spawned worker process; their results in order. A worker's exception is
    raised here, and a worker that dies raises BrokenProcessPool (a RuntimeError): multiprocessing.Pool would wait
    forever for the task of a worker that exited (SystemExit included) or was killed."""
    with ProcessPoolExecutor(len(jobs), mp_context=multiprocessing.get_context("spawn")) as pool:
        return [f.result() for f in [pool.submit(fn, *job) for job in jobs]]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--workers", type=int, default=3)
    ap.add_argument("--mib", type=int, default=64, help="about how large the weights are")
    ap.add_argument("--name", default=f"weights-{os.getpid()}")
    args = ap.parse_args()
    for opt in ("workers", "mib"):
        if getattr(args, opt) < 1:
            ap.error(f"--{opt} must be at least 1")
    why = why_no_gpu()
    if why:
        print(f"weights_server.py needs a GPU: {why}", file=sys.stderr)
        return 2
    import torch

    import gpuipc.torch

    layers = max(1, args.mib // 2)
    t0 = time.perf_counter()
    pool = gpuipc.torch.MemPool(args.name + ".weights", device=0)  # the name of the pool, for `gpuipc ls`
    shared = None
    try:  # from here on a failure (out of memory, args.name taken, Ctrl-C) must not leave the pool's name behind
        with torch.cuda.use_mem_pool(pool):
            model = build(torch, layers).to(device="cuda", dtype=torch.bfloat16)  # parameters born in the pool
        digest = forward_digest(torch, model)
        t1 = time.perf_counter()
        shared = gpuipc.share_tensors(args.name, model.state_dict())
        t2 = time.perf_counter()
        how = "by reference, no copy" if shared.pool is None else "with a copy (some tensors were not in the pool)"
        print(f"server: built a {layers}-layer model in gpuipc.torch.MemPool in {1e3 * (t1 - t0):.1f} ms; shared "
              f"{len(model.state_dict())} tensors as {args.name!r} {how} in {1e3 * (t2 - t1):.2f} ms")
        try:
            lines = run_workers(worker, [(args.name, layers, digest, i) for i in range(args.workers)])
        except RuntimeError as e:  # a worker's check failed, or a worker died
            print(f"weights_server.py: a worker failed: {e}", file=sys.stderr)
            return 1
        for line in lines:
            print(line)
    finally:
        if shared is not None:
            shared.close()  # removes the name; the workers are done with it
        # The pool's name outlives this process like any other, and with it the memory of its chunks (docs/torch.md,
        # MemPool): unlinked, that memory goes once this process lets go of it.
        gpuipc.Pool.unlink(args.name + ".weights")
    return 0


if __name__ == "__main__":
    sys.exit(main())
