"""Two GPUs of one node from Python (issue 15): a segment of GPU 1 read and written from GPU 0, a read-only peer
mapping whose write faults only the writer, a channel from GPU 1 to GPU 0, a pool used across GPUs (and one opened
without a device while cuda:1 is current, whose tensors are on cuda:1), and processes whose CUDA_VISIBLE_DEVICES
differ ("1,0", "1") opening the same physical GPU, also by UUID (``device="GPU-..."``). Children are fresh
interpreters started with their own CUDA_VISIBLE_DEVICES. Skipped, with the reason, below two GPUs or without
PyTorch."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

import gpuipc
import helpers

_NO_TWO_GPUS = helpers.gpus_missing(2)
pytestmark = pytest.mark.skipif(bool(_NO_TWO_GPUS), reason=f"needs two GPUs: {_NO_TWO_GPUS}")

N = 1 << 20  # float32 elements


def _torch():
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available() or torch.cuda.device_count() < 2:
        pytest.skip("torch without two CUDA devices")
    return torch


def _uuids():
    """The UUIDs of this process's GPUs 0 and 1, from a child (gpuipc.device_ordinal's inverse)."""
    code = "import torch; print(' '.join('GPU-' + str(torch.cuda.get_device_properties(i).uuid) for i in (0, 1)))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    return out.stdout.split()


def _child(code: str, visible: str | None = None, timeout: float = 180) -> subprocess.CompletedProcess:
    """Runs ``code`` in a fresh interpreter (the test's runtime directory inherited) with CUDA_VISIBLE_DEVICES set
    to ``visible`` (None: as this process has it)."""
    env = dict(os.environ)
    if visible is not None:
        env["CUDA_VISIBLE_DEVICES"] = visible
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], env=env, capture_output=True, text=True,
                          timeout=timeout)


def _visible(uuids, *ordinals) -> str:
    """CUDA_VISIBLE_DEVICES showing this process's GPUs ``ordinals`` in that order (by UUID: right whatever this
    process's own CUDA_VISIBLE_DEVICES)."""
    return ",".join(uuids[o] for o in ordinals)


def test_segment_of_gpu1_read_and_written_from_gpu0(name):
    torch = _torch()
    with gpuipc.Segment.create(name, N * 4, kind="device", device=1) as seg:
        assert seg.device == 1
        t = torch.from_dlpack(seg.as_array("float32", N))
        assert t.device == torch.device("cuda", 1)
        t.copy_(torch.arange(N, dtype=torch.float32, device="cuda:1"))
        torch.cuda.synchronize(1)
        r = _child(f"""
            import torch, gpuipc
            with gpuipc.Segment.open({name!r}, device=0) as seg:
                assert seg.device == 0, seg.device
                t = torch.from_dlpack(seg.as_array("float32", {N}))
                assert t.device == torch.device("cuda", 0), t.device
                assert torch.equal(t, torch.arange({N}, dtype=torch.float32, device="cuda:0"))
                t.mul_(2)
                torch.cuda.synchronize(0)
            print("ok")
        """)
        assert r.returncode == 0 and r.stdout.strip() == "ok", r.stderr
        assert torch.equal(t, 2 * torch.arange(N, dtype=torch.float32, device="cuda:1"))


def test_write_through_read_only_peer_mapping_faults_only_the_writer(name):
    torch = _torch()
    with gpuipc.Segment.create(name, N * 4, kind="device", device=1) as seg:
        t = torch.from_dlpack(seg.as_array("float32", N))
        t.fill_(7.0)
        torch.cuda.synchronize(1)
        broker = gpuipc._gpuipc._broker_pid()
        r = _child(f"""
            import torch, gpuipc
            seg = gpuipc.Segment.open({name!r}, readonly=True, device=0)
            view = seg.as_array("float32", {N})
            assert view.readonly
            ptr = view.__cuda_array_interface__["data"][0]
            # Written with the driver: frameworks refuse to write a read-only view.
            torch.zeros(1, device="cuda:0")  # GPU 0's context current
            import ctypes
            cuda = ctypes.CDLL("libcuda.so.1")
            rc = cuda.cuMemsetD32_v2(ctypes.c_uint64(ptr), ctypes.c_uint(0xdeadbeef), ctypes.c_size_t(16))
            rc2 = cuda.cuCtxSynchronize()
            print("write", rc, rc2)
        """)
        # The write is refused or faults the child's context (a nonzero CUresult); either way only the child.
        assert r.returncode == 0, r.stderr
        words = r.stdout.split()
        assert words[0] == "write" and (words[1] != "0" or words[2] != "0"), r.stdout
        assert gpuipc._gpuipc._broker_pid() == broker  # the broker survived
        assert torch.equal(t, torch.full((N,), 7.0, device="cuda:1"))  # the owner's data is untouched
        t.add_(1)  # and its context still works
        torch.cuda.synchronize(1)
        assert float(t[0]) == 8.0


def test_channel_from_gpu1_to_gpu0(name):
    torch = _torch()
    ch = gpuipc.Channel.create(name, slots=4, slot_bytes=N * 4, kind="device", device=1, role="producer")
    consumer = subprocess.Popen(
        [sys.executable, "-c", textwrap.dedent(f"""
            import torch, gpuipc
            torch.zeros(1, device="cuda:0")
            ch = gpuipc.Channel.open({name!r}, role="consumer", wait=30, device=0)
            assert ch.device == 0
            n = 0
            for msg in ch:
                with msg:
                    t = torch.from_dlpack(msg.array)
                    assert t.device == torch.device("cuda", 0), t.device
                    assert torch.equal(t, torch.full(({N},), float(n), device="cuda:0")), n
                    n += 1
            print(n)
        """)],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )
    try:
        for i in range(50):
            ch.send(torch.full((N,), float(i), device="cuda:1"), timeout=60)
        torch.cuda.synchronize(1)
        ch.close()
        out, err = consumer.communicate(timeout=120)
    finally:
        if consumer.poll() is None:
            consumer.kill()
        gpuipc.Channel.unlink(name)
    assert consumer.returncode == 0 and out.strip() == "50", err


def test_pool_on_gpu1_blocks_resolved_on_gpu0(name):
    torch = _torch()
    pool = gpuipc.Pool.create(name, kind="device", device=1, chunk_bytes=4 << 20, max_bytes=16 << 20)
    try:
        block = pool.allocate(N * 4)
        t = torch.from_dlpack(block.view()).view(torch.float32)
        t.copy_(torch.arange(N, dtype=torch.float32, device="cuda:1"))
        torch.cuda.synchronize(1)
        ref = block.ref
        assert ref.chunk == 0
        r = _child(f"""
            import torch, gpuipc
            torch.zeros(1, device="cuda:0")
            pool = gpuipc.Pool.open({name!r}, device=0)
            b = pool.resolve(gpuipc.BlockRef.from_bytes({bytes(ref)!r}))
            t = torch.from_dlpack(b.view()).view(torch.float32)
            assert torch.equal(t.to("cuda:0"), torch.arange({N}, dtype=torch.float32, device="cuda:0"))
            print("ok")
        """)
        assert r.returncode == 0 and r.stdout.strip() == "ok", r.stderr
        pool.free(block)
    finally:
        pool.close()
        gpuipc.Pool.unlink(name)


def test_pool_opened_without_a_device_gives_tensors_on_the_current_gpu(name):
    # Pool.open(device=None) with torch on cuda:1: the chunks are mapped for GPU 1, so the block views (and the tensors
    # open_tensors makes over pool memory) are on cuda:1, also for a chunk first mapped while cuda:0 is current.
    torch = _torch()
    pool = gpuipc.Pool.create(name, kind="device", device=0, chunk_bytes=4 << 20, max_bytes=16 << 20)
    try:
        blocks = [pool.allocate(3 << 20) for _ in range(2)]  # one per chunk
        for i, block in enumerate(blocks):
            assert block.ref.chunk == i
            torch.from_dlpack(block.view()).view(torch.float32).fill_(float(i + 1))
        torch.cuda.synchronize(0)
        refs = [bytes(b.ref) for b in blocks]
        r = _child(f"""
            import torch, gpuipc
            torch.cuda.set_device(1)
            torch.zeros(1, device="cuda")  # GPU 1's context current
            pool = gpuipc.Pool.open({name!r})
            a = torch.from_dlpack(pool.resolve(gpuipc.BlockRef.from_bytes({refs[0]!r})).view()).view(torch.float32)
            assert a.device == torch.device("cuda", 1), a.device
            assert bool((a == 1.0).all())
            torch.cuda.set_device(0)
            torch.zeros(1, device="cuda")  # GPU 0's context current
            b = torch.from_dlpack(pool.resolve(gpuipc.BlockRef.from_bytes({refs[1]!r})).view()).view(torch.float32)
            assert b.device == torch.device("cuda", 1), b.device
            with torch.cuda.device(1):
                assert bool((b == 2.0).all())
                b.fill_(3.0)
                torch.cuda.synchronize(1)
            print("ok")
        """)
        assert r.returncode == 0 and r.stdout.strip() == "ok", r.stderr
        assert bool((torch.from_dlpack(blocks[1].view()).view(torch.float32) == 3.0).all())
        for block in blocks:
            pool.free(block)
    finally:
        pool.close()
        gpuipc.Pool.unlink(name)


def test_processes_with_other_cuda_visible_devices_open_the_same_gpu(name):
    torch = _torch()
    uuids = _uuids()
    with gpuipc.Segment.create(name, N * 4, kind="device", device=1) as seg:
        assert gpuipc.Segment.stat(name).device_uuid == uuids[1]
        t = torch.from_dlpack(seg.as_array("float32", N))
        t.fill_(3.0)
        torch.cuda.synchronize(1)
        check = f"""
            import torch, gpuipc
            assert gpuipc.device_ordinal({uuids[1]!r}) == {{want}}
            with gpuipc.Segment.open({name!r}, readonly=True) as seg:
                assert seg.device == {{want}}, seg.device
                t = torch.from_dlpack(seg.as_array("float32", {N}))
                assert torch.equal(t, torch.full(({N},), 3.0, device=t.device))
            with gpuipc.Segment.open({name!r}, readonly=True, device={uuids[1]!r}) as seg:  # by UUID
                assert seg.device == {{want}}
            print("ok")
        """
        # "1,0": this process's GPU 1 is the child's GPU 0.
        r = _child(check.replace("{want}", "0"), visible=_visible(uuids, 1, 0))
        assert r.returncode == 0 and r.stdout.strip() == "ok", r.stderr
        # "1" alone.
        r = _child(check.replace("{want}", "0"), visible=_visible(uuids, 1))
        assert r.returncode == 0 and r.stdout.strip() == "ok", r.stderr
        # "0" alone: the segment's GPU is hidden; asked by UUID it is NoDevice, saying so.
        r = _child(f"""
            import gpuipc
            assert gpuipc.device_ordinal({uuids[1]!r}) == -1
            try:
                gpuipc.Segment.open({name!r}, readonly=True, device={uuids[1]!r})
            except gpuipc.NoDevice as e:
                print("NoDevice", "CUDA_VISIBLE_DEVICES" in str(e))
        """, visible=_visible(uuids, 0))
        assert r.returncode == 0 and r.stdout.strip() == "NoDevice True", r.stdout + r.stderr
