"""Pools from Python (host kinds, NumPy): allocate, BlockRef round trips, resolve and hold across processes, stats,
errors; and share() refusing what is not GPU memory."""

from __future__ import annotations

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


def test_block_freed_by_garbage_collection(name):
    with gpuipc.Pool.create(name, chunk_bytes=1 << 20) as pool:
        pool.allocate(100)  # dropped at once
        assert pool.stats()["live_blocks"] == 0


def test_share_refuses_host_memory(name):
    with pytest.raises(gpuipc.InvalidArgument, match="GPU memory"):
        gpuipc.share(name, np.zeros(16))
    with pytest.raises(gpuipc.InvalidArgument, match="nbytes"):
        gpuipc.share(name, 12345)
    with pytest.raises(TypeError):
        gpuipc.share(name, object())
