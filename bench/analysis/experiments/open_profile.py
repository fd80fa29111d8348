"""Where the time of gpuipc.open_tensors goes, finer than open_stages.py: for a 291-tensor, 2 GiB bf16 dict built under
gpuipc.torch.MemPool and published with publish_tensors(versions=1), in fresh consumer processes (torch and CUDA
initialised before the clock, as `gpuipc bench weights` does), each stage timed alone, then the same in a warm
process, then micro-measures of the per-tensor calls (DLPack imports, holds) so that a change can be judged by parts.

    python bench/analysis/experiments/open_profile.py   (needs torch with CUDA, gpuipc importable, GPUIPC_DAEMON set)

Prints one line per stage set; medians over the runs last.
"""
import json
import os
import statistics
import subprocess
import sys
import time

import torch

import gpuipc
from gpuipc import _index
from gpuipc.segment import Segment
from gpuipc.tensors import _Opened

NAME = f"open_profile_sd.{os.getppid() if len(sys.argv) > 1 else os.getpid()}"
N = 291


def clock():
    return time.perf_counter() * 1e6


def stages():
    """One open, split: broker + map of the index, JSON decode, pool joins, refs read, tensors_of_index (holds,
    resolves, capsules), DLPack imports, dict, touch. Microseconds."""
    t = {}
    a = clock()
    seg = Segment.open(NAME, readonly=True)
    b = clock()
    t["index_open"] = b - a
    mem = seg.as_array("uint8")
    c = clock()
    t["index_map_as_array"] = c - b
    index = _index.decode(NAME, mem)
    d = clock()
    t["index_decode"] = d - c
    opened = _Opened(NAME, index, True, 0)
    e = clock()
    t["pool_join"] = e - d
    raw = _index.read_refs_raw(index, mem, 0)
    stamp = _index.read_stamp(index, mem, 0)
    f = clock()
    t["refs_read"] = f - e
    g = clock()
    out = opened.torch_tensors(torch, raw)
    j = clock()
    t["torch_tensors"] = j - g
    for x in out.values():
        x.data_ptr()
    torch.cuda.current_stream().synchronize()
    k = clock()
    t["touch"] = k - j
    assert _index.read_stamp(index, mem, 0) == stamp
    t["total"] = k - a
    del out
    opened.close()
    seg.close()
    return t


def whole():
    a = clock()
    d = gpuipc.open_tensors(NAME, device=0)
    for x in d.values():
        x.data_ptr()
    torch.cuda.current_stream().synchronize()
    return clock() - a


def micro():
    """Per-call costs with the pool joined: tensors_of_index with and without holds, views_of, one import per chunk,
    from_dlpack alone, torch.empty+set_, UntypedStorage slices, as_strided."""
    seg = Segment.open(NAME, readonly=True)
    mem = seg.as_array("uint8")
    index = _index.decode(NAME, mem)
    opened = _Opened(NAME, index, True, 0)
    raw = _index.read_refs_raw(index, mem, 0)
    pool = next(iter(opened.pools.values()))._pool
    dts = opened._dtype_layouts()
    fast = pool.tensors_of_index(raw, 0, index.flat_bytes, index.storage_bytes, dts, True, False)
    r = {"fast_tensors": [len(fast)], "storages": [index.storage_count]}
    del fast
    for _ in range(3):
        a = clock()
        caps = pool.tensors_of_index(raw, 0, index.flat_bytes, index.storage_bytes, dts, True, True)
        b = clock()
        del caps
        c = clock()
        caps = pool.tensors_of_index(raw, 0, index.flat_bytes, index.storage_bytes, dts, True, False)
        d = clock()
        made = [torch._C._from_dlpack(x) for _, x in caps]
        e = clock()
        del made
        f = clock()
        capsules, span, offset = pool.spans_of(raw, True, True, True)
        g = clock()
        chunks = [torch._C._from_dlpack(x) for x in capsules]
        whole = [x.untyped_storage() for x in chunks]
        h = clock()
        ns = len(index.storages)
        sl = [whole[span[s]][offset[s] + index.storages[s]["offset"] : offset[s] + index.storages[s]["offset"] + index.storages[s]["nbytes"]] for s in range(ns)]
        i = clock()
        ts = [torch.empty(0, dtype=torch.bfloat16, device="cuda:0").set_(sl[tt["storage"]], tt["offset"], tt["shape"], tt["strides"]) for tt in index.tensors]
        j = clock()
        byte = chunks[0].view(torch.bfloat16) if chunks[0].numel() % 2 == 0 else None
        k = clock()
        on0 = [tt for tt in index.tensors if span[tt["storage"]] == 0]
        if byte is not None:
            asd = [byte.as_strided(tt["shape"], tt["strides"], (offset[tt["storage"]] + index.storages[tt["storage"]]["offset"]) // 2 + tt["offset"]) for tt in on0]
        l_ = clock()
        nas = len(on0)
        del ts, sl, whole, chunks, capsules
        m = clock()
        js = json.dumps(index.body)
        n = clock()
        json.loads(js)
        o = clock()
        for key, v in (("tensors_of_index_hold", b - a), ("release", c - b), ("tensors_of_index_nohold", d - c),
                       ("from_dlpack", e - d), ("spans_of", g - f), ("chunk_import", h - g),
                       ("storage_slices", i - h), ("empty_set_all", j - i),
                       (f"as_strided_{nas}", l_ - k), ("release_spans", m - l_), ("json_loads", o - n),
                       ("json_bytes", len(js))):
            r.setdefault(key, []).append(v)
    opened.close()
    seg.close()
    return {k: statistics.median(v) for k, v in r.items()}


def consumer(runs):
    torch.cuda.set_device(0)
    x = torch.zeros(64, device="cuda:0")
    torch._C._from_dlpack(x.__dlpack__())
    torch.cuda.synchronize()
    fresh = stages()
    warm = [stages() for _ in range(runs)]
    whole_fresh_proc_second = whole()
    print(json.dumps({"fresh": fresh, "warm": {k: statistics.median(w[k] for w in warm) for k in warm[0]},
                      "open_tensors_warm_us": whole_fresh_proc_second, "micro": micro()}), flush=True)


def parts():
    """The first calls of a fresh process one by one: the broker connection (a stat), a second round trip, the
    index's open (a host segment), the pool's control segment opened unregistered (Pool.stat) and registered
    (Segment.open: host_pinned memory is registered with CUDA), Pool.open (the join, over the cached mapping), the
    first tensors_of_index (maps the chunks) and a second one. Microseconds."""
    torch.cuda.set_device(0)
    x = torch.zeros(64, device="cuda:0")
    torch._C._from_dlpack(x.__dlpack__())
    torch.cuda.synchronize()
    pool_name = NAME + ".weights"
    t = {}
    a = clock()
    Segment.stat(NAME)
    b = clock()
    t["first_stat_connect"] = b - a
    Segment.stat(NAME)
    c = clock()
    t["second_stat"] = c - b
    seg = Segment.open(NAME, readonly=True)
    d = clock()
    t["index_open"] = d - c
    gpuipc.Pool.stat(pool_name)
    e = clock()
    t["pool_stat_unregistered"] = e - d
    ctrl = Segment.open(pool_name)
    f = clock()
    t["pool_control_open_registered"] = f - e
    pool = gpuipc.Pool.open(pool_name, readonly=True, device=0)
    g = clock()
    t["pool_open_after"] = g - f
    mem = seg.as_array("uint8")
    index = _index.decode(NAME, mem)
    raw = _index.read_refs_raw(index, mem, 0)
    dts = [_dl(d) for d in index.dtypes]
    h = clock()
    caps = pool._pool.tensors_of_index(raw, 0, index.flat_bytes, index.storage_bytes, dts, True, True)
    i = clock()
    t["tensors_of_index_first_maps_chunks"] = i - h
    caps2 = pool._pool.tensors_of_index(raw, 0, index.flat_bytes, index.storage_bytes, dts, True, True)
    j = clock()
    t["tensors_of_index_second"] = j - i
    del caps, caps2
    pool.close()
    ctrl.close()
    seg.close()
    print(json.dumps({"parts": t}), flush=True)


def _dl(name):
    from gpuipc._dtypes import dlpack_of_name

    return dlpack_of_name(name)


def fresh_whole():
    torch.cuda.set_device(0)
    x = torch.zeros(64, device="cuda:0")
    torch._C._from_dlpack(x.__dlpack__())
    torch.cuda.synchronize()
    print(json.dumps({"open_tensors_fresh_us": whole()}), flush=True)


def main():
    if len(sys.argv) > 1:
        return {"consumer": lambda: consumer(5), "parts": parts}.get(sys.argv[1], fresh_whole)()
    import gpuipc.torch as gt

    pool = gt.MemPool(NAME + ".weights", device=0)
    with torch.cuda.use_mem_pool(pool):
        sd = {f"l.{i}": torch.full((2048,) if i % 4 == 0 else (1536, 3072), float(i % 7), dtype=torch.bfloat16, device="cuda")
              for i in range(N)}
    torch.cuda.synchronize()
    print("dict bytes", sum(t.numel() * 2 for t in sd.values()), flush=True)
    pub = gpuipc.publish_tensors(NAME, sd, versions=1)
    try:
        for mode in ("whole", "whole", "whole", "parts", "parts", "consumer", "consumer"):
            subprocess.run([sys.executable, __file__, mode], check=True)
    finally:
        pub.close()
        del sd


if __name__ == "__main__":
    main()
