"""The stages of gpuipc.open_tensors for a dict built under gpuipc.torch.MemPool and shared with publish_tensors
(as `gpuipc bench weights` does), in a fresh process and again warm: index, pool joins, storages resolved and
torch tensors made (_Opened.torch_tensors).

    python bench/analysis/experiments/open_stages.py   (needs torch with CUDA, gpuipc importable, GPUIPC_DAEMON set)
"""
import os
import subprocess
import sys
import time

import torch

import gpuipc
from gpuipc import _index
from gpuipc.tensors import _Opened, read_index

NAME = f"open_stages_sd.{os.getppid() if len(sys.argv) > 1 else os.getpid()}"


def stages() -> str:
    t = [time.perf_counter()]
    index, seg, mem = read_index(NAME, 10.0)
    t.append(time.perf_counter())
    opened = _Opened(NAME, index, True, 0)
    t.append(time.perf_counter())
    raw = _index.read_refs_raw(index, mem, 0)
    out = opened.torch_tensors(torch, raw)
    t.append(time.perf_counter())
    for x in out.values():
        x.data_ptr()
    torch.cuda.synchronize()
    t.append(time.perf_counter())
    chunks = {opened.pools[p]._pool.stats()["chunks"] for p in opened.pools}
    opened.close()
    seg.close()
    d = [(b - a) * 1e3 for a, b in zip(t, t[1:])]
    return (f"total {sum(d):.3f} ms: index {d[0]:.3f}, pool open {d[1]:.3f}, storages resolved and torch tensors "
            f"made {d[2]:.3f} (pool chunks {chunks}), touch {d[3]:.3f}; "
            f"{len(index.storages)} storages, {len(index.tensors)} tensors")


def consumer() -> None:
    torch.zeros(1, device="cuda")
    if sys.argv[1] == "profile":
        import cProfile
        import pstats

        pr = cProfile.Profile()
        pr.enable()
        print("fresh, profiled:", stages(), flush=True)
        pr.disable()
        pstats.Stats(pr).sort_stats("cumulative").print_stats(30)
        return
    print("fresh:", stages(), flush=True)
    for _ in range(3):
        print("warm: ", stages(), flush=True)
    t0 = time.perf_counter()
    d = gpuipc.open_tensors(NAME, device=0)
    print(f"open_tensors: {(time.perf_counter() - t0) * 1e3:.3f} ms")


def main() -> None:
    if len(sys.argv) > 1:
        return consumer()
    import gpuipc.torch as gt

    pool = gt.MemPool(NAME + ".weights", device=0)
    with torch.cuda.use_mem_pool(pool):
        sd = {f"l.{i}": torch.full((2048,) if i % 4 == 0 else (1536, 3072), float(i % 7), dtype=torch.bfloat16, device="cuda")
              for i in range(291)}
    torch.cuda.synchronize()
    print("dict bytes", sum(t.numel() * 2 for t in sd.values()), flush=True)
    pub = gpuipc.publish_tensors(NAME, sd, versions=1)
    try:
        for mode in ("consumer", "consumer", "profile"):
            subprocess.run([sys.executable, __file__, mode], check=True)
    finally:
        pub.close()
        del sd
        gpuipc.Pool.unlink(NAME + ".weights")


if __name__ == "__main__":
    main()
