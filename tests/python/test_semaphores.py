"""Semaphores from Python on the CPU (host kind): host waits across processes, poisoning, timeouts, Ctrl-C."""

from __future__ import annotations

import os
import signal
import threading
import time

import pytest

import gpuipc
import helpers


def test_signal_and_wait_across_processes(name, start):
    with gpuipc.Semaphore.create(name, kind="host", initial=2) as sem:
        assert sem.role == "signaller" and sem.value == 2 and sem.status == "ok" and sem.name == name
        waiter = start(helpers.semaphore_wait, name, 5, 30.0)
        time.sleep(0.2)
        assert not waiter.done()
        sem.signal_host(5)
        assert waiter.result(timeout=30) >= 5
        assert sem.wait_host(3, timeout=0) == 5  # already there
        sem.signal_host(4)  # never lowers
        assert sem.value == 5
    gpuipc.Semaphore.unlink(name)


def test_timeouts(name):
    with gpuipc.Semaphore.create(name, kind="host") as sem:
        t0 = time.monotonic()
        with pytest.raises(gpuipc.Timeout) as e:
            sem.wait_host(1, timeout=0.2)
        assert 0.15 < time.monotonic() - t0 < 5
        assert isinstance(e.value, TimeoutError) and not isinstance(e.value, gpuipc.WouldBlock)
        with pytest.raises(gpuipc.WouldBlock):
            sem.wait_host(1, timeout=0)
        # under a nanosecond is a timeout all the same (it rounded to 0: WouldBlock, "timeout=0")
        with pytest.raises(gpuipc.Timeout) as e:
            sem.wait_host(1, timeout=1e-12)
        assert not isinstance(e.value, gpuipc.WouldBlock)
        assert sem.wait_host(0, timeout=0) == 0
        with pytest.raises(ValueError):
            sem.wait_host(1, timeout=-1)


def test_a_spinning_wait_sees_the_value_and_keeps_its_timeout(name):
    with gpuipc.Semaphore.create(name, kind="host") as sem:
        threading.Timer(0.01, sem.signal_host, args=(3,)).start()
        assert sem.wait_host(3, timeout=5, spin=1.0) == 3  # seen while still spinning
        t0 = time.monotonic()
        with pytest.raises(gpuipc.Timeout):
            sem.wait_host(4, timeout=0.1, spin=10.0)  # the timeout bounds the spin
        assert time.monotonic() - t0 < 5
        with pytest.raises(ValueError):
            sem.wait_host(4, timeout=0, spin=-1)


def test_waiter_cannot_signal_and_host_kind_has_no_streams(name):
    with gpuipc.Semaphore.create(name, kind="host") as sem, gpuipc.Semaphore.open(name) as waiter:
        assert waiter.role == "waiter"
        with pytest.raises(gpuipc.InvalidState):
            waiter.signal_host(1)
        with pytest.raises(gpuipc.InvalidState):
            sem.signal(1)  # stream-ordered signal of a host-kind semaphore
        with pytest.raises(ValueError, match="role"):
            gpuipc.Semaphore.open(name, role="boss")
        with pytest.raises(gpuipc.InvalidState):
            sem.signal_host(gpuipc.MAX_VALUE + 1)


def test_clean_close_of_last_signaller_gives_closed(name, start):
    ready = name + "r"
    child = start(helpers.semaphore_signaller_then_close, name, ready)
    helpers.wait_for_name(ready)
    with gpuipc.Semaphore.open(name, role="waiter", wait=10) as sem:
        assert sem.wait_host(1, timeout=10) == 1
        with pytest.raises(gpuipc.Closed):
            sem.wait_host(2, timeout=30)
        assert sem.status == "closed"
    child.result(timeout=30)


def test_killed_signaller_gives_peer_died(name):
    import multiprocessing

    ready = name + "r"
    proc = multiprocessing.get_context("spawn").Process(target=helpers.semaphore_signaller_forever, args=(name, ready))
    proc.start()
    try:
        helpers.wait_for_name(ready)
        with gpuipc.Semaphore.open(name, role="waiter", wait=10) as sem:
            assert sem.wait_host(1, timeout=10) == 1
            os.kill(proc.pid, signal.SIGKILL)
            with pytest.raises(gpuipc.PeerDied):
                sem.wait_host(2, timeout=30)
            assert sem.status == "peer_died"
    finally:
        proc.kill()
        proc.join(10)


class _Alarm(Exception):
    pass


def test_ctrl_c_interrupts_a_wait(name):
    """A signal handler that raises (as SIGINT's does: KeyboardInterrupt) ends a blocking wait within a slice."""

    def handler(signum, frame):
        raise _Alarm()

    old = signal.signal(signal.SIGALRM, handler)
    try:
        with gpuipc.Semaphore.create(name, kind="host") as sem:
            signal.setitimer(signal.ITIMER_REAL, 0.2)
            t0 = time.monotonic()
            with pytest.raises(_Alarm):
                sem.wait_host(1)  # forever
            assert time.monotonic() - t0 < 2
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)


def test_wait_releases_the_gil(name):
    counter = [0]
    stop = threading.Event()

    def spin():
        while not stop.is_set():
            counter[0] += 1

    with gpuipc.Semaphore.create(name, kind="host") as sem:
        t = threading.Thread(target=spin)
        t.start()
        try:
            before = counter[0]
            with pytest.raises(gpuipc.Timeout):
                sem.wait_host(1, timeout=0.3)
            assert counter[0] - before > 1000  # the other thread ran while we waited
        finally:
            stop.set()
            t.join()


def test_close_while_another_thread_waits(name):
    with gpuipc.Semaphore.create(name, kind="host") as sem:
        waiter = gpuipc.Semaphore.open(name)
        result = []

        def wait():
            try:
                result.append(waiter.wait_host(1, timeout=10))
            except gpuipc.Error as e:
                result.append(e)

        t = threading.Thread(target=wait)
        t.start()
        time.sleep(0.1)
        sem.signal_host(1)
        t.join(10)
        assert result == [1]
        waiter.close()
        with pytest.raises(gpuipc.Closed, match="this handle was closed"):
            waiter.wait_host(1)


def test_close_releases_a_thread_waiting_with_no_timeout(name):
    """close() from another thread does not wait for ever behind a wait_host with no timeout: the waiter raises
    Closed within a slice. Before, close blocked until the wait returned."""
    with gpuipc.Semaphore.create(name, kind="host") as sem:
        waiter = gpuipc.Semaphore.open(name)
        got = helpers.close_while_waiting(waiter, lambda: waiter.wait_host(1))
        assert isinstance(got, gpuipc.Closed), got
        assert sem.value == 0


def test_values_out_of_range_are_refused_with_gpuipc_errors(name):
    """A value the semaphore can never reach is refused at once (wait_host used to wait for it for ever), and
    negative or too large ints raise gpuipc errors, not the binding's TypeError."""
    with gpuipc.Semaphore.create(name, kind="host") as sem:
        with pytest.raises(gpuipc.InvalidState, match="MAX_VALUE"):
            sem.wait_host(gpuipc.MAX_VALUE + 1)
        with pytest.raises(gpuipc.InvalidState, match="MAX_VALUE"):
            sem.signal_host(1 << 64)
        for call in (sem.signal_host, sem.wait_host):
            with pytest.raises(gpuipc.InvalidArgument, match="from 0 to MAX_VALUE"):
                call(-1)
        with pytest.raises(gpuipc.InvalidArgument, match="initial"):
            gpuipc.Semaphore.create(name + "x", kind="host", initial=-1)
        with pytest.raises(gpuipc.InvalidArgument, match="mode"):
            gpuipc.Semaphore.create(name + "x", kind="host", mode=-1)
        with pytest.raises(gpuipc.InvalidArgument, match="size"):
            gpuipc.Segment.create(name + "x", -1)
        assert sem.value == 0


def test_an_infinite_spin_spins(name):
    """spin=math.inf polls for the whole wait (it used to read as no spin at all)."""
    with gpuipc.Semaphore.create(name, kind="host") as sem:
        cpu0, t0 = time.process_time(), time.monotonic()
        with pytest.raises(gpuipc.Timeout):
            sem.wait_host(1, timeout=0.3, spin=float("inf"))
        assert time.process_time() - cpu0 > 0.5 * (time.monotonic() - t0)
        with pytest.raises(gpuipc.InvalidArgument, match="None \\(20 us\\)"):
            sem.wait_host(1, timeout=0, spin=-1)
