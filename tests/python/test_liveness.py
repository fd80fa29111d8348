"""Liveness from Python: holders of a name with their roles, and a heartbeat that turns hung."""

from __future__ import annotations

import multiprocessing
import os
import signal
import time

import pytest

import gpuipc
import helpers


def test_holders_and_a_hung_heartbeat(name):
    with gpuipc.CountingSemaphore.create(name, initial=1):
        (me,) = gpuipc.holders(name)
        assert me["pid"] == os.getpid() and me["role"] == "creator+holder" and me["read_write"]
        assert me["heartbeat"] == "none" and me["heartbeat_deadline"] == 0
        gpuipc.heartbeat(name, 0.05)
        time.sleep(0.3)
        (me,) = gpuipc.holders(name)
        assert me["heartbeat"] == "hung" and me["heartbeat_deadline"] == pytest.approx(0.05)
        gpuipc.heartbeat(name, 10)
        assert gpuipc.holders(name)[0]["heartbeat"] == "alive"
        gpuipc.heartbeat(name, 0.0004)  # under a millisecond: 1 ms, not 0 (which stops the heartbeats)
        assert gpuipc.holders(name)[0]["heartbeat_deadline"] == pytest.approx(0.001)
        gpuipc.heartbeat(name, 0)
        assert gpuipc.holders(name)[0]["heartbeat"] == "none"
    with pytest.raises(gpuipc.NotFound):
        gpuipc.holders(name + "x")
    gpuipc.CountingSemaphore.unlink(name)


def test_a_killed_holder_leaves_the_list(name):
    with gpuipc.CountingSemaphore.create(name, initial=2):
        ready = name + "r"
        proc = multiprocessing.get_context("spawn").Process(target=helpers.counting_hold_forever, args=(name, 1, ready))
        proc.start()
        try:
            helpers.wait_for_name(ready)
            pids = {h["pid"]: h["role"] for h in gpuipc.holders(name)}
            assert pids[proc.pid] == "holder"
            os.kill(proc.pid, signal.SIGKILL)
            deadline = time.monotonic() + 10
            while proc.pid in {h["pid"] for h in gpuipc.holders(name)} and time.monotonic() < deadline:
                time.sleep(0.01)
            assert [h["pid"] for h in gpuipc.holders(name)] == [os.getpid()]
        finally:
            proc.kill()
            proc.join(10)
    gpuipc.CountingSemaphore.unlink(name)
