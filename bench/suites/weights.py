#!/usr/bin/env python3
"""The measuring side of `gpuipc bench weights` (bench/suites/suite_weights.cpp): a model-like state dict of bf16 tensors
handed to other processes with gpuipc's Python API, beside the ways it is done without it. One part per run:

    python3 bench/suites/weights.py --part open     --spec SPEC.json --consumers 10
    python3 bench/suites/weights.py --part segments --spec SPEC.json --consumers 10
    python3 bench/suites/weights.py --part update   --spec SPEC.json --updates 200 --copies 20
    python3 bench/suites/weights.py --part stream   --spec SPEC.json [--spec-large SPEC16.json] --reps 5

SPEC.json lists the tensors ([{"name", "shape"}, ...]); the suite writes it from bench/suites/statedict.cpp (the 2 GiB dict
of 291 tensors, and its 16 GiB version of 340 layers) so that every part and bench/analysis/baselines/statedict.py hand over
the same dict. Tensor i holds the value i % 7 + 1 everywhere (exact in bf16); every receiver checks the first and
last element of every tensor, outside the timed windows.

* open: the dict is built under a gpuipc.torch.MemPool and published with gpuipc.publish_tensors (versions=1: by
  reference, no copy). Fresh consumer processes (spawn; torch imported and CUDA initialised before the clock, all
  started at once, measured one at a time) go from the name to every tensor usable: gpuipc.open_tensors, then
  data_ptr() of every tensor and a synchronize of the current stream (what the torch baseline's consumer does).
* segments: the old way (examples/python/weights_server.py before issue 13): one device Segment per tensor and a
  JSON index in a host segment; the consumer opens the index, then every segment read-only, torch.from_dlpack each.
* update: publish_tensors(versions=1, then 2) of the MemPool dict; a reader process blocked in
  Reader.wait_version on the host. Timed from the publisher's pub.update(stream=...) call (time.monotonic_ns) to
  the reader's return from wait_version (time.monotonic_ns in the reader: CLOCK_MONOTONIC, one clock for every
  process of the machine). Also with update() signalling from the host (stream=None). Apart: update_from of the
  whole dict (the copy in, then update), until its stream has finished.
* stream: gpuipc.stream_publisher / stream_reader (bucketed streaming; null with the reason when this gpuipc has
  none) from this process to a reader process that receives into its own tensors: from publish() to the reader's
  return from receive() plus a synchronize of its stream. Beside it, in this process: the same bytes copied
  device to device into a second dict (torch._foreach_copy_), and one flat copy.

Each run uses its own broker (a private GPUIPC_RUNTIME_DIR) and stops it at the end. Prints one JSON line last:
{"impl": "weights-PART", ...} with the raw samples; {"impl", "skipped": why} when torch, a GPU or GPU memory is
missing; {"impl", "error": why} when it fails.
"""
import argparse
import json
import math
import os
import shutil
import signal
import sys
import tempfile
import time
import traceback

HERE = os.path.dirname(os.path.abspath(__file__))
for _p in (HERE, os.path.join(HERE, "..", "analysis", "baselines")):
    if _p not in sys.path:
        sys.path.insert(0, _p)

import report  # noqa: E402  (bench/analysis/baselines/report.py)
from python_handoff import stop_broker  # noqa: E402

#: Seconds any one wait may take (a receive, an acknowledgement, a consumer's open).
TIMEOUT = 120.0
#: Seconds for spawned processes to import torch and initialise CUDA (all at once).
STARTUP = 300.0
#: GPU memory a process's CUDA context and torch take, for the fit checks (about 0.5 GiB on an H100).
CONTEXT_BYTES = 3 << 28
GiB = 1 << 30
BUCKET_BYTES = 1 << 30
BUCKETS = 2
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


# --- part open: publish_tensors of a MemPool dict, open_tensors in fresh processes ---------------------------------------
def open_consumer(k, name, spec_path, go, results):
    try:
        torch = cuda_init()
        import gpuipc

        spec = load_spec(spec_path)
        results.put(("ready", k, None))
        go.get(timeout=STARTUP + TIMEOUT * (k + 1))
        t0 = time.perf_counter()
        tensors = gpuipc.open_tensors(name, device=0, wait=TIMEOUT)
        t1 = time.perf_counter()
        for t in tensors.values():
            t.data_ptr()
        torch.cuda.current_stream().synchronize()
        t2 = time.perf_counter()
        check(torch, tensors, spec)
        del tensors, t
        # The same open again in this now warm process (imports done, the pool's chunks mapped once before).
        t3 = time.perf_counter()
        tensors = gpuipc.open_tensors(name, device=0)
        for t in tensors.values():
            t.data_ptr()
        torch.cuda.current_stream().synchronize()
        t4 = time.perf_counter()
        results.put(("done", k, {"open_ms": (t2 - t0) * 1e3, "call_ms": (t1 - t0) * 1e3, "touch_ms": (t2 - t1) * 1e3,
                                 "reopen_ms": (t4 - t3) * 1e3}))
    except BaseException:  # noqa: BLE001 - reported to the driver
        _report_error(results, k)


def part_open(a):
    torch = cuda_init()
    import gpuipc
    import gpuipc.torch as gt

    spec = load_spec(a.spec)
    nbytes = spec_bytes(spec)
    why = fits(torch, nbytes + GiB + a.consumers * CONTEXT_BYTES, f"the open of a {nbytes / GiB:.1f} GiB dict")
    if why:
        return {"skipped": why, "tensors": len(spec), "bytes": nbytes}
    name = tag()
    t0 = time.perf_counter()
    pool = gt.MemPool(name + ".weights", device=0)
    with torch.cuda.use_mem_pool(pool):
        sd = make_dict(torch, spec)
    t1 = time.perf_counter()
    pub = gpuipc.publish_tensors(name, sd, versions=1)
    t2 = time.perf_counter()
    try:
        rows = run_consumers(open_consumer, (name, a.spec), a.consumers)
    finally:
        by_reference = pub.pool is None  # a pool of copies exists only when something had to be packed
        pub.close()
    return {"tensors": len(spec), "bytes": nbytes, "consumers": a.consumers, "by_reference": by_reference,
            "storages": len(pub._plan.storages), "build_ms": (t1 - t0) * 1e3, "publish_ms": (t2 - t1) * 1e3,
            **_columns(rows, ("open_ms", "call_ms", "touch_ms", "reopen_ms"))}


# --- part segments: one Segment per tensor and a JSON index (the old weights_server.py) -----------------------------
def segments_consumer(k, prefix, spec_path, go, results):
    try:
        torch = cuda_init()
        import gpuipc

        spec = load_spec(spec_path)
        results.put(("ready", k, None))
        go.get(timeout=STARTUP + TIMEOUT * (k + 1))
        t0 = time.perf_counter()
        with gpuipc.Segment.open(prefix, readonly=True, wait=TIMEOUT) as idx:
            n = int(idx.as_array("uint64", 1)[0])
            index = json.loads(bytes(idx.as_array("uint8", n, offset=8)))
        tensors = {}
        for tname, (seg_name, dtype, shape) in index["tensors"].items():
            with gpuipc.Segment.open(seg_name, readonly=True) as seg:
                tensors[tname] = torch.from_dlpack(seg.as_array(dtype, tuple(shape)))  # keeps the mapping
        t1 = time.perf_counter()
        for t in tensors.values():
            t.data_ptr()
        torch.cuda.current_stream().synchronize()
        t2 = time.perf_counter()
        check(torch, tensors, spec)
        results.put(("done", k, {"open_ms": (t2 - t0) * 1e3, "call_ms": (t1 - t0) * 1e3, "touch_ms": (t2 - t1) * 1e3}))
    except BaseException:  # noqa: BLE001 - reported to the driver
        _report_error(results, k)


def part_segments(a):
    torch = cuda_init()
    import numpy as np

    import gpuipc

    spec = load_spec(a.spec)
    nbytes = spec_bytes(spec)
    # Device segments are rounded up to 2 MiB each.
    rounded = sum(-(-2 * math.prod(e["shape"]) // (2 << 20)) * (2 << 20) for e in spec)
    why = fits(torch, rounded + GiB + a.consumers * CONTEXT_BYTES, f"{len(spec)} device segments")
    if why:
        return {"skipped": why, "tensors": len(spec), "bytes": nbytes}
    prefix = tag()
    segs = []
    try:
        t0 = time.perf_counter()
        entries = {}
        for i, e in enumerate(spec):
            seg = gpuipc.Segment.create(f"{prefix}.{i}", 2 * math.prod(e["shape"]), kind="device")
            segs.append(seg)
            torch.from_dlpack(seg.as_array("bfloat16", tuple(e["shape"]))).fill_(fill_value(i))
            entries[e["name"]] = [f"{prefix}.{i}", "bfloat16", e["shape"]]
        torch.cuda.synchronize()
        index = json.dumps({"kind": "device", "tensors": entries}).encode()
        idx = gpuipc.Segment.create(prefix, len(index) + 8)
        segs.append(idx)
        idx.as_array("uint8", len(index), offset=8)[:] = np.frombuffer(index, dtype=np.uint8)
        idx.as_array("uint64", 1)[0] = len(index)
        t1 = time.perf_counter()
        rows = run_consumers(segments_consumer, (prefix, a.spec), a.consumers)
    finally:
        for seg in segs:
            n = seg.name
            seg.close()
            try:
                gpuipc.Segment.unlink(n)
            except gpuipc.Error:
                pass
    return {"tensors": len(spec), "bytes": nbytes, "segment_bytes": rounded, "consumers": a.consumers,
            "setup_ms": (t1 - t0) * 1e3, **_columns(rows, ("open_ms", "call_ms", "touch_ms"))}


# --- part update: pub.update() -> a reader's wait_version returns ---------------------------------------------------
def _open_ack(gpuipc, name, procs, results):
    """The semaphore a peer creates to acknowledge, as soon as it exists."""
    deadline = time.monotonic() + STARTUP
    while True:
        try:
            return gpuipc.Semaphore.open(name, role="waiter", wait=0.2)
        except (gpuipc.NotFound, gpuipc.Timeout):
            if not procs[0].is_alive() or time.monotonic() > deadline:
                try:
                    kind, _, payload = results.get(timeout=2)
                    if kind == "error":
                        raise PeerFailed(payload) from None
                except Exception as e:  # noqa: BLE001 - only to find the peer's reason
                    if isinstance(e, PeerFailed):
                        raise
                why = "timed out" if procs[0].is_alive() else f"it exited with status {procs[0].exitcode}"
                raise PeerFailed(f"the peer did not create its acknowledgement semaphore {name!r}: {why}") from None


#: How long a spinning reader polls before it sleeps (the reader is blocked some 2 ms before each update).
SPIN_S = 0.05


def update_reader(name, ack_name, spec_path, spins, results):
    try:
        torch = cuda_init()
        import gpuipc

        spec = load_spec(spec_path)
        ack = gpuipc.Semaphore.create(ack_name, initial=0, kind="host")
        r = gpuipc.open_tensors(name, versioned=True, device=0, wait=TIMEOUT)
        v = r.version
        t1, seen = [], []
        for i, spin in enumerate(spins):
            ack.signal_host(i + 1)  # about to wait for version v + 1
            got = r.wait_version(v + 1, timeout=TIMEOUT, spin=SPIN_S if spin else None)
            t1.append(time.monotonic_ns())
            seen.append(got)
            v += 1
        with r.pin() as p:  # the latest version, read through its index slot (untimed)
            check(torch, p.tensors, spec)
        results.put(("done", 0, {"t1_ns": t1, "seen": seen}))
        torch.cuda.synchronize()
        r.close()
        ack.close()
    except BaseException:  # noqa: BLE001 - reported to the driver
        _report_error(results, 0)


def measure_updates(torch, gpuipc, pub, name, versions, updates, copies, source, spec_path):
    # A reader sleeping in wait_version (spins 20 us, then a futex), and one polling (spin=SPIN_S).
    cur = torch.cuda.current_stream()
    modes = (("stream", cur, False), ("host", None, False), ("stream_spin", cur, True), ("host_spin", None, True))
    spins = [spin for _, _, spin in modes for _ in range(WARMUP_UPDATES + updates)]
    rounds = len(spins)
    ack_name = name + ".ack"
    _, results, procs = _spawn(update_reader, [(name, ack_name, spec_path, spins)])
    ok = False
    out = {"signal": "stream-ordered" if pub._sem_kind == "host_pinned" else "host (update(stream=...) does not "
           "order the signal after the stream: the version semaphore is host-kind)"}
    try:
        ack = _open_ack(gpuipc, ack_name, procs, results)
        t0s, call_us, i = [], [], 0
        for mode, stream, _ in modes:
            for _ in range(WARMUP_UPDATES + updates):
                if versions == 2:
                    pub.tensors  # the back buffer (allocated, filled with the front), before the clock
                torch.cuda.synchronize()
                i += 1
                ack.wait_host(i, timeout=TIMEOUT)  # the reader is about to block in wait_version
                time.sleep(0.002)  # ... and is blocked by now
                t0 = time.monotonic_ns()
                pub.update(stream=stream)
                t1 = time.monotonic_ns()
                t0s.append(t0)
                call_us.append((t1 - t0) / 1e3)
        kind, _, payload = _get(results, time.monotonic() + TIMEOUT, procs, "the reader's timestamps")
        if kind == "error":
            raise PeerFailed(payload)
        ack.close()
        ok = True
    finally:
        _stop(procs, 60 if ok else 2)
    if payload["seen"] != list(range(payload["seen"][0], payload["seen"][0] + rounds)):
        raise RuntimeError(f"the reader saw versions {payload['seen'][:5]}... : not each version in turn")
    visible = [(t1 - t0) / 1e3 for t0, t1 in zip(t0s, payload["t1_ns"])]
    n = WARMUP_UPDATES + updates
    for m, (mode, _, _) in enumerate(modes):
        lo = m * n + WARMUP_UPDATES
        out[mode] = {"visible_us": visible[lo:(m + 1) * n], "call_us": call_us[lo:(m + 1) * n]}
    # update_from of the whole dict: the copy in, then the update; until its stream has finished. The source holds
    # the same values, so what readers would see does not change.
    s = torch.cuda.current_stream()
    copy_ms, copy_call_ms = [], []
    for j in range(WARMUP_COPIES + copies):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        pub.update_from(source, stream=s)
        t1 = time.perf_counter()
        s.synchronize()
        t2 = time.perf_counter()
        if j >= WARMUP_COPIES:
            copy_ms.append((t2 - t0) * 1e3)
            copy_call_ms.append((t1 - t0) * 1e3)
    out["copy_ms"], out["copy_call_ms"] = copy_ms, copy_call_ms
    return out


def part_update(a):
    torch = cuda_init()
    import gpuipc
    import gpuipc.torch as gt

    spec = load_spec(a.spec)
    nbytes = spec_bytes(spec)
    # The MemPool dict, the source of update_from, and versions=2's pool (front, back, and one freed in order).
    why = fits(torch, 5 * nbytes + GiB + CONTEXT_BYTES, f"updates of a {nbytes / GiB:.1f} GiB dict")
    if why:
        return {"skipped": why, "tensors": len(spec), "bytes": nbytes}
    name = tag()
    pool = gt.MemPool(name + ".weights", device=0)
    with torch.cuda.use_mem_pool(pool):
        sd = make_dict(torch, spec)
    source = make_dict(torch, spec)
    out = {"tensors": len(spec), "bytes": nbytes, "updates": a.updates, "copies": a.copies, "warmup": WARMUP_UPDATES}
    for versions in (1, 2):
        pub = gpuipc.publish_tensors(f"{name}-v{versions}", sd, versions=versions)
        try:
            out[f"v{versions}"] = measure_updates(torch, gpuipc, pub, f"{name}-v{versions}", versions, a.updates,
                                                  a.copies, source, a.spec)
            out[f"v{versions}"]["by_reference"] = pub.pool is None
        finally:
            pub.close()
        torch.cuda.synchronize()
    return out


# --- part stream: bucketed streaming to a reader process, beside a local device-to-device copy ------------------------
def stream_reader_proc(name, ack_name, spec_path, rounds, results):
    try:
        torch = cuda_init()
        import gpuipc

        spec = load_spec(spec_path)
        into = {e["name"]: torch.empty(e["shape"], dtype=torch.bfloat16, device="cuda:0") for e in spec}
        s = torch.cuda.current_stream()
        deadline = time.monotonic() + TIMEOUT
        while True:
            try:
                rd = gpuipc.stream_reader(name)
                break
            except gpuipc.NotFound:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.05)
        ack = gpuipc.Semaphore.create(ack_name, initial=0, kind="host")
        t1, versions = [], []
        for i in range(rounds):
            if i == rounds - 1:  # the last round must deliver every byte again: clear the targets (untimed)
                torch._foreach_zero_(list(into.values()))
                torch.cuda.synchronize()
            ack.signal_host(i + 1)  # about to block in receive
            versions.append(rd.receive(into, stream=s, timeout=TIMEOUT))
            s.synchronize()
            t1.append(time.monotonic_ns())
        check(torch, into, spec)
        results.put(("done", 0, {"t1_ns": t1, "versions": versions}))
        close = getattr(rd, "close", None)
        if close is not None:
            close()
        ack.close()
    except BaseException:  # noqa: BLE001 - reported to the driver
        _report_error(results, 0)


def measure_stream(torch, gpuipc, sd, spec_path, reps):
    name = tag()
    ack_name = name + ".ack"
    s = torch.cuda.current_stream()
    items = list(sd.items())
    pub = gpuipc.stream_publisher(name, bucket_bytes=BUCKET_BYTES, buckets=BUCKETS, device=0)
    ok = False
    try:
        _, results, procs = _spawn(stream_reader_proc, [(name, ack_name, spec_path, reps + 1)])
        try:
            ack = _open_ack(gpuipc, ack_name, procs, results)
            t0s, call_ms, versions = [], [], []
            for i in range(reps + 1):
                torch.cuda.synchronize()
                ack.wait_host(i + 1, timeout=TIMEOUT)
                time.sleep(0.005)  # the reader is blocked in receive by now
                t0 = time.monotonic_ns()
                versions.append(pub.publish(items, stream=s))
                t1 = time.monotonic_ns()
                t0s.append(t0)
                call_ms.append((t1 - t0) / 1e6)
                s.synchronize()
            kind, _, payload = _get(results, time.monotonic() + TIMEOUT, procs, "the stream reader's timestamps")
            if kind == "error":
                raise PeerFailed(payload)
            ack.close()
            ok = True
        finally:
            _stop(procs, 60 if ok else 2)
    finally:
        close = getattr(pub, "close", None)
        if close is not None:
            close()
    ms = [(t1 - t0) / 1e6 for t0, t1 in zip(t0s, payload["t1_ns"])][1:]
    return {"ms": ms, "publish_call_ms": call_ms[1:], "first_ms": (payload["t1_ns"][0] - t0s[0]) / 1e6,
            "versions_published": versions, "versions_received": payload["versions"]}


def measure_local(torch, sd, reps):
    """The same bytes copied device to device in this process: into a second dict (one fused call), and flat."""
    nbytes = sum(t.numel() * t.element_size() for t in sd.values())
    src = list(sd.values())
    dst = [torch.empty_like(t) for t in src]
    foreach = hasattr(torch, "_foreach_copy_")
    ms = []
    for j in range(1 + reps):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        if foreach:
            torch._foreach_copy_(dst, src)
        else:
            for d, t in zip(dst, src):
                d.copy_(t, non_blocking=True)
        torch.cuda.synchronize()
        if j > 0:
            ms.append((time.perf_counter() - t0) * 1e3)
    del dst
    torch.cuda.empty_cache()
    flat_bytes = min(nbytes, 2 * GiB)
    a = torch.empty(flat_bytes, dtype=torch.uint8, device="cuda:0")
    b = torch.empty_like(a)
    flat_ms = []
    for j in range(1 + reps):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        b.copy_(a)
        torch.cuda.synchronize()
        if j > 0:
            flat_ms.append((time.perf_counter() - t0) * 1e3)
    del a, b
    torch.cuda.empty_cache()
    return {"ms": ms, "method": "torch._foreach_copy_" if foreach else "Tensor.copy_ per tensor",
            "flat_bytes": flat_bytes, "flat_ms": flat_ms}


def part_stream(a):
    torch = cuda_init()
    import gpuipc

    out = {"bucket_bytes": BUCKET_BYTES, "buckets": BUCKETS, "reps": a.reps, "skipped_sizes": []}
    # The reader's targets and this process's dict, the ring, and a second dict for the local copy afterwards.
    chosen = None
    for path, label in ((a.spec_large, "large"), (a.spec, "small")):
        if not path:
            continue
        spec = load_spec(path)
        nbytes = spec_bytes(spec)
        why = fits(torch, 2 * nbytes + BUCKETS * BUCKET_BYTES + 2 * GiB + CONTEXT_BYTES,
                   f"streaming a {nbytes / GiB:.1f} GiB dict")
        if why is None:
            chosen = (path, spec, nbytes, label)
            break
        out["skipped_sizes"].append(why)
    if chosen is None:
        return {**out, "skipped": "; ".join(out["skipped_sizes"])}
    path, spec, nbytes, label = chosen
    out.update({"dict": label, "tensors": len(spec), "bytes": nbytes})
    sd = make_dict(torch, spec)
    if not (hasattr(gpuipc, "stream_publisher") and hasattr(gpuipc, "stream_reader")):
        out["stream_missing"] = (f"this gpuipc ({getattr(gpuipc, '__version__', '?')}, {os.path.dirname(gpuipc.__file__)}) "
                                 "has no stream_publisher / stream_reader: bucketed streaming is not built in it")
    else:
        try:
            out["stream"] = measure_stream(torch, gpuipc, sd, path, a.reps)
        except Exception as e:  # noqa: BLE001 - the local copy is still measured; the suite reports the failure
            traceback.print_exc()
            out["stream_error"] = f"{type(e).__name__}: {e}"
    torch.cuda.synchronize()
    out["local"] = measure_local(torch, sd, a.reps)
    return out


# --- main -------------------------------------------------------------------------------------------------------------
PARTS = {"open": part_open, "segments": part_segments, "update": part_update, "stream": part_stream}


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--part", choices=sorted(PARTS), required=True)
    ap.add_argument("--spec", required=True, help="the dict: JSON [{name, shape}, ...] (bf16)")
    ap.add_argument("--spec-large", default="", help="stream: the larger dict, used when GPU memory allows")
    ap.add_argument("--consumers", type=int, default=10, help="open, segments: fresh consumer processes")
    ap.add_argument("--updates", type=int, default=200, help="update: measured updates per versions and mode")
    ap.add_argument("--copies", type=int, default=20, help="update: measured update_from calls per versions")
    ap.add_argument("--reps", type=int, default=5, help="stream: measured publishes and local copies")
    a = ap.parse_args()
    # SIGTERM (the suite's time limit) unwinds like an error: the broker and the children are stopped below.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit("terminated (SIGTERM)"))
    out = {"impl": f"weights-{a.part}"}
    # A private broker: its own runtime directory (short: the socket path must fit in 108 bytes), stopped at the end.
    runtime_dir = tempfile.mkdtemp(prefix="gpuipc-wb-", dir="/tmp")
    os.chmod(runtime_dir, 0o700)
    os.environ["GPUIPC_RUNTIME_DIR"] = runtime_dir  # before the first gpuipc call; spawned children inherit it

    def body():
        try:
            import torch
        except Exception as e:  # noqa: BLE001 - the reason to skip
            return {"skipped": f"torch is not importable: {type(e).__name__}: {e}"}
        if not torch.cuda.is_available():
            return {"skipped": "torch sees no CUDA device"}
        import gpuipc

        res = PARTS[a.part](a)
        return {"torch": torch.__version__, "gpuipc": gpuipc.__version__, **res}

    try:
        return report.finish(out, body)
    finally:
        stop_broker(runtime_dir)
        shutil.rmtree(runtime_dir, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
