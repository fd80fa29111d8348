"""Where gpuipc.open_tensors spends its time for torch CUDA tensors: the per-storage DLPack way (views_of + build)
against one tensor per chunk (spans_of + build_torch), in a process other than the publisher's.

    python bench/analysis/experiments/open_paths.py   (needs torch with CUDA, gpuipc importable, GPUIPC_DAEMON set)
"""
import cProfile
import os
import pstats
import subprocess
import sys
import time

import torch

import gpuipc
from gpuipc import _index
from gpuipc.tensors import _Opened, build, build_torch, read_index

NAME = "open_paths_sd"


def p50(xs):
    xs = sorted(xs)
    return xs[len(xs) // 2] * 1e3


def consumer() -> None:
    torch.cuda.init()
    torch.zeros(1, device="cuda")
    index, seg, mem = read_index(NAME, 10.0)
    opened = _Opened(NAME, index, True, None)
    raw = _index.read_refs_raw(index, mem, 0)
    for label, fn in (
        ("per-storage dlpack (views_of + build)", lambda: build(index.tensors, opened.views(raw, dlpack=True), True)),
        ("one import per chunk (spans_of + build_torch)", lambda: build_torch(torch, index.tensors, index.storages, *opened.spans(raw))),
        ("views_of alone (C++: holds, capsules)", lambda: opened.views(raw, dlpack=True)),
        ("spans_of alone", lambda: opened.spans(raw)),
    ):
        fn()
        ts = []
        for _ in range(30):
            t0 = time.perf_counter()
            d = fn()
            ts.append(time.perf_counter() - t0)
            del d
        print(f"{label}: p50 {p50(ts):.3f} ms (min {min(ts) * 1e3:.3f})", flush=True)
    caps = opened.views(raw, dlpack=True)
    t0 = time.perf_counter()
    ts_ = [torch.from_dlpack(c) for c in caps]
    print(f"torch.from_dlpack of {len(caps)} CUDA capsules: {(time.perf_counter() - t0) * 1e6 / len(caps):.2f} us each")
    t0 = time.perf_counter()
    vs = [t.view(torch.bfloat16) for t in ts_]
    print(f"view(bfloat16): {(time.perf_counter() - t0) * 1e6 / len(caps):.2f} us each")
    t0 = time.perf_counter()
    [v.as_strided((512, 1024), (1024, 1), 0) for v in vs]
    print(f"as_strided: {(time.perf_counter() - t0) * 1e6 / len(caps):.2f} us each")
    del ts_, vs, caps
    for t in range(3):
        t0 = time.perf_counter()
        d = gpuipc.open_tensors(NAME)
        [x.data_ptr() for x in d.values()]
        torch.cuda.synchronize()
        print(f"open_tensors + data_ptr: {(time.perf_counter() - t0) * 1e3:.3f} ms")
        del d
    pr = cProfile.Profile()
    pr.enable()
    for _ in range(10):
        build(index.tensors, opened.views(raw, dlpack=True), True)
    pr.disable()
    pstats.Stats(pr).sort_stats("tottime").print_stats(8)
    opened.close()
    seg.close()


def main() -> None:
    if len(sys.argv) > 1:
        return consumer()
    sd = {f"layer.{i}.weight": torch.full((512, 1024 + 8 * (i % 5)), float(i), dtype=torch.bfloat16, device="cuda")
          for i in range(291)}
    with gpuipc.share_tensors(NAME, sd):
        subprocess.run([sys.executable, __file__, "consumer"], check=True)


if __name__ == "__main__":
    main()
