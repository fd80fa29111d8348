"""Pools from Python (host kinds, NumPy): allocate, BlockRef round trips, resolve and hold across processes, stats,
errors; and share() refusing what is not GPU memory."""

from __future__ import annotations

import gc
import os

import numpy as np
import pytest

import gpuipc
import helpers


def test_allocate_views_and_context_manager(name):
    with gpuipc.Pool.create(name, chunk_bytes=1 << 20, max_bytes=4 << 20) as pool:
        assert pool.kind == "host" and pool.name == name and not pool.fixed
        with pool.allocate(4096) as blk:
            assert blk.size == 4096 and blk.address % 256 == 0 and not blk.freed
            a = blk.numpy("float32", (32, 32))
            a[:] = np.arange(1024, dtype=np.float32).reshape(32, 32)
            assert np.asarray(blk.view())[:4].tolist() == [0, 0, 0, 0]
            assert np.from_dlpack(blk).nbytes == 4096
            assert pool.stats()["live_blocks"] == 1
            with pytest.raises(AttributeError):
                blk.__cuda_array_interface__
        assert blk.freed and pool.stats()["live_blocks"] == 0
        blk.free()  # idempotent
        with pytest.raises(gpuipc.InvalidArgument):
            pool.free(blk)


def test_block_ref_round_trip(name):
    with gpuipc.Pool.create(name, chunk_bytes=1 << 20) as pool:
        blk = pool.allocate(1000)
        ref = blk.ref
        assert ref.pool == pool.id and ref.size == 1000 and ref.generation != 0
        raw = bytes(ref)
        assert len(raw) == 40 and gpuipc.BlockRef.from_bytes(raw) == ref
        with pytest.raises(AttributeError):
            ref.size = 5  # frozen
        with pytest.raises(gpuipc.InvalidArgument, match="40"):
            gpuipc.BlockRef.from_bytes(raw[:39])
        blk.free()


def test_resolve_in_another_process_and_hold(name, spawn):
    with gpuipc.Pool.create(name, chunk_bytes=1 << 20) as pool:
        blk = pool.allocate(8 * 100)
        blk.numpy("int64", 100)[:] = np.arange(100)
        ref = blk.ref
        assert spawn(helpers.pool_resolve_and_sum, name, bytes(ref)) == sum(range(100))
        assert pool.stats()["members"] == 1  # the child left
        # a stale ref (freed) is refused with InvalidArgument naming the generation
        blk.free()
        with pytest.raises(gpuipc.InvalidArgument, match="generation"):
            pool.resolve(ref)


def test_map_chunks_maps_every_chunk_the_refs_name_at_once(name, spawn):
    with gpuipc.Pool.create(name, chunk_bytes=1 << 16, max_bytes=4 << 16) as pool, \
            gpuipc.Pool.create(name + "x", chunk_bytes=1 << 16, max_bytes=1 << 16) as other:
        blocks = [pool.allocate(1 << 16) for _ in range(4)]  # one chunk each
        assert sorted(b.ref.chunk for b in blocks) == [0, 1, 2, 3]
        for k, b in enumerate(blocks):
            b.numpy("int64")[:] = k
        stranger = other.allocate(64)
        raw = [bytes(b.ref) for b in blocks] + [bytes(stranger.ref)]  # another pool's ref is skipped
        # In a process that maps the chunks already (here, their creator's), another handle maps nothing anew: it
        # resolves to the same addresses (an open_tensors of one's own tensors gives one's own memory).
        with gpuipc.Pool.open(name) as again:
            again.map_chunks([b.ref for b in blocks])
            assert [again.resolve(b.ref).view().address for b in blocks] == [b.view().address for b in blocks]
        assert spawn(helpers.pool_map_chunks_then_sum, name, raw) == [k * (1 << 13) for k in range(4)]  # unlinks
        gpuipc.Pool.unlink(name + "x")


def test_hold_keeps_memory_from_reuse(name):
    with gpuipc.Pool.create(name, chunk_bytes=64 << 10, max_bytes=64 << 10) as owner:
        other = gpuipc.Pool.open(name)
        blk = owner.allocate(64 << 10)
        ref = blk.ref
        with other.held(ref) as view:
            view.numpy("uint8")[:] = 7
            blk.free()
            with pytest.raises(gpuipc.QuotaExceeded):
                owner.allocate(64 << 10)  # still held by `other`
            assert view.numpy("uint8")[0] == 7
        owner.allocate(64 << 10).free()  # released: reusable
        other.close()


def test_stats_and_stat(name):
    with gpuipc.Pool.create(name, chunk_bytes=1 << 20, max_bytes=2 << 20) as pool:
        blocks = [pool.allocate(1 << 10) for _ in range(3)]
        s = pool.stats()
        assert s["live_blocks"] == 3 and s["chunks"] == 1 and s["max_bytes"] == 2 << 20
        assert gpuipc.Pool.stat(name)["live_blocks"] == 3
        for b in blocks:
            b.free()
        assert gpuipc.Pool.stat(name)["frees"] == 3


def test_fixed_pool(name):
    with gpuipc.Pool.create(name, block_bytes=4096, block_count=2) as pool:
        assert pool.fixed and pool.block_bytes == 4096
        a, b = pool.allocate(4096), pool.allocate(100)
        with pytest.raises(gpuipc.QuotaExceeded):
            pool.allocate(1)
        a.free()
        b.free()


def test_errors(name):
    with pytest.raises(gpuipc.InvalidArgument):
        gpuipc.Pool.create(name, kind="nowhere")
    with pytest.raises(gpuipc.NotFound):
        gpuipc.Pool.open(name)
    gpuipc.Segment.create(name, 4096).close()
    with pytest.raises(gpuipc.InvalidArgument, match="pool"):
        gpuipc.Pool.open(name)
    with gpuipc.Pool.create(name + "p", chunk_bytes=1 << 20) as pool:
        with pytest.raises(gpuipc.AlreadyExists):
            gpuipc.Pool.create(name + "p")
        with pytest.raises(gpuipc.InvalidArgument):
            pool.allocate(2 << 20)  # above the chunk size
        with pytest.raises(gpuipc.InvalidArgument):
            pool.free("not a block")
    gpuipc.Pool.unlink(name + "p")
    with pytest.raises(gpuipc.NotFound):
        gpuipc.Pool.stat(name + "p")


def test_free_through_another_handle_of_the_same_pool(name):
    with gpuipc.Pool.create(name, chunk_bytes=1 << 20) as pool, gpuipc.Pool.open(name) as again:
        block = pool.allocate(100)
        assert pool.stats()["live_blocks"] == 1
        again.free(block)  # the handle that allocated it frees it
        assert pool.stats()["live_blocks"] == 0
        with pytest.raises(gpuipc.InvalidArgument, match="double free"):
            again.free(block)
        with gpuipc.Pool.create(name + "q", chunk_bytes=1 << 20) as stranger:
            with pytest.raises(gpuipc.InvalidArgument, match="its own pool"):
                stranger.free(pool.allocate(100))


def test_block_freed_by_garbage_collection(name):
    with gpuipc.Pool.create(name, chunk_bytes=1 << 20) as pool:
        pool.allocate(100)  # dropped at once
        assert pool.stats()["live_blocks"] == 0


def test_a_view_keeps_its_block_when_the_block_object_is_collected(name):
    # `pool.allocate(n).numpy()`: the Block was collected (so freed) at once while the array lived on over its
    # memory, and the next allocations were handed that memory (found by an audit: the array read another block's
    # 2.0 after 255 allocations).
    with gpuipc.Pool.create(name, chunk_bytes=1 << 20, max_bytes=4 << 20) as pool:
        a = pool.allocate(4096).numpy("float32")
        a[:] = 1
        gc.collect()
        assert pool.stats()["live_blocks"] == 1
        others = []
        for _ in range(300):
            b = pool.allocate(4096)
            assert b.address != a.ctypes.data
            b.numpy("float32")[:] = 2
            others.append(b)
        assert (a == 1).all()
        del a
        gc.collect()
        assert pool.stats()["live_blocks"] == 300  # the last view gone, the block is freed
        # free() frees the block whatever views are left (documented): the view's holder is the one to drop them.
        b = others.pop()
        v = b.numpy()
        b.free()
        assert b.freed and pool.stats()["live_blocks"] == 299
        del v, others


def test_a_collected_block_does_not_hide_the_block_that_took_its_memory(name):
    # A Block freed, its memory handed out again, then collected: its finalizer dropped the new Block's entry, so
    # find_block (share_tensors, cupy.block_of) no longer found it, and share_tensors copied instead of sharing.
    from gpuipc.pool import find_block

    with gpuipc.Pool.create(name, block_bytes=4096, block_count=1) as pool:
        first = pool.allocate(4096)
        first.free()
        second = pool.allocate(4096)
        assert second.address == first.address
        del first
        gc.collect()
        assert find_block(second.address, 4096) is second
        second.free()


def test_a_block_outlives_its_pool_handle(name):
    # Its free() and repr went through the Python Pool, and raised Closed once that was closed: such a block could
    # only be freed by garbage collection (no stream= then).
    with gpuipc.Pool.create(name, chunk_bytes=1 << 20) as pool:
        b = pool.allocate(64)
        r = pool.resolve(b.ref)
    assert name in repr(b) and "handle closed" in repr(r)
    b.free()
    assert b.freed and repr(b) == "<gpuipc.Block freed>"
    b.free()  # idempotent
    with pytest.raises(gpuipc.Closed):
        pool.free(b)
    gpuipc.Pool.unlink(name)


def test_share_refuses_host_memory(name):
    with pytest.raises(gpuipc.InvalidArgument, match="GPU memory"):
        gpuipc.share(name, np.zeros(16))
    with pytest.raises(gpuipc.InvalidArgument, match="nbytes"):
        gpuipc.share(name, 12345)
    with pytest.raises(TypeError):
        gpuipc.share(name, object())
    # Checked before the memory is looked at: InvalidArgument, not the binding's TypeError.
    for kw in (dict(device=True), dict(device=-2), dict(mode=-1), dict(mode=1 << 32)):
        with pytest.raises(gpuipc.InvalidArgument):
            gpuipc.share(name, 12345, 4096, **kw)
    with pytest.raises(TypeError, match="GPU ordinal"):
        gpuipc.share(name, 12345, 4096, device=1.5)


def test_pause_keeps_addresses_and_contents_and_resume_restores_them(name):
    with gpuipc.Pool.create(name, chunk_bytes=1 << 20, max_bytes=2 << 20) as pool:
        blk = pool.allocate(8 * 1000)
        a = blk.numpy("int64")
        a[:] = np.arange(1000)
        address, ref = blk.address, blk.ref
        assert not pool.paused and pool.stats()["state"] == "active"
        pool.pause(keep_contents=True)
        assert pool.paused
        st = pool.stats()
        assert st["state"] == "paused" and st["paused_by_pid"] == os.getpid() and st["epoch"] == 1
        assert not st["pauser_gone"] and st["live_blocks"] == 1
        assert gpuipc.Pool.stat(name)["state"] == "paused"
        assert not a.any(), "the pages are released (the memfd has a hole): the array reads zeros, and nothing crashes"
        with pytest.raises(gpuipc.InvalidState, match=f"paused by pid {os.getpid()}"):
            pool.allocate(16)
        with pytest.raises(gpuipc.InvalidState, match="paused"):
            pool.resolve(ref)
        with pytest.raises(gpuipc.InvalidState, match="paused"):
            pool.pause()
        pool.resume()
        assert not pool.paused and blk.address == address
        assert a.tolist() == list(range(1000))
        assert pool.resolve(ref).numpy("int64").tolist() == list(range(1000))
        with pytest.raises(gpuipc.InvalidState, match="not paused"):
            pool.resume()
        blk.free()


def test_pause_without_keeping_contents_gives_zeros(name):
    with gpuipc.Pool.create(name, chunk_bytes=1 << 20) as pool:
        blk = pool.allocate(4096)
        blk.numpy()[:] = 7
        pool.pause()
        pool.resume()
        assert not blk.numpy().any()
        blk.free()


def test_pause_with_a_kept_buffer_saves_each_cycles_own_bytes(name):
    """keep_buffer: resume keeps the host buffer and the next pause reuses it; each cycle brings back what was there
    at its own pause (not an earlier cycle's bytes), also once the pool holds more than the buffer did."""
    with gpuipc.Pool.create(name, chunk_bytes=1 << 20, max_bytes=2 << 20) as pool:
        blk = pool.allocate(8 * 1000)
        a = blk.numpy("int64")
        for cycle in range(3):
            a[:] = np.arange(1000) + cycle
            pool.pause(keep_contents=True, keep_buffer=True)
            pool.resume()
            assert a.tolist() == list(range(cycle, 1000 + cycle))
        big = pool.allocate(1 << 20)  # the second chunk: more than the kept buffer holds
        big.numpy("uint8")[:] = 9
        pool.pause(keep_contents=True, keep_buffer=True)
        pool.resume()
        assert (big.numpy("uint8") == 9).all() and a.tolist() == list(range(2, 1002))
        big.free()
        blk.free()


def test_a_paused_pool_tells_another_process_who_paused_it(name, spawn):
    with gpuipc.Pool.create(name, chunk_bytes=1 << 20) as pool:
        blk = pool.allocate(8 * 100)
        blk.numpy("int64")[:] = np.arange(100)
        pool.pause(keep_contents=True)
        r = spawn(helpers.pool_paused_report, name, bytes(blk.ref))
        assert r["paused"] and r["stats"]["state"] == "paused" and r["stats"]["paused_by_pid"] == os.getpid()
        for what in ("resolve", "hold", "allocate"):
            cls, msg = r[what]
            assert cls == "InvalidState" and f"paused by pid {os.getpid()}" in msg, (what, r[what])
        pool.resume()
        assert spawn(helpers.pool_resolve_and_sum, name, bytes(blk.ref)) == sum(range(100))
        blk.free()


def test_only_a_writer_may_pause(name):
    with gpuipc.Pool.create(name, chunk_bytes=1 << 20) as pool, gpuipc.Pool.open(name, readonly=True) as reader:
        with pytest.raises(gpuipc.PermissionDenied, match="write access"):
            reader.pause()
        assert not pool.paused


def test_torch_pause_without_a_mempool_says_so():
    import gpuipc.torch

    with pytest.raises(gpuipc.InvalidState, match="no active MemPool"):
        gpuipc.torch.pause(7)
    with pytest.raises(gpuipc.InvalidState, match="no active MemPool"):
        gpuipc.torch.resume(7)


def test_a_read_only_pool_never_gives_a_writable_view(name):
    """Whatever readonly= a caller passes, views of a pool opened read-only are read-only (its chunks are mapped
    PROT_READ: a writable view would crash the process at its first write)."""
    with gpuipc.Pool.create(name, chunk_bytes=1 << 20) as pool, gpuipc.Pool.open(name, readonly=True) as reader:
        blk = pool.allocate(4096)
        raw = bytes(blk.ref)
        views = [reader._pool.view(blk.ref._tuple(), False)] + list(reader._pool.views_of(raw, False, False, False))
        views += list(reader._pool.spans_of(raw, False, False, False)[0])
        for v in views:
            arr = np.asarray(v)
            assert not arr.flags.writeable
            with pytest.raises(ValueError):
                arr[0] = 1
        del views, arr
        blk.free()


def test_closing_a_pool_while_another_thread_uses_it_is_an_error_there_not_a_crash(name, spawn):
    """views_of, tensors_of_index and the other calls that release the GIL keep a handle of their own on the pool:
    a close() from another thread meanwhile makes the call fail saying the handle was closed, or lets it finish;
    it never pulls the pool away under it (which crashed the process, or failed with "an empty Pool handle")."""
    r = spawn(helpers.views_of_while_another_thread_closes, name, 200, timeout=120)
    assert set(r) == {"views", "closed", "overlapped"} and r["views"] + r["closed"] == 200, r
    assert r["overlapped"] >= 40, f"too few closes came while the call ran to show anything: {r}"


def test_bad_pool_arguments_are_refused_with_gpuipc_errors(name):
    for kw in (dict(chunk_bytes=-1), dict(max_blocks=1 << 32), dict(mode=-1), dict(mode=True)):
        with pytest.raises(gpuipc.InvalidArgument):
            gpuipc.Pool.create(name, **kw)
    # More than 1024 chunks: refused, naming what to change (it was cut to 1024 chunks without a word).
    with pytest.raises(gpuipc.InvalidArgument, match="raise chunk_bytes to at least 4194304 or lower max_bytes"):
        gpuipc.Pool.create(name, chunk_bytes=1 << 20, max_bytes=4 << 30)
    with gpuipc.Pool.create(name, chunk_bytes=1 << 20, max_bytes=4 << 20) as pool:
        for args in ((-1,), (10, -1), (True,)):
            with pytest.raises(gpuipc.InvalidArgument):
                pool.allocate(*args)
        assert pool.stats()["live_blocks"] == 0


def test_a_block_ref_with_bad_fields_is_refused(name):
    """A BlockRef made by hand with a negative or huge field raises InvalidArgument, not the binding's TypeError."""
    import dataclasses

    with gpuipc.Pool.create(name, chunk_bytes=1 << 20, max_bytes=4 << 20) as pool:
        with pool.allocate(64) as blk:
            for bad in (dict(offset=-1), dict(generation=-5), dict(chunk=1 << 64)):
                ref = dataclasses.replace(blk.ref, **bad)
                for call in (pool.resolve, pool.hold, pool.release):
                    with pytest.raises(gpuipc.InvalidArgument, match="every field of a BlockRef"):
                        call(ref)

