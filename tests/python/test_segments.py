"""Segments from Python on the CPU: host kinds, NumPy views, processes, permissions, lifetimes."""

from __future__ import annotations

import gc
import os
import weakref

import numpy as np
import pytest

import gpuipc
import helpers


def test_create_open_modify_across_processes(name, spawn):
    n = 1 << 16
    with gpuipc.Segment.create(name, n * 8, kind="host") as seg:
        a = seg.as_array("float64", (n,))
        a[:] = np.arange(n)
        assert spawn(helpers.open_check_and_double, name, n) == float(np.arange(n).sum())
        assert np.array_equal(a, 2 * np.arange(n, dtype=np.float64))
    gpuipc.Segment.unlink(name)


def test_properties_and_repr(name):
    with gpuipc.Segment.create(name, 1000, mode=0o640) as seg:
        assert seg.name == name
        assert seg.size == 4096  # rounded up to a page
        assert seg.kind == "host"
        assert seg.access == "read_write" and not seg.readonly
        assert seg.device == -1
        assert seg.id > 0
        assert seg.address != 0 and seg.device_pointer == 0
        assert name in repr(seg)
        info = gpuipc.Segment.stat(name)
        assert isinstance(info, gpuipc.SegmentInfo)
        assert (info.id, info.name, info.kind, info.size, info.mode) == (seg.id, name, "host", 4096, 0o640)
        assert info.owner_uid == os.getuid() and os.getpid() in info.mapper_pids and info.references >= 1
        assert info.device_uuid == ""
        assert name in [i.name for i in gpuipc.Segment.list()]
    assert seg.closed and "closed" in repr(seg)
    with pytest.raises(gpuipc.Closed, match="this handle was closed"):
        seg.size
    seg.close()  # idempotent


def test_readonly_open_gives_readonly_arrays(name, spawn):
    with gpuipc.Segment.create(name, 4096) as seg:
        seg.as_array("uint8", 16)[0] = 42
        with gpuipc.Segment.open(name, readonly=True) as ro:
            assert ro.readonly and ro.access == "read_only"
            a = ro.as_array("uint8", 16)
            assert not a.flags.writeable and a[0] == 42
            with pytest.raises(ValueError):
                a[0] = 1
            with pytest.raises(ValueError):
                a.flags.writeable = True
            assert memoryview(ro.view()).readonly
            assert not memoryview(seg.view()).readonly
            b = np.from_dlpack(ro.view())  # our DLPack exporter says read-only too
            assert not b.flags.writeable and b[0] == 42
        writeable, err, first = spawn(helpers.open_readonly_and_try_write, name)
        assert not writeable and "read-only" in err and first == 42


def test_as_array_shapes_dtypes_offsets(name):
    with gpuipc.Segment.create(name, 4096) as seg:
        whole = seg.as_array()
        assert whole.dtype == np.uint8 and whole.shape == (4096,)
        f = seg.as_array(np.float32, (4, 8), offset=64)
        f[:] = 1.5
        assert seg.as_array("float32", 32, offset=64).sum() == 48.0
        assert seg.as_array("int16").shape == (2048,)
        assert seg.as_array("float64", (2, 0)).shape == (2, 0)
        assert seg.as_array("bool", ()).shape == ()
        with pytest.raises(gpuipc.InvalidArgument, match="do not fit"):
            seg.as_array("float64", 513)
        with pytest.raises(ValueError, match="multiple of the element size"):
            seg.as_array("float32", 1, offset=2)
        with pytest.raises(ValueError):
            seg.as_array("float32", 1, offset=-4)
        with pytest.raises(TypeError):
            seg.as_array("object", 1)
        with pytest.raises(TypeError):
            seg.as_array("float32", (1.5, 2))  # not cut to (1, 2)
        with pytest.raises(gpuipc.InvalidArgument, match="out of range"):
            seg.as_array("uint8", None, 1 << 64)
        view = seg.view()
        assert view.nbytes == 4096 and not view.is_cuda and view.__dlpack_device__() == (1, 0)
        assert not hasattr(view, "__cuda_array_interface__")


def test_array_keeps_mapping_alive_after_close(name):
    seg = gpuipc.Segment.create(name, 8192)
    a = seg.as_array("int32", 2048)
    a[:] = 7
    seg.close()
    gpuipc.Segment.unlink(name)
    # The name is gone and the handle closed, but the array still owns the mapping: no use after unmap.
    assert int(a.sum()) == 7 * 2048
    a[5] = 9
    assert a[5] == 9
    (info,) = [i for i in gpuipc.Segment.list() if i.id and i.name == ""]
    assert info.references == 1
    del a
    gc.collect()
    assert all(i.name != "" for i in gpuipc.Segment.list())  # the last reference went: freed


def test_reference_counts_follow_handles(name):
    seg = gpuipc.Segment.create(name, 4096)
    again = gpuipc.Segment.open(name)  # same process, same access: shares the mapping
    assert gpuipc.Segment.stat(name).references == 1
    ro = gpuipc.Segment.open(name, readonly=True)
    assert gpuipc.Segment.stat(name).references == 2
    seg.close()
    again.close()
    assert gpuipc.Segment.stat(name).references == 1
    ro.close()
    assert gpuipc.Segment.stat(name).references == 0
    gpuipc.Segment.unlink(name)


def test_unlink_keeps_mappings(name):
    with gpuipc.Segment.create(name, 4096) as seg:
        seg.as_array("uint8", 1)[0] = 5
        gpuipc.Segment.unlink(name)
        with pytest.raises(gpuipc.NotFound):
            gpuipc.Segment.open(name)
        with pytest.raises(FileNotFoundError):
            gpuipc.Segment.unlink(name)
        assert seg.as_array("uint8", 1)[0] == 5


def test_open_waits_for_creator(name, start):
    later = start(helpers.create_later, name, 0.3, 1234)
    with gpuipc.Segment.open(name, wait=20) as seg:
        assert seg.as_array("int64", 1)[0] in (0, 1234)
    later.result(timeout=30)


def test_open_wait_times_out(name):
    with pytest.raises(gpuipc.Timeout, match="did not appear within 0.3 s") as e:
        gpuipc.Segment.open(name, wait=0.3)
    assert isinstance(e.value, TimeoutError) and e.value.code == "Timeout"
    with pytest.raises(gpuipc.NotFound):
        gpuipc.Segment.open(name, wait=0)


def test_errors_are_typed(name):
    with gpuipc.Segment.create(name, 4096):
        with pytest.raises(gpuipc.AlreadyExists) as e:
            gpuipc.Segment.create(name, 4096)
        assert isinstance(e.value, FileExistsError) and name in str(e.value)
    with pytest.raises(gpuipc.InvalidArgument):
        gpuipc.Segment.create("bad/name", 4096)
    with pytest.raises(ValueError, match="kind must be"):
        gpuipc.Segment.create(name + "x", 4096, kind="gpu")
    with pytest.raises(ValueError):
        gpuipc.Segment.create(name + "y", 0)
    with pytest.raises(ValueError, match="bits outside 0777"):
        gpuipc.Segment.create(name + "z", 4096, mode=0o1777)
    with pytest.raises(ValueError):
        gpuipc.Segment.open(name, wait=-1)


def test_device_kinds_without_a_gpu(name):
    if os.path.exists("/dev/nvidiactl"):
        pytest.skip("this machine has a GPU: tests/python/test_gpu.py covers device kinds")
    with pytest.raises((gpuipc.NoDriver, gpuipc.NoDevice)):
        gpuipc.Segment.create(name, 4096, kind="device")
    with pytest.raises((gpuipc.NoDriver, gpuipc.NoDevice)):
        gpuipc.Segment.create(name, 4096, kind="host_pinned")


def test_weakref_finalizer_runs_on_drop(name):
    seg = gpuipc.Segment.create(name, 4096)
    gone = []
    weakref.finalize(seg, gone.append, True)
    del seg
    assert gone == [True]
    assert gpuipc.Segment.stat(name).references == 0


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to setuid a child to another uid")
@pytest.mark.parametrize("what", ["segment", "segment-view", "pool-view", "held-view"])
def test_a_dropped_handle_lets_other_threads_run_while_it_waits_for_the_broker(name, spawn, runtime_dir, what):
    # A handle Python frees (no close()) tells the broker, under the library's lock, which a reconnect holds while a
    # broker starts. Its destructor ran with the GIL held: every other Python thread stopped until the new broker
    # was up (a pool or a channel whose stream still works waits for it the same way). So did the last view of a
    # closed handle's memory, which owned a copy of the handle: now the handle and its views share one, which goes
    # without the GIL.
    import shutil

    daemon = os.path.join(os.path.dirname(gpuipc.__file__), "gpuipcd")
    if not os.path.exists(daemon):
        daemon = shutil.which("gpuipcd") or pytest.fail("no gpuipcd beside the package or on PATH")
    slow, started = os.path.join(runtime_dir, "slow"), os.path.join(runtime_dir, "started")
    wrapper = os.path.join(runtime_dir, "slow-gpuipcd")
    with open(wrapper, "w") as f:
        f.write(f'#!/bin/sh\nif [ -e "{slow}" ]; then touch "{started}"; sleep 2; fi\nexec "{daemon}" "$@"\n')
    os.chmod(wrapper, 0o755)
    r = spawn(helpers.drop_while_the_broker_restarts, name, wrapper, slow, started, what)
    assert r["drop_s"] > 1.0, f"the drop did not wait for the reconnect ({r}): this test no longer tests anything"
    assert r["counts_during"] > 0, f"no other thread ran while the dropped handle waited for the broker: {r}"


def test_other_uid_is_refused_by_mode_bits(name, spawn):
    with gpuipc.Segment.create(name, 4096, mode=0o600):
        cls, msg = spawn(helpers.open_as_other_user, name, True)
        assert cls == "PermissionDenied"
        assert "mode 0600" in msg and "you are uid 65534" in msg
        assert spawn(helpers.unlink_as_other_user, name) == "PermissionDenied"
    other = name + "o"
    with gpuipc.Segment.create(other, 4096, mode=0o644) as seg:
        seg.as_array("uint8", 1)[0] = 77
        assert spawn(helpers.open_as_other_user, other, True) == ("ok", "77")  # other may read
        cls, msg = spawn(helpers.open_as_other_user, other, False)  # ... but not write
        assert cls == "PermissionDenied" and "read-only" in msg
