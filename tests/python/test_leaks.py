"""No leaks: C++ objects are counted (gpuipc._gpuipc._live_objects), Python wrappers are finalized, broker
references go back to zero, and nanobind's own leak report (printed at exit when bound objects outlive the
interpreter) stays silent."""

from __future__ import annotations

import gc
import subprocess
import sys
import textwrap
import weakref

import numpy as np

import gpuipc
from gpuipc import _gpuipc

WORKLOAD = """
import gc, sys
import numpy as np
import gpuipc
from gpuipc import _gpuipc

def work(tag):
    seg = gpuipc.Segment.create(tag + "s", 1 << 16)
    a = seg.as_array("float32", (128, 128))
    a[:] = 3
    ro = gpuipc.Segment.open(tag + "s", readonly=True)
    b = np.from_dlpack(ro.view())           # a DLPack export consumed by NumPy
    cap = ro.view().__dlpack__()            # an export nobody consumes
    del cap
    assert b.nbytes == seg.size and float(ro.as_array("float32", 4).sum()) == 12
    tx = gpuipc.Channel.create(tag + "c", kind="host", slots=2, slot_bytes=1 << 16)
    rx = gpuipc.Channel.open(tag + "c", "consumer")
    for i in range(5):
        tx.send(a * i, meta=b"m")
        with rx.recv(timeout=5) as m:
            assert float(m.array.sum()) == 3 * i * 128 * 128
    tx.send(a)
    msg = rx.recv(timeout=5)                # held when the channel closes
    arr = msg.array
    sem = gpuipc.Semaphore.create(tag + "m", kind="host")
    sem.signal_host(3)
    assert gpuipc.Semaphore.open(tag + "m").wait_host(3, timeout=1) == 3
    try:
        gpuipc.Segment.open(tag + "missing")
    except gpuipc.NotFound:
        pass
    for o in (tx, rx, sem, seg, ro):
        o.close()
    gpuipc.Segment.unlink(tag + "s")
    gpuipc.Channel.unlink(tag + "c")
    gpuipc.Semaphore.unlink(tag + "m")
    return float(arr.sum())

for i in range(3):
    assert work(f"w{i}") == 3 * 128 * 128
gc.collect()
live = _gpuipc._live_objects()
assert all(v == 0 for v in live.values()), live
assert not [s for s in gpuipc.Segment.list() if s.references], gpuipc.Segment.list()
print("OK", live)
"""

# What a real program leaves behind: objects in globals at exit, a message never released, views alive.
AT_EXIT = """
import numpy as np
import gpuipc
seg = gpuipc.Segment.create("exit-s", 4096)
arr = seg.as_array("int32", 16)
tx = gpuipc.Channel.create("exit-c", kind="host", slots=2, slot_bytes=4096)
rx = gpuipc.Channel.open("exit-c", "consumer")
tx.send(np.arange(4))
msg = rx.recv(timeout=5)
view = msg.array
sem = gpuipc.Semaphore.create("exit-m", kind="host")
print("OK")
"""


def _run(script: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-X", "dev", "-c", textwrap.dedent(script)],
        capture_output=True,
        text=True,
        timeout=90,
    )


def test_workload_leaves_nothing_behind():
    r = _run(WORKLOAD)
    assert r.returncode == 0, r.stderr
    assert r.stdout.startswith("OK"), r.stdout + r.stderr
    assert "leaked" not in r.stderr, r.stderr


def test_objects_alive_at_exit_are_not_reported_as_leaks():
    r = _run(AT_EXIT)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "OK"
    assert "leaked" not in r.stderr, r.stderr


def test_counters_return_to_baseline_in_process(name):
    gc.collect()
    base = _gpuipc._live_objects()
    finalized = []
    seg = gpuipc.Segment.create(name, 8192)
    arr = seg.as_array("uint8")
    tx = gpuipc.Channel.create(name + "c", kind="host", slots=2, slot_bytes=4096)
    rx = gpuipc.Channel.open(name + "c", "consumer")
    tx.send(np.ones(3))
    msg = rx.recv(timeout=5)
    for o in (seg, tx, rx, msg):
        weakref.finalize(o, finalized.append, type(o).__name__)
    during = _gpuipc._live_objects()
    assert during["Segment"] == base["Segment"] + 1 and during["Channel"] == base["Channel"] + 2
    assert during["ArrayView"] > base["ArrayView"]
    msg.release()
    del seg, arr, tx, rx, msg, o
    gc.collect()
    assert sorted(finalized) == ["Channel", "Channel", "Message", "Segment"]
    assert _gpuipc._live_objects() == base
    assert gpuipc.Segment.stat(name).references == 0
