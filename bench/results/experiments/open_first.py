"""Where the first open_tensors of a process goes, against the same open again (issue 13: open <= 1 ms).

open_stages.py timed open_tensors' steps only after a first open in the same process: the first open_tensors took
2.2-2.5 ms, the one after 1.1-1.4 ms. Here fresh spawned children (torch and CUDA initialised, gpuipc imported,
the broker woken by one Stat so that its wake-up is in neither) take the steps on their very first open, then again:
  steps     index open, pool join, refs read, one resolve per chunk (each maps its chunk: broker call, import, map,
            access), tensors_of_index (holds and capsules; the chunks mapped), from_dlpack, close, touch;
  profile   the first open_tensors under cProfile (the 25 functions with the most time of their own), then the
            second without.
The owner publishes the bench's 2 GiB dict as open_stages.py does. Prints one JSON line per child.
Usage: python open_first.py [repeats]
"""
import cProfile
import io
import json
import os
import pstats
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _open_owner import init_torch, publish_dict, report_error, run_variants  # noqa: E402


def steps(name, torch):
    """open_tensors' path (tensors.py) with a clock between its steps; the chunks mapped one by one first."""
    from gpuipc import _index
    from gpuipc.tensors import _Opened, read_index

    c = [time.perf_counter()]
    index, seg, mem = read_index(name, None)
    c.append(time.perf_counter())
    opened = _Opened(name, index, True, 0)
    c.append(time.perf_counter())
    v = _index.read_stamp(index, mem, 0)
    raw = _index.read_refs_raw(index, mem, 0)
    refs = _index.read_refs(index, mem, 0)
    c.append(time.perf_counter())
    pool = next(iter(opened.pools.values()))._pool
    first = {}
    for r in refs:
        first.setdefault(r.chunk, r)
    maps = {}
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
    parts = ("index_open", "pool_join", "refs_read", "chunk_maps", "tensors_of_index", "from_dlpack", "close", "touch")
    us = {p: round((c[k + 1] - c[k]) * 1e6, 1) for k, p in enumerate(parts)}
    us["total"] = round((c[-1] - c[0]) * 1e6, 1)
    us["maps"] = maps
    return us, out


def child(variant, name, q):
    try:
        torch = init_torch()
        import gpuipc

        out = {"variant": variant}
        gpuipc.Segment.stat(name)  # the broker awake
        if variant == "steps":
            out["first"], d = steps(name, torch)
            del d
            gpuipc.Segment.stat(name)
            out["again"], d = steps(name, torch)
            del d
        else:
            prof = cProfile.Profile()
            t = time.perf_counter()
            prof.enable()
            d = gpuipc.open_tensors(name, device=0)
            prof.disable()
            out["first_us_profiled"] = round((time.perf_counter() - t) * 1e6, 1)
            del d
            gpuipc.Segment.stat(name)
            t = time.perf_counter()
            d = gpuipc.open_tensors(name, device=0)
            out["again_us"] = round((time.perf_counter() - t) * 1e6, 1)
            del d
            s = io.StringIO()
            pstats.Stats(prof, stream=s).sort_stats("tottime").print_stats(25)
            out["profile"] = s.getvalue().splitlines()[:45]
        q.put(out)
    except BaseException as e:  # noqa: BLE001
        report_error(q, variant, e)


def main():
    repeats = int(sys.argv[1]) if len(sys.argv) > 1 else 3
    torch = init_torch()
    name = f"first{os.getpid()}"
    pool, sd, pub = publish_dict(torch, name)
    print(json.dumps({"tensors": len(sd), "device": torch.cuda.get_device_name(0), "torch": torch.__version__}), flush=True)
    run_variants(child, name, ("steps", "profile"), repeats)
    pub.close()
    del pool


if __name__ == "__main__":
    main()
