"""Does mapping a pool's chunks on a thread of their own (Pool::map_ahead, which tensors_of_index uses) shorten an
open_tensors of the bench's 2 GiB dict? (issue 13)

The owner publishes the dict (291 bf16 tensors, gpuipc.torch.MemPool, three 1 GiB chunks) as open_stages.py does.
Fresh spawned children (torch and CUDA initialised), taking turns:
  ahead    gpuipc.open_tensors as it is: tensors_of_index maps the chunks after the first on a thread meanwhile;
  serial   the same with map_ahead=False: each chunk is mapped when the loop reaches its first block.
Each child makes one broker call first (a stat of the index), so that the broker's wake-up from idle is not part of
either, then times open_tensors, then every tensor's data_ptr() and a stream synchronize, as the weights suite's
consumers do. Prints one JSON line per child, then the medians. Usage: python map_ahead_ab.py [repeats]

Ran at d5df926 (map-ahead-ab-d5df926-h200-20261127.log): on an H200, 3.05 ms (2.47-3.83) ahead against 2.78 ms
(1.83-2.91) serial, medians of eight children each. The next commit took Pool::map_ahead out again, and with it the
map_ahead argument this script passes: run it on d5df926.
"""
import json
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _open_owner import init_torch, report_error, serve  # noqa: E402


def child(variant, name, q):
    try:
        torch = init_torch()
        import gpuipc
        from gpuipc import _gpuipc

        if variant == "serial":
            orig = _gpuipc.Pool.tensors_of_index

            def serial(self, *args, **kwargs):
                return orig(self, *args, map_ahead=False)

            _gpuipc.Pool.tensors_of_index = serial
        gpuipc.Segment.stat(name)
        t0 = time.perf_counter()
        tensors = gpuipc.open_tensors(name, device=0)
        t1 = time.perf_counter()
        for t in tensors.values():
            t.data_ptr()
        torch.cuda.current_stream().synchronize()
        t2 = time.perf_counter()
        q.put({"variant": variant, "tensors": len(tensors), "open_ms": round((t2 - t0) * 1e3, 3),
               "call_ms": round((t1 - t0) * 1e3, 3), "touch_ms": round((t2 - t1) * 1e3, 3)})
    except BaseException as e:  # noqa: BLE001
        report_error(q, variant, e)


def main():
    rows = serve(child, ("ahead", "serial"), "ahead", 5)
    for v in ("ahead", "serial"):
        got = [r for r in rows if r.get("variant") == v and "open_ms" in r]
        if got:
            print(json.dumps({"variant": v, "children": len(got),
                              **{f"median_{k}": round(statistics.median(r[k] for r in got), 3)
                                 for k in ("open_ms", "call_ms", "touch_ms")},
                              "open_ms_range": [min(r["open_ms"] for r in got), max(r["open_ms"] for r in got)]}))


if __name__ == "__main__":
    main()
