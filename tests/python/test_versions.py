"""Versions for weight sync, host kinds: publish_tensors, Reader (version, wait_version, pin), double buffering,
a SIGKILLed publisher (readers keep the last version, waits raise PeerDied) and a SIGKILLed reader (nothing left)."""

from __future__ import annotations

import os
import signal
import time

import numpy as np
import pytest

import gpuipc
import helpers


def _wait_until(pred, timeout=10.0):
    deadline = time.monotonic() + timeout
    while not pred():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.01)


@pytest.mark.parametrize("versions", [1, 2])
def test_update_seen_by_two_reader_processes(name, start, versions):
    with gpuipc.publish_tensors(name, {"w": np.full(4096, 1.0)}, versions=versions) as pub:
        readers = [start(helpers.reader_follow, name, 4) for _ in range(2)]
        with gpuipc.open_tensors(name, versioned=True) as r:
            for v in (2, 3, 4):
                time.sleep(0.2)
                assert pub.update_from({"w": np.full(4096, float(v))}) == v
                assert r.wait_version(v, timeout=10) >= v
        for fut in readers:
            seen = fut.result(timeout=60)
            assert seen[-1] == (4, 4.0) and all(float(v) == w for v, w in seen), seen


def test_in_place_update_and_pin(name):
    with gpuipc.publish_tensors(name, {"w": np.zeros(8), "b": np.ones(2)}, versions=2) as pub:
        r = gpuipc.open_tensors(name, versioned=True)
        assert r.version == 1 and r.versions == 2
        with r.pin() as p:
            assert p.version == 1
            back = pub.tensors
            back["w"][:] = 5  # the back buffer: the pinned version does not change
            assert (p.tensors["w"] == 0).all()
            assert pub.update() == 2
            assert (p.tensors["w"] == 0).all() and r.version == 2
        assert (r.tensors["w"] == 5).all() and (r.tensors["b"] == 1).all()  # b carried over
        assert not r.tensors["w"].flags.writeable
        r.close()


def test_versions_one_is_in_place(name):
    w = np.zeros(16, dtype=np.float32)
    with gpuipc.publish_tensors(name, {"w": w}, versions=1) as pub:
        r = gpuipc.open_tensors(name, versioned=True)
        live = r.tensors["w"]
        pub.tensors["w"][:] = 7
        assert (live == 7).all()  # one buffer: readers see writes at once
        pub.update()
        assert r.wait_version(2, timeout=1) == 2
        with pytest.raises(gpuipc.Timeout):
            r.wait_version(3, timeout=0.05)
        r.close()


def test_update_from_checks(name):
    with gpuipc.publish_tensors(name, {"w": np.zeros(4)}, versions=2) as pub:
        with pytest.raises(gpuipc.InvalidArgument, match="not one of"):
            pub.update_from({"x": np.zeros(4)})
        with pytest.raises(gpuipc.InvalidArgument, match="does not match"):
            pub.update_from({"w": np.zeros(5)})
        for bad in (3, 2.0, True):  # (2.0 and True compare equal to 2 and 1)
            with pytest.raises(gpuipc.InvalidArgument, match="versions must be"):
                gpuipc.publish_tensors(name + "x", {"w": np.zeros(4)}, versions=bad)


@pytest.mark.parametrize("versions", [1, 2])
def test_a_refused_update_from_writes_nothing(name, versions):
    """update_from checks every entry before it writes any: a bad one leaves the live memory (versions=1) and the
    back buffer (versions=2) as they were, so the tensors a later update leaves out keep their values. Before, the
    entries ahead of the bad one were written, and versions=2 kept an unfilled back buffer for the next update."""
    state = {"a": np.arange(4, dtype=np.float32), "b": np.full(4, 7, dtype=np.float32)}
    with gpuipc.publish_tensors(name, state, versions=versions) as pub:
        r = gpuipc.open_tensors(name, versioned=True)
        with pytest.raises(gpuipc.InvalidArgument, match="does not match"):
            pub.update_from({"a": np.ones(4, dtype=np.float32), "b": np.zeros(5, dtype=np.float32)})
        with pytest.raises(TypeError, match="update_from\\['b'\\]"):
            pub.update_from({"a": np.ones(4, dtype=np.float32), "b": [1.0, 2.0, 3.0, 4.0]})
        assert pub.version == 1
        assert pub.tensors["a"].tolist() == [0.0, 1.0, 2.0, 3.0]  # the live memory, or a copy of it in the back
        assert pub.update_from({"a": np.full(4, 2, dtype=np.float32)}) == 2
        v, got = r.snapshot()
        assert v == 2 and got["a"].tolist() == [2.0] * 4 and got["b"].tolist() == [7.0] * 4, (v, got)
        r.close()


def test_update_with_a_bad_stream_publishes_nothing(name):
    """A stream update() cannot use is refused before the version is published, and does not stick."""
    with gpuipc.publish_tensors(name, {"w": np.zeros(4)}, versions=2) as pub:
        with pytest.raises(ValueError, match="negative"):
            pub.update(stream=-1)
        assert pub.version == 1
        assert pub.update() == 2
        assert pub.update_from({"w": np.ones(4)}) == 3


@pytest.mark.parametrize("state", [{}, {"e": np.zeros((0, 3))}])
def test_double_buffering_with_nothing_to_pack(name, state):
    with gpuipc.publish_tensors(name, state, versions=2) as pub:
        assert pub.update() == 2
        assert set(pub.tensors) == set(state)
        assert pub.update_from(state) == 3
        with gpuipc.open_tensors(name, versioned=True) as r:
            assert r.version == 3


def test_double_buffering_reuses_memory(name):
    with gpuipc.publish_tensors(name, {"w": np.zeros(1 << 16)}, versions=2) as pub:
        for v in range(2, 12):
            pub.update_from({"w": np.full(1 << 16, float(v))})
        assert pub.pool.stats()["live_blocks"] == 1  # old fronts were freed



def test_publisher_killed(name, runtime_dir):
    import multiprocessing

    ctx = multiprocessing.get_context("spawn")
    p = ctx.Process(target=helpers.publisher_forever, args=(name, name + "-ready", 2))
    p.start()
    try:
        helpers.wait_for_name(name + "-ready")
        r = gpuipc.open_tensors(name, versioned=True)
        with r.pin() as pin:
            assert pin.version == 2
            w = pin.tensors["w"]
            os.kill(p.pid, signal.SIGKILL)
            p.join(10)
            with pytest.raises(gpuipc.PeerDied):
                r.wait_version(3, timeout=10)
            assert (w == 2.0).all()  # the last complete version stays
        assert (r.tensors["w"] == 2.0).all()
        r.close()
    finally:
        p.kill()
        p.join()
    gpuipc.unlink_tensors(name)


def test_a_reader_that_fails_to_open_gives_the_index_back_at_once(name):
    """A Reader that cannot open (here its version semaphore is gone) closes the index it mapped before it raises,
    instead of leaving it to the garbage collector (the exception's frames keep the half-made Reader alive)."""
    import multiprocessing

    ctx = multiprocessing.get_context("spawn")
    p = ctx.Process(target=helpers.publisher_forever, args=(name, name + "-ready", 1))
    p.start()
    try:
        helpers.wait_for_name(name + "-ready")
        gpuipc.Semaphore.unlink(name + ".version")
        assert gpuipc.Segment.stat(name).references == 1  # the publisher's
        with pytest.raises(gpuipc.NotFound) as failed:
            gpuipc.open_tensors(name, versioned=True)
        assert gpuipc.Segment.stat(name).references == 1, failed.value
    finally:
        p.kill()
        p.join()
    gpuipc.unlink_tensors(name)


def test_reader_killed_leaves_nothing(name):
    import multiprocessing

    with gpuipc.publish_tensors(name, {"w": np.zeros(1 << 12)}, versions=2) as pub:
        ctx = multiprocessing.get_context("spawn")
        p = ctx.Process(target=helpers.reader_pin_then_sleep, args=(name, name + "-ready"))
        p.start()
        try:
            helpers.wait_for_name(name + "-ready")
            assert pub.pool.stats()["members"] == 2
            os.kill(p.pid, signal.SIGKILL)
            p.join(10)
        finally:
            p.kill()
            p.join()
        _wait_until(lambda: pub.pool.stats()["members"] == 1)
        for v in range(2, 6):
            pub.update_from({"w": np.full(1 << 12, float(v))})
        # the reader's pin on version 1 is gone: only the front is live
        assert pub.pool.stats()["live_blocks"] == 1
        refs = [s for s in gpuipc.Segment.list() if s.name.startswith(name) and s.references]
        assert all(os.getpid() in s.mapper_pids for s in refs), refs


def test_wait_version_host_path_and_stream_on_host_memory(name):
    pub = gpuipc.publish_tensors(name, {"w": np.zeros(8)}, versions=1)
    with gpuipc.open_tensors(name, versioned=True) as r:
        assert r.status == "ok"
        pub.update()
        assert r.wait_version(2, timeout=1) == 2
        assert r.wait_version(2, None, 1) == 2  # stream=None: the host path
        # host tensors have a host-only counter: a stream wait says so instead of enqueuing anything
        with pytest.raises(gpuipc.InvalidState, match="host memory only"):
            r.wait_version(3, stream=1)
        pub.close()
        assert r.status == "closed"
        with pytest.raises(gpuipc.Closed):
            r.wait_version(3, timeout=5)


def test_only_the_owner_signals_the_version_counter_and_the_stream_timelines(name):
    """The timelines took the object's mode: with 0o660 (readers that record holds in the pool) every reader could
    open NAME.version, NAME.filled or another reader's slot as a signaller, announce versions or buckets never
    published, and by holding it keep the broker from poisoning it when the publisher died."""
    with gpuipc.publish_tensors(name, {"w": np.zeros(8)}, versions=2, mode=0o660):
        assert gpuipc.Segment.stat(name + ".pool").mode == 0o660
        assert gpuipc.Segment.stat(name + ".version").mode == 0o640
    stream = name + "s"
    with gpuipc.stream_publisher(stream, 4096, 2, readers=1, kind="host", mode=0o662) as pub:
        pub.init()
        assert gpuipc.Segment.stat(stream + ".filled").mode == 0o640
        with gpuipc.stream_reader(stream):
            assert gpuipc.Segment.stat(stream + ".reader.0").mode == 0o640


def test_a_block_freed_while_its_version_is_current_is_named_not_taken_for_a_death(name):
    """versions=1 shares pool tensors by reference: a block the live publisher freed (a replaced tensor) made the
    reader retry 10000 times, resolving every storage each time, then raise PeerDied "could not read a consistent
    version" while the publisher was alive."""
    with gpuipc.Pool.create(name + ".src", kind="host", chunk_bytes=1 << 20) as pool:
        blk = pool.allocate(4096)
        a = blk.numpy("float32", (1024,))
        a[:] = 1
        with gpuipc.publish_tensors(name, {"a": a}, versions=1):
            del a
            blk.free()
            with gpuipc.open_tensors(name, versioned=True) as r:
                with pytest.raises(gpuipc.InvalidArgument, match="freed while it was current"):
                    r.tensors
                assert r.status == "ok"
