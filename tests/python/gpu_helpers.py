"""Functions the GPU tests run in spawned child processes (importable by name, so spawn can find them)."""

from __future__ import annotations

import os
import time
from typing import List, Tuple

import gpuipc

N = 1024  # segments hold N x N float32


def torch_cuda():
    import torch

    torch.zeros(1, device="cuda")  # a current context before gpuipc maps anything
    return torch


def torch_check_and_double(name: str) -> bool:
    torch = torch_cuda()
    with gpuipc.Segment.open(name) as seg:
        t = torch.from_dlpack(seg.as_array("float32", (N, N)))
        assert t.is_cuda and t.shape == (N, N)
        ok = torch.equal(t, torch.arange(N * N, dtype=torch.float32, device="cuda").reshape(N, N))
        t.mul_(2)
        torch.cuda.synchronize()
        return ok


def cupy_check_and_negate(name: str) -> bool:
    import cupy

    with gpuipc.Segment.open(name) as seg:
        view = seg.as_array("float32", (N, N))
        a = cupy.from_dlpack(view)
        b = cupy.asarray(view)  # through __cuda_array_interface__
        assert a.data.ptr == b.data.ptr == view.address
        ok = bool(cupy.array_equal(a, cupy.arange(N * N, dtype=cupy.float32).reshape(N, N)))
        b *= -1
        cupy.cuda.Device().synchronize()
        return ok


def torch_read_only(name: str) -> Tuple[bool, bool, bool]:
    """(view says read-only, CAI says read-only, contents right) for a read-only open through torch.from_dlpack."""
    torch = torch_cuda()
    with gpuipc.Segment.open(name, readonly=True) as seg:
        view = seg.as_array("float32", (N, N))
        t = torch.from_dlpack(view)
        ok = torch.equal(t, torch.full((N, N), 7.0, device="cuda"))
        return view.readonly, view.__cuda_array_interface__["data"][1], ok


def torch_write_read_only(name: str) -> str:
    """Writes through a read-only mapping: the write faults this process's context (returns the error)."""
    torch = torch_cuda()
    with gpuipc.Segment.open(name, readonly=True) as seg:
        t = torch.from_dlpack(seg.as_array("float32", (N, N)))
        try:
            t.add_(1)
            torch.cuda.synchronize()
            return ""
        except RuntimeError as e:
            return str(e) or "RuntimeError"


def torch_samples(i: int):
    import torch

    dtypes = [torch.float32, torch.float16, torch.bfloat16, torch.int64, torch.uint8]
    shapes = [(17,), (4, 33), (2, 3, 5), (), (0, 7)]
    dt = dtypes[i % len(dtypes)]
    shape = shapes[i % len(shapes)]
    x = torch.full(shape, i % 100, dtype=dt, device="cuda")
    if x.dim() == 2 and i % 2:
        x = x.t()  # strided: send copies it into a contiguous slot
    return x


def torch_producer(name: str, count: int) -> int:
    torch = torch_cuda()
    stream = torch.cuda.Stream()
    with gpuipc.Channel.open(name, "producer", wait=30) as ch:
        with torch.cuda.stream(stream):
            for i in range(count):
                ch.send(torch_samples(i), stream=stream, meta=str(i).encode(), timeout=60)
        stream.synchronize()
    return count


def torch_sums(name: str, count: int) -> list:
    """Receives ``count`` messages and returns each one's sum (through Message.tensor)."""
    torch_cuda()
    sums = []
    with gpuipc.Channel.open(name, "consumer", wait=30) as ch:
        for _ in range(count):
            with ch.recv(timeout=60) as msg:
                sums.append(float(msg.tensor().sum().item()))
    return sums


def cupy_producer(name: str, count: int) -> int:
    import cupy

    stream = cupy.cuda.Stream(non_blocking=True)
    with gpuipc.Channel.open(name, "producer", wait=30) as ch:
        with stream:
            for i in range(count):
                a = cupy.full((8, 16), i, dtype=cupy.float32)[:, ::2]  # strided: cupy copies it
                ch.send(a, stream=stream, timeout=60)
        stream.synchronize()
    return count


def jax_producer(name: str, count: int) -> int:
    os.environ["XLA_PYTHON_CLIENT_PREALLOCATE"] = "false"
    import jax.numpy as jnp

    with gpuipc.Channel.open(name, "producer", wait=30) as ch:
        for i in range(count):
            ch.send(jnp.full((3, 5), i, dtype=jnp.float32), timeout=60)
    return count


def numpy_producer(name: str, count: int) -> int:
    import numpy as np

    with gpuipc.Channel.open(name, "producer", wait=30) as ch:
        for i in range(count):
            ch.send(np.full((6, 6), i, dtype=np.int32), timeout=60)
    return count


def torch_producer_killed(name: str, ready: str) -> None:
    torch = torch_cuda()
    ch = gpuipc.Channel.open(name, "producer", wait=30)
    for i in range(2):
        ch.send(torch.full((64,), float(i), device="cuda"))
    torch.cuda.synchronize()
    keep = gpuipc.Segment.create(ready, 4096)
    time.sleep(600)
    del ch, keep


def torch_semaphore_consumer(seg_name: str, sem_name: str) -> float:
    """Waits on the GPU (stream-ordered) for semaphore value 1, then sums the segment on the same stream."""
    torch = torch_cuda()
    stream = torch.cuda.Stream()
    with gpuipc.Segment.open(seg_name, readonly=True, wait=30) as seg, \
            gpuipc.Semaphore.open(sem_name, role="waiter", wait=30) as sem:
        t = torch.from_dlpack(seg.as_array("float32", (N, N)))
        with torch.cuda.stream(stream):
            sem.wait(1, stream=stream)
            total = t.sum()
        stream.synchronize()
        return float(total.item())


def receive_sums(name: str, count: int) -> List[float]:
    torch = torch_cuda()
    out = []
    with gpuipc.Channel.open(name, "consumer", wait=30) as ch:
        for _ in range(count):
            with ch.recv(timeout=60) as msg:
                out.append(float(torch.from_dlpack(msg.array).double().sum().item()))
    return out


def torch_model_in_gpuipc_pool(name: str) -> dict:
    """Builds a small model under gpuipc.torch.MemPool(name) and reports where its tensors live."""
    import gpuipc.torch as gt

    torch = torch_cuda()
    pool = gt.MemPool(name, device=0, chunk_bytes=64 << 20, max_bytes=1 << 30)
    with torch.cuda.use_mem_pool(pool):
        model = torch.nn.Sequential(torch.nn.Linear(256, 512), torch.nn.ReLU(), torch.nn.Linear(512, 64)).cuda()
    params = list(model.parameters())
    blocks = [gt.block_of(p) for p in params]
    x = torch.randn(8, 256, device="cuda")
    y = model(x)  # outside the pool: activations come from torch's own allocator
    torch.cuda.synchronize()
    held, used, refused = gt.pool_stats(0)
    out = {
        "params": len(params),
        "in_pool": sum(1 for b in blocks if b is not None and b[2] == name),
        "param_bytes": sum(p.numel() * p.element_size() for p in params),
        "activation_in_pool": gt.block_of(y) is not None,
        "held": held,
        "used": used,
        "refused": refused,
    }
    del model, params, blocks, y
    del pool
    torch.cuda.synchronize()
    out["held_after"] = gt.pool_stats(0)[0]
    out["detached"] = gt.detach(0)
    return out


def torch_block_freed_once_torch_gives_it_back(name: str) -> dict:
    """A gpuipc.torch.MemPool tensor's block, as share_tensors finds it: live while torch keeps its segment (also
    after the tensor is gone: torch caches the segment), freed once torch gave the segment back (the MemPool
    deleted), which moves torch_frees."""
    import gpuipc.torch as gt
    from gpuipc.pool import find_block, torch_frees

    torch = torch_cuda()
    pool = gt.MemPool(name, device=0, chunk_bytes=64 << 20, max_bytes=1 << 30)
    with torch.cuda.use_mem_pool(pool):
        a = torch.ones(1 << 20, device="cuda")
    block = find_block(a.data_ptr(), a.numel() * a.element_size())
    frees = torch_frees()
    out = {"kind": type(block).__name__, "live": not block.recheck()}
    del a
    torch.cuda.synchronize()
    out["live_after_the_tensor"] = not block.recheck() and torch_frees() == frees
    del pool
    torch.cuda.synchronize()
    out["frees_moved"] = torch_frees() > frees
    out["freed"] = block.recheck()
    out["detached"] = gt.detach(0)
    return out


def torch_mempool_made_again_under_its_name(name: str) -> dict:
    """A MemPool whose blocks share_tensors found (opening the pool), detached and unlinked, then a new MemPool
    under the same name: the handle found blocks through must be the new pool's, and the old one let go."""
    import gpuipc.pool as gp
    import gpuipc.torch as gt

    torch = torch_cuda()
    pool = gt.MemPool(name, device=0, chunk_bytes=64 << 20, max_bytes=1 << 30)
    with torch.cuda.use_mem_pool(pool):
        a = torch.ones(1 << 20, device="cuda")
    first = gp.find_block(a.data_ptr(), a.numel() * a.element_size())
    out = {"first_is_cached": gp._TORCH_POOLS.get(name) is first.pool}
    del a, first
    del pool
    torch.cuda.synchronize()
    out["detached"] = gt.detach(0)
    gpuipc.Pool.unlink(name)
    out["cached_after_detach"] = name in gp._TORCH_POOLS
    pool = gt.MemPool(name, device=0, chunk_bytes=64 << 20, max_bytes=1 << 30)
    with torch.cuda.use_mem_pool(pool):
        b = torch.full((1 << 20,), 2.0, device="cuda")
    second = gp.find_block(b.data_ptr(), b.numel() * b.element_size())
    try:
        whole = torch.from_dlpack(second.view().__dlpack__())  # the block's bytes, through the handle found
        start = b.data_ptr() - second.address
        got = whole[start : start + b.numel() * b.element_size()].view(torch.float32)
        out["second_reads"] = bool(torch.equal(got, b))
        del whole, got
    except gpuipc.Error as e:
        out["second_reads"] = f"{type(e).__name__}: {e}"
    del b, second
    del pool
    torch.cuda.synchronize()
    gt.detach(0)
    gpuipc.Pool.unlink(name)
    return out


def torch_sum_segment(name: str, n: int) -> float:
    torch = torch_cuda()
    with gpuipc.Segment.open(name, readonly=True) as seg:
        return float(torch.from_dlpack(seg.as_array("float32", n)).sum())


def torch_open_tensors_and_write(name: str) -> dict:
    """open_tensors(name) writable in torch: (shape, stride, storage_offset) per tensor, and whether a write
    through "t" shows in "a"."""
    torch = torch_cuda()
    got = gpuipc.open_tensors(name, readonly=False, wait=10)
    out = {k: (tuple(v.shape), tuple(v.stride()), v.storage_offset()) for k, v in got.items()}
    got["t"][0, 1] = -7  # a[2]
    torch.cuda.synchronize()
    out["shared"] = float(got["a"][2]) == -7.0
    return out


def torch_read_version(name: str):
    torch_cuda()
    with gpuipc.open_tensors(name, versioned=True, wait=10) as r:
        with r.pin() as p:
            return p.version, float(p.tensors["w"][0])


def _mempool_model(torch):
    torch.manual_seed(1234)
    return torch.nn.Sequential(torch.nn.Linear(256, 512), torch.nn.GELU(), torch.nn.Linear(512, 256)).to(
        device="cuda", dtype=torch.bfloat16
    )


def _forward_digest(torch, model) -> str:
    import hashlib

    x = torch.arange(8 * 256, device="cuda", dtype=torch.float32).reshape(8, 256).sin().to(torch.bfloat16)
    with torch.no_grad():
        y = model(x)
    torch.cuda.synchronize()
    return hashlib.sha256(y.float().cpu().numpy().tobytes()).hexdigest()


def torch_mempool_publisher(name: str, ready: str, done: str) -> None:
    """Builds a model under gpuipc.torch.MemPool, shares its state dict with no copy, writes its forward digest
    to `ready`, and lives until `done` exists."""
    import os
    import time

    import gpuipc
    import gpuipc.torch as gt

    torch = torch_cuda()
    pool = gt.MemPool(name + ".weights", device=0, chunk_bytes=64 << 20, max_bytes=1 << 30)
    with torch.cuda.use_mem_pool(pool):
        model = _mempool_model(torch)
    shared = gpuipc.share_tensors(name, model.state_dict())
    copied = shared.pool is not None  # a pool of copies exists only when something had to be packed
    digest = _forward_digest(torch, model)
    with open(ready + ".tmp", "w") as f:
        f.write(f"{digest} {int(copied)}")
    os.rename(ready + ".tmp", ready)
    while not os.path.exists(done):
        time.sleep(0.05)
    shared.close()


def torch_mempool_reader(name: str) -> str:
    """Opens the shared state dict and returns the forward digest of a model built on it, how many tensors took
    the slow path (build_torch: a storage slice and a set_), and how many are not alone at offset 0 on a storage of
    exactly their bytes."""
    import gpuipc
    from gpuipc import tensors as gt

    torch = torch_cuda()
    slow = []
    real = gt.build_torch
    gt.build_torch = lambda torch, records, *a: (slow.extend(t["name"] for t in records), real(torch, records, *a))[1]
    try:
        tensors = gpuipc.open_tensors(name, device=0)
    finally:
        gt.build_torch = real
    odd = [k for k, t in tensors.items()
           if t.storage_offset() != 0 or t.untyped_storage().nbytes() != t.numel() * t.element_size()]
    model = _mempool_model(torch)
    model.load_state_dict(tensors, assign=True)  # assign: the parameters become the shared views, no copy
    return f"{_forward_digest(torch, model)} {len(slow)} {len(odd)}"


# Streaming and stream-ordered versions -------------------------------------------------------------------------------
def sync_within(stream, timeout: float = 60.0) -> None:
    """Waits for `stream` by polling, so that a stream stuck on a semaphore fails the test instead of hanging it."""
    deadline = time.monotonic() + timeout
    while not stream.query():
        if time.monotonic() > deadline:
            raise TimeoutError(f"the stream did not finish within {timeout:g} s")
        time.sleep(0.001)


def torch_stream_state(torch, v: int) -> dict:
    """Version v of the streamed GPU state: "w" (2 MiB of bf16) spans several 1 MiB buckets."""
    return {
        "w": (torch.arange(1 << 20, device="cuda", dtype=torch.float32) + v).to(torch.bfloat16),
        "b": torch.full((3, 5), float(v), device="cuda"),
        "i": torch.arange(1000, device="cuda", dtype=torch.int64) * v,
    }


def torch_stream_reader_switches_streams(name: str) -> list:
    """Joins stream `name` and receives three versions of {"w": 64 Ki float32, all v}: the first on a stream held
    back by a semaphore, the next two on another stream. The hold is let go 0.5 s after the second receive (time
    for a publisher let through to refill version 1's bucket with version 3), so the order does not rest on the GPU
    switching between processes during a long kernel. Returns [(version, min, max)] once both streams ran."""
    torch = torch_cuda()
    slow, fast = torch.cuda.Stream(), torch.cuda.Stream()
    into = [{"w": torch.zeros(1 << 16, device="cuda")} for _ in range(3)]
    # receive's copy kernels (int64 and uint8 views, docs/torch.md), loaded now: under CUDA's lazy loading a kernel's
    # first launch waits until the GPU's queued work ran, so the held stream would hold the first receive's copies
    # on the other stream too, and hide the order this test checks (or, launched from the host, hang it).
    for dtype in (torch.int64, torch.uint8):
        a, b = torch.zeros(1 << 10, dtype=dtype, device="cuda"), torch.ones(1 << 10, dtype=dtype, device="cuda")
        torch._foreach_copy_([a[:512], a[512:]], [b[:512], b[512:]], non_blocking=True)
        a.copy_(b, non_blocking=True)
    torch.cuda.synchronize()
    hold = gpuipc.Semaphore.create(name + ".hold")
    try:
        with hold, gpuipc.stream_reader(name, wait=30) as rd:
            try:
                hold.wait(1, stream=slow)  # version 1's copies and release wait for the host
                got = [rd.receive(into[0], stream=slow, timeout=60)]
                got.append(rd.receive(into[1], stream=fast, timeout=60))
                time.sleep(0.5)
            finally:
                hold.signal_host(1)  # (also on an error: the reader's close waits for the slow stream)
            got.append(rd.receive(into[2], stream=fast, timeout=60))
            torch.cuda.synchronize()
            return [(v, float(t["w"].min()), float(t["w"].max())) for v, t in zip(got, into)]
    finally:
        gpuipc.Semaphore.unlink(name + ".hold")


def torch_stream_reader(name: str, versions: int, how: str = "alternate", hold: float = 0.0,
                        count: bool = False) -> list:
    """Joins stream `name` and receives `versions` versions on a side stream, with receive() ("receive"),
    receive_iter() copying each piece itself ("iter"; `hold`: seconds it sleeps before each copy), or the two in
    turn ("alternate": receive first). Returns [(version, every tensor right)], and with `count` the calls that
    opened or resolved a handle during each receive (helpers.count_handle_calls) as a third item."""
    import helpers

    torch = torch_cuda()
    s = torch.cuda.Stream()
    out = []
    with gpuipc.stream_reader(name, wait=30) as rd:
        into = {k: torch.empty_like(x) for k, x in torch_stream_state(torch, 0).items()}
        torch.cuda.synchronize()
        counts = helpers.count_handle_calls() if count else {}
        for turn in range(versions):
            for k in counts:
                counts[k] = 0
            if how == "receive" or (how == "alternate" and turn % 2 == 0):
                v = rd.receive(into, stream=s, timeout=60)
            else:
                for item in rd.receive_iter(stream=s, timeout=60):
                    time.sleep(hold)
                    with torch.cuda.stream(s):
                        into[item.name].view(-1)[item.start : item.start + item.count].copy_(item.view.reshape(-1))
                    if hold:
                        sync_within(s)
                v = rd.version
            calls = {k: n for k, n in counts.items() if n}
            sync_within(s)
            want = torch_stream_state(torch, v)
            ok = all(torch.equal(into[k], want[k]) for k in want)
            out.append((v, ok, calls) if count else (v, ok))
    return out


def torch_stream_reader_plans(name: str, versions: int) -> list:
    """Joins stream `name` and receives `versions` versions on a side stream, counting the bucket copy plans it makes
    for each (a plan is made where none is kept for the bucket). Returns [(version, every tensor right, plans)]."""
    from gpuipc import _stream_reader

    made = [0]

    class Counted(_stream_reader._Copies):
        def __init__(self, *args) -> None:
            made[0] += 1
            super().__init__(*args)

    _stream_reader._Copies = Counted
    torch = torch_cuda()
    s = torch.cuda.Stream()
    out = []
    with gpuipc.stream_reader(name, wait=30) as rd:
        into = {k: torch.empty_like(x) for k, x in torch_stream_state(torch, 0).items()}
        torch.cuda.synchronize()
        for _ in range(versions):
            made[0] = 0
            v = rd.receive(into, stream=s, timeout=60)
            sync_within(s)
            want = torch_stream_state(torch, v)
            out.append((v, all(torch.equal(into[k], want[k]) for k in want), made[0]))
    return out


def torch_stream_reader_swaps(name: str) -> list:
    """Receives 3 versions into one dict, changing it between them the ways a model does: after version 1 a
    parameter's storage is replaced in place (``.data =``, same object) and another entry becomes a new tensor;
    after version 2 nothing changes (receive may reuse its copy plan). Returns [(version, every tensor right)]."""
    torch = torch_cuda()
    s = torch.cuda.Stream()
    out = []
    with gpuipc.stream_reader(name, wait=30) as rd:
        into = {k: torch.empty_like(x) for k, x in torch_stream_state(torch, 0).items()}
        torch.cuda.synchronize()
        for turn in range(3):
            if turn == 1:
                into["b"].data = torch.empty_like(into["b"])
                into["i"] = torch.empty_like(into["i"])
                torch.cuda.synchronize()
            v = rd.receive(into, stream=s, timeout=60)
            sync_within(s)
            want = torch_stream_state(torch, v)
            out.append((v, all(torch.equal(into[k], want[k]) for k in want)))
    return out


def torch_stream_wait_version(name: str, ready: str) -> tuple:
    """Enqueues wait_version(2) on a side stream and a copy of w after it, creates `ready` (the test then
    publishes version 2) and waits for the stream: (stream was blocked before, version seen at the call, w[0])."""
    torch = torch_cuda()
    s = torch.cuda.Stream()
    with gpuipc.open_tensors(name, versioned=True, wait=30) as r:
        w = r.tensors["w"]  # versions=1: the live memory
        seen = r.wait_version(2, stream=s)  # returns at once
        with torch.cuda.stream(s):
            got = w[:16].clone()
        time.sleep(0.5)
        blocked = not s.query()
        with gpuipc.Segment.create(ready, 4096):
            sync_within(s, 60)
        return blocked, seen, float(got[0].item())


def torch_versions_publisher_forever(name: str, ready: str) -> None:
    """publish_tensors of one GPU tensor (versions=1), creates `ready`, then sleeps until killed."""
    torch = torch_cuda()
    pub = gpuipc.publish_tensors(name, {"w": torch.zeros(1024, device="cuda")}, versions=1)
    torch.cuda.synchronize()
    keep = gpuipc.Segment.create(ready, 4096)
    time.sleep(600)
    del pub, keep


def torch_mempool_pause_resume(name: str) -> dict:
    """A model built under gpuipc.torch.MemPool(name); its pool paused with its contents kept, then resumed: what
    the GPU got back, whether the parameters kept their addresses, and whether the forward pass is bitwise equal."""
    import gpuipc.torch as gt

    torch = torch_cuda()
    pool = gt.MemPool(name, device=0, chunk_bytes=256 << 20, max_bytes=1 << 30)
    with torch.cuda.use_mem_pool(pool):
        model = torch.nn.Sequential(torch.nn.Linear(4096, 4096), torch.nn.ReLU(), torch.nn.Linear(4096, 4096)).cuda()
        big = torch.full((48 << 20,), 3, dtype=torch.int32, device="cuda")  # 192 MiB more
    x = torch.randn(16, 4096, device="cuda")
    before = model(x)
    addresses = [p.data_ptr() for p in model.parameters()] + [big.data_ptr()]
    torch.cuda.synchronize()
    free0 = torch.cuda.mem_get_info()[0]
    pool.pause(keep_contents=True)
    free1 = torch.cuda.mem_get_info()[0]
    paused = pool.paused()
    pool.resume()
    after = model(x)
    torch.cuda.synchronize()
    out = {
        "freed": free1 - free0,
        "used": gt.pool_stats(0)[1],
        "paused": paused,
        "resumed": not pool.paused(),
        "same_addresses": addresses == [p.data_ptr() for p in model.parameters()] + [big.data_ptr()],
        "bitwise_equal": bool(torch.equal(before, after)),
        "big_intact": bool((big == 3).all()),
    }
    del model, big, before, after, x
    del pool
    torch.cuda.synchronize()
    gt.detach(0)
    return out


def torch_mempool_pause_under_a_publisher(name: str) -> dict:
    """A model built under gpuipc.torch.MemPool(NAME.weights), published by reference (publish_tensors, versions=1)
    and updated in place with update_from (which writes through the blocks' views); then its pool paused with the
    contents kept, and resumed, and updated again. The views came from a second handle of the pool, whose mapping of
    the chunks a pause of the MemPool did not release, and after the resume update_from raised InvalidState."""
    import gpuipc
    import gpuipc.torch as gt

    torch = torch_cuda()
    pool = gt.MemPool(name + ".weights", device=0, chunk_bytes=256 << 20, max_bytes=1 << 30)
    with torch.cuda.use_mem_pool(pool):
        model = torch.nn.Sequential(torch.nn.Linear(4096, 4096), torch.nn.Linear(4096, 4096)).cuda()
    out: dict = {}
    pub = gpuipc.publish_tensors(name, model.state_dict())
    try:
        new = {k: torch.full_like(v, 2) for k, v in model.state_dict().items()}
        pub.update_from(new)
        torch.cuda.synchronize()
        out["updated"] = all(bool((v == 2).all()) for v in model.state_dict().values())
        free0 = torch.cuda.mem_get_info()[0]
        pool.pause(keep_contents=True)
        out["freed"] = torch.cuda.mem_get_info()[0] - free0
        out["used"] = gt.pool_stats(0)[1]
        pool.resume()
        try:
            pub.update_from({k: torch.full_like(v, 3) for k, v in new.items()})
            torch.cuda.synchronize()
            out["updated_after_resume"] = all(bool((v == 3).all()) for v in model.state_dict().values())
        except gpuipc.Error as e:
            out["updated_after_resume"] = f"{type(e).__name__}: {e}"
    finally:
        pub.close()
        del model, new
        del pool
        torch.cuda.synchronize()
        gt.detach(0)
        gpuipc.Pool.unlink(name + ".weights")
    return out


# Bucketed streaming by reference (a publisher's gpuipc.torch.MemPool tensors) -----------------------------------------
def mempool_stream_state(torch, name: str, v: int) -> tuple:
    """torch_stream_state(v) built under the gpuipc.torch.MemPool NAME.weights (64 MiB chunks, 1 GiB at most), its
    writes finished: (pool, state)."""
    import gpuipc.torch as gt

    pool = gt.MemPool(name + ".weights", device=0, chunk_bytes=64 << 20, max_bytes=1 << 30)
    with torch.cuda.use_mem_pool(pool):
        state = torch_stream_state(torch, v)
    torch.cuda.synchronize()
    return pool, state


def torch_mempool_stream_publisher(name: str, versions: int, readers: int, mixed: bool, buckets: int = 2) -> list:
    """Builds torch_stream_state(1) under gpuipc.torch.MemPool (with `mixed`, "b" outside it: staged) and publishes
    `versions` versions, two buckets each, through a ring of `buckets` 1 MiB buckets on a side stream s
    (by_reference True, or "auto" with `mixed`), writing the next version's
    values into the same tensors on s right after each publish(): finish() made s wait for the readers' copies.
    Returns, per version, each tensor's piece ("reference" or "staged") in the buckets the version sent (reference
    pieces go out in buckets of bucket_bytes as the publisher walks the dict, so every bucket is looked at)."""
    torch = torch_cuda()
    import gpuipc.torch as gt

    pool, state = mempool_stream_state(torch, name, 1)
    if mixed:
        state["b"] = torch_stream_state(torch, 1)["b"].clone()  # torch's own allocator: staged
        torch.cuda.synchronize()
    s = torch.cuda.Stream()
    out = []
    with gpuipc.stream_publisher(name, 1 << 20, buckets, device=0, by_reference="auto" if mixed else True) as pub:
        pub.wait_readers(readers, timeout=60)
        sent: list = []
        flush = pub._flush

        def recording_flush(flags: int) -> None:
            sent.extend(pub._bucket.pieces)  # the bucket about to go out
            flush(flags)

        pub._flush = recording_flush
        for v in range(1, versions + 1):
            assert pub.publish(state, stream=s) == v
            out.append({p[0]: "reference" if len(p) == 7 else "staged" for p in sent})
            sent.clear()
            with torch.cuda.stream(s):  # made and written on s: after finish()'s wait for the readers
                nxt = torch_stream_state(torch, v + 1)
                for k in state:
                    state[k].copy_(nxt[k])
        assert pub.wait_consumed(timeout=60) == versions
        sync_within(s)
    del state, pool
    torch.cuda.synchronize()
    gt.detach(0)
    return out


def torch_mempool_stream_publisher_replays(name: str) -> list:
    """Publishes eight versions of torch_stream_state, built under gpuipc.torch.MemPool, by reference on a side stream
    (two buckets a version: ["w"], ["b", "i"]), writing version v's values in place on that stream after publish()
    of v - 1; before version 4 it replaces the storage of "w", before version 7 that of "i" (t.data = a new MemPool
    tensor holding the version's values). Returns (version, tensors sent again without a walk) for each version in
    which the publisher tried to send the last one's buckets again (StreamPublisher._send_again)."""
    torch = torch_cuda()
    import gpuipc.torch as gt

    pool, state = mempool_stream_state(torch, name, 1)
    s = torch.cuda.Stream()
    replayed = []
    replace = {4: "w", 7: "i"}
    with gpuipc.stream_publisher(name, 1 << 20, 2, device=0, by_reference=True) as pub:
        pub.wait_readers(1, timeout=60)
        again = pub._send_again

        def counted(rp, items) -> int:
            n = again(rp, items)
            replayed.append((pub._current, n))
            return n

        pub._send_again = counted
        for v in range(1, 9):
            if v > 1:
                nxt = torch_stream_state(torch, v)
                torch.cuda.synchronize()
                if v in replace:
                    with torch.cuda.use_mem_pool(pool):
                        fresh = nxt[replace[v]].clone()
                    torch.cuda.synchronize()
                    state[replace[v]].data = fresh
                with torch.cuda.stream(s):  # after finish()'s wait for the readers
                    for k in state:
                        if replace.get(v) != k:
                            state[k].copy_(nxt[k])
            assert pub.publish(state, stream=s) == v
        pub.wait_consumed(timeout=60)
        sync_within(s)
    del state, pool
    torch.cuda.synchronize()
    gt.detach(0)
    return replayed


def torch_mempool_stream_publisher_writes_late(name: str, versions: int) -> int:
    """Publishes `versions` versions of torch_stream_state, built under gpuipc.torch.MemPool, by reference on a side
    stream s, writing version v's values on s after start() and behind a ~10 ms sleep kernel, then update() and
    finish(): every bucket must be signalled after those writes ran. Returns the last version."""
    torch = torch_cuda()
    import gpuipc.torch as gt

    pool, state = mempool_stream_state(torch, name, 0)
    s = torch.cuda.Stream()
    with gpuipc.stream_publisher(name, 1 << 20, 2, device=0, by_reference=True) as pub:
        pub.wait_readers(1, timeout=60)
        for v in range(1, versions + 1):
            nxt = torch_stream_state(torch, v)
            torch.cuda.synchronize()
            pub.start(stream=s)
            with torch.cuda.stream(s):
                torch.cuda._sleep(20_000_000)
                for k in state:
                    state[k].copy_(nxt[k])
            pub.update(state)
            last = pub.finish()
        pub.wait_consumed(timeout=60)
        sync_within(s)
    del state, pool
    torch.cuda.synchronize()
    gt.detach(0)
    return last


def torch_mempool_stream_publish_held(name: str, published: str) -> dict:
    """Publishes torch_stream_state(1), built under gpuipc.torch.MemPool, by reference on a side stream to one
    reader, creates `published`, and waits (60 s at most) for that stream. Returns whether the stream was still
    blocked 0.5 s after publish() returned, and whether it finished."""
    torch = torch_cuda()
    import gpuipc.torch as gt

    pool, state = mempool_stream_state(torch, name, 1)
    s = torch.cuda.Stream()
    with gpuipc.stream_publisher(name, 1 << 20, 2, device=0, by_reference=True) as pub:
        pub.wait_readers(1, timeout=60)
        pub.publish(state, stream=s)
        time.sleep(0.5)
        blocked = not s.query()
        with gpuipc.Segment.create(published, 4096):
            sync_within(s, 60)  # released when the reader is killed (the broker poisons its slot)
        out = {"blocked": blocked, "finished": s.query(), "readers": pub.readers}
    del state, pool
    torch.cuda.synchronize()
    gt.detach(0)
    return out
