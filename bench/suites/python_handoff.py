#!/usr/bin/env python3
"""gpuipc's channel handoff from Python, measured like the baselines in bench/analysis/baselines/handoff.py.

    python3 bench/suites/python_handoff.py --bytes 1048576 --iters 2000 [--host] [--stream default|side]

A producer process and a consumer process (multiprocessing "spawn", as the torch baseline). One round trip, timed
at the producer with time.perf_counter: the producer sends the same 1 MiB torch CUDA tensor (filled once) through a
gpuipc device Channel (``ch.send(tensor, stream=torch.cuda.current_stream())``) -> the consumer receives it
(``ch.recv``), makes a torch tensor of it (``msg.tensor()``, zero-copy, made once per slot; ``torch.from_dlpack(msg.array)``
with a gpuipc that lacks it), releases it in stream order
and acknowledges -> the producer sees the acknowledgement. The acknowledgement is a host-kind gpuipc Semaphore that
the consumer raises (``signal_host``) and the producer waits on (``wait_host``): one atomic and a futex wake, cheaper
than a reverse channel (acquire, publish, receive, release).

Two variants, each after 50 warm-up round trips:

* drained (the headline, ``p50_us``...): between round trips, outside the timed window, both processes synchronize
  their stream (the consumer then raises the semaphore once more, which the producer waits for before its next
  timer starts). The baselines queue no GPU work, so each of their round trips starts with idle streams; gpuipc's
  send queues a device copy and stream memory operations, which are drained here.
* back to back (``nodrain_*``): no synchronisation between round trips; stream work may overlap the next one.

Then the zero-copy handoff (``zc_*``), the protocol of the C++ channels suite's ``handoff_rtt`` from Python: a
one-slot channel; the producer acquires the slot (``ch.acquire``), has its torch view (``slot.tensor()``, made once)
and publishes it (``slot.publish_array``); the consumer receives it, makes its torch view (``msg.tensor()``) and
releases it; the producer's next acquire returns once that release is seen. One round trip is the time from the
producer's publish call to its next acquire's return; no bytes are copied (the producer filled the slot once, in
the warm-up, and the consumer checks them once). Each side uses a torch stream of its own (``torch.cuda.Stream()``,
non-blocking, as the C++ suite's streams), whatever ``--stream`` says: drained (``zc_p50_us``...: both streams
synchronized between round trips, outside the timed window; the consumer says so through the semaphore) and back to
back (``zc_nodrain_*``). Then drained again on torch's default stream, the legacy stream (``zc_legacy_*``): it waits
for every blocking stream, so publish and release enqueue their signal on it instead of writing it from the host.

``--host`` runs the same protocol through a host channel with a NumPy array (no GPU, no torch: tests the script).
``--stream side`` uses a new torch stream on each side instead of the current (default) stream.

Prints one JSON line last: {"impl": "gpuipc-python", "bytes", "iters", "p50_us", "p99_us", "min_us", "mean_us",
"nodrain_p50_us", ..., "ack", ...} or {"impl": ..., "error": ...}. `gpuipc bench python` runs it beside the
baselines (bench/suites/suite_python.cpp).
"""
import argparse
import json
import math
import os
import shutil
import signal
import statistics
import sys
import tempfile
import time
import traceback

WARMUP = 50
TIMEOUT_S = 60.0


def quantile(s, q):
    """The q-quantile of the sorted samples `s`, interpolated between its neighbours as `summarize` in
    bench/harness/bench.cpp computes every _p99 of the suites (and bench/analysis/baselines/report.py those of the
    baselines this is compared with)."""
    pos = q * (len(s) - 1)
    lo = math.floor(pos)
    hi = min(lo + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (pos - lo)


def summarize(samples_us, prefix=""):
    s = sorted(samples_us)
    return {
        f"{prefix}p50_us": statistics.median(s),
        f"{prefix}p99_us": quantile(s, 0.99),
        f"{prefix}min_us": s[0],
        f"{prefix}mean_us": statistics.fmean(s),
    }


def phases(iters):
    """(name, drained, round trips) in the order both processes run them."""
    return [("drained", True, WARMUP + iters), ("nodrain", False, WARMUP + iters)]


ZC_FILL = 7  # the byte the zero-copy producer writes into its slot once


def _slot_view(slot, nbytes, host):
    return slot.as_array("uint8", (nbytes,)) if host else slot.tensor("uint8", (nbytes,))


def _msg_view(msg, host):
    import numpy as np

    return np.asarray(msg.array) if host else msg.tensor()


def zc_phases(iters, torch):
    """(name, drained, round trips, stream) of the zero-copy round trips, in the order both processes run them."""
    side = torch.cuda.Stream() if torch is not None else None
    legacy = torch.cuda.default_stream() if torch is not None else None
    return [(name, drained, n, side) for name, drained, n in phases(iters)] + [("legacy", True, WARMUP + iters, legacy)]


def _check_received(a, nbytes, want, stream, what):
    """RuntimeError unless ``a`` holds ``nbytes`` bytes starting and ending with ``want``, once ``stream`` is done."""
    if stream is not None:
        stream.synchronize()
    first, last = int(a[0]), int(a[-1])
    if a.shape[0] != nbytes or first != want or last != want:
        raise RuntimeError(f"{what}received {tuple(a.shape)} starting {first}, ending {last}: expected {nbytes} "
                           f"bytes of {want}")


def zero_copy_producer(zc, sem, value, torch, nbytes, iters, host):
    """The zero-copy round trips (see the module docstring), after the copying ones; returns ({"zc_p50_us", ...},
    the acknowledgement semaphore's value)."""
    out = {}
    for name, drained, n, stream in zc_phases(iters, torch):
        rtt, acquire_us, view_us, publish_us = [], [], [], []
        published = 0.0
        for k in range(n):  # acquire k returns once message k - 1 was released: its round trip
            a0 = time.perf_counter()
            slot = zc.acquire(stream=stream, timeout=TIMEOUT_S)
            a1 = time.perf_counter()
            if k > WARMUP:
                rtt.append((a1 - published) * 1e6)
                acquire_us.append((a1 - a0) * 1e6)
            buf = _slot_view(slot, nbytes, host)
            a2 = time.perf_counter()
            if k == 0:  # once a phase, in the warm-up, on the stream acquire ordered after the slot's last reader
                if host:
                    buf.fill(ZC_FILL)
                else:
                    with torch.cuda.stream(stream):
                        buf.fill_(ZC_FILL)
            if k > WARMUP:
                view_us.append((a2 - a1) * 1e6)
            del buf
            if drained:  # outside the timed window: both streams idle, the consumer done with the last one
                if stream is not None:
                    stream.synchronize()
                if k > 0:
                    value += 1
                    sem.wait_host(value, timeout=TIMEOUT_S)
            published = time.perf_counter()
            slot.publish_array("uint8", (nbytes,), stream=stream)
            if k > WARMUP:
                publish_us.append((time.perf_counter() - published) * 1e6)
        if drained and n > 0:
            value += 1
            sem.wait_host(value, timeout=TIMEOUT_S)  # the consumer drained the last message of the phase
        elif stream is not None:
            stream.synchronize()
        prefix = "zc_" if name == "drained" else f"zc_{name}_"
        out.update(summarize(rtt, prefix))
        if name == "drained":
            out.update({"zc_acquire_call_us": statistics.median(acquire_us),
                        "zc_slot_view_us": statistics.median(view_us),
                        "zc_publish_call_us": statistics.median(publish_us)})
    return out, value


def zero_copy_consumer(zc, sem, value, torch, nbytes, iters, host):
    """The consumer's side of zero_copy_producer; returns ({"zc_recv_wait_us", ...}, the semaphore's value)."""
    out = {}
    checked = False
    for name, drained, n, stream in zc_phases(iters, torch):
        recv_us, view_us, release_us = [], [], []
        for k in range(n):
            r0 = time.perf_counter()
            msg = zc.recv(timeout=TIMEOUT_S, stream=stream)
            r1 = time.perf_counter()
            a = _msg_view(msg, host)
            r2 = time.perf_counter()
            if not checked:
                _check_received(a, nbytes, ZC_FILL, stream, "zero-copy: ")
                checked = True
            del a
            msg.release(stream=stream)
            r3 = time.perf_counter()
            if k >= WARMUP and drained:
                recv_us.append((r1 - r0) * 1e6)
                view_us.append((r2 - r1) * 1e6)
                release_us.append((r3 - r2) * 1e6)
            if drained:
                if stream is not None:
                    stream.synchronize()
                value += 1
                sem.signal_host(value)
        if stream is not None:
            stream.synchronize()
        if name == "drained":
            out.update({"zc_recv_wait_us": statistics.median(recv_us), "zc_view_us": statistics.median(view_us),
                        "zc_release_call_us": statistics.median(release_us)})
    return out, value


def _torch_cuda():
    import torch

    torch.cuda.set_device(0)
    torch.zeros(1, device="cuda")  # a current context before gpuipc maps anything
    return torch


def _stream(torch, which):
    if which == "side":
        s = torch.cuda.Stream()
        torch.cuda.set_stream(s)
    return torch.cuda.current_stream()


# --- consumer ------------------------------------------------------------------------------------------------
def consumer(ch_name, zc_name, sem_name, nbytes, iters, host, which_stream, results):
    """Receives, views, releases and acknowledges every message; puts {"recv_wait_us", ...} or {"error"} last."""
    out = {}
    try:
        import gpuipc
        import numpy as np

        torch = None
        stream = None
        if not host:
            torch = _torch_cuda()
            stream = _stream(torch, which_stream)
        ch = gpuipc.Channel.open(ch_name, "consumer", wait=TIMEOUT_S)
        zc = gpuipc.Channel.open(zc_name, "consumer", wait=TIMEOUT_S)
        sem = gpuipc.Semaphore.create(sem_name, initial=0, kind="host")
        value = 0
        recv_us, view_us, release_us = [], [], []
        checked = False
        for _, drained, n in phases(iters):
            for i in range(n):
                t0 = time.perf_counter()
                msg = ch.recv(timeout=TIMEOUT_S, stream=stream)
                t1 = time.perf_counter()
                if host:
                    a = np.asarray(msg.array)
                elif hasattr(msg, "tensor"):
                    a = msg.tensor()  # zero-copy view of the slot, made once per slot and handed out again
                else:
                    a = torch.from_dlpack(msg.array)  # zero-copy view of the slot (gpuipc before Message.tensor)
                t2 = time.perf_counter()
                if not checked:  # once, in the warm-up: the bytes arrived (outside any timed window)
                    _check_received(a, nbytes, 1, stream, "")
                    checked = True
                del a
                msg.release(stream=stream)
                t3 = time.perf_counter()
                value += 1
                sem.signal_host(value)  # the acknowledgement
                if i >= WARMUP and drained:
                    recv_us.append((t1 - t0) * 1e6)
                    view_us.append((t2 - t1) * 1e6)
                    release_us.append((t3 - t2) * 1e6)
                if drained:
                    if stream is not None:
                        stream.synchronize()
                    value += 1
                    sem.signal_host(value)  # drained: the producer may start its next timer
        if stream is not None:
            stream.synchronize()
        zc_out, value = zero_copy_consumer(zc, sem, value, torch, nbytes, iters, host)
        results.put({
            **zc_out,
            "recv_wait_us": statistics.median(recv_us),
            "from_dlpack_us": statistics.median(view_us),  # the torch view's cost, however it was made:
            "view": "np.asarray(msg.array)" if host else (
                "msg.tensor()" if hasattr(gpuipc.Message, "tensor") else "torch.from_dlpack(msg.array)"),
            "release_call_us": statistics.median(release_us),
        })
        # Closing the semaphore poisons it: wait until the producer has seen the last acknowledgement (it closes
        # the channel after that) so that its last wait_host cannot see "closed" first.
        try:
            ch.recv(timeout=TIMEOUT_S, stream=stream)
            raise RuntimeError("a message after the last round trip")
        except (gpuipc.Closed, gpuipc.PeerDied):
            pass
        ch.close()
        zc.close()
        sem.close()
        return
    except BaseException as e:  # noqa: BLE001 - reported to the producer
        traceback.print_exc()
        out = {"error": f"consumer: {type(e).__name__}: {e}"}
    results.put(out)


class ConsumerFailed(RuntimeError):
    pass


# --- producer ------------------------------------------------------------------------------------------------
def _open_ack(gpuipc, name, proc, results):
    """The consumer's semaphore, as soon as it exists (fails at once when the consumer is gone)."""
    deadline = time.monotonic() + 180  # a spawned child importing torch and making a context takes seconds
    while True:
        try:
            return gpuipc.Semaphore.open(name, role="waiter", wait=0.2)
        except (gpuipc.NotFound, gpuipc.Timeout):
            if not proc.is_alive() or time.monotonic() > deadline:
                why = "timed out" if proc.is_alive() else f"it exited with status {proc.exitcode}"
                raise RuntimeError(f"the consumer did not create the acknowledgement semaphore: {why}") from None


def send_parts(ch, buf, stream, n=2000):
    """Where send()'s Python time goes: each step it takes before the library's send_copy, timed alone over ``n``
    calls (medians, us); the rest of a send is send_copy (acquire, the copy's enqueue, publish). Internal names:
    {"error"} when this gpuipc has other ones."""
    try:
        from gpuipc._array_header import pack_header
        from gpuipc._copy_plans import plan_copy
        from gpuipc._streams import stream_handle
    except ImportError as e:
        return {"error": f"{type(e).__name__}: {e}"}
    to_gpu = ch.kind == "device"
    handle = stream_handle(stream)
    plan = plan_copy(buf, to_gpu, handle)
    steps = {
        "stream_handle": lambda: stream_handle(stream),
        "plan_copy": lambda: plan_copy(buf, to_gpu, handle),
        "check_fits": lambda: ch._check_fits(plan.dtype, plan.shape, plan.nbytes, b""),
        "pack_header": lambda: pack_header(plan.dtype, plan.shape, plan.nbytes, b""),
        "bytes_meta": lambda: bytes(b""),
    }
    out = {}
    for name, step in steps.items():
        times = []
        for _ in range(n):
            t0 = time.perf_counter_ns()
            step()
            times.append(time.perf_counter_ns() - t0)
        out[name] = statistics.median(times) / 1e3
    times = []
    for _ in range(n):  # the clock's own cost, to subtract by eye
        t0 = time.perf_counter_ns()
        times.append(time.perf_counter_ns() - t0)
    out["clock"] = statistics.median(times) / 1e3
    return out


def run(nbytes, iters, host, which_stream):
    import multiprocessing as mp

    import gpuipc

    torch = None
    stream = None
    if host:
        import numpy as np

        buf = np.ones(nbytes, dtype=np.uint8)
    else:
        torch = _torch_cuda()
        stream = _stream(torch, which_stream)
        buf = torch.empty(nbytes, dtype=torch.uint8, device="cuda:0")
        buf.fill_(1)
        torch.cuda.synchronize()
    tag = f"{os.getpid()}-{time.monotonic_ns() % 1000000}"
    ch_name, zc_name, sem_name = f"pyhandoff-{tag}", f"pyhandoff-zc-{tag}", f"pyhandoff-ack-{tag}"
    kind = "host" if host else "device"
    ch = gpuipc.Channel.create(ch_name, slots=4, slot_bytes=nbytes, kind=kind)
    zc = gpuipc.Channel.create(zc_name, slots=1, slot_bytes=nbytes, kind=kind)
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    p = ctx.Process(target=consumer, args=(ch_name, zc_name, sem_name, nbytes, iters, host, which_stream, results))
    p.start()
    out = {}
    finished = False
    try:
        sem = _open_ack(gpuipc, sem_name, p, results)
        value = 0
        send_us = []
        for name, drained, n in phases(iters):
            samples = []
            for i in range(n):
                t0 = time.perf_counter()
                ch.send(buf, stream=stream, timeout=TIMEOUT_S)
                t1 = time.perf_counter()
                value += 1
                sem.wait_host(value, timeout=TIMEOUT_S)
                t2 = time.perf_counter()
                if i >= WARMUP:
                    samples.append((t2 - t0) * 1e6)
                    if drained:
                        send_us.append((t1 - t0) * 1e6)
                if drained:  # outside the timed window: both streams idle before the next round trip
                    if stream is not None:
                        stream.synchronize()
                    value += 1
                    sem.wait_host(value, timeout=TIMEOUT_S)
            out.update(summarize(samples, "" if drained else f"{name}_"))
        out["send_call_us"] = statistics.median(send_us)
        out["send_parts_us"] = send_parts(ch, buf, stream)
        if stream is not None:
            stream.synchronize()
        zc_out, value = zero_copy_producer(zc, sem, value, torch, nbytes, iters, host)
        out.update(zc_out)
        peer = results.get(timeout=TIMEOUT_S)
        if "error" in peer:
            raise ConsumerFailed(peer["error"])
        out.update(peer)
        sem.close()
        finished = True
    except ConsumerFailed:
        raise
    except Exception as e:
        # The consumer's own error says more than the producer's PeerDied: prefer it when there is one.
        try:
            peer = results.get(timeout=5)
        except Exception:  # noqa: BLE001 - nothing more to say
            peer = {}
        if "error" in peer:
            raise ConsumerFailed(f"{peer['error']} (producer: {type(e).__name__}: {e})") from e
        raise
    finally:
        zc.close()
        ch.close()  # the consumer's cue to exit
        p.join(timeout=TIMEOUT_S if finished else 2)
        if p.is_alive():
            p.kill()
            p.join(timeout=10)
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--bytes", type=int, default=1 << 20)
    ap.add_argument("--iters", type=int, default=1000)
    ap.add_argument("--host", action="store_true", help="a host channel and a NumPy array (no GPU needed)")
    ap.add_argument("--stream", choices=["default", "side"], default="default",
                    help="torch's current (default) stream, or a new stream on each side")
    a = ap.parse_args()
    # SIGTERM (the suite's time limit) unwinds like an error: the broker and the consumer are stopped below.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit("terminated (SIGTERM)"))
    out = {"impl": "gpuipc-python", "bytes": a.bytes, "iters": a.iters, "kind": "host" if a.host else "device",
           "warmup": WARMUP, "stream": "none" if a.host else a.stream,
           "ack": "gpuipc host Semaphore (signal_host/wait_host)", "array": "numpy" if a.host else "torch cuda:0"}
    # A private broker: its own runtime directory (short: the socket path must fit in 108 bytes), stopped at the end.
    runtime_dir = tempfile.mkdtemp(prefix="gpuipc-pyb-", dir="/tmp")
    os.chmod(runtime_dir, 0o700)
    os.environ["GPUIPC_RUNTIME_DIR"] = runtime_dir  # before the first gpuipc call; the spawned consumer inherits it
    try:
        out.update(run(a.bytes, a.iters, a.host, a.stream))
        import gpuipc

        out["version"] = gpuipc.__version__
        # the module measured, which need not be the suite binary's build (the suite compares)
        out["gpuipc_commit"] = getattr(gpuipc, "__commit__", "unknown (older than __commit__)")
        out["gpuipc_path"] = os.path.dirname(gpuipc.__file__)
        if not a.host:
            import torch

            out["torch"] = torch.__version__
    except BaseException as e:  # noqa: BLE001 - reported as data, the suite records it
        traceback.print_exc()
        out["error"] = f"{type(e).__name__}: {e}"
    finally:
        from gpuipc._broker import stop_broker

        stop_broker(runtime_dir)
        shutil.rmtree(runtime_dir, ignore_errors=True)
    print(json.dumps(out), flush=True)
    return 0 if "error" not in out else 1


if __name__ == "__main__":
    sys.exit(main())
