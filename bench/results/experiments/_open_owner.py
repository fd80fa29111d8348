"""What the open experiments (open_stages.py, chunk_maps.py) share: torch's CUDA set up in a process, the bench's
2 GiB dict built under gpuipc.torch.MemPool and published as the weights suite publishes it, and each variant run in
a fresh spawned child that reports one JSON line."""
import json
import multiprocessing as mp
import traceback

from _statedict_spec import spec


def init_torch():
    """torch, with CUDA initialised on GPU 0 (what the weights suite's consumers have before they open)."""
    import torch

    torch.cuda.init()
    torch.zeros(1, device="cuda:0")
    torch.cuda.synchronize()
    return torch


def publish_dict(torch, name):
    """(pool, dict, publisher): the 2 GiB dict of 291 bf16 tensors built under gpuipc.torch.MemPool and published
    under ``name`` with publish_tensors(versions=1), as the weights suite's open part does."""
    import gpuipc
    import gpuipc.torch as gt

    pool = gt.MemPool(name + ".weights", device=0)
    with torch.cuda.use_mem_pool(pool):
        sd = {n: torch.ones(sh, dtype=torch.bfloat16, device="cuda:0") for n, sh in spec(32)}
    torch.cuda.synchronize()
    return pool, sd, gpuipc.publish_tensors(name, sd, versions=1)


def report_error(q, variant, e):
    q.put({"variant": variant, "error": repr(e), "trace": traceback.format_exc()})


def run_variants(child, name, variants, repeats):
    """child(variant, name, queue) in a fresh spawned process for each variant, ``repeats`` times over; prints the
    JSON line each puts on its queue, and returns them."""
    ctx = mp.get_context("spawn")
    rows = []
    for _ in range(repeats):
        for variant in variants:
            q = ctx.Queue()
            p = ctx.Process(target=child, args=(variant, name, q))
            p.start()
            rows.append(q.get(timeout=120))
            print(json.dumps(rows[-1]), flush=True)
            p.join(30)
    return rows
