"""GPU tests of bucketed streaming (device staging, torch, a side stream; receive and receive_iter, with and
without checksums; by reference from a gpuipc.torch.MemPool dict, and finish()'s stream wait), stream-ordered
Reader.wait_version (and its release when the publisher is SIGKILLed), and gpuipc.cupy.set_allocator. Skipped (with
the reason) where there is no GPU, torch or CuPy."""

from __future__ import annotations

import gc
import multiprocessing
import os
import signal
import time

import numpy as np
import pytest

import gpuipc
import gpu_helpers
import helpers
from test_gpu import _NO_GPU

pytestmark = pytest.mark.skipif(bool(_NO_GPU), reason=f"needs a GPU: {_NO_GPU}")


def _torch():
    torch = pytest.importorskip("torch", reason="needs PyTorch")
    if not torch.cuda.is_available():
        pytest.skip("torch without CUDA")
    torch.zeros(1, device="cuda")  # a current context before gpuipc maps anything
    return torch


@pytest.mark.parametrize("checksum", [False, True])
def test_stream_round_trip_on_device(name, start, checksum):
    torch = _torch()
    # 1 MiB buckets, a ring of two: "w" (2 MiB) is split, each version takes 3 buckets, readers pace the publisher
    with gpuipc.stream_publisher(name, 1 << 20, 2, device=0, checksum=checksum) as pub:
        futs = [start(gpu_helpers.torch_stream_reader, name, 3) for _ in range(2)]
        assert pub.wait_readers(2, timeout=60) == 2
        s = torch.cuda.Stream()
        for v in (1, 2, 3):
            assert pub.publish(gpu_helpers.torch_stream_state(torch, v), stream=s) == v
        gpu_helpers.sync_within(s)
        for f in futs:
            assert f.result(timeout=60) == [(1, True), (2, True), (3, True)]


def test_stream_receive_follows_tensors_replaced_between_versions(name, start):
    """receive() reuses a bucket's copy plan only while its destinations are the same tensors at the same
    addresses: a storage replaced in place, or a new tensor under a name, gets the next version."""
    torch = _torch()
    with gpuipc.stream_publisher(name, 1 << 20, 2, device=0) as pub:
        fut = start(gpu_helpers.torch_stream_reader_swaps, name)
        assert pub.wait_readers(1, timeout=60) == 1
        for v in (1, 2, 3):
            assert pub.publish(gpu_helpers.torch_stream_state(torch, v)) == v
        torch.cuda.synchronize()
        assert fut.result(timeout=60) == [(1, True), (2, True), (3, True)]


def test_stream_reader_that_switches_streams_keeps_its_last_copies(name, start):
    """A reader receives version 1 on a stream held back, then versions 2 and 3 on another (one bucket a version, a
    ring of two). Version 3 reuses version 1's bucket; the new stream waits for the old one, so the publisher
    refills that bucket only after version 1 was copied out. Before, the new stream gave the buckets back at once,
    ahead of version 1's copies, and those copies read version 3."""
    torch = _torch()
    with gpuipc.stream_publisher(name, 1 << 20, 2, device=0) as pub:
        fut = start(gpu_helpers.torch_stream_reader_switches_streams, name)
        assert pub.wait_readers(1, timeout=60) == 1
        s = torch.cuda.Stream()
        for v in (1, 2, 3):
            with torch.cuda.stream(s):
                state = {"w": torch.full((1 << 16,), float(v), device="cuda")}
            assert pub.publish(state, stream=s) == v
        gpu_helpers.sync_within(s)
        assert fut.result(timeout=60) == [(1, 1.0, 1.0), (2, 2.0, 2.0), (3, 3.0, 3.0)]


def test_wait_version_on_a_stream(name, start):
    torch = _torch()
    with gpuipc.publish_tensors(name, {"w": torch.zeros(1 << 16, device="cuda")}, versions=1) as pub:
        torch.cuda.synchronize()
        fut = start(gpu_helpers.torch_stream_wait_version, name, name + "-ready")
        helpers.wait_for_name(name + "-ready", timeout=60)
        two = torch.full((1 << 16,), 2.0, device="cuda")
        assert pub.update_from({"w": two}, stream=torch.cuda.current_stream()) == 2
        blocked, seen, value = fut.result(timeout=60)
    assert blocked, "the reader's stream ran before version 2 was published"
    assert (seen, value) == (1, 2.0)


def test_stream_wait_released_when_the_publisher_dies(name):
    torch = _torch()
    ctx = multiprocessing.get_context("spawn")
    p = ctx.Process(target=gpu_helpers.torch_versions_publisher_forever, args=(name, name + "-ready"))
    p.start()
    try:
        helpers.wait_for_name(name + "-ready", timeout=60)
        s = torch.cuda.Stream()
        with gpuipc.open_tensors(name, versioned=True, wait=30) as r:
            assert r.wait_version(5, stream=s) == 1
            with torch.cuda.stream(s):
                x = torch.ones(4, device="cuda") * 3
            time.sleep(0.3)
            assert not s.query(), "the stream did not wait"
            os.kill(p.pid, signal.SIGKILL)
            p.join(30)
            gpu_helpers.sync_within(s, 30)  # released by the broker's poison
            assert r.status == "peer_died"
            with pytest.raises(gpuipc.PeerDied):
                r.wait_version(5, timeout=5)
            with pytest.raises(gpuipc.PeerDied):
                r.wait_version(5, stream=s)  # already poisoned: nothing is enqueued
            assert float(x.sum()) == 12.0
    finally:
        p.kill()
        p.join()
    gpuipc.unlink_tensors(name)


def test_cupy_allocator(name):
    cupy = pytest.importorskip("cupy", reason="needs CuPy")
    import gpuipc.cupy as gcupy

    with gpuipc.Pool.create(name, kind="device", chunk_bytes=8 << 20, max_bytes=16 << 20) as pool:
        gcupy.set_allocator(pool)
        try:
            a = cupy.arange(1 << 16, dtype=cupy.int64)
            found = gcupy.block_of(a)
            assert found is not None and found[2] == name
            assert pool.stats()["live_blocks"] >= 1
            assert int(a.sum()) == (1 << 16) * ((1 << 16) - 1) // 2
            del a
            cupy.cuda.Device().synchronize()
        finally:
            gcupy.set_allocator(None)
        b = cupy.zeros(16)
        assert gcupy.block_of(b) is None  # CuPy's own pool again
        gc.collect()
        deadline = time.monotonic() + 10
        while pool.stats()["live_blocks"] and time.monotonic() < deadline:
            time.sleep(0.01)
        assert pool.stats()["live_blocks"] == 0, "CuPy's frees did not reach the pool"
        assert np.isfinite(float(b.sum()))


def test_cupy_memory_is_freed_on_the_stream_it_was_allocated_on(name):
    """An array made under a non-blocking stream and dropped outside it: its block was freed on the stream current
    at the drop (the legacy one), so the pool handed its memory out again while the array's stream still used it."""
    cupy = pytest.importorskip("cupy", reason="needs CuPy")
    import gpuipc.cupy as gcupy

    spin = cupy.RawKernel(
        r'extern "C" __global__ void spin(long long n) { long long t = clock64(); while (clock64() - t < n) {} }', "spin")
    with gpuipc.Pool.create(name, kind="device", chunk_bytes=8 << 20, max_bytes=16 << 20) as pool:
        gcupy.set_allocator(pool)
        try:
            s = cupy.cuda.Stream(non_blocking=True)
            with s:
                a = cupy.ones(1 << 16, dtype=cupy.float32)  # a block of 256 KiB
                spin((1,), (1,), (cupy.int64(3_000_000_000),))  # about a second of work queued on s
            assert gcupy.block_of(a)[2] == name
            del a  # outside `with s`: the current stream is the legacy one now
            gc.collect()
            time.sleep(0.05)  # a free on the idle legacy stream would have landed by now
            st = pool.stats()
            assert st["frees"] == 1, st
            # Still draining behind the spin on s (on an H200: 1 now, 0 with the free on the legacy stream:
            # bench/results/experiments/cupy-free-stream-ddc557a-h200-20261130.log)
            assert st["draining_blocks"] == 1, st
            s.synchronize()
        finally:
            gcupy.set_allocator(None)


def test_bucket_copies_land_every_byte_whatever_the_alignment():
    """The copies a bucket enqueues (_Copies): int64 bulks with uint8 ends, pieces at odd addresses, and a piece large
    enough to be copied on its own all write exactly their bytes, and nothing beside them."""
    torch = _torch()
    from gpuipc._stream_format import _MEMCPY_BYTES, _Copies

    src = torch.randint(0, 256, (_MEMCPY_BYTES + (2 << 20),), dtype=torch.uint8, device="cuda")
    # (destination offset, source offset, bytes): aligned, aligned with an odd end, odd addresses, a few bytes, 1 MiB,
    # and one of _MEMCPY_BYTES; the destinations do not overlap and leave gaps that must stay zero
    cases = [(0, 0, 64), (128, 16, 61), (259, 5, 1000), (2049, 3, 7), (4096, 4096, 1 << 20),
             ((1 << 20) + 8192, 64, _MEMCPY_BYTES)]
    dst = torch.zeros(cases[-1][0] + _MEMCPY_BYTES + 64, dtype=torch.uint8, device="cuda")
    want = torch.zeros_like(dst)
    for d, s, n in cases:
        want[d : d + n] = src[s : s + n]
    copies = _Copies(torch, [dst[d : d + n] for d, _, n in cases], [src[s : s + n] for _, s, n in cases])
    assert len(copies.single) == 1 and len(copies.lists) == 2  # the large piece; the int64 bulks, the uint8 rest
    for _ in range(2):  # a plan runs any number of times
        dst.zero_()
        copies.run(torch, non_blocking=True)
        torch.cuda.synchronize()
        assert torch.equal(dst, want)


# By reference: a publisher's gpuipc.torch.MemPool tensors, copied straight into the readers' tensors
@pytest.mark.parametrize("mixed", [False, True])
def test_stream_by_reference_from_a_mempool(name, start, mixed):
    """A dict built under gpuipc.torch.MemPool goes by reference (with `mixed`, one tensor outside the pool is
    staged beside the others); readers receive with receive and receive_iter; the reader that counts its handle
    calls resolves the blocks in version 1 and opens nothing later."""
    _torch()
    readers = [start(gpu_helpers.torch_stream_reader, name, 3),
               start(gpu_helpers.torch_stream_reader, name, 3, "receive", 0.0, True)]
    pub = start(gpu_helpers.torch_mempool_stream_publisher, name, 3, 2, mixed)
    pieces = pub.result(timeout=120)
    want = {"w": "reference", "b": "staged" if mixed else "reference", "i": "reference"}
    assert all(p == want for p in pieces), pieces
    assert readers[0].result(timeout=60) == [(1, True), (2, True), (3, True)]
    counted = readers[1].result(timeout=60)
    assert [(v, ok) for v, ok, _ in counted] == [(1, True), (2, True), (3, True)]
    assert counted[0][2].get("Pool.open") == 1, counted  # the MemPool's pool, joined once
    # its chunks mapped ahead of the resolves: one broker round trip per bucket that names new blocks (a version
    # takes two buckets with by_reference=True, one with "auto")
    assert counted[0][2].get("Pool.map_chunks") == (1 if mixed else 2), counted
    assert counted[1][2] == counted[2][2] == {}, counted  # steady state: no handle opened or resolved


def test_stream_by_reference_finish_orders_the_next_write(name, start):
    """The publisher writes the next version into its MemPool tensors on its stream right after publish(); a reader
    that takes 0.3 s per piece still gets each version whole, because finish() made that stream wait for it."""
    _torch()
    reader = start(gpu_helpers.torch_stream_reader, name, 2, "iter", 0.3)
    pub = start(gpu_helpers.torch_mempool_stream_publisher, name, 2, 1, False)
    assert len(pub.result(timeout=120)) == 2
    assert reader.result(timeout=60) == [(1, True), (2, True)]


def test_stream_by_reference_reader_keeps_its_plans_as_buckets_move_round_the_ring(name, start):
    """Two buckets a version through a ring of three: each bucket lands in another slot every version. A bucket of
    reference pieces reads nothing from its slot, so the reader plans its copies once, in version 1."""
    _torch()
    reader = start(gpu_helpers.torch_stream_reader_plans, name, 4)
    assert len(start(gpu_helpers.torch_mempool_stream_publisher, name, 4, 1, False, 3).result(timeout=120)) == 4
    got = reader.result(timeout=60)
    assert [(v, ok) for v, ok, _ in got] == [(1, True), (2, True), (3, True), (4, True)]
    assert [n for _, _, n in got] == [2, 0, 0, 0], got


def test_stream_by_reference_sends_a_version_like_the_last_again_only_where_nothing_moved(name, start):
    """A version whose tensors are those of the last, in its order and unchanged, is sent as the last one's buckets
    again (versions 3 and 6: all three tensors). Where a tensor's storage was replaced, the buckets before its own
    are sent again and the rest walked (version 4: "w" is in the first bucket, nothing sent again; version 7: "i" is
    in the second, one tensor sent again); the version after such a one is walked, to be recorded. Every version
    arrives whole."""
    _torch()
    reader = start(gpu_helpers.torch_stream_reader, name, 8, "receive")
    got = start(gpu_helpers.torch_mempool_stream_publisher_replays, name).result(timeout=120)
    assert got == [(3, 3), (4, 0), (6, 3), (7, 1)], got
    assert reader.result(timeout=60) == [(v, True) for v in range(1, 9)]


def test_stream_by_reference_buckets_follow_writes_enqueued_after_start(name, start):
    """Tensors written on the version's stream after start(), behind a slow kernel, then passed to update(): readers
    get the written values (a bucket of reference pieces is signalled from the host only once that stream is idle)."""
    _torch()
    reader = start(gpu_helpers.torch_stream_reader, name, 3, "receive")
    assert start(gpu_helpers.torch_mempool_stream_publisher_writes_late, name, 3).result(timeout=120) == 3
    assert reader.result(timeout=60) == [(1, True), (2, True), (3, True)]


def test_stream_by_reference_wait_released_when_the_reader_dies(name, start):
    _torch()
    ctx = multiprocessing.get_context("spawn")
    holder = ctx.Process(target=helpers.stream_reader_holds_first, args=(name, name + "-ready", True))
    holder.start()
    try:
        pub = start(gpu_helpers.torch_mempool_stream_publish_held, name, name + "-published")
        helpers.wait_for_name(name + "-ready", timeout=120)
        helpers.wait_for_name(name + "-published", timeout=120)
        os.kill(holder.pid, signal.SIGKILL)
        r = pub.result(timeout=120)
    finally:
        holder.kill()
        holder.join()
    assert r["blocked"], "finish() did not make the publisher's stream wait for the reader"
    assert r["finished"], r
