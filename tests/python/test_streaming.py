"""Bucketed streaming, host kind (NumPy): stream_publisher / stream_reader with several reader processes, tensors
split across buckets, receive_iter, checksums (a corrupted bucket), an abandoned version, a SIGKILLed publisher
mid-version (PeerDied, never a torn version, never a hang), a SIGKILLed or stalled reader (the publisher goes on)."""

from __future__ import annotations

import gc
import multiprocessing
import os
import signal
import threading
import time

import numpy as np
import pytest

import gpuipc
import helpers


def _kill_when(ready: str, pid: int) -> threading.Thread:
    """A thread that SIGKILLs `pid` once the name `ready` exists."""

    def run() -> None:
        helpers.wait_for_name(ready, timeout=60)
        time.sleep(0.2)  # let the other side block on what the victim holds
        os.kill(pid, signal.SIGKILL)

    t = threading.Thread(target=run, daemon=True)
    t.start()
    return t


def _zeros() -> dict:
    return {k: np.zeros_like(x) for k, x in helpers.stream_state(0).items()}


def _same(a: dict, b: dict) -> bool:
    return all(np.array_equal(a[k], b[k]) for k in b)


def test_round_trip_several_reader_processes(name, start):
    # 64 KiB buckets, a ring of 2: "a" (200 KB) is split over 4 buckets, and the publisher waits for the readers
    with gpuipc.stream_publisher(name, 64 << 10, 2, readers=4, kind="host") as pub:
        futs = [start(helpers.stream_reader_follow, name, 3) for _ in range(3)]
        assert pub.wait_readers(3, timeout=60) == 3
        for v in (1, 2, 3):
            assert pub.publish(helpers.stream_state(v)) == v
        assert pub.version == 3
        for f in futs:
            assert f.result(timeout=60) == [(1, True), (2, True), (3, True)]


def test_receive_iter_and_lifecycle(name):
    # buckets=8: the version fits in the ring, so one process can publish and then read
    with gpuipc.stream_publisher(name, 64 << 10, 8, kind="host") as pub, gpuipc.stream_reader(name) as rd:
        assert pub.wait_readers(1, timeout=10) == 1
        assert pub.start() == 1
        state = helpers.stream_state(1)
        pub.update([("a", state["a"]), ("b", state["b"])])
        pub.update({"h": state["h"], "z": state["z"], "s": state["s"]})
        assert pub.finish() == 1
        got = _zeros()
        pieces = []
        for item in rd.receive_iter(timeout=10):
            key, view = item
            assert not view.flags.writeable and view.dtype == got[key].dtype
            got[key].reshape(-1)[item.start : item.start + item.count] = view.reshape(-1)
            pieces.append((key, item.complete))
        assert rd.version == 1 and _same(got, state)
        assert [p for p in pieces if p[0] == "a"] == [("a", False)] * 4  # split over 4 buckets
        assert ("b", True) in pieces and ("z", True) in pieces
        # receive: names the caller lacks are skipped; a strided source travels contiguous
        src = np.arange(200, dtype=np.float64).reshape(10, 20)[:, ::2]
        assert pub.publish({"t": src, "b": state["b"]}) == 2
        into = {"t": np.zeros((10, 10))}
        assert rd.receive(into, timeout=10) == 2
        assert np.array_equal(into["t"], src) and rd.skipped == ["b"]


def test_checksum_mismatch_names_the_bucket(name):
    with gpuipc.stream_publisher(name, 4096, 8, kind="host", checksum=True) as pub, gpuipc.stream_reader(name) as rd:
        pub.wait_readers(1, timeout=10)
        a = np.arange(1500, dtype=np.float32)  # 6000 bytes: buckets 0 and 1
        into = {"a": np.zeros_like(a)}
        assert pub.publish({"a": a}) == 1
        first = pub._blocks[1 % pub.buckets]  # bucket sequence 1 lives in ring slot 1
        first.numpy()[8] ^= 0xFF  # corrupt the staging bucket after the publisher's checksum
        with pytest.raises(gpuipc.ChecksumMismatch, match=r"bucket 0 of version 1"):
            rd.receive(into, timeout=10)
        assert rd.version == 0
        # the next receive skips the rest of version 1 and gets version 2 whole
        assert pub.publish({"a": a * 2}) == 2
        assert rd.receive(into, timeout=10) == 2 and np.array_equal(into["a"], a * 2)


def test_abandoned_version_and_errors(name):
    with gpuipc.stream_publisher(name, 4096, 8, kind="host") as pub, gpuipc.stream_reader(name) as rd:
        pub.wait_readers(1, timeout=10)
        a = np.arange(100, dtype=np.float32)
        into = {"a": np.zeros_like(a)}
        with pytest.raises(gpuipc.InvalidArgument, match="twice"):
            pub.publish([("a", a), ("a", a)])  # abandoned: readers are told
        with pytest.raises(gpuipc.InvalidState, match="abandoned version 1"):
            rd.receive(into, timeout=10)
        assert pub.publish({"a": a + 1}) == 2
        assert rd.receive(into, timeout=10) == 2 and np.array_equal(into["a"], a + 1)
        pub.publish({"a": np.zeros(3, dtype=np.float32)})
        with pytest.raises(gpuipc.InvalidArgument, match="float32\\[3\\]"):
            rd.receive(into, timeout=10)
        with pytest.raises(gpuipc.Timeout):
            rd.receive(into, timeout=0.1)
        with pytest.raises(gpuipc.InvalidState, match="start"):
            pub.update({"a": a})
        with pytest.raises(gpuipc.AlreadyExists, match="unlink_stream"):
            gpuipc.stream_publisher(name, 4096, 2, kind="host")
    with pytest.raises(gpuipc.NotFound):
        gpuipc.stream_reader(name)


def test_reader_slots_are_bounded_and_reused(name):
    with gpuipc.stream_publisher(name, 4096, 4, readers=1, kind="host") as pub:
        rd = gpuipc.stream_reader(name)
        with pytest.raises(gpuipc.QuotaExceeded, match="reader slots"):
            gpuipc.stream_reader(name, wait=0.1)
        rd.close()
        assert pub.readers == 0  # the closed reader's slot is freed
        with gpuipc.stream_reader(name, wait=5) as rd2:
            assert rd2.slot == 0 and pub.publish({"x": np.ones(4)}) == 1
            into = {"x": np.zeros(4)}
            assert rd2.receive(into, timeout=10) == 1 and into["x"].sum() == 4


def test_slow_reader_is_evicted(name):
    with gpuipc.stream_publisher(name, 4096, 2, kind="host", reader_timeout=0.3) as pub, \
            gpuipc.stream_reader(name) as rd:
        pub.wait_readers(1, timeout=10)
        t0 = time.monotonic()
        assert pub.publish({"a": np.zeros(5000, dtype=np.float32)}) == 1  # 5 buckets: the reader never reads
        assert time.monotonic() - t0 < 10
        with pytest.raises(gpuipc.InvalidState, match="evicted"):
            rd.receive({"a": np.zeros(5000, dtype=np.float32)}, timeout=5)


def test_publisher_killed_mid_version(name):
    ctx = multiprocessing.get_context("spawn")
    p = ctx.Process(target=helpers.stream_publisher_dies_mid_version, args=(name, name + "-ready"))
    p.start()
    try:
        with gpuipc.stream_reader(name, wait=30) as rd:
            into = _zeros()
            assert rd.receive(into, timeout=60) == 1 and _same(into, helpers.stream_state(1))
            killer = _kill_when(name + "-ready", p.pid)
            t0 = time.monotonic()
            with pytest.raises(gpuipc.PeerDied):
                rd.receive(into, timeout=60)
            assert time.monotonic() - t0 < 30
            killer.join(10)
            assert rd.version == 1  # version 2 is never reported
            assert into["a"][0] == 2 and into["b"][0, 0] == 1  # documented: partly written
            with pytest.raises(gpuipc.PeerDied):
                rd.receive(into, timeout=5)
    finally:
        p.kill()
        p.join()
    gpuipc.unlink_stream(name)
    with pytest.raises(gpuipc.NotFound):
        gpuipc.unlink_stream(name)


def test_reader_killed_publisher_goes_on(name, start):
    ctx = multiprocessing.get_context("spawn")
    with gpuipc.stream_publisher(name, 64 << 10, 2, kind="host") as pub:
        good = start(helpers.stream_reader_follow, name, 2)
        p = ctx.Process(target=helpers.stream_reader_stalls, args=(name, name + "-ready"))
        p.start()
        try:
            assert pub.wait_readers(2, timeout=60) == 2
            assert pub.publish(helpers.stream_state(1)) == 1
            killer = _kill_when(name + "-ready", p.pid)
            t0 = time.monotonic()
            assert pub.publish(helpers.stream_state(2)) == 2  # blocks on the staller until it is killed
            assert time.monotonic() - t0 < 30
            killer.join(10)
        finally:
            p.kill()
            p.join()
        assert good.result(timeout=60) == [(1, True), (2, True)]
        deadline = time.monotonic() + 10
        while pub.readers and time.monotonic() < deadline:
            time.sleep(0.01)
        assert pub.readers == 0
        assert pub.publish(helpers.stream_state(3)) == 3  # no reader left: nothing to wait for


def test_publisher_follows_torch_tensors_changed_between_versions(name):
    """The publisher remembers the torch tensors it sent, and trusts that only while each is the same tensor at
    the same address: values written in place, a storage replaced in place (``.data =``), a new tensor under a
    name, and a tensor that is gone all travel right; what it remembered of a dead tensor is dropped."""
    torch = pytest.importorskip("torch", reason="torch is not installed here")
    state = {"w": torch.arange(40000, dtype=torch.float32), "b": torch.ones(7, dtype=torch.bfloat16)}
    with gpuipc.stream_publisher(name, 64 << 10, 8, kind="host") as pub, gpuipc.stream_reader(name) as rd:
        assert pub.wait_readers(1, timeout=10) == 1
        into = {k: torch.zeros_like(v) for k, v in state.items()}
        for v in (1, 2, 3, 4):
            if v == 2:
                state["w"].add_(1)  # in place: same tensor, same address
            elif v == 3:
                state["w"].data = torch.full((40000,), -5.0)  # same object, another storage
                state["b"] = torch.full((7,), 3.0, dtype=torch.bfloat16)  # a new tensor under the name
            elif v == 4:
                state["w"] = state["w"] * 2
            assert pub.publish(state) == v
            assert rd.receive(into, timeout=10) == v
            assert all(torch.equal(into[k], state[k]) for k in state), v
        gone = torch.ones(3)
        pub.publish({"gone": gone})
        assert "gone" in pub._seen
        del gone
        gc.collect()
        assert "gone" not in pub._seen
