#!/usr/bin/env python3
"""Load model weights once; let several worker processes map them read-only, without copies.

The server creates one segment per tensor ("<prefix>.<tensor name>"), fills it, and publishes an index segment
("<prefix>") that lists names, dtypes and shapes. Workers open the index, then each tensor read-only: on a GPU
(device segments) they get torch tensors through ``torch.from_dlpack`` that share the server's GPU memory; without
a GPU (``--cpu``, or no CUDA) the segments are host memory and the workers get NumPy arrays. Writes from a worker
fault: the mapping is read-only.

    python examples/python/weights_server.py --workers 3            # GPU if there is one, else CPU
    python examples/python/weights_server.py --cpu --workers 2 --mib 8
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import sys
import time
from typing import Dict, List, Tuple

import numpy as np

import gpuipc


def have_gpu() -> bool:
    try:
        import torch

        return torch.cuda.is_available()
    except ImportError:
        return False


def make_weights(total_mib: int) -> Dict[str, Tuple[str, Tuple[int, ...]]]:
    """Tensor names -> (dtype, shape): a small transformer-like layout totalling about `total_mib`."""
    rows = max(1, int(total_mib * (1 << 20) / 4 / 4 / 1024))
    return {
        "embed": ("float32", (rows, 1024)),
        "attn.qkv": ("float32", (rows, 1024)),
        "attn.out": ("float32", (rows, 1024)),
        "mlp": ("float32", (rows, 1024)),
        "norm.bias": ("float16", (1024,)),
    }


def expected_value(name: str) -> float:
    """The value the server writes into every element of tensor `name` (workers check it)."""
    return float(sum(name.encode()) % 97)


def serve(prefix: str, layout: Dict[str, Tuple[str, Tuple[int, ...]]], kind: str) -> List[gpuipc.Segment]:
    """Creates and fills one segment per tensor, then the index; returns the segments (keep them alive)."""
    segments = []
    for tname, (dtype, shape) in layout.items():
        nbytes = int(np.prod(shape)) * np.dtype(dtype).itemsize
        seg = gpuipc.Segment.create(f"{prefix}.{tname}", nbytes, kind=kind, mode=0o644)
        if kind == "device":
            import torch

            torch.from_dlpack(seg.as_array(dtype, shape)).fill_(expected_value(tname))
            torch.cuda.synchronize()
        else:
            seg.as_array(dtype, shape)[...] = expected_value(tname)
        segments.append(seg)
    index = json.dumps({"kind": kind, "tensors": {k: [d, list(s)] for k, (d, s) in layout.items()}}).encode()
    idx = gpuipc.Segment.create(prefix, len(index) + 8, mode=0o644)
    idx.as_array("uint64", 1)[0] = len(index)
    idx.as_array("uint8", len(index), offset=8)[:] = np.frombuffer(index, dtype=np.uint8)
    segments.append(idx)
    return segments


def worker(prefix: str, wid: int) -> str:
    """Maps every tensor read-only and checks it; returns a one-line report."""
    t0 = time.perf_counter()
    with gpuipc.Segment.open(prefix, readonly=True, wait=30) as idx:
        n = int(idx.as_array("uint64", 1)[0])
        index = json.loads(bytes(idx.as_array("uint8", n, offset=8)))
    tensors = {}
    for tname, (dtype, shape) in index["tensors"].items():
        with gpuipc.Segment.open(f"{prefix}.{tname}", readonly=True) as seg:
            view = seg.as_array(dtype, tuple(shape))  # keeps the mapping after the handle closes
        if index["kind"] == "device":
            import torch

            t = torch.from_dlpack(view)
            ok = bool((t == expected_value(tname)).all().item())
        else:
            t = view
            assert not t.flags.writeable
            ok = bool((t == expected_value(tname)).all())
        if not ok:
            raise SystemExit(f"worker {wid}: tensor {tname} has wrong contents")
        tensors[tname] = t
    mib = sum(int(np.prod(t.shape)) * (t.element_size() if hasattr(t, "element_size") else t.itemsize)
              for t in tensors.values()) / (1 << 20)
    return (f"worker {wid} (pid {os.getpid()}): mapped {len(tensors)} tensors, {mib:.1f} MiB, read-only, "
            f"in {1e3 * (time.perf_counter() - t0):.1f} ms")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--workers", type=int, default=3)
    ap.add_argument("--mib", type=int, default=64, help="total size of the weights")
    ap.add_argument("--cpu", action="store_true", help="host segments and NumPy even when a GPU is present")
    ap.add_argument("--prefix", default=f"weights-{os.getpid()}")
    args = ap.parse_args()

    kind = "host" if args.cpu or not have_gpu() else "device"
    t0 = time.perf_counter()
    segments = serve(args.prefix, make_weights(args.mib), kind)
    print(f"server: loaded {args.mib} MiB into {len(segments) - 1} {kind} segments in "
          f"{1e3 * (time.perf_counter() - t0):.1f} ms")
    try:
        ctx = multiprocessing.get_context("spawn")
        with ctx.Pool(args.workers) as pool:
            for line in pool.starmap(worker, [(args.prefix, i) for i in range(args.workers)]):
                print(line)
    finally:
        for seg in segments:
            name = seg.name
            seg.close()
            gpuipc.Segment.unlink(name)
    return 0


if __name__ == "__main__":
    sys.exit(main())
