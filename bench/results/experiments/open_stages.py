"""Where the time of gpuipc.open_tensors goes, stage by stage, in fresh processes (issue 13: open <= 1 ms).

The owner builds the bench's 2 GiB dict (291 bf16 tensors) under gpuipc.torch.MemPool and publishes it with
publish_tensors(versions=1), as the weights suite does. Fresh spawned children (torch and CUDA initialised, gpuipc
imported, as the suite's consumers) then run open_tensors' steps one by one with a clock between them, cold and then
warm (the same open again in the same process). Variants, one child each:
  plain      the steps, cold then warm;
  prewarm    an unrelated 2 MiB device segment opened first (the VA arena reserved, the context's VMM state warm);
  broker     connect, a Stat after 100 ms idle (the broker's CPU asleep), a Stat right after (awake);
  reserve    cuMemAddressReserve through ctypes: the first and second call, 2 MiB and 256 GiB;
  parts      (with the argument "parts" only) the index's open and the pool's join taken apart, back to back
             (medians of 7), with CUDA initialised (parts) and without (parts_nocuda).
Prints one JSON line per child. Usage: python open_stages.py [repeats] [parts]
"""
import ctypes
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _open_owner import init_torch, publish_dict, report_error, run_variants  # noqa: E402



def steps(name, torch):
    """open_tensors' path (tensors.py) with a clock between its steps; returns (times in us, tensors)."""
    from gpuipc import _index
    from gpuipc.tensors import _Opened, read_index

    c = [time.perf_counter()]
    index, seg, mem = read_index(name, None)
    c.append(time.perf_counter())
    opened = _Opened(name, index, True, 0)
    c.append(time.perf_counter())
    v = _index.read_stamp(index, mem, 0)
    raw = _index.read_refs_raw(index, mem, 0)
    c.append(time.perf_counter())
    caps = []
    for pool, lo, hi in opened._run_bounds():
        caps.extend(pool.tensors_of_index(raw[lo * 40 : hi * 40], lo, index.flat_bytes, index.storage_bytes,
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
    parts = ("index_open", "pool_join", "refs_read", "tensors_of_index", "from_dlpack", "close", "touch")
    us = {p: round((c[k + 1] - c[k]) * 1e6, 1) for k, p in enumerate(parts)}
    us["total"] = round((c[-1] - c[0]) * 1e6, 1)
    return us, out


def parts(name, out):
    """The index open and the pool join, taken apart (medians of 7, back to back, after one warm-up)."""
    import statistics

    import numpy as np
    import gpuipc
    from gpuipc import _gpuipc, _index

    seg = gpuipc.Segment.open(name, readonly=True)
    pool_name = _index.decode(name, np.frombuffer(seg.view(), dtype=np.uint8)).pools[0]
    seg.close()
    steps = {}

    def clock(label, f):
        t = time.perf_counter()
        r = f()
        steps.setdefault(label, []).append((time.perf_counter() - t) * 1e6)
        return r

    for _ in range(8):
        clock("stat", lambda: gpuipc.Segment.stat(name))
        raw = clock("segment_open_binding", lambda: _gpuipc.Segment.open(name, readonly=True, wait=None, device=None))
        clock("segment_close_binding", raw.close)
        s = clock("segment_open", lambda: gpuipc.Segment.open(name, readonly=True))
        v = clock("view", s.view)
        mem = clock("frombuffer", lambda: np.frombuffer(v, dtype=np.uint8))
        clock("decode", lambda: _index.decode(name, mem))
        clock("segment_close", s.close)
        p = clock("pool_open_binding", lambda: _gpuipc.Pool.open(pool_name, readonly=True, wait=None, device=0))
        clock("pool_close_binding", p.close)
    for k, v in steps.items():
        out[k + "_us"] = round(statistics.median(v[1:]), 1)


def child(variant, name, q):
    try:
        if variant == "parts_nocuda":
            out = {"variant": variant}
            parts(name, out)
            q.put(out)
            return
        torch = init_torch()
        import gpuipc

        out = {"variant": variant}
        if variant == "parts":
            parts(name, out)
        elif variant == "reserve":
            cu = ctypes.CDLL("libcuda.so.1")
            ptr = ctypes.c_uint64()
            for label, size in (("first_2MiB", 2 << 20), ("second_2MiB", 2 << 20), ("third_256GiB", 256 << 30),
                                ("fourth_256GiB", 256 << 30)):
                t = time.perf_counter()
                rc = cu.cuMemAddressReserve(ctypes.byref(ptr), ctypes.c_size_t(size), ctypes.c_size_t(2 << 20),
                                            ctypes.c_uint64(0), ctypes.c_uint64(0))
                out[label + "_us"] = round((time.perf_counter() - t) * 1e6, 1)
                out[label + "_rc"] = rc
        elif variant == "broker":
            t = time.perf_counter()
            gpuipc.Segment.stat(name)
            out["first_call_us"] = round((time.perf_counter() - t) * 1e6, 1)
            for k in range(3):
                time.sleep(0.1)
                t = time.perf_counter()
                gpuipc.Segment.stat(name)
                out[f"after_100ms_idle_{k}_us"] = round((time.perf_counter() - t) * 1e6, 1)
                t = time.perf_counter()
                gpuipc.Segment.stat(name)
                out[f"back_to_back_{k}_us"] = round((time.perf_counter() - t) * 1e6, 1)
        else:
            if variant == "prewarm":
                s = gpuipc.Segment.open(name + ".warm", readonly=True, device=0)
                time.sleep(0.1)
            t = time.perf_counter()
            d = gpuipc.open_tensors(name, device=0)
            for x in d.values():
                x.data_ptr()
            torch.cuda.current_stream().synchronize()
            out["open_tensors_cold_us"] = round((time.perf_counter() - t) * 1e6, 1)
            del d, x
            time.sleep(0.1)
            out["cold_steps"] = steps(name, torch)[0]
            time.sleep(0.1)
            out["warm_steps"] = steps(name, torch)[0]
            out["warm_steps_b2b"] = steps(name, torch)[0]
            t = time.perf_counter()
            d = gpuipc.open_tensors(name, device=0)
            out["open_tensors_warm_us"] = round((time.perf_counter() - t) * 1e6, 1)
            del d
            if variant == "prewarm":
                s.close()
        q.put(out)
    except BaseException as e:  # noqa: BLE001
        report_error(q, variant, e)


def main():
    repeats = int(sys.argv[1]) if len(sys.argv) > 1 else 2
    torch = init_torch()
    import gpuipc

    name = f"stages{os.getpid()}"
    pool, sd, pub = publish_dict(torch, name)
    warm = gpuipc.Segment.create(name + ".warm", 2 << 20, kind="device", device=0)
    print(json.dumps({"tensors": len(sd), "bytes": sum(t.nbytes for t in sd.values()), "gpuipc": gpuipc.__version__,
                      "torch": torch.__version__, "device": torch.cuda.get_device_name(0)}), flush=True)
    variants = ("parts", "parts_nocuda") if "parts" in sys.argv[2:] else ("plain", "prewarm", "broker", "reserve")
    run_variants(child, name, variants, repeats)
    pub.close()
    warm.close()
    del pool

if __name__ == "__main__":
    main()
