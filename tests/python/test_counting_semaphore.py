"""Counting semaphores from Python: counts, timeouts, over-release, a killed holder's permits, stat, Ctrl-C."""

from __future__ import annotations

import multiprocessing
import os
import signal
import threading
import time

import pytest

import gpuipc
import helpers


def test_acquire_release_and_counts(name):
    with gpuipc.CountingSemaphore.create(name, initial=2, max_count=3) as sem:
        assert (sem.held, sem.available, sem.max_count, sem.name) == (1, 2, 3, name)  # the creator holds 3 - 2
        sem.acquire(2, timeout=1)
        assert sem.held == 3 and sem.available == 0
        assert not sem.try_acquire()
        sem.release(3)
        assert sem.try_acquire(1)
        assert gpuipc.CountingSemaphore.stat(name) == {
            "available": 2, "max_count": 3, "held": 1, "holders": 1, "waiting": 0,
        }
        assert "held=1" in repr(sem)
        with pytest.raises(gpuipc.InvalidArgument):
            sem.acquire(4, timeout=0)
    assert repr(sem) == "<gpuipc.CountingSemaphore closed>"
    gpuipc.CountingSemaphore.unlink(name)


def test_over_release_is_refused(name):
    with gpuipc.CountingSemaphore.create(name, initial=3) as sem, gpuipc.CountingSemaphore.open(name) as other:
        sem.acquire(1)
        with pytest.raises(gpuipc.InvalidArgument, match="holds 0 permits"):
            other.release(1)
        with pytest.raises(ValueError, match="holds 1 permit;"):
            sem.release(2)
        assert sem.held == 1 and sem.available == 2
    gpuipc.CountingSemaphore.unlink(name)


def test_timeouts(name):
    with gpuipc.CountingSemaphore.create(name, initial=0, max_count=1) as sem:
        with gpuipc.CountingSemaphore.open(name) as other:
            t0 = time.monotonic()
            with pytest.raises(gpuipc.Timeout) as e:
                other.acquire(1, timeout=0.2)
            assert 0.15 < time.monotonic() - t0 < 5
            assert not isinstance(e.value, gpuipc.WouldBlock) and "did not come within 0.2 s" in str(e.value)
            with pytest.raises(gpuipc.WouldBlock):
                other.acquire(1, timeout=0)
            with pytest.raises(ValueError):
                other.acquire(1, timeout=-1)
            threading.Timer(0.05, sem.release, args=(1,)).start()
            other.acquire(1, timeout=10)
            assert other.held == 1
    gpuipc.CountingSemaphore.unlink(name)


def test_permits_of_a_killed_holder_come_back(name):
    with gpuipc.CountingSemaphore.create(name, initial=2) as sem:
        ready = name + "r"
        proc = multiprocessing.get_context("spawn").Process(target=helpers.counting_hold_forever, args=(name, 2, ready))
        proc.start()
        try:
            helpers.wait_for_name(ready)
            assert sem.available == 0
            threading.Timer(0.1, os.kill, args=(proc.pid, signal.SIGKILL)).start()
            sem.acquire(2, timeout=30)  # pending when the holder dies
            assert sem.held == 2
        finally:
            proc.kill()
            proc.join(10)
    gpuipc.CountingSemaphore.unlink(name)


def test_a_waiter_in_another_process(name, start):
    with gpuipc.CountingSemaphore.create(name, initial=0, max_count=2) as sem:
        waiter = start(helpers.counting_acquire, name, 2, 30.0)
        deadline = time.monotonic() + 30
        while gpuipc.CountingSemaphore.stat(name)["waiting"] == 0 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert gpuipc.CountingSemaphore.stat(name)["waiting"] == 1  # it sleeps in the queue, not spins elsewhere
        sem.release(2)
        assert waiter.result(timeout=30) == 2
    gpuipc.CountingSemaphore.unlink(name)


def test_ctrl_c_interrupts_an_acquire(name):
    # Python's own SIGINT handler, even where pytest was started with SIGINT ignored (nohup, a background job).
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        _interrupt_an_acquire(name)
    finally:
        signal.signal(signal.SIGINT, previous)


def _interrupt_an_acquire(name):
    with gpuipc.CountingSemaphore.create(name, initial=0, max_count=1) as sem:
        t0 = time.monotonic()
        with pytest.raises(KeyboardInterrupt):
            # Started inside the raises: however late the timer fires, its KeyboardInterrupt lands here.
            threading.Timer(0.2, os.kill, args=(os.getpid(), signal.SIGINT)).start()
            sem.acquire(1)
        assert time.monotonic() - t0 < 10
        assert sem.waiting == 0  # it left the queue
    gpuipc.CountingSemaphore.unlink(name)


def test_open_checks_the_kind(name):
    with gpuipc.Segment.create(name, 8192, kind="host"):
        with pytest.raises(gpuipc.InvalidArgument, match="not a gpuipc counting semaphore"):
            gpuipc.CountingSemaphore.open(name)
    gpuipc.Segment.unlink(name)


def test_close_releases_a_thread_waiting_in_acquire(name):
    """close() from another thread does not wait for ever behind an acquire with no timeout: the waiter leaves the
    queue and raises Closed. Before, close blocked until the acquire returned."""
    with gpuipc.CountingSemaphore.create(name, initial=0, max_count=1) as sem:
        other = gpuipc.CountingSemaphore.open(name)
        got = helpers.close_while_waiting(other, lambda: other.acquire(1))
        assert isinstance(got, gpuipc.Closed), got
        assert sem.waiting == 0
        sem.release(1)
        assert sem.available == 1


def test_counts_out_of_range_are_refused_with_gpuipc_errors(name):
    with pytest.raises(gpuipc.InvalidArgument, match="max_count"):
        gpuipc.CountingSemaphore.create(name, initial=1, max_count=1 << 32)
    with pytest.raises(gpuipc.InvalidArgument, match="max_count"):
        gpuipc.CountingSemaphore.create(name, initial=1, max_count=-1)
    with gpuipc.CountingSemaphore.create(name, initial=1) as sem:
        for call in (sem.acquire, sem.try_acquire, sem.release):
            with pytest.raises(gpuipc.InvalidArgument, match="n must be"):
                call(-1)
        assert sem.held == 0 and sem.available == 1
    gpuipc.CountingSemaphore.unlink(name)


def test_a_forked_child_neither_uses_nor_releases_its_parents_handle(name):
    """multiprocessing's fork start method hands the parent's object to the child as it is: the child's copy holds
    the parent's member entry. Its calls are refused and its close releases nothing (it released the parent's
    permits, and its acquires mixed their counts with the parent's)."""
    with gpuipc.CountingSemaphore.create(name, initial=1, max_count=2) as sem:
        sem.acquire(1)  # the parent holds both permits
        pid = os.fork()
        if pid == 0:  # the child: no pytest from here on, only an exit status
            code = 1
            try:
                try:
                    sem.acquire(1, timeout=0)
                except gpuipc.InvalidState as e:
                    code = 0 if "open the semaphore again in this process" in str(e) else 2
                if sem.held != 0:
                    code = 3
                sem.close()
            finally:
                os._exit(code)
        _, status = os.waitpid(pid, 0)
        assert os.waitstatus_to_exitcode(status) == 0
        assert sem.held == 2 and sem.available == 0
        assert gpuipc.CountingSemaphore.stat(name)["holders"] == 1
        sem.release(2)
        assert sem.available == 2
    gpuipc.CountingSemaphore.unlink(name)
