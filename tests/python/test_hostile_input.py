"""What another process writes is not trusted: a forged or corrupted tensor index, stream header or bucket
descriptor is refused with a gpuipc error that says so, never a crash, a read out of bounds, a silent wrong value or
a builtin exception. Host kinds: no GPU needed."""

from __future__ import annotations

import ctypes
import json
import os
import stat
import struct
import subprocess
import sys
import threading
import time

import numpy as np
import pytest

import gpuipc
import helpers
from gpuipc import _index
from gpuipc import _stream_format as F
from gpuipc.__main__ import _runtime_dir_report


def test_a_strided_view_whose_span_wraps_round_is_refused(name):
    """Each stride under the cap, their sum over it: the span wrapped round to a few bytes and passed the bound
    (the read then went 2^63 bytes away and crashed the process)."""
    with gpuipc.Segment.create(name, 112) as seg:
        v = seg.view()
        with pytest.raises(gpuipc.InvalidArgument, match="too large"):
            v.as_strided((1, 16, 1), "<u2", [3, 3], [1 << 61, 1 << 61], 0)
        with pytest.raises(gpuipc.InvalidArgument, match="too large"):
            v.as_strided((1, 32, 1), "<f4", [2], [1 << 62], 0)  # (2^62 + 1) x 4 bytes wraps to 4
        assert v.as_strided((1, 8, 1), "|u1", [4, 7], [7, 1], 0).nbytes == 28  # a plain one still works


def test_typed_on_a_strided_view_is_contiguous(name):
    """typed() of a strided view kept the parent's strides: its bounds check counted contiguous elements, the export
    stepped by the old strides (past the segment: a crash, or another mapping's bytes read and written)."""
    size = 1 << 16
    with gpuipc.Segment.create(name, size) as seg:
        base = np.frombuffer(seg.view(), dtype=np.uint8)
        base[:] = np.arange(size, dtype=np.uint32).astype(np.uint8)
        spread = seg.view().as_strided((2, 32, 1), "<f4", [2], [size // 4 - 1], 0)  # bytes 0 and size - 4
        assert spread.strides == (size // 4 - 1,)
        t = spread.typed((1, 8, 1), "|u1", [2, 2], size - 8)  # 4 bytes near the end, contiguous
        assert t.strides is None
        a = np.from_dlpack(t)
        assert a.strides == (2, 1)
        np.testing.assert_array_equal(a.ravel(), base[size - 8 : size - 4])
        a[1, 1] = 7
        assert base[size - 5] == 7


def test_the_buffer_protocol_gives_a_views_element_type_shape_and_strides(name):
    """A typed or strided host view exported its bytes only: ``numpy.asarray(view)`` of a (2, 3) float32 view was a
    flat uint8 array of 24 bytes, and of a strided view a 0-d object array (NumPy swallows the BufferError)."""
    with gpuipc.Segment.create(name, 4096) as seg:
        base = np.frombuffer(seg.view(), dtype=np.float32)
        base[:] = np.arange(1024, dtype=np.float32)
        v = seg.view()
        a = np.asarray(v.typed((2, 32, 1), "<f4", [2, 3], 8))
        assert a.dtype == np.float32 and a.shape == (2, 3)
        np.testing.assert_array_equal(a, base[2:8].reshape(2, 3))
        s = np.asarray(v.as_strided((0, 16, 1), "<i2", [3, 2], [4, 1], 0))  # every other pair of int16s
        assert s.dtype == np.int16 and s.shape == (3, 2) and s.strides == (8, 2)
        np.testing.assert_array_equal(s, np.frombuffer(seg.view(), dtype=np.int16)[:12].reshape(3, 4)[:, :2])
        m = memoryview(v.typed((1, 64, 1), "<u8", [4], 0))
        assert (m.format, m.itemsize, m.shape, m.nbytes) == ("Q", 8, (4,), 32)
        assert memoryview(v).format == "B" and memoryview(v).nbytes == 4096  # a bytes view stays bytes
        with pytest.raises(BufferError, match="no buffer format"):
            memoryview(v.typed((4, 16, 1), "<V2", [4], 0))  # bfloat16
        with pytest.raises(BufferError, match="not row-major"):
            ctypes.c_char.from_buffer_copy(v.as_strided((0, 16, 1), "<i2", [3, 2], [4, 1], 0))  # asks for bytes
        a[0, 0] = 42
        assert base[2] == 42
        # A consumer that asks for contiguous memory reads len bytes from buf as they lie: a stride of 0 or the wrong
        # order is refused (they were given: 4000 bytes read for a 4-byte footprint).
        zero = v.as_strided((2, 32, 1), "<f4", [1000], [0], 0)
        two_by_three = v.typed((2, 32, 1), "<f4", [2, 3], 0)
        transposed = v.as_strided((2, 32, 1), "<f4", [3, 2], [1, 3], 0)
        for view, granted in [(zero, set()), (two_by_three, {"C", "ANY"}), (transposed, {"F", "ANY"})]:
            for order, flags in _CONTIGUOUS.items():
                if order in granted:
                    assert _buffer_len(view, flags) == view.nbytes
                else:
                    with pytest.raises(BufferError, match="order the consumer asked for"):
                        _buffer_len(view, flags)
            assert _buffer_len(view, _PYBUF_STRIDES) >= 4  # with its strides it is always given


class _PyBuffer(ctypes.Structure):
    _fields_ = [("buf", ctypes.c_void_p), ("obj", ctypes.c_void_p), ("len", ctypes.c_ssize_t),
                ("itemsize", ctypes.c_ssize_t), ("readonly", ctypes.c_int), ("ndim", ctypes.c_int),
                ("format", ctypes.c_char_p), ("shape", ctypes.c_void_p), ("strides", ctypes.c_void_p),
                ("suboffsets", ctypes.c_void_p), ("internal", ctypes.c_void_p)]


_PYBUF_STRIDES = 0x18
_CONTIGUOUS = {"C": 0x20 | _PYBUF_STRIDES, "F": 0x40 | _PYBUF_STRIDES, "ANY": 0x80 | _PYBUF_STRIDES}


def _buffer_len(obj, flags: int) -> int:
    """PyObject_GetBuffer(obj, flags)'s len, the buffer released (BufferError as the exporter raises it)."""
    get = ctypes.pythonapi.PyObject_GetBuffer
    get.argtypes = [ctypes.py_object, ctypes.POINTER(_PyBuffer), ctypes.c_int]
    release = ctypes.pythonapi.PyBuffer_Release
    release.argtypes = [ctypes.POINTER(_PyBuffer)]
    b = _PyBuffer()
    get(obj, ctypes.byref(b), flags)
    try:
        return b.len
    finally:
        release(ctypes.byref(b))


#: (case, body changes, tensor column, what the error names). The storage is a real 64-byte float32 block.
_FORGED = [
    ("past its storage", {}, [0, 0, 0, 0, 1, 17, 1], "outside its storage"),
    ("strides past its storage", {}, [0, 0, 0, 0, 2, 2, 2, 1 << 40, 1], "outside its storage"),
    ("elements and no storage", {}, [-1, 0, 0, 0, 2, 3, 4, 4, 1], "elements and no storage"),
    ("an unknown dtype", {"dtypes": ["nonsense"]}, [0, 0, 0, 0, 1, 4, 1], "dtype 'nonsense'"),
    ("a dtype that is no string", {"dtypes": [5]}, [0, 0, 0, 0, 1, 4, 1], "no string"),
    # np.dtype raises SyntaxError for it, which escaped as a bare SyntaxError
    ("a dtype numpy cannot parse", {"dtypes": ["i4,("]}, [0, 0, 0, 0, 1, 4, 1], "dtype 'i4,('"),
    ("a pool name that is no string", {"pools": [7]}, [0, 0, 0, 0, 1, 4, 1], "no string"),
    ("a name twice", {"names": ["a", "a"]}, [0, 0, 0, 0, 1, 4, 1] * 2, "a tensor name twice"),
    ("versioning that is no dict", {"versioning": "yes"}, [0, 0, 0, 0, 1, 4, 1], "versioning"),
    ("versioning with no semaphore", {"versioning": {"versions": 1}}, [0, 0, 0, 0, 1, 4, 1], "versioning"),
]


@pytest.mark.parametrize("case, change, flat, says", _FORGED, ids=[c[0] for c in _FORGED])
def test_a_forged_tensor_index_is_refused_as_malformed(name, case, change, flat, says):
    """InvalidArgument naming what is wrong, before any ref is resolved: not a PeerDied ("freed"), not a builtin
    exception, not an array over memory the storage does not have."""
    with gpuipc.Pool.create(name + "P", chunk_bytes=1 << 16, max_bytes=1 << 16) as pool:
        block = pool.allocate(64)
        body = helpers.index_body(["a"], pools=[name + "P"], words=len(flat))
        body.update({k: ([name + "P" if p == "P" else p for p in v] if k == "pools" else v) for k, v in change.items()})
        with helpers.forge_index(name, body, flat, [0, 64, 0, 0], bytes(block.ref)):
            with pytest.raises(gpuipc.InvalidArgument, match="malformed") as e:
                gpuipc.open_tensors(name)
            assert says in str(e.value), (case, str(e.value))
        block.free()


def test_a_tensor_index_of_two_slots_without_versioning_is_malformed(name):
    """(Its reader was told to use open_tensors, the call that sent it there.)"""
    with helpers.forge_index(name, helpers.index_body([]), [], [], b"") as seg:
        seg.as_array("uint8")[16:20] = np.frombuffer(struct.pack("<I", 2), np.uint8)  # slots
        with pytest.raises(gpuipc.InvalidArgument, match="two slots and no versioning"):
            gpuipc.open_tensors(name)


def test_a_tensor_index_nested_thousands_deep_is_malformed_not_a_recursion_error(name):
    nested = b"[" * 100000 + b"]" * 100000
    with helpers.forge_index(name, nested, [], [], b""):
        with pytest.raises(gpuipc.InvalidArgument, match="malformed"):
            gpuipc.open_tensors(name)


def test_open_waits_for_a_slot_its_owner_is_rewriting(name):
    """Stamp 0 means the owner is writing the slot's refs: the opener waits for the stamp to come back rather than
    read refs half written."""
    with gpuipc.Pool.create(name + "P", chunk_bytes=1 << 16, max_bytes=1 << 16) as pool:
        block = pool.allocate(64)
        block.numpy("float32")[:] = 7
        flat = [0, 0, 0, 0, 1, 16, 1]
        with helpers.forge_index(name, helpers.index_body(["a"], pools=[name + "P"], words=len(flat)), flat, [0, 64, 0, 0], bytes(block.ref),
                    stamp=0) as seg:
            mem = seg.as_array("uint8")
            stamp_at = _index.decode(name, mem).slot_offset
            later = threading.Timer(0.05, lambda: mem.__setitem__(slice(stamp_at, stamp_at + 8), 1))
            later.start()
            t0 = time.monotonic()
            got = gpuipc.open_tensors(name)
            took = time.monotonic() - t0
            later.join()
            assert took >= 0.04 and float(got["a"].sum()) == 7 * 16, took
            del got
        block.free()


def _put_desc(mem, ring, readers, seq, pieces, blocks=(), index=0, flags=F._D_LAST):
    body = json.dumps({"pieces": pieces, "blocks": list(blocks)}).encode()
    d = F._desc_view(mem, ring, readers, seq % ring)
    d[:] = 0
    d[: F._DESC.size] = np.frombuffer(F._DESC.pack(seq, 7, index, flags, 4096, 0, len(body), 0), np.uint8)
    d[F._DESC.size : F._DESC.size + len(body)] = np.frombuffer(body, np.uint8)


def test_a_stream_header_that_claims_bigger_buckets_than_it_has_is_refused(name):
    """Pieces are checked against the header's bucket_bytes: one larger than the staging blocks let a piece past a
    block's end through, and a byte of it was broadcast over a whole tensor."""
    with gpuipc.stream_publisher(name, 4096, 2, readers=1, kind="host") as pub:
        pub._mem[16:24] = np.frombuffer(struct.pack("<Q", 1 << 20), np.uint8)  # bucket_bytes
        with pytest.raises(gpuipc.InvalidArgument, match="bucket_bytes 1048576 is more than its staging blocks"):
            gpuipc.stream_reader(name)


@pytest.mark.parametrize("pieces, blocks", [
    ([["a", "float32", [64], 0, 16, 0, 0]], [[5, "00" * 40]]),  # a pool name that is no string
    ([["a", "float32", [64], 0, 16, 0, 0]], [{}]),  # a table entry that is no pair
    ([["a", "float32", [64], 2, 16, 0]], []),  # splits an element
    ([["a", "float32", [1 << 20], 0, 0, 0]], []),  # elements and no bytes (a 4 MiB empty array)
], ids=["pool-int", "entry-dict", "split-element", "no-bytes"])
def test_a_stream_reader_stops_at_a_malformed_bucket(name, pieces, blocks):
    """ProtocolError for the bucket, and again at every later call (it used to read the same bad bucket for ever),
    saying to close the reader."""
    with gpuipc.stream_publisher(name, 4096, 2, readers=1, kind="host") as pub:
        with gpuipc.stream_reader(name) as rd:
            src = {"a": np.arange(64, dtype=np.float32)}
            t = threading.Thread(target=pub.publish, args=(src,))
            t.start()
            assert rd.receive({"a": np.zeros(64, np.float32)}, timeout=10) == 1
            t.join()
            _put_desc(pub._mem, 2, 1, rd._next, pieces, blocks)
            pub._filled.signal_host(rd._next)
            with pytest.raises(gpuipc.ProtocolError, match="bucket descriptor"):
                rd.receive({"a": np.zeros(64, np.float32)}, timeout=2)
            with pytest.raises(gpuipc.ProtocolError, match="close it"):
                rd.receive({"a": np.zeros(64, np.float32)}, timeout=2)


@pytest.mark.parametrize("second, says", [
    (["a", "float32", [1024], 128, 128, 0], "is float32\\[1024\\]; its first was float32\\[64\\]"),
    (["a", "int32", [64], 128, 128, 0], "is int32\\[64\\]; its first was float32\\[64\\]"),
    (["a", "float32", [64], 192, 64, 0], "starts at byte 192, not 128"),
    (["b", "float32", [4], 0, 16, 0], "ended with 'a' sent in part"),
], ids=["larger-shape", "other-dtype", "gap", "left-short"])
def test_a_version_whose_pieces_do_not_make_up_its_tensors_is_refused(name, second, says):
    """A split tensor's pieces must keep the shape and dtype of its first, follow each other, and all arrive before
    the version ends: each was checked against its own shape alone, so a later piece claiming a larger shape, or a
    version that left a tensor half sent, was reported whole with stale bytes in it."""
    with gpuipc.stream_publisher(name, 4096, 2, readers=1, kind="host") as pub:
        with gpuipc.stream_reader(name) as rd:
            t = threading.Thread(target=pub.publish, args=({"a": np.arange(64, dtype=np.float32)},))
            t.start()
            assert rd.receive({"a": np.zeros(64, np.float32)}, timeout=10) == 1
            t.join()
            e = rd._next
            _put_desc(pub._mem, 2, 1, e, [["a", "float32", [64], 0, 128, 0]], index=0, flags=0)
            _put_desc(pub._mem, 2, 1, e + 1, [second], index=1)
            pub._filled.signal_host(e + 1)
            into = {"a": np.zeros(64, np.float32), "b": np.zeros(4, np.float32)}
            with pytest.raises(gpuipc.ProtocolError, match=says):
                rd.receive(into, timeout=2)
            assert rd.version == 1  # not the torn version 7


def test_a_bucket_naming_a_block_of_something_that_is_no_pool_is_a_protocol_error(name):
    """A reference piece whose table names a segment that is no pool: ProtocolError naming the block, not the
    InvalidState that says the publisher freed a tensor (which a stale ref of a real pool gets)."""
    ref = struct.pack("<QQQQII", 1, 1, 0, 4096, 0, 0).hex()
    with gpuipc.Segment.create(name + "-s", 4096, kind="host"), \
            gpuipc.stream_publisher(name, 4096, 2, readers=1, kind="host") as pub, gpuipc.stream_reader(name) as rd:
        src = {"a": np.arange(64, dtype=np.float32)}
        t = threading.Thread(target=pub.publish, args=(src,))
        t.start()
        assert rd.receive({"a": np.zeros(64, np.float32)}, timeout=10) == 1
        t.join()
        _put_desc(pub._mem, 2, 1, rd._next, [["a", "float32", [64], 0, 256, 0, 0]], [[name + "-s", ref]])
        pub._filled.signal_host(rd._next)
        with pytest.raises(gpuipc.ProtocolError, match="cannot use"):
            rd.receive({"a": np.zeros(64, np.float32)}, timeout=2)


def test_python_doctor_judges_the_runtime_directory_as_the_library_does(tmp_path):
    sticky = tmp_path / "sticky"
    sticky.mkdir()
    os.chmod(sticky, 0o1777)  # like /tmp: the library uses it
    assert _runtime_dir_report(str(sticky))["usable"], _runtime_dir_report(str(sticky))
    open_dir = tmp_path / "open"
    open_dir.mkdir()
    os.chmod(open_dir, 0o777)
    assert "chmod go-w" in _runtime_dir_report(str(open_dir))["error"]
    real = tmp_path / "real"
    real.mkdir(mode=0o700)
    link = tmp_path / "link"
    link.symlink_to(real)
    assert "symbolic link" in _runtime_dir_report(str(link))["error"]
    assert stat.S_ISLNK(os.lstat(link).st_mode)


def test_an_error_message_with_bytes_that_are_not_utf8_is_still_the_gpuipc_error(tmp_path):
    # The message named a runtime directory from the environment: its bytes were decoded strictly, and the caller got
    # a UnicodeDecodeError instead of the gpuipc error that says what is wrong.
    script = (
        "import gpuipc\n"
        "try:\n"
        "    gpuipc.Segment.open('x')\n"
        "except gpuipc.Error as e:\n"
        "    print(type(e).__name__, ascii(str(e)))\n"
    )
    env = dict(os.environb)
    env[b"GPUIPC_RUNTIME_DIR"] = os.fsencode(str(tmp_path)) + b"/bad\xff/rt"
    env[b"GPUIPC_NO_AUTOSTART"] = b"1"
    out = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, timeout=60)
    assert out.returncode == 0, out.stderr.decode(errors="replace")
    assert b"\\\\xff" in out.stdout, out.stdout  # the byte, escaped: "\\xff" as ascii() shows a backslash


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to setuid a child to another uid")
def test_an_index_cannot_point_a_reader_at_a_pool_its_owner_could_not_use(name, spawn):
    """A reader joins the pools an index names with its own permissions: another user's index that named the
    reader's private pool had it take that pool's bytes as the tensors (and write into them, opened writable)."""
    with gpuipc.Pool.create(name + "P", chunk_bytes=1 << 16, max_bytes=1 << 16, mode=0o600) as pool:
        block = pool.allocate(64)
        block.numpy("float32")[:] = 7
        assert spawn(helpers.forge_index_as_other_user, name, [name + "P"], [bytes(block.ref)]) == "ok"
        assert gpuipc.Segment.stat(name).owner_uid == 65534
        with pytest.raises(gpuipc.PermissionDenied, match="may not read: a reader joins only pools"):
            gpuipc.open_tensors(name)
        assert gpuipc.Pool.stat(name + "P")["members"] == 1  # the refused join was left again
        got = gpuipc.open_tensors(name, trust_pools=True)  # the reader's own choice
        assert float(got["t0"].sum()) == 7 * 16
        del got
        block.free()
    gpuipc.Segment.unlink(name)
    # A pool everyone may read: the index's owner could read it too, but not write it.
    with gpuipc.Pool.create(name + "R", chunk_bytes=1 << 16, max_bytes=1 << 16, mode=0o644) as pool:
        block = pool.allocate(64)
        block.numpy("float32")[:] = 3
        assert spawn(helpers.forge_index_as_other_user, name, [name + "R"], [bytes(block.ref)]) == "ok"
        got = gpuipc.open_tensors(name)
        assert float(got["t0"].sum()) == 3 * 16
        del got
        with pytest.raises(gpuipc.PermissionDenied, match="may not read and write"):
            gpuipc.open_tensors(name, readonly=False)
        block.free()
    gpuipc.Segment.unlink(name)
    # Two pools, the second refused: the first is left again at once, not when the error's traceback goes.
    with gpuipc.Pool.create(name + "A", chunk_bytes=1 << 16, max_bytes=1 << 16, mode=0o666) as a, \
            gpuipc.Pool.create(name + "B", chunk_bytes=1 << 16, max_bytes=1 << 16, mode=0o600) as b:
        blocks = [a.allocate(64), b.allocate(64)]
        refs = [bytes(x.ref) for x in blocks]
        assert spawn(helpers.forge_index_as_other_user, name, [name + "A", name + "B"], refs) == "ok"
        with pytest.raises(gpuipc.PermissionDenied, match=f"pool {name + 'B'!r}") as err:
            gpuipc.open_tensors(name)
        assert gpuipc.Pool.stat(name + "A")["members"] == 1, "while the error (its traceback) is still held"
        del err
        for x in blocks:
            x.free()
    gpuipc.Segment.unlink(name)


def test_a_stream_reader_takes_blocks_only_of_pools_the_streams_owner_could_read(name):
    """The same for the blocks a stream's buckets name: the reader's HeldBlocks judge each pool by the stream's
    owner."""
    from gpuipc.tensors import HeldBlocks

    with gpuipc.Pool.create(name + "P", chunk_bytes=1 << 16, max_bytes=1 << 16, mode=0o600) as pool:
        block = pool.allocate(64)
        stranger = HeldBlocks(True, None, f"stream {name!r}", (os.getuid() + 1, os.getgid() + 1))
        with pytest.raises(gpuipc.PermissionDenied, match=f"stream {name!r} names pool"):
            stranger.get(name + "P", bytes(block.ref))
        mine = HeldBlocks(True, None, f"stream {name!r}", (os.getuid(), os.getgid()))
        assert mine.get(name + "P", bytes(block.ref)).view.nbytes == 64
        mine.close()
        block.free()
    with gpuipc.stream_publisher(name, 4096, 2, readers=1, kind="host") as pub, gpuipc.stream_reader(name) as rd:
        assert rd._held._vouch == (pub._seg.owner_uid, pub._seg.owner_gid) == (os.getuid(), os.getgid())
