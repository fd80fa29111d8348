"""GPU tests of pools, share() and share_tensors/open_tensors with device memory (torch, CuPy). Skipped (with the
reason) where there is no GPU or no such framework."""

from __future__ import annotations

import numpy as np
import pytest

import gpuipc
import gpu_helpers
from test_gpu import _NO_GPU

pytestmark = pytest.mark.skipif(bool(_NO_GPU), reason=f"needs a GPU: {_NO_GPU}")


def _torch():
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("torch without CUDA")
    return torch


def test_device_pool_block_views(name):
    torch = _torch()
    with gpuipc.Pool.create(name, kind="device", chunk_bytes=2 << 20, max_bytes=4 << 20) as pool:
        with pool.allocate(4096) as blk:
            assert blk.is_cuda and blk.__dlpack_device__()[0] == 2
            t = torch.from_dlpack(blk.as_array("float32", 1024))
            t.fill_(3)
            torch.cuda.synchronize()
            assert blk.__cuda_array_interface__["data"][0] == blk.address
            with pytest.raises(gpuipc.InvalidArgument, match="NumPy"):
                blk.numpy("float32")


def test_share_a_torch_tensor(name, spawn):
    torch = _torch()
    t = torch.arange(1024, dtype=torch.float32, device="cuda")
    torch.cuda.synchronize()
    with gpuipc.share(name, t) as seg:
        assert seg.size >= t.numel() * 4
        assert spawn(gpu_helpers.torch_sum_segment, name, 1024) == float(t.sum())
    # The GPU named by its UUID, as Segment.create and open take it.
    uuid = "GPU-" + str(torch.cuda.get_device_properties(0).uuid)
    with gpuipc.share(name + "u", t, device=uuid) as seg:
        assert seg.device == 0 and gpuipc.Segment.stat(name + "u").device_uuid == uuid


def test_share_tensors_torch_layout(name, spawn):
    torch = _torch()
    a = torch.arange(64, dtype=torch.float32, device="cuda")
    state = {"a": a, "t": a[::2].reshape(4, 8), "h": torch.ones(3, dtype=torch.bfloat16, device="cuda")}
    torch.cuda.synchronize()
    with gpuipc.share_tensors(name, state):
        got = spawn(gpu_helpers.torch_open_tensors_and_write, name)
    assert got == {"a": ((64,), (1,), 0), "t": ((4, 8), (16, 2), 0), "h": ((3,), (1,), 0), "shared": True}


def test_versions_on_device(name, spawn):
    torch = _torch()
    with gpuipc.publish_tensors(name, {"w": torch.zeros(1 << 16, device="cuda")}, versions=2) as pub:
        pub.update_from({"w": torch.full((1 << 16,), 2.0, device="cuda")}, stream=torch.cuda.current_stream())
        assert spawn(gpu_helpers.torch_read_version, name) == (2, 2.0)


def test_versions_back_buffer_copies_after_the_update_stream(name):
    """versions=2: pub.tensors after update(stream=s) starts as a copy of the version just published, made after s.
    Before, the copy followed only the legacy default stream, which a torch stream (non-blocking) does not hold
    back, so the new back buffer could hold the version before."""
    torch = _torch()
    with gpuipc.publish_tensors(name, {"w": torch.zeros(1 << 16, device="cuda")}, versions=2) as pub:
        s = torch.cuda.Stream()
        w = pub.tensors["w"]  # the back buffer (a copy of version 1)
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            torch.cuda._sleep(200_000_000)  # about 0.1 s: the fill lands long after update() returned
            w.fill_(5.0)
        assert pub.update(stream=s) == 2
        nxt = pub.tensors["w"]  # a new back buffer, a copy of version 2
        torch.cuda.synchronize()
        assert float(nxt.min()) == 5.0 and float(nxt.max()) == 5.0


def test_update_from_follows_torchs_current_stream(name, spawn):
    """update_from(stream=None) copies after torch's current stream, where the values are being written."""
    torch = _torch()
    with gpuipc.publish_tensors(name, {"w": torch.zeros(1 << 16, device="cuda")}, versions=2) as pub:
        s = torch.cuda.Stream()
        src = torch.zeros(1 << 16, device="cuda")
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            torch.cuda._sleep(200_000_000)  # about 0.1 s
            src.fill_(4.0)
            assert pub.update_from({"w": src}) == 2
        assert spawn(gpu_helpers.torch_read_version, name) == (2, 4.0)
