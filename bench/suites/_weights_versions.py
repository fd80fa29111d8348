"""The parts of bench/suites/weights.py that hand a dict over again and again: update (pub.update() -> a reader's
wait_version returns) and stream (bucketed streaming to a reader process, staged and by reference, beside a local
device-to-device copy)."""
import inspect
import os
import time
import traceback

from _weights_common import (
    BUCKET_BYTES,
    REF_BUCKET_BYTES,
    BUCKETS,
    CONTEXT_BYTES,
    STARTUP,
    TIMEOUT,
    WARMUP_COPIES,
    WARMUP_UPDATES,
    GiB,
    PeerFailed,
    _get,
    _report_error,
    _spawn,
    _stop,
    check,
    cuda_init,
    fits,
    load_spec,
    make_dict,
    spec_bytes,
    tag,
)


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


def update_reader(name, ack_name, floor_name, spec_path, spins, floor_rounds, results):
    try:
        torch = cuda_init()
        import gpuipc

        spec = load_spec(spec_path)
        ack = gpuipc.Semaphore.create(ack_name, initial=0, kind="host")
        r = gpuipc.open_tensors(name, versioned=True, device=0, wait=TIMEOUT)
        floor = gpuipc.Semaphore.open(floor_name, role="waiter", wait=TIMEOUT)
        v = r.version
        t1, seen = [], []
        for i, spin in enumerate(spins):
            ack.signal_host(i + 1)  # about to wait for version v + 1
            got = r.wait_version(v + 1, timeout=TIMEOUT, spin=SPIN_S if spin else None)
            t1.append(time.monotonic_ns())
            seen.append(got)
            v += 1
        # The floor: the same wait (20 us of polling, then a futex) on a plain host semaphore the publisher raises.
        for k in range(floor_rounds):
            ack.signal_host(len(spins) + k + 1)
            floor.wait_host(k + 1, timeout=TIMEOUT)
            t1.append(time.monotonic_ns())
        floor.close()
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
    floor_name = name + ".floor"
    floor = gpuipc.Semaphore.create(floor_name, initial=0, kind="host")
    floor_rounds = WARMUP_UPDATES + updates
    _, results, procs = _spawn(update_reader, [(name, ack_name, floor_name, spec_path, spins, floor_rounds)])
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
        floor_t0 = []
        for k in range(floor_rounds):
            i += 1
            ack.wait_host(i, timeout=TIMEOUT)
            time.sleep(0.002)
            floor_t0.append(time.monotonic_ns())
            floor.signal_host(k + 1)
        kind, _, payload = _get(results, time.monotonic() + TIMEOUT, procs, "the reader's timestamps")
        if kind == "error":
            raise PeerFailed(payload)
        ack.close()
        ok = True
    finally:
        _stop(procs, 60 if ok else 2)
        floor.close()
        gpuipc.Semaphore.unlink(floor_name)
    floor_us = [(t1 - t0) / 1e3 for t0, t1 in zip(floor_t0, payload["t1_ns"][rounds:])]
    out["floor"] = {"visible_us": floor_us[WARMUP_UPDATES:],
                    "what": "a plain host-kind gpuipc Semaphore: signal_host() to the same reader's wait_host() "
                            "(20 us of polling, then a futex), timed the same way: the machine's cost of waking a "
                            "process that sleeps"}
    if payload["seen"] != list(range(payload["seen"][0], payload["seen"][0] + rounds)):
        raise RuntimeError(f"the reader saw versions {payload['seen'][:5]}... : not each version in turn")
    visible = [(t1 - t0) / 1e3 for t0, t1 in zip(t0s, payload["t1_ns"][:rounds])]
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


def _has_by_reference(gpuipc):
    return "by_reference" in inspect.signature(gpuipc.stream_publisher).parameters


class _PublishProfile:
    """cProfile of one publish() call, written as text (by own time, then cumulative) to ``path``."""

    def __init__(self, path):
        import cProfile  # noqa: PLC0415 - only when asked for

        self.path = path
        self.profile = cProfile.Profile()
        self.enable, self.disable = self.profile.enable, self.profile.disable

    def write(self):
        import io  # noqa: PLC0415
        import pstats  # noqa: PLC0415

        out = io.StringIO()
        for key in ("tottime", "cumulative"):
            pstats.Stats(self.profile, stream=out).sort_stats(key).print_stats(40)
        with open(self.path, "w") as f:
            f.write(out.getvalue())


def _publish_profiler(by_reference):
    """A profiler of the last measured publish() when $GPUIPC_BENCH_PROFILE_PUBLISH names a directory (one file per
    staging mode: publish-staged.txt, publish-byref.txt, publish-auto.txt), else None. The figures of that call then
    include the profiler's own cost; the other calls are not profiled."""
    where = os.environ.get("GPUIPC_BENCH_PROFILE_PUBLISH")
    if not where:
        return None
    mode = "auto" if by_reference is None else ("byref" if by_reference else "staged")
    return _PublishProfile(os.path.join(where, f"publish-{mode}.txt"))


def measure_stream(torch, gpuipc, sd, spec_path, reps, by_reference=None, bucket_bytes=BUCKET_BYTES, buckets=BUCKETS):
    """publish(sd) to a reader process, reps + 1 times (the first unmeasured). by_reference: passed to
    stream_publisher when not None (False: the staged path, True: every tensor by reference, in buckets whose pieces
    name bucket_bytes)."""
    name = tag()
    ack_name = name + ".ack"
    s = torch.cuda.current_stream()
    items = list(sd.items())
    kw = {} if by_reference is None else {"by_reference": by_reference}
    pub = gpuipc.stream_publisher(name, bucket_bytes=bucket_bytes, buckets=buckets, device=0, **kw)
    ring_bytes = pub.bucket_bytes
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
                profile = _publish_profiler(by_reference) if i == reps else None
                t0 = time.monotonic_ns()
                if profile is not None:
                    profile.enable()
                versions.append(pub.publish(items, stream=s))
                if profile is not None:
                    profile.disable()
                t1 = time.monotonic_ns()
                if profile is not None:
                    profile.write()
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
            "versions_published": versions, "versions_received": payload["versions"], "by_reference": by_reference,
            "bucket_bytes": ring_bytes, "bucket_bytes_asked": bucket_bytes, "buckets": buckets}


#: The local copy's way of copying large tensors one by one, as the stream reader does (gpuipc._stream_format).
MEMCPY_BYTES = 32 << 20


def _wide_copy(torch, dst, src):
    """The copies the stream reader enqueues, over the same tensors: the reader's own layout of them
    (gpuipc._stream_format._Copies over uint8 views), or with a gpuipc older than it, this layout written again:
    tensors of MEMCPY_BYTES or more one
    Tensor.copy_ each, the rest in one torch._foreach_copy_ over int64 views (bf16 tensors whose bytes are a multiple
    of 8; others in one more call as they are). torch's _foreach_copy_ moves 2-byte elements with 8-byte loads, int64
    ones with 32-byte loads: bench/results/experiments/copy-methods-*."""
    try:
        from gpuipc._stream_format import _Copies
    except ImportError:
        _Copies = None
    if _Copies is not None:
        flat = [t.view(-1).view(torch.uint8) for t in dst], [t.view(-1).view(torch.uint8) for t in src]
        copies = _Copies(torch, *flat)
        return (lambda: copies.run(torch, True)), (
            "the stream reader's copies (gpuipc._stream_format._Copies: Tensor.copy_ for pieces of 32 MiB or more, "
            "torch._foreach_copy_ over int64 views of the 8-byte-aligned rest, uint8 for odd ends)")
    single = [(d, s) for d, s in zip(dst, src) if d.numel() * d.element_size() >= MEMCPY_BYTES]
    rest = [(d, s) for d, s in zip(dst, src) if d.numel() * d.element_size() < MEMCPY_BYTES]
    wide = [(d.view(-1).view(torch.int64), s.view(-1).view(torch.int64))
            for d, s in rest if (d.numel() * d.element_size()) % 8 == 0]
    other = [(d, s) for d, s in rest if (d.numel() * d.element_size()) % 8]
    lists = [([d for d, _ in x], [s for _, s in x]) for x in (wide, other) if x]

    def run():
        for d, s in single:
            d.copy_(s, non_blocking=True)
        for ds, ss in lists:
            torch._foreach_copy_(ds, ss)

    return run, (f"Tensor.copy_ for tensors of {MEMCPY_BYTES} bytes or more, torch._foreach_copy_ over int64 views "
                 "for the rest")


def _timed_ms(torch, fn, reps):
    """fn() 1 + reps times, each until the device is idle; the last reps times in ms."""
    ms = []
    for j in range(1 + reps):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        if j > 0:
            ms.append((time.perf_counter() - t0) * 1e3)
    return ms


def measure_local(torch, sd, reps):
    """The same bytes copied device to device in this process, into a second dict: in one fused call over the tensors
    as they are ("ms"), and the way the stream reader copies ("wide_ms", where torch has _foreach_copy_); and one flat
    copy ("flat_ms")."""
    nbytes = sum(t.numel() * t.element_size() for t in sd.values())
    src = list(sd.values())
    dst = [torch.empty_like(t) for t in src]
    foreach = hasattr(torch, "_foreach_copy_")
    if foreach:
        ms = _timed_ms(torch, lambda d=dst: torch._foreach_copy_(d, src), reps)
        wide_run, wide_method = _wide_copy(torch, dst, src)
        wide_ms = _timed_ms(torch, wide_run, reps)
    else:
        ms = _timed_ms(torch, lambda ds=dst: [d.copy_(t, non_blocking=True) for d, t in zip(ds, src)], reps)
        wide_ms, wide_method = [], None
    del dst
    torch.cuda.empty_cache()
    flat_bytes = min(nbytes, 2 * GiB)
    a = torch.empty(flat_bytes, dtype=torch.uint8, device="cuda:0")
    b = torch.empty_like(a)
    flat_ms = _timed_ms(torch, lambda x=a, y=b: y.copy_(x), reps)
    del a, b
    torch.cuda.empty_cache()
    return {"ms": ms, "method": "torch._foreach_copy_" if foreach else "Tensor.copy_ per tensor", "wide_ms": wide_ms,
            "wide_method": wide_method, "flat_bytes": flat_bytes, "flat_ms": flat_ms}


def measure_stream_byref(torch, gpuipc, spec, spec_path, nbytes, reps):
    """The by-reference path: the same dict built under gpuipc.torch.MemPool, published with by_reference=True (the
    reader copies straight from it: one copy, no staging). Returns {"stream_byref": ...}, or why it has no figure
    ("stream_byref_missing", "stream_byref_skipped", "stream_byref_error")."""
    if not _has_by_reference(gpuipc):
        return {"stream_byref_missing": f"this gpuipc ({getattr(gpuipc, '__version__', '?')}) has no "
                                        "stream_publisher(by_reference=...): streaming by reference is not built in it"}
    # Now: the MemPool dict (rounded up to the pool's 1 GiB chunks), the reader's targets and its context; the
    # staged run's dict and ring, and the local copy's second dict, are gone by then.
    why = fits(torch, 2 * nbytes + GiB + CONTEXT_BYTES, f"streaming a {nbytes / GiB:.1f} GiB MemPool dict by reference")
    if why:
        return {"stream_byref_skipped": why}
    import gpuipc.torch as gt

    # $GPUIPC_BENCH_REF_BUCKET_MIB (comma-separated MiB): the bytes a bucket's reference pieces name, one run each
    # ("stream_byref" is the first, the others "stream_byref_<MiB>"); else REF_BUCKET_BYTES.
    # $GPUIPC_BENCH_REF_RINGS (comma-separated): ring sizes to run each of those with ("_ring<N>" appended but for
    # the first), else BUCKETS.
    sizes = [int(x) << 20 for x in os.environ.get("GPUIPC_BENCH_REF_BUCKET_MIB", "").split(",") if x.strip()]
    rings = [int(x) for x in os.environ.get("GPUIPC_BENCH_REF_RINGS", "").split(",") if x.strip()] or [BUCKETS]
    pool_name = tag() + ".weights"
    try:
        pool = gt.MemPool(pool_name, device=0)
        with torch.cuda.use_mem_pool(pool):
            sd = make_dict(torch, spec)
        out = {}
        for i, size in enumerate(sizes or [REF_BUCKET_BYTES]):
            for j, ring in enumerate(rings):
                key = "stream_byref" if i == 0 and j == 0 else \
                    f"stream_byref_{size >> 20}" + (f"_ring{ring}" if j else "")
                out[key] = measure_stream(torch, gpuipc, sd, spec_path, reps, by_reference=True, bucket_bytes=size,
                                          buckets=ring)
        return out
    except Exception as e:  # noqa: BLE001 - the staged figures stand; the suite reports the failure
        traceback.print_exc()
        return {"stream_byref_error": f"{type(e).__name__}: {e}"}
    finally:
        # A pool's names outlive its creator (the broker holds its memory): removed here, its memory goes when this
        # process exits, not after the suite's later parts.
        try:
            gpuipc.Pool.unlink(pool_name)
        except gpuipc.NotFound:
            pass


def part_stream(a):
    torch = cuda_init()
    import gpuipc

    out = {"bucket_bytes": BUCKET_BYTES, "buckets": BUCKETS, "reps": a.reps, "skipped_sizes": []}
    # The reader's targets and this process's dict, the ring, and a second dict for the local copy afterwards. The
    # by-reference run comes last, once this dict is freed, and checks its own fit then (measure_stream_byref).
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
            # the staged path: every byte copied into a bucket, then out of it
            out["stream"] = measure_stream(torch, gpuipc, sd, path, a.reps,
                                           by_reference=False if _has_by_reference(gpuipc) else None)
        except Exception as e:  # noqa: BLE001 - the local copy is still measured; the suite reports the failure
            traceback.print_exc()
            out["stream_error"] = f"{type(e).__name__}: {e}"
    torch.cuda.synchronize()
    out["local"] = measure_local(torch, sd, a.reps)
    if "stream_missing" not in out:
        del sd
        torch.cuda.empty_cache()
        out.update(measure_stream_byref(torch, gpuipc, spec, path, nbytes, a.reps))
    return out
