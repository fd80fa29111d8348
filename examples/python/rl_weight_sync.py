#!/usr/bin/env python3
"""Weight sync for RL: a trainer updates a policy every step; two inference processes pick up each version with
no copy and run it.

The trainer publishes its policy's state dict with ``gpuipc.publish_tensors(name, ..., versions=2)``: double
buffered, so a version a reader has pinned never changes under it. After each optimizer step it calls
``pub.update_from(model.state_dict(), stream=...)``: one device copy into the back buffer, then ``pub.update()``,
which publishes the next version in stream order, once the copy is done. Each inference process waits for that
version on the host (``Reader.wait_version``), pins it (``Reader.pin()``: the tensors are views of the trainer's
buffer, nothing is copied) and runs its forward pass on them (``torch.func.functional_call``). The trainer waits for
both readers before its next step (on-policy) and checks their outputs against its own. Time is CLOCK_MONOTONIC
(``time.monotonic_ns``), one clock for every process of the machine, so "seen after" spans two processes.

Needs a GPU and PyTorch 2.6 or later.

    python examples/python/rl_weight_sync.py                 # 20 steps
    python examples/python/rl_weight_sync.py --steps 100 --hidden 2048
"""

from __future__ import annotations

import argparse
import multiprocessing
import os
import queue
import statistics
import sys
import time

import gpuipc

READERS = 2
TIMEOUT = 60.0  # seconds any one wait may take


def why_no_gpu() -> str:
    """'' when torch sees a GPU, else why not."""
    try:
        import torch
    except ImportError:
        return "PyTorch is not installed"
    if not torch.cuda.is_available():
        return "torch sees no CUDA device"
    return ""


def policy(torch, hidden: int):
    return torch.nn.Sequential(
        torch.nn.Linear(hidden, hidden), torch.nn.GELU(), torch.nn.Linear(hidden, hidden), torch.nn.GELU(),
        torch.nn.Linear(hidden, 16),
    )


def probe(torch, hidden: int):
    """The fixed input both sides run, to compare outputs."""
    return torch.arange(32 * hidden, device="cuda", dtype=torch.float32).reshape(32, hidden).sin()


def inference(k: int, name: str, hidden: int, steps: int, clock, reports) -> None:
    """Follows every version: wait, pin (no copy), forward; reports (version, output sum, timings) per version."""
    try:
        import torch
        from torch.func import functional_call

        torch.cuda.set_device(0)
        with torch.device("meta"):
            model = policy(torch, hidden)  # no memory of its own: the weights are the pinned version's tensors
        x = probe(torch, hidden)
        reader = gpuipc.open_tensors(name, versioned=True, device=0, wait=TIMEOUT)  # a gpuipc.Reader
        try:
            for v in range(1, steps + 2):  # version 1 is what publish_tensors put out; each step adds one
                reader.wait_version(v, timeout=TIMEOUT)
                seen = time.monotonic_ns()
                with reader.pin() as pinned:
                    t0 = time.perf_counter()
                    if pinned.version != v:
                        raise RuntimeError(f"pinned version {pinned.version}, expected {v}")
                    with torch.no_grad():
                        out = functional_call(model, pinned.tensors, (x,))
                    total = float(out.double().sum())  # synchronizes: the forward ran on this version
                    t1 = time.perf_counter()
                reports.put(("version", k, v, total, (seen - clock[v]) / 1e3, (t1 - t0) * 1e3))
        finally:
            reader.close()
    except BaseException as e:  # noqa: BLE001 - the trainer reports it
        reports.put(("error", k, f"{type(e).__name__}: {e}"))


def collect(reports, procs, v: int) -> list:
    """The READERS reports of version v (raises RuntimeError when a reader failed or went quiet)."""
    got = []
    deadline = time.monotonic() + TIMEOUT * 2
    while len(got) < READERS:
        try:
            msg = reports.get(timeout=0.5)
        except queue.Empty:
            dead = [p for p in procs if p.exitcode not in (None, 0)]
            if dead or time.monotonic() > deadline:
                why = f"exited with status {dead[0].exitcode}" if dead else "sent nothing"
                raise RuntimeError(f"an inference process {why} while the trainer waited for version {v}") from None
            continue
        if msg[0] == "error":
            raise RuntimeError(f"inference process {msg[1]} failed: {msg[2]}")
        if msg[2] != v:
            raise RuntimeError(f"inference process {msg[1]} reported version {msg[2]}, expected {v}")
        got.append(msg)
    return sorted(got)


def check(got: list, want: float) -> int:
    """How many readers' output sums differ from the trainer's (each one said)."""
    bad = 0
    for _, k, v, total, _, _ in got:
        if abs(total - want) > 1e-3 * max(1.0, abs(want)):
            bad += 1
            print(f"  inference {k}, version {v}: output sum {total!r} differs from the trainer's {want!r}")
    return bad


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--name", default=f"policy-{os.getpid()}")
    args = ap.parse_args()
    for opt in ("steps", "hidden"):  # the summary needs at least one step
        if getattr(args, opt) < 1:
            ap.error(f"--{opt} must be at least 1")
    why = why_no_gpu()
    if why:
        print(f"rl_weight_sync.py needs a GPU: {why}", file=sys.stderr)
        return 2
    import torch

    torch.cuda.set_device(0)
    torch.manual_seed(0)
    model = policy(torch, args.hidden).cuda()
    opt = torch.optim.SGD(model.parameters(), lr=1e-2)
    x = probe(torch, args.hidden)
    stream = torch.cuda.current_stream()

    def reference() -> float:
        with torch.no_grad():
            return float(model(x).double().sum())

    ctx = multiprocessing.get_context("spawn")
    clock = ctx.Array("q", args.steps + 2, lock=False)  # clock[v]: when the trainer started publishing version v
    reports = ctx.Queue()
    clock[1] = time.monotonic_ns()
    pub = gpuipc.publish_tensors(args.name, model.state_dict(), versions=2)  # version 1
    mib = sum(t.numel() * t.element_size() for t in model.state_dict().values()) / (1 << 20)
    procs = [ctx.Process(target=inference, args=(k, args.name, args.hidden, args.steps, clock, reports))
             for k in range(READERS)]
    publish_ms, seen_us, forward_ms, mismatches = [], [], [], 0
    try:
        for p in procs:
            p.start()
        mismatches += check(collect(reports, procs, 1), reference())  # both readers are up and ran version 1
        print(f"trainer: published a {mib:.1f} MiB policy as {args.name!r} (versions=2); {READERS} inference "
              f"processes follow it")
        for step in range(1, args.steps + 1):
            xb = torch.randn(64, args.hidden, device="cuda")
            loss = torch.nn.functional.mse_loss(model(xb), torch.zeros(64, 16, device="cuda"))
            opt.zero_grad()
            loss.backward()
            opt.step()
            v = step + 1
            want = reference()  # what the readers must compute with version v
            clock[v] = time.monotonic_ns()
            t0 = time.perf_counter()
            pub.update_from(model.state_dict(), stream=stream)  # copy into the back buffer, then publish version v
            publish_ms.append((time.perf_counter() - t0) * 1e3)
            got = collect(reports, procs, v)
            mismatches += check(got, want)
            seen_us += [r[4] for r in got]
            forward_ms += [r[5] for r in got]
            print(f"step {step:3d}: loss {loss.item():.5f}; version {v} published (update_from call "
                  f"{publish_ms[-1]:.2f} ms), seen by the readers after {got[0][4]:.0f} / {got[1][4]:.0f} us, "
                  f"forward {got[0][5]:.2f} / {got[1][5]:.2f} ms")
        for p in procs:
            p.join(timeout=TIMEOUT)
        if any(p.exitcode != 0 for p in procs):
            raise RuntimeError(f"inference processes exited with {[p.exitcode for p in procs]}")
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join(timeout=10)
        pub.close()  # removes the names (NAME, NAME.pool, NAME.version)
    med = statistics.median
    print(f"{args.steps} versions, each picked up by both readers with no copy: update_from call {med(publish_ms):.2f} "
          f"ms, seen {med(seen_us):.0f} us after it (max {max(seen_us):.0f}), forward {med(forward_ms):.2f} ms "
          f"(medians); outputs {'match' if mismatches == 0 else f'DIFFER in {mismatches} cases from'} the trainer's")
    return 0 if mismatches == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
