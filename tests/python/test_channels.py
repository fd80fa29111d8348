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
        with pytest.raises(gpuipc.InvalidState, match="older messages first"):
            m1.release()
        m0.release()
        m0.release()  # idempotent
        assert m0.released and not m1.released
        with pytest.raises(gpuipc.InvalidState, match="released"):
            m0.array
        arr = m1.array
        m1.release()
        assert arr[0] == 1  # still mapped (but the slot may be reused: views must not outlive release)
        with rx.recv(timeout=5) as m2:
            assert m2.array[0] == 2
        with pytest.raises(gpuipc.InvalidState):
            rx.release()
        assert "released" in repr(m2)


def test_back_pressure_and_timeouts(name):
    with _host_channel(name, slots=2) as tx, gpuipc.Channel.open(name, "consumer") as rx:
        tx.send(np.zeros(4))
        tx.send(np.ones(4))
        t0 = time.monotonic()
        with pytest.raises(gpuipc.Timeout):
            tx.send(np.ones(4), timeout=0.2)
        assert time.monotonic() - t0 >= 0.15
        with pytest.raises(gpuipc.WouldBlock):
            tx.acquire(timeout=0)
        assert tx.stats.head == 2  # the timed-out send claimed nothing
        rx.recv(timeout=1).release()
        tx.send(np.full(4, 2.0), timeout=1)
        got = []
        for _ in range(2):
            with rx.recv(timeout=1) as m:
                got.append(float(m.array[0]))
        assert got == [1.0, 2.0]
        with pytest.raises(gpuipc.WouldBlock):
            rx.recv(timeout=0)
        with pytest.raises(gpuipc.Timeout):
            rx.recv(timeout=0.1)


def test_too_big_is_refused_before_acquiring(name):
    with _host_channel(name, slot_bytes=256, header_bytes=64) as tx, gpuipc.Channel.open(name, "consumer"):
        with pytest.raises(gpuipc.InvalidArgument, match="do not fit in a slot"):
            tx.send(np.zeros(1000))
        with pytest.raises(gpuipc.InvalidArgument, match="header"):
            tx.send(np.zeros([1] * 6))  # 24 + 48 bytes of header > 64
        with pytest.raises(gpuipc.InvalidArgument, match="header"):
            tx.send(np.zeros(2), meta=b"x" * 64)
        with pytest.raises(TypeError):
            tx.send(np.array([object()]))
        with pytest.raises(TypeError):
            tx.send("text")
        assert tx.stats.head == 0 and tx.stats.free_slots == 4


def test_zero_copy_slots_and_raw_messages(name):
    with _host_channel(name) as tx, gpuipc.Channel.open(name, "consumer") as rx:
        slot = tx.acquire(timeout=1)
        assert slot.capacity == 4096 and not slot.published
        a = slot.as_array("float32", (4, 4))
        a[:] = np.eye(4)
        assert slot.publish_array("float32", (4, 4), meta=b"eye") == slot.sequence
        assert slot.published
        # Raw: any header, any bytes.
        raw = tx.acquire(timeout=1)
        np.frombuffer(raw.data, dtype=np.uint8, count=5)[:] = np.frombuffer(b"hello", dtype=np.uint8)
        raw.publish(5, header=b"\x01\x02")
        with rx.receive(timeout=1) as m:
            assert np.array_equal(m.array, np.eye(4, dtype=np.float32)) and m.meta == b"eye"
        with rx.receive(timeout=1) as m:
            assert m.header == b"\x01\x02" and m.size == 5
            assert bytes(np.asarray(m.data)) == b"hello"
            assert bytes(m.as_array("uint8", 5)) == b"hello"
            with pytest.raises(gpuipc.InvalidState, match="not sent with Channel.send"):
                m.array


def test_publish_array_headers_follow_each_spelling(name):
    """publish_array remembers each (dtype, shape, meta) spelling's header: alternating spellings, unhashable ones
    and bad ones each give their own header or error."""
    with _host_channel(name, slots=2, slot_bytes=4096, header_bytes=64) as tx, gpuipc.Channel.open(
        name, "consumer"
    ) as rx:
        spellings = [
            ("float32", (4, 4), b"a"),
            ("int16", (2, 3), b""),
            ("float32", (4, 4), b"a"),
            (np.dtype("float64"), [3], bytearray(b"bb")),  # a list shape and bytearray meta: not remembered
            ("uint8", 5, b""),
            ("int16", (2, 3), b""),
            ("float32", (16,), b"a"),
        ]
        for round_ in range(2):
            for dtype, shape, meta in spellings:
                slot = tx.acquire(timeout=1)
                slot.publish_array(dtype, shape, meta=meta)
                with rx.recv(timeout=1) as m:
                    dims = (shape,) if isinstance(shape, int) else tuple(shape)
                    want = np.dtype(dtype)
                    assert (m.dtype, m.shape, m.meta, m.size) == (want, dims, bytes(meta), want.itemsize * int(np.prod(dims)))
        for bad, error, match in [
            (("float32", (2000,), b""), gpuipc.InvalidArgument, "do not fit in a slot"),
            (("uint8", (-1, 4), b""), gpuipc.InvalidArgument, "negative dimension"),
            (("uint8", (1,) * 6, b""), gpuipc.InvalidArgument, "header"),
            (("no-such-type", (1,), b""), TypeError, "element type"),
        ]:
            slot = tx.acquire(timeout=1)
            for _ in range(2):  # refused the same way again (an error is not remembered)
                with pytest.raises(error, match=match):
                    slot.publish_array(*bad[:2], meta=bad[2])
            assert not slot.published
            slot.publish(0)
            rx.recv(timeout=1).release()
        assert tx.stats.free_slots == 2


def test_unpublished_slot_is_skipped_by_recv(name):
    with _host_channel(name) as tx, gpuipc.Channel.open(name, "consumer") as rx:
        with pytest.raises(RuntimeError, match="boom"):
            with tx.acquire(timeout=1) as slot:
                slot.as_array("uint8", 1)[0] = 1
                raise RuntimeError("boom")
        with tx.acquire(timeout=1):
            pass  # forgotten: published as aborted too
        tx.send(np.array([7, 8, 9]))
        with rx.recv(timeout=1) as m:
            assert list(m.array) == [7, 8, 9] and m.sequence == 2
        assert tx.stats.free_slots == 4
        assert not tx._acquired  # the streams of slots acquired are forgotten once published or aborted


def test_a_slot_given_up_on_a_channel_with_short_headers(name):
    """With header_bytes under 24 there is no room for the aborted mark: a slot given up is published as an empty
    message, and the exception that left the block is the one raised. Before, the failed abort raised InvalidState in
    its place and left the slot acquired, refusing every later publish."""
    with _host_channel(name, header_bytes=0) as tx, gpuipc.Channel.open(name, "consumer") as rx:
        with pytest.raises(RuntimeError, match="boom"):
            with tx.acquire(timeout=1):
                raise RuntimeError("boom")
        assert not tx._ch.held
        slot = tx.acquire(timeout=1)
        slot.as_array("uint8", 3)[:] = [1, 2, 3]
        slot.publish(3)
        with rx.receive(timeout=1) as m0:
            assert (m0.sequence, m0.size, m0.header) == (0, 0, b"")
        with rx.receive(timeout=1) as m1:
            assert m1.sequence == 1 and m1.as_array("uint8", 3).tolist() == [1, 2, 3]


def test_an_array_of_an_element_type_numpy_lacks_is_received_raw(name):
    """A C++ producer may send an array header of a type NumPy has no dtype for (float8: DLPack float, 8 bits).
    recv returns the message, whose .array raises TypeError saying so; it can be released. Before, recv raised
    TypeError and kept the message held with no handle to release it by."""
    with _host_channel(name) as tx, gpuipc.Channel.open(name, "consumer") as rx:
        fp8 = _array_header._HEADER.pack(_array_header.ARRAY_HEADER_MAGIC, _array_header._VERSION, 1, 0, 2, 8, 1, 0, 4)
        slot = tx.acquire(timeout=1)
        slot.publish(4, header=fp8 + struct.pack("<q", 4))
        tx.send(np.arange(3))
        msg = rx.recv(timeout=1)
        assert msg.sequence == 0 and msg.size == 4 and "Message 0" in repr(msg)
        with pytest.raises(TypeError, match="code=2, bits=8"):
            msg.array
        msg.release()
        with rx.recv(timeout=1) as m1:
            assert m1.array.tolist() == [0, 1, 2]


def test_publish_order_rules(name):
    with _host_channel(name) as tx, gpuipc.Channel.open(name, "consumer"):
        s0, s1 = tx.acquire(timeout=1), tx.acquire(timeout=1)
        with pytest.raises(gpuipc.InvalidState, match="older acquired slots first"):
            s1.publish(1)
        s0.publish(1)
        with pytest.raises(gpuipc.InvalidState, match="already published"):
            s0.publish(1)
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
        with pytest.raises(gpuipc.InvalidState, match="older acquired slots first"):
            s1.publish(0)
        assert s0.publish(0) == 0 and s0.published and tx._ch.held == [1]
        assert tx.publish(0) == 1 and s1.published and tx._ch.held == []
        m0, m1 = rx.receive(timeout=1), rx.receive(timeout=1)
        assert rx._ch.held == [0, 1] and not m0.incomplete
        with pytest.raises(gpuipc.InvalidState, match=r"release the older messages first \(held: \[0, 1\]\)"):
            m1.release()
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
