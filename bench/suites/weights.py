#!/usr/bin/env python3
"""The measuring side of `gpuipc bench weights` (bench/suites/suite_weights.cpp): a model-like state dict of bf16 tensors
handed to other processes with gpuipc's Python API, beside the ways it is done without it. One part per run:

    python3 bench/suites/weights.py --part open     --spec SPEC.json --consumers 10
    python3 bench/suites/weights.py --part segments --spec SPEC.json --consumers 10
    python3 bench/suites/weights.py --part update   --spec SPEC.json --updates 200 --copies 20
    python3 bench/suites/weights.py --part stream   --spec SPEC.json [--spec-large SPEC16.json] --reps 5

SPEC.json lists the tensors ([{"name", "shape"}, ...]); the suite writes it from bench/suites/statedict.cpp (the 2 GiB dict
of 291 tensors, and its 16 GiB version of 340 layers) so that every part and bench/analysis/baselines/statedict.py hand over
the same dict. Tensor i holds the value i % 7 + 1 everywhere (exact in bf16); every receiver checks the first and
last element of every tensor, outside the timed windows.

* open: the dict is built under a gpuipc.torch.MemPool and published with gpuipc.publish_tensors (versions=1: by
  reference, no copy). Fresh consumer processes (spawn; torch imported and CUDA initialised before the clock, all
  started at once, measured one at a time) go from the name to every tensor usable: gpuipc.open_tensors, then
  data_ptr() of every tensor and a synchronize of the current stream (what the torch baseline's consumer does).
* segments: the old way (examples/python/weights_server.py before issue 13): one device Segment per tensor and a
  JSON index in a host segment; the consumer opens the index, then every segment read-only, torch.from_dlpack each.
* update: publish_tensors(versions=1, then 2) of the MemPool dict; a reader process blocked in
  Reader.wait_version on the host. Timed from the publisher's pub.update(stream=...) call (time.monotonic_ns) to
  the reader's return from wait_version (time.monotonic_ns in the reader: CLOCK_MONOTONIC, one clock for every
  process of the machine). Also with update() signalling from the host (stream=None). Apart: update_from of the
  whole dict (the copy in, then update), until its stream has finished.
* stream: gpuipc.stream_publisher / stream_reader (bucketed streaming; null with the reason when this gpuipc has
  none) from this process to a reader process that receives into its own tensors: from publish() to the reader's
  return from receive() plus a synchronize of its stream. Twice: staged ("stream": a dict in torch's allocator,
  by_reference=False, every byte copied into a bucket and out of it) and by reference ("stream_byref": the same dict
  built under gpuipc.torch.MemPool, by_reference=True, the reader copies straight from it). Beside them, in this
  process: the same bytes copied device to device into a second dict (torch._foreach_copy_), and one flat copy.

Each run uses its own broker (a private GPUIPC_RUNTIME_DIR) and stops it at the end. Prints one JSON line last:
{"impl": "weights-PART", ...} with the raw samples; {"impl", "skipped": why} when torch, a GPU or GPU memory is
missing; {"impl", "error": why} when it fails.
"""
import argparse
import json
import math
import os
import shutil
import signal
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
for _p in (HERE, os.path.join(HERE, "..", "analysis", "baselines")):
    if _p not in sys.path:
        sys.path.insert(0, _p)

import report  # noqa: E402  (bench/analysis/baselines/report.py)
from _weights_common import (  # noqa: E402  (the limits, the dict and the processes every part shares)
    CONTEXT_BYTES,
    STARTUP,
    TIMEOUT,
    GiB,
    _columns,
    _report_error,
    check,
    cuda_init,
    fill_value,
    fits,
    load_spec,
    make_dict,
    run_consumers,
    spec_bytes,
    tag,
)
from _weights_versions import part_stream, part_update  # noqa: E402


# --- part open: publish_tensors of a MemPool dict, open_tensors in fresh processes ---------------------------------------
def open_consumer(k, name, spec_path, go, results):
    try:
        torch = cuda_init()
        import gpuipc

        spec = load_spec(spec_path)
        results.put(("ready", k, None))
        go.get(timeout=STARTUP + TIMEOUT * (k + 1))
        t0 = time.perf_counter()
        tensors = gpuipc.open_tensors(name, device=0, wait=TIMEOUT)
        t1 = time.perf_counter()
        for t in tensors.values():
            t.data_ptr()
        torch.cuda.current_stream().synchronize()
        t2 = time.perf_counter()
        check(torch, tensors, spec)
        del tensors, t
        # The same open again in this now warm process (imports done, the pool's chunks mapped once before).
        t3 = time.perf_counter()
        tensors = gpuipc.open_tensors(name, device=0)
        for t in tensors.values():
            t.data_ptr()
        torch.cuda.current_stream().synchronize()
        t4 = time.perf_counter()
        results.put(("done", k, {"open_ms": (t2 - t0) * 1e3, "call_ms": (t1 - t0) * 1e3, "touch_ms": (t2 - t1) * 1e3,
                                 "reopen_ms": (t4 - t3) * 1e3}))
    except BaseException:  # noqa: BLE001 - reported to the driver
        _report_error(results, k)


def part_open(a):
    torch = cuda_init()
    import gpuipc
    import gpuipc.torch as gt

    spec = load_spec(a.spec)
    nbytes = spec_bytes(spec)
    why = fits(torch, nbytes + GiB + a.consumers * CONTEXT_BYTES, f"the open of a {nbytes / GiB:.1f} GiB dict")
    if why:
        return {"skipped": why, "tensors": len(spec), "bytes": nbytes}
    name = tag()
    t0 = time.perf_counter()
    pool = gt.MemPool(name + ".weights", device=0)
    with torch.cuda.use_mem_pool(pool):
        sd = make_dict(torch, spec)
    t1 = time.perf_counter()
    pub = gpuipc.publish_tensors(name, sd, versions=1)
    t2 = time.perf_counter()
    try:
        rows = run_consumers(open_consumer, (name, a.spec), a.consumers)
    finally:
        by_reference = pub.pool is None  # a pool of copies exists only when something had to be packed
        pub.close()
    return {"tensors": len(spec), "bytes": nbytes, "consumers": a.consumers, "by_reference": by_reference,
            "storages": len(pub._plan.storages), "build_ms": (t1 - t0) * 1e3, "publish_ms": (t2 - t1) * 1e3,
            **_columns(rows, ("open_ms", "call_ms", "touch_ms", "reopen_ms"))}


# --- part segments: one Segment per tensor and a JSON index (the old weights_server.py) -----------------------------
def segments_consumer(k, prefix, spec_path, go, results):
    try:
        torch = cuda_init()
        import gpuipc

        spec = load_spec(spec_path)
        results.put(("ready", k, None))
        go.get(timeout=STARTUP + TIMEOUT * (k + 1))
        t0 = time.perf_counter()
        with gpuipc.Segment.open(prefix, readonly=True, wait=TIMEOUT) as idx:
            n = int(idx.as_array("uint64", 1)[0])
            index = json.loads(bytes(idx.as_array("uint8", n, offset=8)))
        tensors = {}
        for tname, (seg_name, dtype, shape) in index["tensors"].items():
            with gpuipc.Segment.open(seg_name, readonly=True) as seg:
                tensors[tname] = torch.from_dlpack(seg.as_array(dtype, tuple(shape)))  # keeps the mapping
        t1 = time.perf_counter()
        for t in tensors.values():
            t.data_ptr()
        torch.cuda.current_stream().synchronize()
        t2 = time.perf_counter()
        check(torch, tensors, spec)
        results.put(("done", k, {"open_ms": (t2 - t0) * 1e3, "call_ms": (t1 - t0) * 1e3, "touch_ms": (t2 - t1) * 1e3}))
    except BaseException:  # noqa: BLE001 - reported to the driver
        _report_error(results, k)


def part_segments(a):
    torch = cuda_init()
    import numpy as np

    import gpuipc

    spec = load_spec(a.spec)
    nbytes = spec_bytes(spec)
    # Device segments are rounded up to 2 MiB each.
    rounded = sum(-(-2 * math.prod(e["shape"]) // (2 << 20)) * (2 << 20) for e in spec)
    why = fits(torch, rounded + GiB + a.consumers * CONTEXT_BYTES, f"{len(spec)} device segments")
    if why:
        return {"skipped": why, "tensors": len(spec), "bytes": nbytes}
    prefix = tag()
    segs = []
    try:
        t0 = time.perf_counter()
        entries = {}
        for i, e in enumerate(spec):
            seg = gpuipc.Segment.create(f"{prefix}.{i}", 2 * math.prod(e["shape"]), kind="device")
            segs.append(seg)
            torch.from_dlpack(seg.as_array("bfloat16", tuple(e["shape"]))).fill_(fill_value(i))
            entries[e["name"]] = [f"{prefix}.{i}", "bfloat16", e["shape"]]
        torch.cuda.synchronize()
        index = json.dumps({"kind": "device", "tensors": entries}).encode()
        idx = gpuipc.Segment.create(prefix, len(index) + 8)
        segs.append(idx)
        idx.as_array("uint8", len(index), offset=8)[:] = np.frombuffer(index, dtype=np.uint8)
        idx.as_array("uint64", 1)[0] = len(index)
        t1 = time.perf_counter()
        rows = run_consumers(segments_consumer, (prefix, a.spec), a.consumers)
    finally:
        for seg in segs:
            n = seg.name
            seg.close()
            try:
                gpuipc.Segment.unlink(n)
            except gpuipc.Error:
                pass
    return {"tensors": len(spec), "bytes": nbytes, "segment_bytes": rounded, "consumers": a.consumers,
            "setup_ms": (t1 - t0) * 1e3, **_columns(rows, ("open_ms", "call_ms", "touch_ms"))}


# --- main -------------------------------------------------------------------------------------------------------------
PARTS = {"open": part_open, "segments": part_segments, "update": part_update, "stream": part_stream}


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--part", choices=sorted(PARTS), required=True)
    ap.add_argument("--spec", required=True, help="the dict: JSON [{name, shape}, ...] (bf16)")
    ap.add_argument("--spec-large", default="", help="stream: the larger dict, used when GPU memory allows")
    ap.add_argument("--consumers", type=int, default=10, help="open, segments: fresh consumer processes")
    ap.add_argument("--updates", type=int, default=200, help="update: measured updates per versions and mode")
    ap.add_argument("--copies", type=int, default=20, help="update: measured update_from calls per versions")
    ap.add_argument("--reps", type=int, default=5, help="stream: measured publishes and local copies")
    a = ap.parse_args()
    # SIGTERM (the suite's time limit) unwinds like an error: the broker and the children are stopped below.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit("terminated (SIGTERM)"))
    out = {"impl": f"weights-{a.part}"}
    # A private broker: its own runtime directory (short: the socket path must fit in 108 bytes), stopped at the end.
    runtime_dir = tempfile.mkdtemp(prefix="gpuipc-wb-", dir="/tmp")
    os.chmod(runtime_dir, 0o700)
    os.environ["GPUIPC_RUNTIME_DIR"] = runtime_dir  # before the first gpuipc call; spawned children inherit it

    def body():
        try:
            import torch
        except Exception as e:  # noqa: BLE001 - the reason to skip
            return {"skipped": f"torch is not importable: {type(e).__name__}: {e}"}
        if not torch.cuda.is_available():
            return {"skipped": "torch sees no CUDA device"}
        import gpuipc

        res = PARTS[a.part](a)
        return {"torch": torch.__version__, "gpuipc": gpuipc.__version__,
                # the module measured, which need not be the suite binary's build (the suite compares)
                "gpuipc_commit": getattr(gpuipc, "__commit__", "unknown (older than __commit__)"),
                "gpuipc_path": os.path.dirname(gpuipc.__file__), **res}

    try:
        return report.finish(out, body)
    finally:
        from gpuipc._broker import stop_broker

        stop_broker(runtime_dir)
        shutil.rmtree(runtime_dir, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())

