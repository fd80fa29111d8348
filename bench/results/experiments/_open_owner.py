"""What the open experiments (open_stages.py, chunk_maps.py) share: torch's CUDA set up in a process, the bench's
2 GiB dict built under gpuipc.torch.MemPool and published as the weights suite publishes it, and each variant run in
a fresh spawned child that reports one JSON line."""
import json
import multiprocessing as mp
import os
import sys
import traceback

from _statedict_spec import spec


def init_torch():
    """torch, with CUDA initialised on GPU 0 (what the weights suite's consumers have before they open)."""
    import torch

    torch.cuda.init()
    torch.zeros(1, device="cuda:0")
    torch.cuda.synchronize()
    return torch


def publish_dict(torch, name, layers=32):
    """(pool, dict, publisher): the 2 GiB dict of 291 bf16 tensors (``layers`` 340: the 16 GiB one of 3063) built
    under gpuipc.torch.MemPool and published under ``name`` with publish_tensors(versions=1), as the weights suite's
    open part does."""
    import gpuipc
    import gpuipc.torch as gt

    pool = gt.MemPool(name + ".weights", device=0)
    with torch.cuda.use_mem_pool(pool):
        sd = {n: torch.ones(sh, dtype=torch.bfloat16, device="cuda:0") for n, sh in spec(layers)}
    torch.cuda.synchronize()
    return pool, sd, gpuipc.publish_tensors(name, sd, versions=1)


def timed_open(torch, name, variant):
    """One open as the weights suite's consumers time it, after one broker call (a stat of the index) so that the
    broker's wake-up from idle is not part of it: open_tensors, then every tensor's data_ptr() and a stream
    synchronize. Returns the row a child reports."""
    import time

    import gpuipc

    gpuipc.Segment.stat(name)
    t0 = time.perf_counter()
    tensors = gpuipc.open_tensors(name, device=0)
    t1 = time.perf_counter()
    for t in tensors.values():
        t.data_ptr()
    torch.cuda.current_stream().synchronize()
    t2 = time.perf_counter()
    return {"variant": variant, "tensors": len(tensors), "open_ms": round((t2 - t0) * 1e3, 3),
            "call_ms": round((t1 - t0) * 1e3, 3), "touch_ms": round((t2 - t1) * 1e3, 3)}


def patched_open_child(variant, name, q, patched, patch):
    """A child of the open A/B scripts: torch set up, then ``patch(_gpuipc)`` when ``variant == patched`` (the
    variant without the change measured), then one timed_open; its row, or the error, goes on ``q``."""
    try:
        torch = init_torch()
        from gpuipc import _gpuipc

        if variant == patched:
            patch(_gpuipc)
        q.put(timed_open(torch, name, variant))
    except BaseException as e:  # noqa: BLE001
        report_error(q, variant, e)


def print_medians(rows, variants):
    """One JSON line per variant: the medians of its children's timed_open rows, and the range of open_ms."""
    import statistics

    for v in variants:
        got = [r for r in rows if r.get("variant") == v and "open_ms" in r]
        if got:
            print(json.dumps({"variant": v, "children": len(got),
                              **{f"median_{k}": round(statistics.median(r[k] for r in got), 3)
                                 for k in ("open_ms", "call_ms", "touch_ms")},
                              "open_ms_range": [min(r["open_ms"] for r in got), max(r["open_ms"] for r in got)]}))


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


def serve(child, variants, prefix, default_repeats):
    """An experiment's main: publishes the dict under ``prefix`` + this pid, prints a header line, runs ``child``
    for each variant (``sys.argv[1]`` times, else ``default_repeats``), and returns the rows. ``sys.argv[2]``: the
    dict's layers (32, the 2 GiB dict, by default; 340 the 16 GiB one)."""
    repeats = int(sys.argv[1]) if len(sys.argv) > 1 else default_repeats
    layers = int(sys.argv[2]) if len(sys.argv) > 2 else 32
    torch = init_torch()
    name = f"{prefix}{os.getpid()}"
    pool, sd, pub = publish_dict(torch, name, layers)
    import gpuipc

    chunks = gpuipc.Pool.stat(name + ".weights")["chunks"]
    print(json.dumps({"tensors": len(sd), "bytes": sum(t.nbytes for t in sd.values()), "chunks": chunks,
                      "device": torch.cuda.get_device_name(0), "torch": torch.__version__}), flush=True)
    try:
        return run_variants(child, name, variants, repeats)
    finally:
        pub.close()
        del pool



def open_steps(name, torch, map_chunks=False):
    """open_tensors' path (tensors.py) with a clock between its steps; returns (times in us, tensors). With
    ``map_chunks``, the chunks are mapped one by one (one resolve each, timed in "maps") before tensors_of_index,
    which then makes holds and capsules only; that step also decodes the refs into Python objects, which
    open_tensors does not (it lands in "refs_read")."""
    import time

    from gpuipc import _index
    from gpuipc.tensors import _Opened, read_index

    c = [time.perf_counter()]
    index, seg, mem = read_index(name, None)
    c.append(time.perf_counter())
    opened = _Opened(name, index, True, 0)
    c.append(time.perf_counter())
    v = _index.read_stamp(index, mem, 0)
    raw = _index.read_refs_raw(index, mem, 0)
    maps = {}
    if map_chunks:
        first = {}
        for r in _index.read_refs(index, mem, 0):
            first.setdefault(r.chunk, r)
        c.append(time.perf_counter())
        pool = next(iter(opened.pools.values()))._pool
        for ch in sorted(first):
            r = first[ch]
            t = time.perf_counter()
            pool.resolve((r.pool, r.generation, r.offset, r.size, r.chunk, r.index))
            maps[ch] = round((time.perf_counter() - t) * 1e6, 1)
    c.append(time.perf_counter())
    caps = []
    for p, lo, hi in opened._run_bounds():
        caps.extend(p.tensors_of_index(raw[lo * 40 : hi * 40], lo, index.flat_bytes, index.storage_bytes,
                                       opened._dtype_layouts(), True, True))
    c.append(time.perf_counter())
    from_dlpack = getattr(torch._C, "_from_dlpack", None) or torch.utils.dlpack.from_dlpack
    made = [None] * index.tensor_count
    for i, cap in caps:
        made[i] = from_dlpack(cap)
    out = dict(zip(index.names, made))
    c.append(time.perf_counter())
    assert _index.read_stamp(index, mem, 0) == v and len(caps) == index.tensor_count
    opened.close()
    seg.close()
    c.append(time.perf_counter())
    for t in out.values():
        t.data_ptr()
    torch.cuda.current_stream().synchronize()
    c.append(time.perf_counter())
    parts = ("index_open", "pool_join", "refs_read") + (("chunk_maps",) if map_chunks else ()) + \
        ("tensors_of_index", "from_dlpack", "close", "touch")
    us = {p: round((c[k + 1] - c[k]) * 1e6, 1) for k, p in enumerate(parts)}
    us["total"] = round((c[-1] - c[0]) * 1e6, 1)
    if map_chunks:
        us["maps"] = maps
    return us, out
