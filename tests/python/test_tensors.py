"""share_tensors / open_tensors with NumPy and host pools: layout kept (dtype, shape, strides, offset, shared
storage), read-only views, tensors already in pool memory shared by ref, errors."""

from __future__ import annotations

import contextlib
import warnings

import numpy as np
import pytest

import gpuipc
import helpers


def _state():
    a = np.arange(64, dtype=np.float32)
    return a, {
        "a": a,
        "t": a[::2].reshape(4, 8),  # a strided view of a's storage
        "tail": a[40:],  # an offset into it
        "i8": np.arange(-5, 5, dtype=np.int8),
        "c": (np.arange(6) * 1j).astype(np.complex64).reshape(2, 3).T,  # transposed
        "b": np.array([True, False]),
        "scalar": np.array(2.5),
        "empty": np.zeros((0, 3), dtype=np.uint16),
    }


def test_layout_and_shared_storage_kept(name):
    a, state = _state()
    with gpuipc.share_tensors(name, state) as shared:
        assert shared.pool is not None and shared.pool.stats()["live_blocks"] == 5  # one per storage (a, t and tail are one)
        got = gpuipc.open_tensors(name, readonly=False)
        assert list(got) == list(state)
        for k, v in state.items():
            g = got[k]
            assert g.dtype == v.dtype and g.shape == v.shape and g.strides == v.strides, k
            assert np.array_equal(g, v), k
        # two views of one storage stay two views of one storage
        assert np.shares_memory(got["a"], got["t"]) and np.shares_memory(got["a"], got["tail"])
        assert got["tail"].__array_interface__["data"][0] - got["a"].__array_interface__["data"][0] == 40 * 4
        got["a"][0] = 100
        assert got["t"][0, 0] == 100
        got["t"][1, 0] = -1  # a[16]
        assert got["a"][16] == -1
        # the opener's writes are the owner's memory, not `a`
        assert shared.tensors["a"][16] == -1 and a[16] == 16


def test_readonly_views(name):
    _, state = _state()
    with gpuipc.share_tensors(name, state):
        got = gpuipc.open_tensors(name)
        for k, v in got.items():
            assert not v.flags.writeable, k
        with pytest.raises(ValueError):
            got["a"][0] = 1


def test_other_process_sees_the_layout(name, spawn):
    _, state = _state()
    with gpuipc.share_tensors(name, state):
        got = spawn(helpers.open_tensors_summary, name)
    for k, v in state.items():
        dtype, shape, strides, total, writeable = got[k]
        assert dtype == str(v.dtype) and shape == v.shape and strides == v.strides, k
        assert total == pytest.approx(float(np.abs(v).sum())) and not writeable


def test_pool_tensors_are_shared_without_copy(name):
    with gpuipc.Pool.create(name + "-user", chunk_bytes=1 << 20) as pool:
        blk = pool.allocate(4096)
        w = blk.numpy("float64", 512)
        w[:] = np.arange(512)
        loose = np.ones(3)
        with gpuipc.share_tensors(name, {"w": w, "w2": w[256:].reshape(16, 16), "loose": loose}) as shared:
            assert shared.pool.stats()["live_blocks"] == 1  # only `loose` was copied
            got = gpuipc.open_tensors(name, readonly=False)
            w[0] = 42  # no copy: the opener sees the owner's block
            assert got["w"][0] == 42 and got["w2"][0, 0] == 256
            assert np.shares_memory(got["w"], got["w2"])
        blk.free()


def test_a_pool_array_smaller_than_its_block_is_shared_and_opened(name):
    # The opener cut the block's view to the storage with as_strided, and a strided view had no buffer interface:
    # open_tensors raised BufferError for any array that did not fill its whole block.
    with gpuipc.Pool.create(name + "-user", chunk_bytes=1 << 20) as pool:
        blk = pool.allocate(4096)
        w = blk.numpy("float64", 100)
        w[:] = np.arange(100)
        with gpuipc.share_tensors(name, {"w": w}):
            got = gpuipc.open_tensors(name)
            assert np.array_equal(got["w"], np.arange(100))
            v = blk.view().as_strided((2, 64, 1), "<f8", [10, 10], [10, 1], 0)  # row-major: bytes in order
            assert bytes(memoryview(v)) == w.tobytes()
            # Not row-major: a consumer that takes strides gets them (test_hostile_input.py has the rest).
            t = np.asarray(blk.view().as_strided((2, 64, 1), "<f8", [10, 10], [1, 10], 0))
            assert np.array_equal(t, w.reshape(10, 10).T)
            del got
        blk.free()


def test_arrays_in_a_block_aligned_below_their_elements_keep_their_offsets(name):
    # A block allocated with alignment 4 (8 mod 8 = 4 here) holding a 4-byte header and float64s after it: the
    # storage began at the block, 4 bytes before the float64s, and their offset was recorded as 4 // 8 = 0 elements.
    # The opener read the wrong bytes, and update_from wrote 4 bytes early, over the header.
    with gpuipc.Pool.create(name + "-user", kind="host", chunk_bytes=1 << 20, max_bytes=1 << 20) as pool:
        pad = pool.allocate(4, alignment=4)
        blk = pool.allocate(64, alignment=4)
        assert blk.address % 8 == 4
        raw = blk.numpy("uint8")
        raw[:] = 0
        hdr = raw[:4].view(np.int32)
        hdr[0] = 1234
        w = raw[4:36].view(np.float64)
        w[:] = np.arange(4)
        with gpuipc.publish_tensors(name, {"hdr": hdr, "w": w}) as pub:
            got = gpuipc.open_tensors(name, versioned=True)
            np.testing.assert_array_equal(got.tensors["w"], np.arange(4))
            assert got.tensors["hdr"][0] == 1234
            pub.update_from({"w": np.full(4, 9.0)})
            assert hdr[0] == 1234
            np.testing.assert_array_equal(w, np.full(4, 9.0))
            np.testing.assert_array_equal(got.tensors["w"], np.full(4, 9.0))
            got.close()
        # Overlapping views of 4- and 8-byte elements starting at the block: no start of one storage fits both.
        both = {"as_int32": raw[:16].view(np.int32), "as_float64": raw[4:20].view(np.float64)}
        with pytest.raises(gpuipc.InvalidArgument, match="alignment >= 8"):
            gpuipc.share_tensors(name + "-both", both)
        blk.free()
        pad.free()


def test_views_hold_their_memory_after_close(name):
    with gpuipc.share_tensors(name, {"x": np.full(1000, 3.0)}) as shared:
        got = gpuipc.open_tensors(name)
        pool_name = shared.pool.name
    with pytest.raises(gpuipc.NotFound):
        gpuipc.open_tensors(name)  # the names went with close
    assert float(got["x"].sum()) == 3000.0  # the memory stays while the views hold it
    del got


@pytest.mark.parametrize("versions", [0, 1, 2])
def test_close_gives_the_memory_back_before_the_object_goes(name, versions):
    """close() unmaps the index, the pool and its chunks in this process at once: the object kept them (its Blocks,
    the index's array) until it was collected, GPU memory on device kinds."""
    a = {"w": np.arange(1000, dtype=np.float32), "b": np.ones(10, dtype=np.int64)}
    shared = gpuipc.share_tensors(name, a) if versions == 0 else gpuipc.publish_tensors(name, a, versions=versions)
    if versions:
        shared.update()
    kept = shared.tensors["w"]  # the caller's array keeps its own memory
    assert any(".pool.chunk." in m for m in helpers.mapped(name))
    shared.close()
    left = helpers.mapped(name)  # the pool that `kept` is a Block of (its control segment and chunks), only
    assert left[0] == f"/memfd:gpuipc:{name}.pool" and all(".pool.chunk." in m for m in left[1:]), left
    assert float(kept[999]) == 999.0
    del kept
    assert helpers.mapped(name) == []
    with pytest.raises(gpuipc.Closed, match="this handle was closed"):
        shared.tensors


def test_a_readers_close_gives_the_index_back(name):
    with gpuipc.publish_tensors(name, {"w": np.arange(10.0)}):
        before = helpers.mapped(name)
        reader = gpuipc.open_tensors(name, versioned=True)
        assert float(reader.tensors["w"][9]) == 9.0
        assert len(helpers.mapped(name)) > len(before)
        reader.close()
        assert helpers.mapped(name) == before


def test_wait_for_the_name(name, start):
    fut = start(helpers.share_later, name, 0.5)
    got = gpuipc.open_tensors(name, wait=30)
    assert got["w"].shape == (1024,) and float(got["w"][0]) == 1.0
    fut.result(timeout=60)


def test_errors(name):
    a = np.arange(10.0)
    with gpuipc.share_tensors(name, {"a": a}):
        with pytest.raises(gpuipc.AlreadyExists, match="unlink_tensors"):
            gpuipc.share_tensors(name, {"a": a})
    with gpuipc.share_tensors(name + ".v1", {"a": a}):  # the advice names the dotted name, not its first part
        with pytest.raises(gpuipc.AlreadyExists, match=f"unlink_tensors\\('{name}.v1'\\)"):
            gpuipc.share_tensors(name + ".v1", {"a": a})
    with pytest.raises(gpuipc.InvalidArgument, match="kind must be"):
        gpuipc.share_tensors(name, {}, kind="gpu")  # checked with nothing to pack too
    with pytest.raises(gpuipc.InvalidArgument, match="negative stride"):
        gpuipc.share_tensors(name, {"r": a[::-1]})
    with pytest.raises(gpuipc.Unsupported, match="element type"):
        gpuipc.share_tensors(name, {"s": np.array(["x", "y"])})
    with pytest.raises(gpuipc.Unsupported, match="element type"):
        gpuipc.share_tensors(name, {"o": np.array([object()])})
    with pytest.raises(gpuipc.InvalidArgument, match="str"):
        gpuipc.share_tensors(name, {1: a})
    with pytest.raises(gpuipc.InvalidArgument, match="mapping"):
        gpuipc.share_tensors(name, [a])
    with pytest.raises(gpuipc.NotFound):
        gpuipc.open_tensors(name)  # failed shares leave no name behind
    gpuipc.Segment.create(name, 4096).close()
    with pytest.raises(gpuipc.InvalidArgument, match="not a gpuipc tensor index"):
        gpuipc.open_tensors(name)
    with pytest.raises(gpuipc.InvalidArgument, match="without versions"):
        with gpuipc.share_tensors(name + "x", {"a": a}):
            gpuipc.open_tensors(name + "x", versioned=True)


def test_unlink_tensors_after_the_owner_went(name):
    shared = gpuipc.share_tensors(name, {"a": np.zeros(4)})
    shared._made.clear()  # as if its owner died: the names stay
    shared.close()
    gpuipc.unlink_tensors(name)
    with pytest.raises(gpuipc.NotFound):
        gpuipc.unlink_tensors(name)


def test_nothing_left_after_views_go(name):
    import gc

    from gpuipc import _gpuipc

    gc.collect()
    base = _gpuipc._live_objects()
    _, state = _state()
    with gpuipc.share_tensors(name, state) as shared:
        got = gpuipc.open_tensors(name)
        del got
        gc.collect()
        with pytest.raises(gpuipc.InvalidArgument):  # no holds left to release
            shared.pool.release(next(b for b in shared._blocks).ref)
    del shared
    gc.collect()
    assert _gpuipc._live_objects() == base


@contextlib.contextmanager
def _slow_path_names(monkeypatch):
    """The names of the tensors open_tensors makes through build_torch (storage slices and set_) while inside."""
    from gpuipc import tensors

    names: set = set()
    real = tensors.build_torch

    def recording(torch, records, *args):
        names.update(t["name"] for t in records)
        return real(torch, records, *args)

    monkeypatch.setattr(tensors, "build_torch", recording)
    yield names
    monkeypatch.setattr(tensors, "build_torch", real)


def test_a_read_only_open_of_torch_cpu_tensors_warns_that_they_look_writable(name):
    """torch has no read-only tensors: a read-only open of host memory gave torch CPU tensors that look writable
    over memory mapped read-only, and a write killed the interpreter (SIGSEGV) with no word before. It warns now, as
    torch.from_numpy does of a non-writable array; a writable open does not."""
    torch = pytest.importorskip("torch", reason="torch is not installed here")
    t = torch.arange(16, dtype=torch.float32)
    with gpuipc.share_tensors(name, {"t": t}):
        with pytest.warns(UserWarning, match="torch has no read-only tensors"):
            got = gpuipc.open_tensors(name)
        assert torch.equal(got["t"], t)
        del got
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            got = gpuipc.open_tensors(name, readonly=False)
            got["t"][0] = 5.0  # writable: no warning, and no crash
        del got


def test_torch_tensor_in_an_adopted_block_larger_than_itself_is_one_typed_import(name, monkeypatch):
    """A torch tensor born in a pool block (as gpuipc.torch.MemPool's are) is shared by ref; the block is larger than
    the tensor (the allocator rounds), and the opened tensor is still one typed import, over the owner's bytes."""
    torch = pytest.importorskip("torch", reason="torch is not installed here")
    with gpuipc.Pool.create(name + "-user", chunk_bytes=1 << 20) as pool:
        blk = pool.allocate(1000)
        w = torch.from_dlpack(blk.view()).view(torch.float32)[:200].reshape(10, 20)  # 800 of the block's bytes
        w[:] = 3.0
        with gpuipc.share_tensors(name, {"w": w}) as shared, _slow_path_names(monkeypatch) as slow:
            assert shared.pool is None  # shared by ref, not copied
            got = gpuipc.open_tensors(name, readonly=False)
            assert slow == set()
            assert got["w"].shape == (10, 20) and got["w"].stride() == (20, 1) and got["w"].untyped_storage().nbytes() == 800
            w[0, 0] = 42.0  # the owner's bytes, no copy
            assert got["w"][0, 0].item() == 42.0 and torch.equal(got["w"][1:], w[1:])
            del got
        blk.free()


def test_torch_storages_sharing_one_adopted_block_stay_apart(name, monkeypatch):
    """Several torch storages in one pool block (torch's caching allocator puts several tensors, each its own
    storage, in one segment of a gpuipc.torch.MemPool) are shared by ref as storages of their own (each its range of
    the block): a tensor alone on its storage opens as one typed import at storage offset 0 over exactly its
    storage's bytes; views of one storage stay views of one storage."""
    torch = pytest.importorskip("torch", reason="torch is not installed here")
    with gpuipc.Pool.create(name + "-user", chunk_bytes=1 << 20) as pool:
        blk = pool.allocate(4096)
        v = blk.view()

        def part(offset, nbytes):  # a torch storage of its own over bytes [offset, offset + nbytes) of the block
            return torch.from_dlpack(v.as_strided((1, 8, 1), "|u1", [nbytes], [1], offset)).view(torch.float32)

        x, y, z = part(0, 1024).reshape(16, 16), part(1024, 512), part(2048, 2048).reshape(8, 64)
        x[:], y[:], z[:] = 1.0, 2.0, torch.arange(512, dtype=torch.float32).reshape(8, 64)
        state = {"x": x, "y": y, "z": z, "zt": z.t(), "zr": z[2:5]}
        with gpuipc.share_tensors(name, state) as shared, _slow_path_names(monkeypatch) as slow:
            assert shared.pool is None  # all by ref
            got = gpuipc.open_tensors(name, readonly=False)
        assert slow == {"z", "zt", "zr"}  # one storage for the three
        for k, want in state.items():
            t = got[k]
            assert (tuple(t.shape), t.stride(), t.storage_offset()) == (tuple(want.shape), want.stride(), want.storage_offset()), k
            assert t.untyped_storage().nbytes() == want.untyped_storage().nbytes(), k
            assert torch.equal(t, want), k
        ptrs = {k: got[k].untyped_storage().data_ptr() for k in state}
        assert ptrs["z"] == ptrs["zt"] == ptrs["zr"] and len({ptrs["x"], ptrs["y"], ptrs["z"]}) == 3
        assert ptrs["y"] == y.data_ptr()  # no copy: the owner's bytes
        got["y"][3] = -5.0
        assert y[3].item() == -5.0 and x.sum().item() == 256.0  # the write stays in y's bytes
        del got, t
        blk.free()


def test_malformed_index_columns_are_refused(name):
    """A reader never trusts an index: a format it does not read, and columns out of range, are InvalidArgument."""
    from gpuipc import _index

    buf = np.arange(32.0)
    first = (-buf.ctypes.data % 64) // 8
    a = buf[first : first + 10]  # 64-byte aligned: alone at the start of its packed storage
    with gpuipc.share_tensors(name, {"a": a}) as shared:
        with gpuipc.Segment.open(name) as seg:
            mem = seg.as_array("uint8")
            index = _index.decode(name, mem)
            raw = _index.read_refs_raw(index, mem, 0)
            pool = shared.pool._pool
            dts = [((2, 64, 1), "<f8")]
            words = lambda xs: np.asarray(xs, dtype="<i8").tobytes()  # noqa: E731
            assert [i for i, _ in pool.tensors_of_index(raw, 0, index.flat_bytes, index.storage_bytes, dts, True, False)] == [0]
            for flat in ([5, 0, 0, 0, 1, 10, 1], [0, 3, 0, 0, 1, 10, 1], [0, 0, 0, 0, 99, 10, 1], [0, 0, 0, 0, 1, 10],
                         [0, 0, 0, 0, 1, 99, 1]):
                with pytest.raises(gpuipc.InvalidArgument, match="tensor|does not fit"):
                    pool.tensors_of_index(raw, 0, words(flat), index.storage_bytes, dts, True, False)
            with pytest.raises(gpuipc.InvalidArgument, match="outside its block"):
                pool.tensors_of_index(raw, 0, index.flat_bytes, words([0, 80, 1 << 40, 0]), dts, True, False)
            with pytest.raises(gpuipc.InvalidArgument, match="outside its storage"):  # 10 float64 in 40 bytes
                pool.tensors_of_index(raw, 0, index.flat_bytes, words([0, 40, 0, 0]), dts, True, True)
            with pytest.raises(gpuipc.InvalidArgument, match="not aligned to its elements"):
                pool.tensors_of_index(raw, 0, index.flat_bytes, words([0, 8, 4, 0]), dts, True, True)
            for flat in ([0, 0, 0, 0, 1, -10, 1], [0, 0, 0, 0, 1, 10, -1]):  # a negative dimension or stride
                with pytest.raises(gpuipc.InvalidArgument, match="negative dimension or stride"):
                    pool.tensors_of_index(raw, 0, words(flat), index.storage_bytes, dts, True, True)
            with pytest.raises(gpuipc.InvalidArgument, match="partial words"):
                pool.tensors_of_index(raw, 0, index.flat_bytes[:-1], index.storage_bytes, dts, True, False)
            bad = _index.Index(index.body, words([0, 0, 0, -1, 1, 10, 1]), index.storage_bytes, 1, index.slot_offset, name)
            with pytest.raises(gpuipc.InvalidArgument, match="malformed"):
                bad.tensors
            json_bytes = int(mem[12])
            mem[12] = 255  # the JSON's size (low byte) now runs into the columns
            with pytest.raises(gpuipc.InvalidArgument, match="malformed"):
                gpuipc.open_tensors(name)
            mem[12] = json_bytes
            mem[8] = 1  # format 1
            with pytest.raises(gpuipc.InvalidArgument, match="format 1; this gpuipc reads format 2"):
                gpuipc.open_tensors(name)


def test_torch_lazily_negated_views_are_refused_not_shared_as_their_bytes(name):
    """A lazily negated view (torch's neg bit, as conjugation of complex tensors uses it) keeps the bytes of the
    tensor it views and a bit that says "negate": shared as its bytes, it opened with the signs flipped. It is
    refused, saying how to resolve it, and a resolved copy travels right."""
    torch = pytest.importorskip("torch", reason="torch is not installed here")
    x = torch.tensor([1.0, -2.0, 3.5])
    if not hasattr(x, "_neg_view"):
        pytest.skip("this torch has no lazily negated views")
    neg = x._neg_view()
    assert neg.is_neg() and torch.equal(neg, -x)
    with pytest.raises(gpuipc.InvalidArgument, match="resolve_neg"):
        gpuipc.share_tensors(name, {"n": neg})
    with gpuipc.share_tensors(name, {"n": neg.resolve_neg()}):
        got = gpuipc.open_tensors(name)
        assert torch.equal(got["n"], -x)
        del got


def test_torch_float8_travels_as_its_bytes_as_the_docs_say(name):
    """NumPy has no 8-bit floats, so a float8 tensor is Unsupported (docs/torch.md): its uint8 view is shared and
    viewed back as float8 where it opens, bit for bit."""
    torch = pytest.importorskip("torch", reason="torch is not installed here")
    if not hasattr(torch, "float8_e4m3fn"):
        pytest.skip("this torch has no float8_e4m3fn")
    w = torch.linspace(-4, 4, 64).to(torch.float8_e4m3fn)
    with pytest.raises(gpuipc.Unsupported):
        gpuipc.share_tensors(name, {"w": w})
    with gpuipc.share_tensors(name, {"w": w.view(torch.uint8)}):
        got = gpuipc.open_tensors(name)["w"].view(torch.float8_e4m3fn)
        assert got.dtype == torch.float8_e4m3fn and torch.equal(got.view(torch.uint8), w.view(torch.uint8))
        del got


def test_torch_cpu_layout_shared_storage_and_holds(name, monkeypatch):
    """torch tensors (host memory): a tensor alone on its storage is one typed DLPack import (h, w, s), the others
    come from one import per chunk, a storage slice per storage and a set_ per tensor; dtype, shape, strides,
    storage offset, storage size and shared storage kept, and the blocks held until the last view goes."""
    torch = pytest.importorskip("torch", reason="torch is not installed here")
    base = torch.arange(64, dtype=torch.float32)
    state = {
        "a": base,
        "t": base[::2].reshape(4, 8),  # strides (16, 2) over a's storage
        "o": base[10:20],  # storage offset 10
        "h": torch.ones(3, dtype=torch.bfloat16),
        "i": base.view(torch.int32)[5:9],  # another dtype over the same storage
        "e": torch.empty(0, dtype=torch.float16),
        "w": torch.arange(12, dtype=torch.float64).reshape(3, 4).t(),  # alone, not contiguous
        "s": torch.tensor(7, dtype=torch.int16),  # alone, no dimensions
    }
    with gpuipc.share_tensors(name, state), _slow_path_names(monkeypatch) as slow:
        got = gpuipc.open_tensors(name, readonly=False)  # writable: the test writes through a view below
    assert slow == {"a", "t", "o", "i", "e"}  # h, w and s came from typed imports
    for k, want in state.items():
        t = got[k]
        assert (t.dtype, tuple(t.shape), t.stride()) == (want.dtype, tuple(want.shape), want.stride()), k
        if want.numel():
            assert t.storage_offset() == want.storage_offset(), k
            assert t.untyped_storage().nbytes() == want.untyped_storage().nbytes(), k
            assert torch.equal(t, want), k
    ptr = got["a"].untyped_storage().data_ptr()
    assert {got[k].untyped_storage().data_ptr() for k in ("a", "t", "o", "i")} == {ptr}
    assert got["h"].untyped_storage().data_ptr() != ptr
    got["a"][12] = -1.0  # writes land in the one shared storage
    assert got["o"][2].item() == -1.0 and got["t"][0, 6].item() == -1.0
    del got, t
