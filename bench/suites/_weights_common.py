"""What every part of bench/suites/weights.py shares: its limits, the dict (made from a spec, filled and checked the
same way in every process) and the processes (spawned consumers, bounded waits on their queues)."""
import json
import math
import os
import sys
import time
import traceback

#: Seconds any one wait may take (a receive, an acknowledgement, a consumer's open).
TIMEOUT = 120.0
#: Seconds for spawned processes to import torch and initialise CUDA (all at once).
STARTUP = 300.0
#: GPU memory a process's CUDA context and torch take, for the fit checks (about 0.5 GiB on an H100).
CONTEXT_BYTES = 3 << 28
GiB = 1 << 30
BUCKET_BYTES = 1 << 30
BUCKETS = 2
#: The by-reference run's bucket_bytes (by_reference=True: the bytes a bucket's reference pieces name): the
#: library's default bound for by_reference="auto" (gpuipc.streaming._REF_BUCKET_BYTES).
REF_BUCKET_BYTES = 512 << 20
#: Unmeasured rounds before the measured ones.
WARMUP_UPDATES = 20
WARMUP_COPIES = 2


# --- the dict -------------------------------------------------------------------------------------------------------
def load_spec(path):
    with open(path) as f:
        spec = json.load(f)
    if not spec or not all("name" in e and "shape" in e for e in spec):
        raise ValueError(f"{path}: not a list of {{name, shape}}")
    return spec


def spec_bytes(spec):
    return sum(2 * math.prod(e["shape"]) for e in spec)


def fill_value(i):
    return float(i % 7 + 1)


def make_dict(torch, spec):
    """The dict on cuda:0 in the current allocator (a MemPool under use_mem_pool): tensor i filled with i % 7 + 1."""
    sd = {}
    for i, e in enumerate(spec):
        sd[e["name"]] = torch.full(e["shape"], fill_value(i), dtype=torch.bfloat16, device="cuda:0")
    torch.cuda.synchronize()
    return sd


def check(torch, tensors, spec):
    """Names, shapes, dtype, device, and the first and last element of every tensor (raises RuntimeError)."""
    bad, ends = [], []
    for e in spec:
        t = tensors.get(e["name"])
        if t is None:
            bad.append(f"{e['name']} is missing")
            continue
        if tuple(t.shape) != tuple(e["shape"]) or t.dtype != torch.bfloat16 or not t.is_cuda:
            bad.append(f"{e['name']} is {t.dtype}{list(t.shape)} on {t.device}, not bfloat16{e['shape']} on cuda")
            continue
        flat = t.reshape(-1)
        ends += [flat[0], flat[-1]]
    if len(tensors) != len(spec):
        bad.append(f"{len(tensors)} tensors, not {len(spec)}")
    if bad:
        raise RuntimeError("received dict is wrong: " + "; ".join(bad[:5]))
    got = torch.stack(ends).float().cpu().tolist()
    for i, e in enumerate(spec):
        if got[2 * i] != fill_value(i) or got[2 * i + 1] != fill_value(i):
            raise RuntimeError(f"{e['name']} holds {got[2 * i]} ... {got[2 * i + 1]}, not {fill_value(i)}")


def cuda_init():
    """torch on cuda:0 with a context, and the calls open_tensors makes (from_dlpack, set_) warmed up."""
    import torch

    torch.cuda.set_device(0)
    x = torch.zeros(64, device="cuda:0")
    y = torch.from_dlpack(x.__dlpack__())
    torch.empty(0, dtype=torch.bfloat16, device="cuda:0").set_(y.untyped_storage(), 0, (8,), (1,))
    torch.cuda.synchronize()
    return torch


def fits(torch, need, what):
    """None when `need` bytes of GPU memory are free, else why not."""
    free, total = torch.cuda.mem_get_info(0)
    if free >= need:
        return None
    return f"{what} needs about {need / GiB:.1f} GiB of GPU memory; {free / GiB:.1f} of {total / GiB:.1f} GiB are free"


def tag():
    return f"wbench-{os.getpid()}-{time.monotonic_ns() % 1000000}"


# --- processes ------------------------------------------------------------------------------------------------------
class PeerFailed(RuntimeError):
    pass


def _get(q, deadline, procs, what):
    """The next message on q; PeerFailed when a process died first, TimeoutError after the deadline."""
    import queue

    while True:
        try:
            return q.get(timeout=0.25)
        except queue.Empty:
            pass
        for k, p in enumerate(procs):
            if p.exitcode not in (None, 0):
                # It may have said why just before it exited.
                try:
                    msg = q.get(timeout=1)
                    if msg[0] == "error":
                        raise PeerFailed(msg[2])
                    return msg
                except queue.Empty:
                    raise PeerFailed(f"process {k} exited with status {p.exitcode} while waiting for {what}") from None
        if time.monotonic() > deadline:
            raise TimeoutError(f"no {what} within the time limit")


def _stop(procs, grace):
    for p in procs:
        p.join(timeout=grace)
    for p in procs:
        if p.is_alive():
            p.kill()
            p.join(timeout=10)


def _spawn(target, args_list):
    import multiprocessing as mp

    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    procs = [ctx.Process(target=target, args=(*args, results), daemon=True) for args in args_list]
    for p in procs:
        p.start()
    return ctx, results, procs


def _report_error(results, k):
    traceback.print_exc()
    e = sys.exc_info()[1]
    results.put(("error", k, f"process {k}: {type(e).__name__}: {e}"))


def run_consumers(target, args, n):
    """Starts n consumers at once, waits until each is ready (CUDA up), then lets them measure one at a time.
    Returns their reports in order."""
    import multiprocessing as mp

    ctx = mp.get_context("spawn")
    gos = [ctx.Queue() for _ in range(n)]
    _, results, procs = _spawn(target, [(k, *args, gos[k]) for k in range(n)])
    ok = False
    try:
        deadline = time.monotonic() + STARTUP
        ready = set()
        while len(ready) < n:
            kind, k, payload = _get(results, deadline, procs, "consumers to start")
            if kind == "error":
                raise PeerFailed(payload)
            ready.add(k)
        rows = []
        for k in range(n):
            gos[k].put("go")
            kind, kk, payload = _get(results, time.monotonic() + TIMEOUT, procs, f"consumer {k}'s open")
            if kind == "error":
                raise PeerFailed(payload)
            if kind != "done" or kk != k:
                raise RuntimeError(f"consumer {k}: unexpected message {kind} from {kk}")
            rows.append(payload)
        ok = True
        return rows
    finally:
        _stop(procs, 60 if ok else 2)


def _columns(rows, keys):
    return {k: [r[k] for r in rows] for k in keys}
