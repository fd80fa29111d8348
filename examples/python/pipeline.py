#!/usr/bin/env python3
"""A two-process tensor pipeline over a gpuipc channel: a producer makes frames, a consumer processes them.

On a GPU the channel's slots are GPU memory: the producer's ``send`` copies each torch tensor into a slot on its
CUDA stream, the consumer's stream waits for it (no host synchronisation on the way) and reads it in place
through ``torch.from_dlpack(msg.array)``. Without a GPU (``--cpu``, or no CUDA) the slots are host memory and both
sides use NumPy. The consumer checks every frame and reports throughput.

    python examples/python/pipeline.py --frames 200
    python examples/python/pipeline.py --cpu --frames 50 --size 256
"""

from __future__ import annotations

import argparse
import multiprocessing
import os
import sys
import time

import numpy as np

import gpuipc


def have_gpu() -> bool:
    try:
        import torch

        return torch.cuda.is_available()
    except ImportError:
        return False


def producer(name: str, frames: int, size: int, gpu: bool) -> None:
    with gpuipc.Channel.open(name, "producer", wait=30) as ch:
        if gpu:
            import torch

            stream = torch.cuda.Stream()
            with torch.cuda.stream(stream):
                for i in range(frames):
                    frame = torch.full((size, size), float(i), device="cuda")  # "decode" a frame
                    ch.send(frame, stream=stream, meta=str(i).encode(), timeout=30)
            stream.synchronize()
        else:
            for i in range(frames):
                ch.send(np.full((size, size), float(i), dtype=np.float32), meta=str(i).encode(), timeout=30)


def consume(ch: gpuipc.Channel, frames: int, size: int, gpu: bool) -> float:
    """Receives `frames` frames, checks each; returns the seconds it took."""
    t0 = time.perf_counter()
    if gpu:
        import torch

        stream = torch.cuda.Stream()
        checks = []
        with torch.cuda.stream(stream):
            for i in range(frames):
                with ch.recv(timeout=30, stream=stream) as msg:
                    x = torch.from_dlpack(msg.array)  # zero-copy view of the slot
                    checks.append((x.sum() - float(i) * size * size).abs())  # "infer", on our stream
                    msg.release(stream=stream)  # the slot comes back once our stream has read it
        stream.synchronize()
        bad = [i for i, c in enumerate(checks) if c.item() > 1e-3]
    else:
        bad = []
        for i in range(frames):
            with ch.recv(timeout=30) as msg:
                if int(msg.meta) != i or not np.all(msg.array == i):
                    bad.append(i)
    if bad:
        raise SystemExit(f"consumer: frames {bad[:10]} had wrong contents")
    return time.perf_counter() - t0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--frames", type=int, default=200)
    ap.add_argument("--size", type=int, default=512, help="frames are size x size float32")
    ap.add_argument("--slots", type=int, default=4)
    ap.add_argument("--cpu", action="store_true", help="a host channel and NumPy even when a GPU is present")
    args = ap.parse_args()
    for opt in ("frames", "size", "slots"):
        if getattr(args, opt) < 1:
            ap.error(f"--{opt} must be at least 1")

    gpu = not args.cpu and have_gpu()
    name = f"pipeline-{os.getpid()}"
    slot_bytes = args.size * args.size * 4
    ch = gpuipc.Channel.create(name, slots=args.slots, slot_bytes=slot_bytes, kind="device" if gpu else "host",
                               role="consumer")
    # The names (NAME and NAME.slots) outlive this process, and a device channel's memory with them: removed however
    # the run ends (a producer that died, Ctrl-C).
    try:
        with ch:
            proc = multiprocessing.get_context("spawn").Process(target=producer,
                                                                args=(name, args.frames, args.size, gpu))
            proc.start()
            try:
                seconds = consume(ch, args.frames, args.size, gpu)
            except BaseException:
                # The producer may be blocked in send() on slots that nobody frees any more: with the consumer
                # gone its send fails at once (Closed) instead of after its 30 s timeout.
                ch.close()
                raise
            finally:
                proc.join(60)
            if proc.exitcode != 0:
                raise SystemExit(f"producer exited with {proc.exitcode}")
    finally:
        gpuipc.Channel.unlink(name)
    mb = args.frames * slot_bytes / 1e6
    print(f"{'GPU' if gpu else 'CPU'} pipeline: {args.frames} frames of {args.size}x{args.size} float32 checked, "
          f"{args.frames / seconds:.0f} frames/s, {mb / seconds:.0f} MB/s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
