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
import os
import pstats
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _open_owner import init_torch, report_error, serve, open_steps  # noqa: E402


def child(variant, name, q):
    try:
        torch = init_torch()
        import gpuipc

        out = {"variant": variant}
        gpuipc.Segment.stat(name)  # the broker awake
        if variant == "steps":
            out["first"] = open_steps(name, torch, map_chunks=True)[0]
            gpuipc.Segment.stat(name)
            out["again"] = open_steps(name, torch, map_chunks=True)[0]
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
            out["tensors"] = len(d)
            s = io.StringIO()
            pstats.Stats(prof, stream=s).sort_stats("tottime").print_stats(25)
            out["profile"] = s.getvalue().splitlines()[:45]
        q.put(out)
    except BaseException as e:  # noqa: BLE001
        report_error(q, variant, e)


def main():
    serve(child, ("steps", "profile"), "first", 3)


if __name__ == "__main__":
    main()
