"""Channels from Python on the CPU (host kind): send/recv across processes, raw slots, back-pressure, peers."""

from __future__ import annotations

import multiprocessing
import os
import signal
import struct
import time

import numpy as np
import pytest

import gpuipc
from gpuipc import _array_header, _copy_plans
import helpers


def _host_channel(name, **kw):
    opts = dict(kind="host", slots=4, slot_bytes=4096)
    opts.update(kw)
    return gpuipc.Channel.create(name, **opts)


def test_send_recv_across_processes_with_contents(name, start):
    arrays = helpers.sample_arrays()
    rounds = 3
    with _host_channel(name, role="producer") as keep:  # the creator stays a producer until the end
        producer = start(helpers.channel_producer, name, rounds)
        with gpuipc.Channel.open(name, "consumer") as rx:
            for i in range(rounds):
                for j, want in enumerate(arrays):
                    with rx.recv(timeout=30) as msg:
                        got = msg.array
                        assert isinstance(got, np.ndarray) and not got.flags.writeable
                        assert got.dtype == want.dtype and got.shape == want.shape
                        assert np.array_equal(got, want), (i, j)
                        assert msg.meta == f"{i}:{j}".encode()
                        assert msg.dtype == want.dtype and msg.shape == want.shape
                        assert not msg.incomplete
        assert producer.result(timeout=60) == rounds * len(arrays)
        assert keep.stats.head == rounds * len(arrays)


def test_consumer_in_child_process(name, start):
    with _host_channel(name) as tx:
        consumer = start(helpers.channel_consumer, name, 2)
        tx.send(np.arange(5, dtype=np.int32), timeout=30)
        tx.send(-np.ones((2, 2)), timeout=30)
        assert consumer.result(timeout=60) == [("int32", (5,), 10.0), ("float64", (2, 2), 4.0)]


def test_message_order_and_release_rules(name):
    with _host_channel(name) as tx, gpuipc.Channel.open(name, "consumer") as rx:
        for i in range(3):
            tx.send(np.full(3, i, dtype=np.uint8))
        m0, m1 = rx.recv(timeout=5), rx.recv(timeout=5)
        assert (m0.sequence, m1.sequence) == (0, 1)
        arr = m0.array
        m0.release()
        m0.release()  # idempotent
        assert m0.released and not m1.released
        with pytest.raises(gpuipc.InvalidState, match="released"):
            m0.array
        assert arr[0] == 0  # still mapped (but the slot may be reused: views must not outlive release)
        m1.release()
        with rx.recv(timeout=5) as m2:
            assert m2.array[0] == 2
        with pytest.raises(gpuipc.InvalidState):
            rx.release()
        assert "released" in repr(m2)


def test_a_host_channel_publishes_and_releases_out_of_order_once_the_older_ones_go(name):
    # The core Channel publishes and releases a handle's oldest only; threads sharing a handle cannot keep that
    # order. A slot published (a message released) ahead of older ones waited for nothing and was refused: the
    # Slot's `with` then failed to give it up too, and the handle held it for good.
    with _host_channel(name, slots=4) as tx, gpuipc.Channel.open(name, "consumer") as rx:
        s0, s1, s2 = (tx.acquire(timeout=1) for _ in range(3))
        assert s1.publish(3) == 1 and s1.published and not s0.published
        assert tx._ch.held == [0, 2] and tx._ch.held_back == 1
        with pytest.raises(gpuipc.WouldBlock):
            rx.receive(timeout=0)  # message 1 waits for message 0
        assert s0.publish(5) == 0 and tx._ch.held == [2] and tx._ch.held_back == 0
        m0, m1 = rx.receive(timeout=1), rx.receive(timeout=1)
        assert (m0.sequence, m0.size, m1.sequence, m1.size) == (0, 5, 1, 3)
        m1.release()
        assert m1.released and not m0.released and rx._ch.held == [0] and rx._ch.held_back == 1
        assert rx.stats.free_slots == 1  # slot 3, never used: message 1's goes once message 0 does
        m1.release()  # idempotent
        m0.release()
        assert rx._ch.held == [] and rx._ch.held_back == 0
        with s2:  # given up: published as aborted, skipped by recv
            pass
        with pytest.raises(gpuipc.WouldBlock):
            rx.recv(timeout=0)


def test_publish_array_refuses_a_dimension_that_is_no_integer(name):
    with _host_channel(name) as tx, gpuipc.Channel.open(name, "consumer") as rx:
        with tx.acquire(timeout=1) as slot:
            with pytest.raises(TypeError):
                slot.publish_array("float32", (1.9,))  # was published as shape (1,)
        with pytest.raises(gpuipc.WouldBlock):
            rx.recv(timeout=0)  # the slot was given up, not published


def test_a_consumer_holding_every_slot_is_told_so(name):
    with _host_channel(name, slots=2) as tx, gpuipc.Channel.open(name, "consumer") as rx:
        tx.send(np.arange(2))
        tx.send(np.arange(2))
        held = [rx.recv(timeout=1), rx.recv(timeout=1)]
        tx.close()
        with pytest.raises(gpuipc.InvalidState, match="holds a message in each of its 2 slots; release one first"):
            rx.recv(timeout=0)
        held[0].release()
        held[1].release()
        assert list(rx) == []  # the producers left: iteration ends


def test_recv_skips_an_aborted_message_behind_a_held_one(name):
    # recv released the aborted message it skipped while the caller held an older one: InvalidState about a message
    # the caller never saw, and the handle held the aborted one for good.
    with _host_channel(name) as tx, gpuipc.Channel.open(name, "consumer") as rx:
        tx.send(np.arange(3))
        with tx.acquire(timeout=1):  # given up: aborted
            pass
        tx.send(np.arange(5))
        m0 = rx.recv(timeout=1)
        m2 = rx.recv(timeout=1)
        assert (m0.sequence, m2.sequence) == (0, 2) and m2.array.shape == (5,)
        assert rx._ch.held == [0, 2]
        m0.release()
        m2.release()
        assert rx._ch.held == [] and rx._ch.held_back == 0


def test_threads_sharing_one_handle_of_each_role(name):
    # Two producer threads and two consumer threads, each pair on one handle, each thread with its own `with`
    # blocks: every message arrives once (the handles were wedged at the first release or publish out of order).
    import threading

    per_thread = 500
    with _host_channel(name, slots=8, slot_bytes=64) as tx, gpuipc.Channel.open(name, "consumer") as rx:
        got, errors = [], []

        def produce(base):
            try:
                for i in range(per_thread):
                    with tx.acquire(timeout=30) as slot:
                        slot.as_array("int64", (1,))[0] = base + i
                        slot.publish_array("int64", (1,))
            except Exception as e:  # noqa: BLE001
                errors.append(e)

        def consume():
            try:
                while True:
                    try:
                        with rx.recv(timeout=5) as msg:
                            got.append(int(msg.array[0]))
                    except gpuipc.Timeout:
                        return
            except Exception as e:  # noqa: BLE001
                errors.append(e)

        threads = [threading.Thread(target=produce, args=(b,)) for b in (0, 10**6)]
        threads += [threading.Thread(target=consume) for _ in range(2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=120)
        assert not any(t.is_alive() for t in threads)
        assert errors == []
        assert sorted(got) == sorted(list(range(per_thread)) + [10**6 + i for i in range(per_thread)])
        assert tx._ch.held == [] and rx._ch.held == [] and tx._ch.held_back == 0 and rx._ch.held_back == 0


def test_publish_order_rules(name):
    with _host_channel(name) as tx, gpuipc.Channel.open(name, "consumer"):
        s0, s1 = tx.acquire(timeout=1), tx.acquire(timeout=1)
        s1.publish(1)  # (held back until s0 is published)
        with pytest.raises(gpuipc.InvalidState, match="already published"):
            s1.publish(1)
        s0.publish(1)
        with pytest.raises(gpuipc.InvalidState, match="already published"):
            s0.publish(1)
        tx.acquire(timeout=1)
        tx.publish(1)
        with pytest.raises(gpuipc.InvalidState, match="no slot is acquired"):
            tx.publish(1)


def test_send_copies_at_once_and_refuses_while_a_slot_is_acquired(name):
    with _host_channel(name) as tx, gpuipc.Channel.open(name, "consumer") as rx:
        a = np.arange(16, dtype=np.int32)
        assert tx.send(a) == 0
        a[:] = -1  # send made its copy: changing the array now changes nothing sent
        b = np.arange(12, dtype=np.float64).reshape(3, 4)[:, ::2]  # strided: copied contiguous first
        assert tx.send(b, meta=b"m") == 1
        with rx.recv(timeout=1) as m0:
            assert m0.array.tolist() == list(range(16)) and m0.sequence == 0
        with rx.recv(timeout=1) as m1:
            np.testing.assert_array_equal(m1.array, np.arange(12, dtype=np.float64).reshape(3, 4)[:, ::2])
            assert (m1.dtype, m1.shape, m1.meta) == (np.dtype(np.float64), (3, 2), b"m")
        slot = tx.acquire(timeout=1)
        with pytest.raises(gpuipc.InvalidState, match="acquire"):
            tx.send(a)
        slot.publish(0)
        assert tx.send(np.zeros((), dtype=np.uint8)) == 3  # a 0-d array
        with rx.recv(timeout=1) as m2:
            assert m2.size == 0
        with rx.recv(timeout=1) as m3:
            assert m3.shape == () and m3.array.tolist() == 0


def test_roles_are_enforced(name):
    with _host_channel(name) as tx, gpuipc.Channel.open(name, "consumer") as rx:
        with pytest.raises(gpuipc.InvalidState):
            tx.receive(timeout=0)
        with pytest.raises(gpuipc.InvalidState):
            rx.acquire(timeout=0)
        with pytest.raises(ValueError, match="role"):
            gpuipc.Channel.open(name, "spectator")
        assert (tx.role, rx.role, tx.kind, tx.slots, tx.slot_bytes, tx.header_bytes, tx.device) == (
            "producer", "consumer", "host", 4, 4096, 256, -1)


def test_iteration_ends_when_producers_close(name):
    tx = _host_channel(name)
    rx = gpuipc.Channel.open(name, "consumer")
    for i in range(3):
        tx.send(np.array([i]))
    tx.close()
    seen = []
    for msg in rx:
        with msg:
            seen.append(int(msg.array[0]))
    assert seen == [0, 1, 2]
    with pytest.raises(gpuipc.Closed):
        rx.recv(timeout=1)
    rx.close()
    with pytest.raises(gpuipc.Closed, match="channel: this handle was closed"):
        rx.recv(timeout=0)
    with pytest.raises(gpuipc.Closed, match="channel: this handle was closed"):
        next(iter(rx))  # iterating a closed handle is an error, not an end


def test_killed_producer_gives_peer_died(name):
    ready = name + "r"
    with _host_channel(name, role="consumer") as rx:
        proc = multiprocessing.get_context("spawn").Process(
            target=helpers.channel_producer_killed, args=(name, ready))
        proc.start()
        try:
            helpers.wait_for_name(ready)
            for want in (1, 2):
                with rx.recv(timeout=10) as m:
                    assert list(m.array) == [want] * 4
            os.kill(proc.pid, signal.SIGKILL)
            with pytest.raises(gpuipc.PeerDied):
                rx.recv(timeout=30)
        finally:
            proc.kill()
            proc.join(10)


def test_views_outlive_channel_close(name):
    tx = _host_channel(name)
    rx = gpuipc.Channel.open(name, "consumer")
    tx.send(np.arange(100, dtype=np.int64))
    msg = rx.recv(timeout=1)
    arr = msg.array
    rx.close()
    tx.close()
    gpuipc.Channel.unlink(name)
    assert int(arr.sum()) == 4950  # the slots stay mapped while a view lives
    assert msg.released  # closing gave the message back


def test_dlpack_producers_and_exporter(name):
    with _host_channel(name) as tx, gpuipc.Channel.open(name, "consumer") as rx:
        # The DLPack consumer in C++ (used for JAX, bfloat16 torch tensors, ...), fed by NumPy's exporter.
        slot = tx.acquire(timeout=1)
        dt, shape, nbytes = _copy_plans.copy_dlpack(np.arange(6, dtype=np.int16).reshape(2, 3), slot.data, 0)
        assert (dt.name, shape, nbytes) == ("int16", (2, 3), 12)
        with pytest.raises(gpuipc.InvalidArgument, match="strided"):
            _copy_plans.copy_dlpack(np.arange(12, dtype=np.int16).reshape(3, 4)[:, ::2], slot.data, 0)
        slot.publish_array("int16", (2, 3))
        with rx.recv(timeout=1) as m:
            assert np.array_equal(m.array, np.arange(6).reshape(2, 3))
            # Our exporter: NumPy reads a message view through DLPack, read-only.
            b = np.from_dlpack(m.data)
            assert not b.flags.writeable and b.nbytes == 12

        class OnlyDLPack:  # an array known only through DLPack
            def __init__(self, a):
                self.a = a

            def __dlpack__(self, **kw):
                return self.a.__dlpack__(**kw)

            def __dlpack_device__(self):
                return self.a.__dlpack_device__()

        tx.send(OnlyDLPack(np.array([[1.5, 2.5]])))
        with rx.recv(timeout=1) as m:
            assert m.shape == (1, 2) and list(m.array[0]) == [1.5, 2.5]


def test_header_layout_is_stable(name):
    with _host_channel(name) as tx, gpuipc.Channel.open(name, "consumer") as rx:
        tx.send(np.zeros((2, 3), dtype=np.float32), meta=b"m")
        with rx.recv(timeout=1) as m:
            h = m.header
            assert h[:4] == b"GPYA"
            magic, version, ndim, flags, code, bits, lanes, meta_len, nbytes = struct.unpack_from("<4sHBBBBHIQ", h)
            assert (version, ndim, flags, code, bits, lanes, meta_len, nbytes) == (1, 2, 0, 2, 32, 1, 1, 24)
            assert struct.unpack_from("<2q", h, 24) == (2, 3) and h[40:41] == b"m"


# A float32 array of shape (2, 3) with meta b"hi": the bytes tests/unit/test_array_header.cpp decodes in C++.
GOLDEN_ARRAY_HEADER = bytes.fromhex(
    "475059410100020002200100020000001800000000000000020000000000000003000000000000006869")
GOLDEN_ABORTED_HEADER = bytes.fromhex("475059410100000101080100000000000000000000000000")


def test_array_header_matches_the_cpp_definition(name):
    layout = gpuipc._gpuipc.array_header_layout  # include/gpuipc/array_header.hpp, exported by the extension
    assert (layout["magic"], layout["version"], layout["fixed_bytes"]) == (b"GPYA", 1, 24)
    assert struct.calcsize(layout["format"]) == layout["fixed_bytes"]
    assert _array_header.ABORTED_HEADER == GOLDEN_ABORTED_HEADER
    with _host_channel(name) as tx, gpuipc.Channel.open(name, "consumer") as rx:
        tx.send(np.zeros((2, 3), dtype=np.float32), meta=b"hi")
        with rx.recv(timeout=1) as m:
            assert m.header == GOLDEN_ARRAY_HEADER
        with tx.acquire(timeout=1):
            pass  # left unpublished: published as aborted
        tx.send(np.ones(1))
        with rx.receive(timeout=1) as m:
            assert m.header == GOLDEN_ABORTED_HEADER
        with rx.recv(timeout=1) as m:
            assert m.array.tolist() == [1.0]
    info = _array_header.unpack_header(GOLDEN_ARRAY_HEADER)
    assert (info.dtype.name, info.shape, info.nbytes, info.meta, info.aborted) == ("float32", (2, 3), 24, b"hi", False)
    assert _array_header.unpack_header(GOLDEN_ARRAY_HEADER[:-1]) is None


def test_held_state_is_the_librarys(name):
    with _host_channel(name) as tx, gpuipc.Channel.open(name, "consumer") as rx:
        s0, s1 = tx.acquire(timeout=1), tx.acquire(timeout=1)
        assert tx._ch.held == [0, 1] and not s0.published
        assert s0.publish(0) == 0 and s0.published and tx._ch.held == [1]
        assert tx.publish(0) == 1 and s1.published and tx._ch.held == []
        m0, m1 = rx.receive(timeout=1), rx.receive(timeout=1)
        assert rx._ch.held == [0, 1] and not m0.incomplete
        rx.release()
        assert m0.released and not m1.released and rx._ch.held == [1]
        # A released message's flag stays readable (a device consumer releases in stream order, then checks).
        assert rx._ch.incomplete(0) is False and m0.incomplete is False
        with pytest.raises(gpuipc.InvalidArgument, match="only a consumer"):
            tx._ch.incomplete(0)
        m1.release()
        with pytest.raises(gpuipc.InvalidState, match="no message is held"):
            rx.release()


def test_a_closed_channel_raises_closed(name):
    tx = _host_channel(name)
    rx = gpuipc.Channel.open(name, "consumer")
    slot = tx.acquire(timeout=1)
    rx.close()
    tx.close()
    for call in (
        lambda: tx.acquire(timeout=0),
        lambda: tx.publish(0),
        lambda: tx.send(np.zeros(1)),
        lambda: slot.publish(0),
        lambda: slot.publish_array("uint8", 0),
        lambda: rx.receive(timeout=0),
        lambda: rx.recv(timeout=0),
        lambda: rx.release(),
        lambda: tx.stats,
        lambda: tx.name,
        lambda: tx._ch.held,
    ):
        with pytest.raises(gpuipc.Closed, match="this handle was closed"):
            call()
    assert slot.published and tx.closed  # a closed handle holds nothing
    tx.close()  # idempotent


def test_a_wait_keeps_no_other_call_of_the_handle_waiting(name):
    # A recv() held the handle's lock for its whole wait: close() from another thread hung until a message came, and
    # a message's array or release() in a worker thread waited for the next message.
    import threading

    with _host_channel(name) as tx:
        rx = gpuipc.Channel.open(name, "consumer")
        tx.send(np.arange(4, dtype=np.uint8), timeout=5)
        held = rx.recv(timeout=5)
        outcome = []

        def waiter():
            try:
                rx.recv(timeout=60)
                outcome.append("received")
            except gpuipc.Closed:
                outcome.append("closed")

        t = threading.Thread(target=waiter, daemon=True)
        t.start()
        time.sleep(0.3)  # the thread waits in recv
        t0 = time.monotonic()
        assert list(held.array) == [0, 1, 2, 3]
        held.release()
        rx.close()
        t.join(10)
        assert not t.is_alive() and outcome == ["closed"]
        assert time.monotonic() - t0 < 2


DAEMON_WAITER = """
import sys, threading, time, gpuipc
name, what = sys.argv[1], sys.argv[2]
if what == "recv":
    ch = gpuipc.Channel.create(name, kind="host", role="consumer")
    wait = lambda: ch.recv()
elif what == "wait_host":
    sem = gpuipc.Semaphore.create(name, kind="host")
    wait = lambda: sem.wait_host(1)
else:
    cs = gpuipc.CountingSemaphore.create(name, initial=0, max_count=1)
    wait = lambda: cs.acquire()
threading.Thread(target=wait, daemon=True).start()
time.sleep(0.3)
print("exiting", flush=True)
"""


@pytest.mark.parametrize("what", ["recv", "wait_host", "acquire"])
def test_a_daemon_thread_waiting_in_gpuipc_lets_the_interpreter_exit(name, what):
    # Python ends such a thread at finalization with pthread_exit, whose unwinding through the extension's C++
    # frames aborted the process ("terminate called without an active exception", exit status 134).
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "-c", DAEMON_WAITER, name + what, what], capture_output=True, text=True,
                         timeout=60)
    assert out.returncode == 0 and "exiting" in out.stdout, out.stdout + out.stderr
    # The parked thread keeps the handle it waits on, as documented: no "leaked instances" report from nanobind.
    assert "leaked" not in out.stderr, out.stderr
    unlink = {"recv": gpuipc.Channel.unlink, "wait_host": gpuipc.Semaphore.unlink}
    unlink.get(what, gpuipc.CountingSemaphore.unlink)(name + what)


CTRL_C = """
import signal, sys, gpuipc
signal.signal(signal.SIGINT, signal.default_int_handler)  # even where it was started with SIGINT ignored (nohup, &)
rx = gpuipc.Channel.create(sys.argv[1], kind="host", role="consumer")
try:  # "waiting" inside the try: a SIGINT that comes before recv() waits is a KeyboardInterrupt here too
    print("waiting", flush=True)
    rx.recv()  # forever
except KeyboardInterrupt:
    print("interrupted", flush=True)
    sys.exit(42)
"""


def test_ctrl_c_interrupts_recv(name):
    import subprocess
    import sys

    proc = subprocess.Popen([sys.executable, "-c", CTRL_C, name], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)
    try:
        assert proc.stdout.readline().strip() == "waiting"
        time.sleep(0.2)
        t0 = time.monotonic()
        proc.send_signal(signal.SIGINT)
        out, err = proc.communicate(timeout=30)
        assert proc.returncode == 42, out + err
        assert "interrupted" in out and time.monotonic() - t0 < 5
    finally:
        proc.kill()
        proc.wait()


def test_bad_channel_arguments_are_refused_with_gpuipc_errors(name):
    """Out-of-range ints and bools raise InvalidArgument (not the binding's TypeError); slots x slot_bytes above the
    largest segment is refused and leaves no name (it used to wrap round and leave both); pacing_ahead is clamped as
    documented; an int meta or header is refused (bytes(5) is five zero bytes)."""
    for kw in (dict(slots=-1), dict(slot_bytes=-1), dict(header_bytes=1 << 32), dict(mode=-1), dict(slots=True)):
        with pytest.raises(gpuipc.InvalidArgument):
            _host_channel(name, **kw)
    with pytest.raises(gpuipc.InvalidArgument, match="largest segment"):
        _host_channel(name, slots=4, slot_bytes=2**62 + 256)
    for left in (name, name + ".slots"):
        with pytest.raises(gpuipc.NotFound):
            gpuipc.Segment.stat(left)
    with _host_channel(name, pacing_ahead=2**40) as tx, gpuipc.Channel.open(name, "consumer"):
        assert tx.pacing_ahead == 4  # clamped to the slots
        tx.pacing_ahead = 2**70
        assert tx.pacing_ahead == 4
        with pytest.raises(gpuipc.InvalidArgument, match="meta must be bytes"):
            tx.send(np.zeros(2), meta=5)
        with pytest.raises(gpuipc.InvalidArgument, match="header must be bytes"):
            tx.acquire(timeout=1).publish(1, header=3)
