"""GPU tests: device segments and channels with PyTorch, CuPy and JAX across processes, read-only mappings,
stream-ordered semaphores, a producer killed mid-stream. Skipped (with the reason) where there is no GPU or no
such framework."""

from __future__ import annotations

import multiprocessing
import os
import signal
import subprocess
import sys
import time

import numpy as np
import pytest

import gpuipc
import gpu_helpers
import helpers

_NO_GPU = helpers.gpus_missing(1)
pytestmark = pytest.mark.skipif(bool(_NO_GPU), reason=f"needs a GPU: {_NO_GPU}")

N = gpu_helpers.N


def _torch():
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("torch without CUDA")
    return torch


def _cupy():
    return pytest.importorskip("cupy")


def test_device_segment_views(name):
    with gpuipc.Segment.create(name, N * N * 4, kind="device") as seg:
        assert seg.kind == "device" and seg.device == 0 and seg.device_pointer == seg.address != 0
        assert gpuipc.Segment.stat(name).device_uuid.startswith("GPU-")
        view = seg.as_array("float32", (N, N))
        assert view.is_cuda and view.__dlpack_device__() == (2, 0) and not view.readonly
        cai = view.__cuda_array_interface__
        assert cai["shape"] == (N, N) and cai["typestr"] == "<f4" and cai["data"] == (seg.address, False)
        assert cai["version"] == 3 and cai["strides"] is None
        with pytest.raises(BufferError):
            memoryview(view)
        with gpuipc.Segment.open(name, readonly=True) as ro:
            assert ro.as_array("float32", 4).__cuda_array_interface__["data"][1] is True


def test_torch_segment_across_processes(name, spawn):
    torch = _torch()
    with gpuipc.Segment.create(name, N * N * 4, kind="device") as seg:
        t = torch.from_dlpack(seg.as_array("float32", (N, N)))
        assert t.is_cuda and t.data_ptr() == seg.address
        want = torch.arange(N * N, dtype=torch.float32, device="cuda").reshape(N, N)
        t.copy_(want)
        torch.cuda.synchronize()
        assert spawn(gpu_helpers.torch_check_and_double, name, timeout=120)
        assert torch.equal(t, want * 2)


def test_cupy_segment_across_processes(name, spawn):
    cupy = _cupy()
    with gpuipc.Segment.create(name, N * N * 4, kind="device") as seg:
        a = cupy.asarray(seg.as_array("float32", (N, N)))
        a[...] = cupy.arange(N * N, dtype=cupy.float32).reshape(N, N)
        cupy.cuda.Device().synchronize()
        assert spawn(gpu_helpers.cupy_check_and_negate, name, timeout=120)
        assert bool(cupy.array_equal(a, -cupy.arange(N * N, dtype=cupy.float32).reshape(N, N)))


def test_torch_from_dlpack_on_a_read_only_segment(name, spawn):
    torch = _torch()
    with gpuipc.Segment.create(name, N * N * 4, kind="device") as seg:
        torch.from_dlpack(seg.as_array("float32", (N, N))).fill_(7.0)
        torch.cuda.synchronize()
        assert spawn(gpu_helpers.torch_read_only, name, timeout=120) == (True, True, True)


def test_writes_through_a_read_only_mapping_fault(name, spawn):
    torch = _torch()
    with gpuipc.Segment.create(name, N * N * 4, kind="device") as seg:
        t = torch.from_dlpack(seg.as_array("float32", (N, N)))
        t.fill_(7.0)
        torch.cuda.synchronize()
        err = spawn(gpu_helpers.torch_write_read_only, name, timeout=120)
        assert err, "a write through a read-only mapping must fault"
        assert bool((t == 7.0).all())  # and the memory is untouched


def test_host_pinned_segment(name):
    with gpuipc.Segment.create(name, 1 << 16, kind="host_pinned") as seg:
        a = seg.as_array("int32")
        a[:] = 5
        assert isinstance(a, np.ndarray) and seg.device_pointer != 0 and seg.device == 0


def test_a_device_channel_keeps_each_handles_order_and_recv_skips_an_aborted_message_behind_a_held_one(name):
    # Out of order on a device channel stays refused (a stream kept for later might be destroyed meanwhile), saying
    # to give each thread a handle; an aborted message recv skips is released from the host once the older go.
    with gpuipc.Channel.create(name, slots=4, slot_bytes=256, kind="device") as tx, \
            gpuipc.Channel.open(name, "consumer") as rx:
        s0, s1 = tx.acquire(timeout=10), tx.acquire(timeout=10)
        with pytest.raises(gpuipc.InvalidState, match="a handle of its own"):
            s1.publish(8)
        s0.publish(8)
        with s1:  # given up: published as aborted
            pass
        tx.send(np.arange(4, dtype=np.int32), timeout=10)
        m0 = rx.receive(timeout=10)
        m2 = rx.recv(timeout=10)  # skips message 1
        assert (m0.sequence, m2.sequence) == (0, 2) and rx._ch.held == [0, 2] and rx._ch.held_back == 1
        with pytest.raises(gpuipc.InvalidState, match="a handle of its own"):
            m2.release()
        m0.release()
        m2.release()
        assert rx._ch.held == [] and rx._ch.held_back == 0


def test_torch_channel_across_processes(name, start):
    torch = _torch()
    count = 40
    with gpuipc.Channel.create(name, slots=4, slot_bytes=1 << 16, kind="device", role="consumer") as ch:
        assert ch.kind == "device" and ch.device == 0
        producer = start(gpu_helpers.torch_producer, name, count)
        stream = torch.cuda.Stream()
        got = []
        with torch.cuda.stream(stream):
            for i in range(count):
                msg = ch.recv(timeout=120, stream=stream)
                x = torch.from_dlpack(msg.array)  # zero-copy, ordered after the producer's copy by recv's stream
                # An empty tensor has no storage, so torch reports its pointer as 0.
                assert x.is_cuda and (x.numel() == 0 or x.data_ptr() == msg.data.address)
                got.append((msg.meta, msg.dtype_name, msg.shape, x.clone()))
                msg.release(stream=stream)
        stream.synchronize()
        assert producer.result(timeout=120) == count
        for i, (meta, dtype_name, shape, x) in enumerate(got):
            want = gpu_helpers.torch_samples(i).contiguous()
            assert meta == str(i).encode() and shape == tuple(want.shape)
            assert dtype_name == str(want.dtype).split(".")[1]
            assert torch.equal(x, want), i


def test_message_tensor_is_made_once_per_slot_and_shape(name):
    """Message.tensor() hands out one torch tensor per slot, dtype and shape (torch.from_dlpack once), holding each
    message's values."""
    torch = _torch()
    with gpuipc.Channel.create(name, slots=2, slot_bytes=1 << 16, kind="device", role="consumer") as ch:
        with gpuipc.Channel.open(name, "producer") as producer:
            seen, kept = {}, []
            for i in range(8):
                shape = (4, 8) if i < 4 else (8, 4)
                producer.send(torch.full(shape, float(i), device="cuda:0"), timeout=10)
                with ch.recv(timeout=10) as msg:
                    t = msg.tensor()
                    torch.cuda.synchronize()
                    assert t.is_cuda and tuple(t.shape) == shape and t.data_ptr() == msg.data.address
                    assert bool((t == i).all()), i
                    seen.setdefault((msg.data.address, shape), set()).add(id(t))
                    kept.append(t)
    assert len(seen) == 4 and all(len(ids) == 1 for ids in seen.values()), seen  # 2 slots x 2 shapes


def test_slot_tensor_is_the_slot_made_once_per_slot_and_shape(name, start):
    """Slot.tensor() is a writable torch tensor of the slot itself: written in place and published with
    publish_array, it arrives in another process; one tensor per slot, dtype and shape."""
    torch = _torch()
    count = 8
    with gpuipc.Channel.create(name, slots=2, slot_bytes=1 << 16, kind="device") as ch:
        consumer = start(gpu_helpers.torch_sums, name, count)
        deadline = time.monotonic() + 120
        while ch.stats.consumers == 0 and time.monotonic() < deadline:
            time.sleep(0.01)
        stream = torch.cuda.Stream()
        seen = {}
        with torch.cuda.stream(stream):
            for i in range(count):
                shape = (4, 8) if i < 4 else (64,)
                slot = ch.acquire(stream=stream, timeout=120)
                t = slot.tensor("float32", shape)
                assert t.is_cuda and tuple(t.shape) == shape and t.data_ptr() == slot.address
                t.fill_(float(i))  # on `stream`, after acquire's wait for the slot's last reader
                slot.publish_array("float32", shape, stream=stream)
                seen.setdefault((slot.address, shape), set()).add(id(t))
        assert consumer.result(timeout=120) == [float(i) * (32 if i < 4 else 64) for i in range(count)]
    assert len(seen) == 4 and all(len(ids) == 1 for ids in seen.values()), seen  # 2 slots x 2 shapes


@pytest.mark.parametrize("how", ["with", "close"])
def test_a_slot_given_up_while_its_stream_still_fills_it_spoils_no_later_message(name, how):
    """A slot left unpublished (its ``with`` block left by an exception, or its channel closed) is given up in the
    order of the stream it was acquired on: a fill still queued there (a torch stream, which neither waits for the
    legacy default stream nor makes it wait) lands before the slot's next message is written, not over it."""
    torch = _torch()
    nbytes = 1 << 20
    with gpuipc.Channel.create(name, slots=2, slot_bytes=nbytes, kind="device", role="consumer") as rx, \
            gpuipc.Channel.open(name, "producer") as sender, gpuipc.Channel.open(name, "producer") as giver:
        side, send_stream, read_stream = torch.cuda.Stream(), torch.cuda.Stream(), torch.cuda.Stream()
        try:
            slot = giver.acquire(stream=side, timeout=10)  # message 0, in slot 0
            with torch.cuda.stream(side):
                torch.cuda._sleep(200_000_000)  # about 0.1 s: the fill lands long after the sends below
                slot.tensor("uint8").fill_(0xAA)
            if how == "with":
                with pytest.raises(RuntimeError, match="boom"):
                    with slot:
                        raise RuntimeError("boom")
            else:
                giver.close()
            with torch.cuda.stream(send_stream):
                sources = [torch.full((nbytes,), i, dtype=torch.uint8, device="cuda") for i in (1, 2)]
            sender.send(sources[0], stream=send_stream, timeout=10)
            with rx.recv(timeout=10, stream=read_stream) as msg:  # skips message 0
                assert msg.sequence == 1
            sender.send(sources[1], stream=send_stream, timeout=10)  # slot 0's next message
            with rx.recv(timeout=10, stream=read_stream) as msg:
                assert msg.sequence == 2
                torch.cuda.synchronize()  # every stream: the side stream's fill has landed, wherever it went
                got = msg.tensor().clone()
            torch.cuda.synchronize()
            assert bool((got == 2).all()), (how, got.unique().tolist())
        finally:
            side.synchronize()


def _late_read(torch, msg, read_stream):
    with torch.cuda.stream(read_stream):
        torch.cuda._sleep(200_000_000)  # about 0.1 s: the read runs long after the next send is enqueued
        return msg.tensor().clone()


@pytest.mark.parametrize("how", ["with", "release", "messages"])
def test_a_message_left_by_its_with_block_is_released_after_the_reads_queued_on_its_stream(name, how):
    """``with ch.recv(stream=s) as msg`` releases the message on ``s``, the stream it was received on, and so do
    ``msg.release()`` given no stream and ``with`` in ``for msg in ch.messages(stream=s)``: a read still queued
    there (late, on a torch stream, which the legacy default stream does not wait for) sees this message, not the
    next one the producer writes into the slot."""
    torch = _torch()
    nbytes = 1 << 20
    with gpuipc.Channel.create(name, slots=1, slot_bytes=nbytes, kind="device", role="consumer") as rx, \
            gpuipc.Channel.open(name, "producer") as tx:
        read_stream, send_stream = torch.cuda.Stream(), torch.cuda.Stream()
        with torch.cuda.stream(send_stream):
            sources = [torch.full((nbytes,), i + 1, dtype=torch.uint8, device="cuda") for i in range(2)]
        tx.send(sources[0], stream=send_stream, timeout=10)
        if how == "with":
            with rx.recv(timeout=10, stream=read_stream) as msg:
                got = _late_read(torch, msg, read_stream)
        elif how == "release":
            msg = rx.recv(timeout=10, stream=read_stream)
            got = _late_read(torch, msg, read_stream)
            msg.release()
        else:
            for msg in rx.messages(stream=read_stream, timeout=10):
                with msg:
                    got = _late_read(torch, msg, read_stream)
                break
        tx.send(sources[1], stream=send_stream, timeout=10)  # the same slot (a one-slot ring)
        torch.cuda.synchronize()
        assert bool((got == 1).all()), got.unique().tolist()
        with rx.recv(timeout=10, stream=read_stream) as msg:
            with torch.cuda.stream(read_stream):
                got = msg.tensor().clone()
        torch.cuda.synchronize()
        assert bool((got == 2).all()), got.unique().tolist()


@pytest.mark.parametrize("how", ["slot", "channel"])
def test_a_slot_published_without_a_stream_follows_the_stream_it_was_acquired_on(name, how):
    """``slot.publish_array(...)`` and ``ch.publish(...)`` given no stream publish on the stream the slot was
    acquired on, where it is filled: a fill queued late on a torch stream (which the legacy default stream does
    not wait for) is what the consumer reads."""
    torch = _torch()
    nbytes = 1 << 20
    with gpuipc.Channel.create(name, slots=2, slot_bytes=nbytes, kind="device", role="consumer") as rx, \
            gpuipc.Channel.open(name, "producer") as tx:
        fill_stream, read_stream = torch.cuda.Stream(), torch.cuda.Stream()
        slot = tx.acquire(stream=fill_stream, timeout=10)
        with torch.cuda.stream(fill_stream):
            torch.cuda._sleep(200_000_000)  # about 0.1 s: the fill lands long after the publish is enqueued
            slot.tensor("uint8").fill_(7)
        if how == "slot":
            slot.publish_array("uint8", (nbytes,))
        else:
            size, header = tx._array_header("uint8", (nbytes,), b"")  # what publish_array sends
            tx.publish(size, header=header)
        with rx.recv(timeout=10, stream=read_stream) as msg:
            with torch.cuda.stream(read_stream):
                got = msg.tensor().clone()
        torch.cuda.synchronize()
        assert bool((got == 7).all()), (how, got.unique().tolist())


def test_cupy_channel_and_torch_consumer(name, start):
    torch = _torch()
    _cupy()
    count = 20
    with gpuipc.Channel.create(name, slots=2, slot_bytes=4096, kind="device", role="consumer") as ch:
        producer = start(gpu_helpers.cupy_producer, name, count)
        for i in range(count):
            with ch.recv(timeout=120) as msg:
                x = torch.from_dlpack(msg.array)
                assert tuple(x.shape) == (8, 8) and bool((x == i).all())
        assert producer.result(timeout=120) == count


def test_cupy_consumer_through_cuda_array_interface(name, start):
    cupy = _cupy()
    with gpuipc.Channel.create(name, slots=2, slot_bytes=4096, kind="device", role="consumer") as ch:
        producer = start(gpu_helpers.numpy_producer, name, 5)  # host arrays into GPU slots
        for i in range(5):
            with ch.recv(timeout=120) as msg:
                a = cupy.asarray(msg.array)
                assert a.shape == (6, 6) and int(a.sum()) == 36 * i
        assert producer.result(timeout=120) == 5


def test_jax_producer(name, start):
    pytest.importorskip("jax")
    torch = _torch()
    with gpuipc.Channel.create(name, slots=2, slot_bytes=4096, kind="device", role="consumer") as ch:
        producer = start(gpu_helpers.jax_producer, name, 4)
        for i in range(4):
            with ch.recv(timeout=180) as msg:
                assert bool((torch.from_dlpack(msg.array) == i).all()) and msg.shape == (3, 5)
        assert producer.result(timeout=180) == 4


def test_torch_producer_to_child_consumer(name, start):
    torch = _torch()
    with gpuipc.Channel.create(name, slots=2, slot_bytes=1 << 16, kind="device") as ch:
        consumer = start(gpu_helpers.receive_sums, name, 6)
        s = torch.cuda.Stream()
        for i in range(6):
            with torch.cuda.stream(s):
                ch.send(torch.full((128,), float(i), device="cuda"), stream=s, timeout=120)
        s.synchronize()
        assert consumer.result(timeout=120) == [128.0 * i for i in range(6)]


def test_killed_producer_raises_peer_died(name):
    _torch()
    ready = name + "r"
    with gpuipc.Channel.create(name, slots=4, slot_bytes=4096, kind="device", role="consumer") as ch:
        proc = multiprocessing.get_context("spawn").Process(target=gpu_helpers.torch_producer_killed,
                                                            args=(name, ready))
        proc.start()
        try:
            helpers.wait_for_name(ready, timeout=120)
            for i in range(2):
                with ch.recv(timeout=60) as msg:
                    assert msg.shape == (64,)
            os.kill(proc.pid, signal.SIGKILL)
            with pytest.raises(gpuipc.PeerDied):
                ch.recv(timeout=60)
        finally:
            proc.kill()
            proc.join(30)


def test_semaphore_orders_streams_across_processes(name, start):
    torch = _torch()
    sem_name = name + "s"
    with gpuipc.Segment.create(name, N * N * 4, kind="device", mode=0o644) as seg, \
            gpuipc.Semaphore.create(sem_name, mode=0o644) as sem:  # host_pinned: GPU streams wait on it
        t = torch.from_dlpack(seg.as_array("float32", (N, N)))
        t.zero_()
        torch.cuda.synchronize()
        consumer = start(gpu_helpers.torch_semaphore_consumer, name, sem_name)
        s = torch.cuda.Stream()
        with torch.cuda.stream(s):
            torch.cuda._sleep(50_000_000)  # the fill lands well after the consumer enqueued its wait
            t.fill_(3.0)
            sem.signal(1, stream=s, wake_host=True)
        s.synchronize()
        assert consumer.result(timeout=120) == 3.0 * N * N
        assert sem.value == 1


@pytest.mark.parametrize("script, args", [
    ("pipeline.py", ["--frames", "100", "--size", "256"]),  # weights_server.py, rl_weight_sync.py: test_examples.py
])
def test_examples_on_the_gpu(script, args):
    _torch()
    path = os.path.join(os.path.dirname(__file__), "..", "..", "examples", "python", script)
    r = subprocess.run([sys.executable, path, *args], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "GPU pipeline" in r.stdout or "device segments" in r.stdout, r.stdout
