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
def test_a_mempool_block_knows_when_torch_gave_it_back(name, spawn):
    """share_tensors and the streaming publisher keep a tensor's block between calls and share it again while it
    is not freed: it must turn freed once torch gives its segment back, whose address a later block may take."""
    pytest.importorskip("torch")
    r = spawn(gpu_helpers.torch_block_freed_once_torch_gives_it_back, name)
    assert r == {"kind": "_TorchBlock", "live": True, "live_after_the_tensor": True, "frees_moved": True,
                 "freed": True, "detached": 0}, r


@pytest.mark.skipif(bool(_NO_GPU), reason=f"needs a GPU: {_NO_GPU}")
def test_a_mempool_made_again_under_its_name_is_found_afresh(name, spawn):
    """The handle opened on a MemPool's pool to find its blocks was kept for good: after detach and unlink it held
    the old pool's memory until the process exited, and a new MemPool under the same name was looked up in the old
    pool (InvalidArgument: another pool id)."""
    pytest.importorskip("torch")
    r = spawn(gpu_helpers.torch_mempool_made_again_under_its_name, name)
    assert r["first_is_cached"] and r["detached"] == 0, r
    assert not r["cached_after_detach"], r
    assert r["second_reads"] is True, r


def test_a_mempool_block_is_freed_once_its_address_holds_nothing_or_another_block(monkeypatch):
    """_TorchBlock.recheck says freed when the allocator's table has nothing at the block's address, or another
    block (the address allocated again); freed stays freed; a live block stays live. recheck_torch_blocks leaves
    other blocks alone. The allocator's table is stood in for: torch (and a GPU) fill it for real, in the test
    above."""
    from types import SimpleNamespace

    from gpuipc import pool as gp

    table, looked = {0x1000: (b"ref-1", 0x1000, "p")}, []
    monkeypatch.setattr(gp._gpuipc, "_torch_block_of", lambda a: looked.append(a) or table.get(a))
    b = gp._TorchBlock(SimpleNamespace(size=4096), 0x1000, None, b"ref-1")
    other = SimpleNamespace(freed=False)
    assert not b.freed and looked == []
    gp.recheck_torch_blocks(iter([b, other]))
    assert not b.freed and looked == [0x1000] and not other.freed
    table[0x1000] = (b"ref-2", 0x1000, "p")  # freed, and the address taken by a new block
    assert b.recheck() and b.freed
    table[0x1000] = (b"ref-1", 0x1000, "p")
    assert b.recheck() and len(looked) == 2  # stays freed, with no look-up
    c = gp._TorchBlock(SimpleNamespace(size=4096), 0x1000, None, b"ref-1")
    table[0x1000] = (b"ref-1", 0x800, "p")  # inside a larger block that starts lower
    assert c.recheck()
    d = gp._TorchBlock(SimpleNamespace(size=4096), 0x1000, None, b"ref-1")
    del table[0x1000]
    assert d.recheck()


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


@pytest.mark.skipif(bool(_NO_GPU), reason=f"needs a GPU: {_NO_GPU}")
def test_a_mempool_under_a_publisher_gives_its_memory_back_on_pause_and_updates_after_resume(name, spawn):
    pytest.importorskip("torch")
    r = spawn(gpu_helpers.torch_mempool_pause_under_a_publisher, name, timeout=180)
    assert r["updated"] is True, r
    assert r["freed"] >= r["used"] * 0.9, f"the pause gave back {r['freed']} bytes of {r['used']} used: {r}"
    assert r["updated_after_resume"] is True, r
