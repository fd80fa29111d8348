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
from _open_owner import init_torch, publish_dict, report_error, run_variants, open_steps  # noqa: E402



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
            out["cold_steps"] = open_steps(name, torch)[0]
            time.sleep(0.1)
            out["warm_steps"] = open_steps(name, torch)[0]
            out["warm_steps_b2b"] = open_steps(name, torch)[0]
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
