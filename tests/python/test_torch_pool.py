"""gpuipc.torch.MemPool: PyTorch allocations made under it live in a gpuipc device pool (issue: PyTorch models
born shareable). The package never imports torch; without torch the module says what is missing."""
from __future__ import annotations

import importlib.util
import subprocess
import sys

import pytest

import gpu_helpers
from test_gpu import _NO_GPU


def test_neither_gpuipc_nor_gpuipc_torch_imports_torch():
    code = "import sys, gpuipc, gpuipc.torch; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True)
    assert out.stdout.strip() == "False"


@pytest.mark.skipif(importlib.util.find_spec("torch") is not None, reason="torch is installed here")
def test_without_torch_mempool_says_what_is_missing(name):
    import gpuipc.torch

    with pytest.raises(ImportError, match="needs PyTorch"):
        gpuipc.torch.MemPool(name)


@pytest.mark.skipif(bool(_NO_GPU), reason=f"needs a GPU: {_NO_GPU}")
def test_a_model_built_under_the_mempool_lives_in_the_gpuipc_pool(name, spawn):
    pytest.importorskip("torch")
    r = spawn(gpu_helpers.torch_model_in_gpuipc_pool, name)
    assert r["params"] == 4
    assert r["in_pool"] == r["params"], r
    assert not r["activation_in_pool"], "allocations outside use_mem_pool must not come from the gpuipc pool"
    assert r["used"] >= r["param_bytes"], r
    assert r["refused"] == 0, r
    assert r["held_after"] == 0, "deleting the MemPool must give every block back"
    assert r["detached"] == 0


@pytest.mark.skipif(bool(_NO_GPU), reason=f"needs a GPU: {_NO_GPU}")
def test_a_model_born_in_the_mempool_is_opened_by_two_processes_with_bitwise_equal_forwards(name, spawn, tmp_path):
    pytest.importorskip("torch")
    import multiprocessing
    import time

    ready, done = str(tmp_path / "ready"), str(tmp_path / "done")
    ctx = multiprocessing.get_context("spawn")
    publisher = ctx.Process(target=gpu_helpers.torch_mempool_publisher, args=(name, ready, done))
    publisher.start()
    try:
        deadline = time.monotonic() + 120
        while not (tmp_path / "ready").exists():
            assert publisher.is_alive(), "the publisher died"
            assert time.monotonic() < deadline, "the publisher did not get ready"
            time.sleep(0.05)
        digest, copied = (tmp_path / "ready").read_text().split()
        assert copied == "0", "parameters born in the MemPool must be shared by reference, with no copy"
        for _ in range(2):
            got, slow, odd = spawn(gpu_helpers.torch_mempool_reader, name, timeout=120).split()
            assert got == digest
            # The four parameters share one block of the pool (torch's allocator puts small tensors in one 2 MiB
            # segment), each its own storage: each opens as one typed import over exactly its bytes.
            assert (slow, odd) == ("0", "0")
    finally:
        (tmp_path / "done").write_text("")
        publisher.join(60)
        if publisher.is_alive():
            publisher.kill()
    assert publisher.exitcode == 0


@pytest.mark.skipif(bool(_NO_GPU), reason=f"needs a GPU: {_NO_GPU}")
def test_a_paused_mempool_gives_its_memory_back_and_resumes_with_the_same_tensors(name, spawn):
    pytest.importorskip("torch")
    r = spawn(gpu_helpers.torch_mempool_pause_resume, name, timeout=180)
    assert r["paused"] and r["resumed"], r
    assert r["freed"] >= r["used"] * 0.9, f"the pause gave back {r['freed']} bytes of {r['used']} used: {r}"
    assert r["same_addresses"] and r["bitwise_equal"] and r["big_intact"], r
