"""Functions the CPU tests run in spawned child processes (importable by name, so spawn can find them)."""

from __future__ import annotations

import json
import os
import signal
import struct
import subprocess
import sys
import time
from typing import Any, List, Optional, Tuple

import numpy as np

import gpuipc
from gpuipc import _index


def mapped(name: str) -> List[str]:
    """The mappings of this process of ``name`` and of the names made from it (NAME.pool.chunk.0, ...): a host
    object's memory is a memfd named gpuipc:NAME (Linux)."""
    with open("/proc/self/maps") as f:
        return sorted(line.split()[5] for line in f if f"/memfd:gpuipc:{name}" in line)


def drop_privileges() -> None:
    """Become uid/gid 65534 (nobody) for good."""
    os.setgroups([])
    os.setgid(65534)
    os.setuid(65534)


def open_check_and_double(name: str, n: int) -> float:
    """Opens float64 segment `name`, checks it holds arange(n), doubles it in place; returns the old sum."""
    with gpuipc.Segment.open(name) as seg:
        a = seg.as_array("float64", (n,))
        assert np.array_equal(a, np.arange(n, dtype=np.float64)), a[:10]
        total = float(a.sum())
        a *= 2
        return total


def open_readonly_and_try_write(name: str) -> Tuple[bool, str, int]:
    """Opens `name` read-only: (array writeable?, error of a write attempt, first byte)."""
    with gpuipc.Segment.open(name, readonly=True) as seg:
        a = seg.as_array("uint8", 16)
        try:
            a[0] = 1
            err = ""
        except ValueError as e:
            err = str(e)
        return bool(a.flags.writeable), err, int(a[0])


def open_as_other_user(name: str, readonly: bool) -> Tuple[str, str]:
    """Drops to uid 65534 and opens `name`: ("ok", first byte) or (exception class, message)."""
    drop_privileges()
    try:
        with gpuipc.Segment.open(name, readonly=readonly) as seg:
            return "ok", str(int(seg.as_array("uint8", 1)[0]))
    except gpuipc.Error as e:
        assert isinstance(e, PermissionError) == isinstance(e, gpuipc.PermissionDenied)
        return type(e).__name__, str(e)


def unlink_as_other_user(name: str) -> str:
    drop_privileges()
    try:
        gpuipc.Segment.unlink(name)
        return "ok"
    except gpuipc.Error as e:
        return type(e).__name__


def create_semaphore_as_other_user(name: str) -> Tuple[str, str]:
    """Drops to uid 65534 and creates semaphore `name`: ("ok", "") or (exception class, message)."""
    drop_privileges()
    try:
        gpuipc.Semaphore.create(name, initial=0, kind="host", mode=0o666).close()
        gpuipc.Semaphore.unlink(name)
        return "ok", ""
    except gpuipc.Error as e:
        return type(e).__name__, str(e)


def forge_index(name, body, flat, storages, refs, stamp=1):
    """Writes a tensor index ``name`` (as share_tensors lays it out) with these JSON body and columns, and slot 0's
    refs; returns its segment."""
    js = json.dumps(body).encode() if isinstance(body, dict) else body
    fb, sb = np.asarray(flat, "<i8").tobytes(), np.asarray(storages, "<i8").tobytes()
    count = len(storages) // 4
    start = (32 + len(js) + 7) // 8 * 8
    offset = (start + len(fb) + len(sb) + 63) // 64 * 64
    seg = gpuipc.Segment.create(name, offset + _index.slot_bytes(count))
    m = seg.as_array("uint8")
    head = _index._HEADER.pack(_index.MAGIC, _index.FORMAT, len(js), 1, count, offset) + js
    head += bytes(start - len(head)) + fb + sb
    m[: len(head)] = np.frombuffer(head, np.uint8)
    m[offset : offset + 8] = np.frombuffer(struct.pack("<Q", stamp), np.uint8)
    m[offset + 16 : offset + 16 + len(refs)] = np.frombuffer(refs, np.uint8)
    return seg


def index_body(names, dtypes=("float32",), pools=("P",), words=0, **extra):
    return {"format": 2, "names": list(names), "dtypes": list(dtypes), "frameworks": ["numpy"], "pools": list(pools),
            "tensor_words": words, "versioning": None, **extra}


def forge_index_as_other_user(name: str, pool_names: List[str], refs: List[bytes]) -> str:
    """Drops to uid 65534 and writes tensor index ``name`` naming block ``refs[k]`` of pool ``pool_names[k]`` (pools
    it may not use) as tensor "t<k>", 16 float32 each; the name stays after this process exits."""
    drop_privileges()
    flat: List[int] = []
    storages: List[int] = []
    for k in range(len(refs)):
        flat += [k, 0, 0, 0, 1, 16, 1]
        storages += [k, 64, 0, 0]
    body = index_body([f"t{k}" for k in range(len(refs))], pools=pool_names, words=len(flat))
    forge_index(name, body, flat, storages, b"".join(refs)).close()
    return "ok"


def create_later(name: str, delay: float, value: int) -> None:
    """Creates host segment `name` after `delay` seconds, writes `value` and keeps it for a while."""
    time.sleep(delay)
    seg = gpuipc.Segment.create(name, 4096)
    seg.as_array("int64", 1)[0] = value
    time.sleep(1.0)  # the name stays; the memory too (the test opens it meanwhile)
    seg.close()


# Semaphores ----------------------------------------------------------------------------------------------------------
def semaphore_wait(name: str, value: int, timeout: float) -> int:
    with gpuipc.Semaphore.open(name, role="waiter", wait=10) as sem:
        return sem.wait_host(value, timeout=timeout)


def semaphore_signaller_then_close(name: str, ready: str) -> None:
    """Creates host semaphore `name`, signals 1, creates segment `ready` as a sign, then closes cleanly."""
    sem = gpuipc.Semaphore.create(name, kind="host")
    sem.signal_host(1)
    gpuipc.Segment.create(ready, 4096).close()
    time.sleep(0.5)
    sem.close()


def semaphore_signaller_forever(name: str, ready: str) -> None:
    """Creates host semaphore `name`, signals 1, creates `ready`, then sleeps until killed."""
    sem = gpuipc.Semaphore.create(name, kind="host")
    sem.signal_host(1)
    keep = gpuipc.Segment.create(ready, 4096)
    time.sleep(600)
    del sem, keep


# Channels ------------------------------------------------------------------------------------------------------------
def sample_arrays() -> List[np.ndarray]:
    """Arrays of every kind send must carry: dtypes, ranks (0-d, empty, 3-d), non-contiguous sources."""
    rng = np.random.default_rng(7)
    base = np.arange(48, dtype=np.float64).reshape(6, 8)
    return [
        np.arange(10, dtype=np.float32),
        rng.integers(-100, 100, size=(3, 4, 5), dtype=np.int64),
        np.array([True, False, True]),
        (np.arange(6) + 1j * np.arange(6)).astype(np.complex64),
        np.linspace(0, 1, 7, dtype=np.float16),
        np.array(3.5, dtype=np.float64),
        np.zeros((0, 4), dtype=np.uint16),
        base[:, ::2],  # strided: send makes it contiguous
        base.T,
        np.frombuffer(b"abcdef", dtype=np.uint8),
    ]


def channel_producer(name: str, count: int) -> int:
    """Opens channel `name` as a producer and sends sample_arrays() `count` times; returns messages sent."""
    with gpuipc.Channel.open(name, "producer", wait=10) as ch:
        sent = 0
        for i in range(count):
            for j, a in enumerate(sample_arrays()):
                ch.send(a, meta=f"{i}:{j}".encode(), timeout=30)
                sent += 1
        return sent


def channel_consumer(name: str, expect: int) -> List[Tuple[str, Tuple[int, ...], float]]:
    """Receives `expect` messages from `name`: (dtype name, shape, sum) of each."""
    out = []
    with gpuipc.Channel.open(name, "consumer", wait=10) as ch:
        for _ in range(expect):
            with ch.recv(timeout=30) as msg:
                a = msg.array
                assert not a.flags.writeable
                out.append((msg.dtype_name, msg.shape, float(np.abs(a).sum())))
    return out


def channel_producer_killed(name: str, ready: str) -> None:
    """Joins `name` as a producer, sends two messages, creates `ready`, then sleeps until killed."""
    ch = gpuipc.Channel.open(name, "producer", wait=10)
    ch.send(np.full(4, 1, dtype=np.int32))
    ch.send(np.full(4, 2, dtype=np.int32))
    keep = gpuipc.Segment.create(ready, 4096)
    time.sleep(600)
    del ch, keep


def wait_for_name(name: str, timeout: float = 30) -> None:
    with gpuipc.Segment.open(name, wait=timeout):
        pass



# Pools and tensors ---------------------------------------------------------------------------------------------------
def pool_resolve_and_sum(name: str, raw_ref: bytes) -> int:
    """Opens pool `name`, holds and resolves the block `raw_ref` names, returns the sum of its int64s."""
    ref = gpuipc.BlockRef.from_bytes(raw_ref)
    with gpuipc.Pool.open(name, readonly=True) as pool, pool.held(ref) as view:
        a = view.numpy("int64")
        assert not a.flags.writeable
        return int(a.sum())


def pool_map_chunks_then_sum(name: str, raw_refs: List[bytes]) -> List[int]:
    """Opens pool `name`, maps the chunks of `raw_refs` with one map_chunks, removes the pool's names (so that a
    chunk not mapped by then could not be opened any more), then resolves each block: the sums of their int64s."""
    refs = [gpuipc.BlockRef.from_bytes(r) for r in raw_refs]
    with gpuipc.Pool.open(name, readonly=True) as pool:
        pool.map_chunks(refs)
        gpuipc.Pool.unlink(name)
        return [int(pool.resolve(r).numpy("int64").sum()) for r in refs if r.pool == pool.id]


def views_of_while_another_thread_closes(name: str, rounds: int) -> dict:
    """Pool `name` with 2048 blocks, each filled with its number. Each round joins it again and one thread makes
    held views of every block through that handle (views_of releases the GIL for the whole look-up) while this one
    closes the handle at a random point within the time one call takes here. Returns how the rounds ended:
    {"views": n, "closed": n}, plus any other error's text; and "overlapped": the rounds whose close came while the
    call ran. Views that came back are checked block by block."""
    import random
    import threading

    from gpuipc._arrays import make_array

    n = 2048
    out: dict = {"views": 0, "closed": 0, "overlapped": 0}
    with gpuipc.Pool.create(name, chunk_bytes=16 << 20, max_bytes=64 << 20) as pool:
        blocks = [pool.allocate(4096) for _ in range(n)]
        for k, b in enumerate(blocks):
            b.numpy("int64")[:] = k
        raw = b"".join(bytes(b.ref) for b in blocks)
        # How long one call takes on this machine: the closes are spread over about that long after the thread
        # starts, so that most land while a call runs on a fast machine as on a slow one.
        with gpuipc.Pool.open(name) as probe:
            calls = []
            for _ in range(3):
                t0 = time.perf_counter()
                probe._pool.views_of(raw, True, True, False)
                calls.append(time.perf_counter() - t0)
            call = min(calls)
        for _ in range(rounds):
            handle = gpuipc.Pool.open(name)._pool
            got: list = []
            span: list = []

            def look() -> None:
                span.append(time.perf_counter())
                try:
                    got.append(handle.views_of(raw, True, True, False))
                except gpuipc.errors.Error as e:  # noqa: PERF203 - the outcome is what the test counts
                    got.append(e)
                span.append(time.perf_counter())

            t = threading.Thread(target=look)
            t.start()
            while not span:  # the call is about to start
                time.sleep(0)
            close_at = span[0] + random.uniform(0, call)
            while time.perf_counter() < close_at:  # sleep(0) gives the GIL to the call; a timed sleep may oversleep
                time.sleep(0)
            closing = time.perf_counter()
            handle.close()
            t.join()
            out["overlapped"] += span[0] < closing < span[1]
            r = got[0]
            if isinstance(r, list):
                assert len(r) == n and all(int(make_array(v, "int64")[0]) == k for k, v in enumerate(r))
                out["views"] += 1
            elif "this handle was closed" in str(r):
                out["closed"] += 1
            else:
                out[str(r)] = out.get(str(r), 0) + 1
    return out


def open_tensors_summary(name: str) -> dict:
    """open_tensors(name): {tensor: (dtype, shape, strides in bytes, sum, writeable)}."""
    t = gpuipc.open_tensors(name, wait=10)
    return {k: (str(v.dtype), v.shape, v.strides, float(np.abs(v).sum()), bool(v.flags.writeable)) for k, v in t.items()}


def reader_follow(name: str, until: int) -> list:
    """A Reader of `name` waits for each version up to `until`; returns [(version, value of w[0])]."""
    seen = []
    with gpuipc.open_tensors(name, versioned=True, wait=10) as r:
        v = 1
        while v <= until:
            r.wait_version(v, timeout=30)
            with r.pin() as p:
                w = p.tensors["w"]
                assert (w == w[0]).all(), "a torn version"
                seen.append((p.version, float(w[0])))
                v = p.version + 1
    return seen


def reader_pin_then_sleep(name: str, ready: str) -> None:
    """Pins the current version of `name`, creates `ready`, then sleeps until killed."""
    r = gpuipc.open_tensors(name, versioned=True, wait=10)
    with r.pin() as p:
        keep = gpuipc.Segment.create(ready, 4096)
        time.sleep(600)
        del keep, p


def publisher_forever(name: str, ready: str, versions: int) -> None:
    """Publishes w = 1.0 (1024 float64) as `name`, updates to 2.0, creates `ready`, then sleeps until killed."""
    pub = gpuipc.publish_tensors(name, {"w": np.full(1024, 1.0)}, versions=versions)
    pub.update_from({"w": np.full(1024, 2.0)})
    keep = gpuipc.Segment.create(ready, 4096)
    time.sleep(600)
    del pub, keep


def share_later(name: str, delay: float) -> None:
    """Shares w = 1.0 (1024 float64) as `name` after `delay` seconds, keeps it for 2 s, then closes."""
    time.sleep(delay)
    with gpuipc.share_tensors(name, {"w": np.full(1024, 1.0)}):
        time.sleep(2.0)


# Bucketed streaming ----------------------------------------------------------------------------------------------------
def stream_state(v: int) -> dict:
    """Version v of the streamed state: "a" (200 KB) spans several 64 KiB buckets; an empty and a 0-d tensor."""
    return {
        "a": np.arange(50000, dtype=np.float32) + v,
        "b": np.full((3, 7), v, dtype=np.int64),
        "h": (np.linspace(0, 1, 1000) + v).astype(np.float16),
        "z": np.zeros((0, 4), dtype=np.float32),
        "s": np.array(v * 0.5),
    }


def stream_reader_follow(name: str, versions: int) -> list:
    """Joins stream `name`, receives `versions` versions; returns [(version, every tensor right)]."""
    out = []
    with gpuipc.stream_reader(name, wait=30) as rd:
        into = {k: np.zeros_like(x) for k, x in stream_state(0).items()}
        for _ in range(versions):
            v = rd.receive(into, timeout=60)
            want = stream_state(v)
            out.append((v, all(np.array_equal(into[k], want[k]) for k in want)))
    return out


def stream_publisher_dies_mid_version(name: str, ready: str) -> None:
    """Publishes version 1 of stream_state to one reader, then starts version 2, sends part of it (3 of 4
    buckets of "a"), creates `ready` and sleeps until killed."""
    pub = gpuipc.stream_publisher(name, 64 << 10, 2, kind="host")
    pub.wait_readers(1, timeout=30)
    pub.publish(stream_state(1))
    pub.start()
    pub.update([("a", stream_state(2)["a"])])
    keep = gpuipc.Segment.create(ready, 4096)
    time.sleep(600)
    del pub, keep


def stream_reader_stalls(name: str, ready: str) -> None:
    """Receives version 1, takes the first piece of version 2 and never lets its bucket go; creates `ready` and
    sleeps until killed."""
    rd = gpuipc.stream_reader(name, wait=30)
    into = {k: np.zeros_like(x) for k, x in stream_state(0).items()}
    rd.receive(into, timeout=60)
    it = rd.receive_iter(timeout=60)
    next(it)
    keep = gpuipc.Segment.create(ready, 4096)
    time.sleep(600)
    del rd, it, keep


# Reference pieces (a publisher's host pool memory) --------------------------------------------------------------------
#: The calls of the extension that open or resolve a handle (a pool join, a block resolve, a segment or semaphore open).
_HANDLE_CALLS = (("Pool", "open"), ("Pool", "map_chunks"), ("Pool", "views_of"), ("Pool", "view"), ("Pool", "spans_of"),
                 ("Pool", "resolve"), ("Segment", "open"), ("Semaphore", "open"))


def count_handle_calls() -> dict:
    """Counts, from now on in this process, every call of _gpuipc that opens or resolves a handle: returns the dict
    of counters (by "Class.method") that the calls bump."""
    from gpuipc import _gpuipc

    counts = {f"{c}.{m}": 0 for c, m in _HANDLE_CALLS}
    for c, m in _HANDLE_CALLS:
        cls = getattr(_gpuipc, c)
        orig = getattr(cls, m)
        key = f"{c}.{m}"

        def counted(*args, _orig=orig, _key=key, **kwargs):
            counts[_key] += 1
            return _orig(*args, **kwargs)

        setattr(cls, m, staticmethod(counted) if m == "open" else counted)
    return counts


def ref_layout(v: int) -> dict:
    """Version v of what test_streaming's reference tests send: "w" and "i" (views of the publisher's pool block),
    "p" (a plain array: staged), "z" (empty)."""
    return {
        "w": np.arange(8000, dtype=np.float32) + v,
        "i": np.full((4, 4), v, dtype=np.int64),
        "p": np.full(5, -v, dtype=np.float64),
        "z": np.zeros((0, 3), dtype=np.float32),
    }


def stream_receive_counting(name: str, layout: dict, versions: int) -> list:
    """Joins stream `name` and receives `versions` versions into zeroed arrays shaped like `layout` (name to array).
    Returns, per version: (version, the arrays received, the handle calls (count_handle_calls) made by receive)."""
    out = []
    with gpuipc.stream_reader(name, wait=30) as rd:
        into = {k: np.zeros_like(x) for k, x in layout.items()}
        counts = count_handle_calls()
        for _ in range(versions):
            for k in counts:
                counts[k] = 0
            v = rd.receive(into, timeout=60)
            out.append((v, {k: x.copy() for k, x in into.items()}, {k: n for k, n in counts.items() if n}))
    return out


def stream_receive_slowly(name: str, hold: float, go: Optional[str] = None) -> dict:
    """Receives one version with receive_iter, holding each piece `hold` seconds before copying it (and the first one
    until the name `go` exists, if given). Returns what it copied (name to array), each item's (dtype, shape,
    complete), and when it let the last bucket go."""
    got, items = {}, {}
    with gpuipc.stream_reader(name, wait=30) as rd:
        for item in rd.receive_iter(timeout=60):
            if go is not None and not got:
                wait_for_name(go, timeout=60)
            time.sleep(hold)
            got[item.name] = np.array(item.view)
            items[item.name] = (item.dtype, item.shape, item.complete, item.view.flags.writeable)
        done = time.monotonic()
    return {"got": got, "items": items, "done": done}


def stream_receive_slow_last(name: str, last: str, hold: float) -> tuple:
    """Receives one version with receive_iter, holding its piece of tensor `last` (the version's last) `hold` seconds
    before copying it: ("raised", class name, message) or ("ok", version, {name: sorted distinct values})."""
    got = {}
    with gpuipc.stream_reader(name, wait=30) as rd:
        try:
            for item in rd.receive_iter(timeout=60):
                if item.name == last:
                    time.sleep(hold)
                got[item.name] = np.array(item.view)
        except gpuipc.Error as e:
            return ("raised", type(e).__name__, str(e))
        return ("ok", rd.version, {k: sorted(set(v.reshape(-1).tolist())) for k, v in got.items()})


def stream_reader_holds_first(name: str, ready: str, cuda: bool = False) -> None:
    """Takes the first piece of the first version and never lets its bucket go; creates `ready` and sleeps until
    killed. cuda: a torch CUDA context first (device staging)."""
    if cuda:
        import torch

        torch.zeros(1, device="cuda")
    rd = gpuipc.stream_reader(name, wait=30)
    it = rd.receive_iter(timeout=60)
    next(it)
    keep = gpuipc.Segment.create(ready, 4096)
    time.sleep(600)
    del rd, it, keep


def stream_receive_after(name: str, go: str, layout: dict) -> list:
    """Joins stream `name`, waits for the name `go`, then receives twice into arrays shaped like `layout`: returns
    [what the first receive raised (class name, message) or its version, the second's (version, arrays)]."""
    with gpuipc.stream_reader(name, wait=30) as rd:
        into = {k: np.zeros_like(x) for k, x in layout.items()}
        wait_for_name(go, timeout=60)
        try:
            first: object = rd.receive(into, timeout=60)
        except gpuipc.Error as e:
            first = (type(e).__name__, str(e))
        v = rd.receive(into, timeout=60)
        return [first, (v, {k: x.copy() for k, x in into.items()})]


def pool_paused_report(name: str, raw_ref: bytes) -> dict:
    """Opens pool `name` (paused by another process) and reports what resolve, hold and allocate raise."""
    ref = gpuipc.BlockRef.from_bytes(raw_ref)
    out: dict = {}
    with gpuipc.Pool.open(name) as pool:
        out["paused"] = pool.paused
        out["stats"] = pool.stats()
        for what, call in (("resolve", lambda: pool.resolve(ref)), ("hold", lambda: pool.hold(ref)),
                           ("allocate", lambda: pool.allocate(16))):
            try:
                call()
                out[what] = ("no error", "")
            except gpuipc.Error as e:
                out[what] = (type(e).__name__, str(e))
    return out


# Counting semaphores -------------------------------------------------------------------------------------------------
def counting_hold_forever(name: str, n: int, ready: str) -> None:
    """Opens counting semaphore `name`, acquires `n` permits, creates `ready`, then sleeps until killed."""
    sem = gpuipc.CountingSemaphore.open(name, wait=10)
    sem.acquire(n, timeout=10)
    keep = gpuipc.Segment.create(ready, 4096)
    time.sleep(600)
    del sem, keep


def counting_acquire(name: str, n: int, timeout: float) -> int:
    """Opens counting semaphore `name`, acquires `n` permits within `timeout`; returns what it holds then."""
    with gpuipc.CountingSemaphore.open(name, wait=10) as sem:
        sem.acquire(n, timeout=timeout)
        return sem.held


def check_fails(what: str) -> None:
    """A worker whose check fails, as weights_server.py's worker does."""
    raise RuntimeError(what)


def killed(what: str) -> None:
    """A worker SIGKILLed before it returns."""
    os.kill(os.getpid(), signal.SIGKILL)


_GPU_PROBE = """
import ctypes, sys
try:
    cuda = ctypes.CDLL("libcuda.so.1")
except OSError:
    print("0 no CUDA driver (libcuda.so.1)"); sys.exit()
rc = cuda.cuInit(0)
if rc != 0:
    print(f"0 cuInit failed ({rc})"); sys.exit()
n = ctypes.c_int(0)
cuda.cuDeviceGetCount(ctypes.byref(n))
print(n.value, "GPUs visible")
"""


def gpus_missing(need: int = 1) -> str:
    """"" when at least ``need`` GPUs are visible, else why not. A child counts them, so that this process never
    initialises CUDA (a process forked after that could not use it)."""
    try:
        out = subprocess.run([sys.executable, "-c", _GPU_PROBE], capture_output=True, text=True, timeout=60).stdout
        count, why = out.split(" ", 1)
        return "" if int(count) >= need else f"{count} {why.strip()}"
    except Exception as e:  # noqa: BLE001 - the reason a test skips
        return f"GPU probe failed: {e}"


def close_while_waiting(handle, wait) -> object:
    """Runs ``wait()`` (a call on ``handle`` with no timeout) in a thread, closes ``handle`` from this thread once it
    waits, and returns what the wait returned or raised. Fails when the close or the wait takes more than 5 s."""
    import threading

    result: list = []

    def run() -> None:
        try:
            result.append(wait())
        except gpuipc.Error as e:
            result.append(e)

    t = threading.Thread(target=run)
    t.start()
    time.sleep(0.2)
    t0 = time.monotonic()
    handle.close()
    t.join(10)
    assert not t.is_alive() and time.monotonic() - t0 < 5, "the close or the wait hung"
    assert len(result) == 1, result
    return result[0]


def drop_while_the_broker_restarts(name: str, wrapper: str, slow: str, started: str, what: str = "segment") -> dict:
    """In a fresh process: drops the last reference of a segment or pool (no close(): Python's refcount frees it)
    while the library's watcher reconnects to a broker that takes 2 s to start (`wrapper`, as GPUIPC_DAEMON, sleeps
    while `slow` exists and says so in `started`). `what`: "segment" (the handle), "segment-view" (an array of a
    closed segment), "pool-view" (an array of a closed pool's block, the block freed) or "held-view" (a held view of
    a closed pool's block). Another Python thread counts meanwhile. Returns how long the drop took and how many counts
    the other thread made while it ran (0.2 s margins)."""
    import signal
    import threading
    import time

    os.environ["GPUIPC_DAEMON"] = wrapper
    os.environ["GPUIPC_CONNECT_TIMEOUT_MS"] = "30000"
    kept = gpuipc.Segment.create(name, 4096)
    dropped: Any
    if what == "segment":
        dropped = gpuipc.Segment.create(name + "b", 4096)
    elif what == "segment-view":
        seg = gpuipc.Segment.create(name + "b", 4096)
        dropped = seg.as_array("uint8")
        seg.close()
    else:
        pool = gpuipc.Pool.create(name + "p", chunk_bytes=1 << 20, max_bytes=1 << 20)
        block = pool.allocate(4096)
        if what == "held-view":  # as open_tensors makes them: the view holds the block
            dropped = pool._pool.view(block.ref._tuple(), False, True)
        else:
            dropped = block.as_array("uint8")
        block.free()
        pool.close()
        del block, pool
    with open(os.path.join(os.environ["GPUIPC_RUNTIME_DIR"], "broker.pid")) as f:
        broker = int(f.read())
    open(slow, "w").close()
    os.kill(broker, signal.SIGKILL)
    deadline = time.monotonic() + 20
    while not os.path.exists(started) and time.monotonic() < deadline:  # the watcher is starting the slow one
        time.sleep(0.005)
    ticks: List[float] = []
    stop = False

    def count() -> None:
        while not stop:
            ticks.append(time.monotonic())
            time.sleep(0.001)

    counter = threading.Thread(target=count)
    counter.start()
    time.sleep(0.05)
    t0 = time.monotonic()
    del dropped
    t1 = time.monotonic()
    stop = True
    counter.join()
    kept.close()
    return {"drop_s": t1 - t0, "counts_during": sum(1 for t in ticks if t0 + 0.2 < t < t1 - 0.2)}
