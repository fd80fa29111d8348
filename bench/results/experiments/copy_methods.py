"""Ways to copy a state dict device to device in one process, and the publisher's walk alone.

Run on a GPU machine with torch and the gpuipc wheel on the path:
    python copy_methods.py [layers]   (340: the 16 GiB dict of `gpuipc bench weights`; 32: the 2 GiB one)

Copies (each timed 5 times after one warm-up, host clock around the call and a synchronize; "enqueue" is the time
until the call returned):
- foreach_bf16:    torch._foreach_copy_ over the tensors as they are (the suite's local baseline)
- foreach_u8:      the same over uint8 views of their bytes (what the stream reader and the staging copies enqueue)
- foreach_i64:     the same over int64 views (every tensor here is a multiple of 8 bytes, 256-aligned)
- per_tensor:      Tensor.copy_ one by one (cudaMemcpyAsync each)
- hybrid_<MiB>:    copy_ for tensors of at least <MiB>, one foreach over int64 views for the rest
- foreach_c128:    the same over complex128 views (16-byte elements)
- batch:           one cuMemcpyBatchAsync of every tensor (CUDA 12.8+ driver; through ctypes), on a side stream
- batch_<n>:       the same in calls of n copies (a bucket's worth)
- flat:            one copy_ of a single buffer of the same size (capped at 2 GiB), scaled to the dict's bytes

Then the publisher alone: stream_publisher(by_reference=True) with no reader, publish() of the MemPool dict 6 times
(the first describes every tensor, later ones take the remembered path), and a cProfile of the last.
"""

import cProfile
import ctypes
import io
import json
import os
import pstats
import sys
import time

from _statedict_spec import spec  # noqa: E402 - this folder, beside the script


def timed(torch, fn, reps=5):
    fn()
    torch.cuda.synchronize()
    total, enq = [], []
    for _ in range(reps):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        t1 = time.perf_counter()
        torch.cuda.synchronize()
        t2 = time.perf_counter()
        total.append((t2 - t0) * 1e3)
        enq.append((t1 - t0) * 1e3)
    total.sort()
    enq.sort()
    return {"ms_median": total[len(total) // 2], "ms_min": total[0], "ms_max": total[-1],
            "enqueue_ms_median": enq[len(enq) // 2]}


class _Loc(ctypes.Structure):
    _fields_ = [("type", ctypes.c_int), ("id", ctypes.c_int)]


class _Attr(ctypes.Structure):
    _fields_ = [("src_access_order", ctypes.c_int), ("src_loc", _Loc), ("dst_loc", _Loc), ("flags", ctypes.c_uint)]


def batch_copier(torch, dst, src, per_call):
    """cuMemcpyBatchAsync of dst[i] <- src[i], per_call copies a call, on a side stream (legacy stream refused)."""
    cu = ctypes.CDLL("libcuda.so.1")
    fn = cu.cuMemcpyBatchAsync_v2
    fn.restype = ctypes.c_int
    st = torch.cuda.Stream()
    calls = []
    for k in range(0, len(dst), per_call):
        d, s = dst[k : k + per_call], src[k : k + per_call]
        n = len(d)
        calls.append(((ctypes.c_uint64 * n)(*[t.data_ptr() for t in d]), (ctypes.c_uint64 * n)(*[t.data_ptr() for t in s]),
                      (ctypes.c_size_t * n)(*[t.numel() * t.element_size() for t in d]), n))
    attr = _Attr(1, _Loc(1, 0), _Loc(1, 0), 0)  # CU_MEMCPY_SRC_ACCESS_ORDER_STREAM
    idx = (ctypes.c_size_t * 1)(0)
    handle = ctypes.c_void_p(st.cuda_stream)

    def run():
        st.wait_stream(torch.cuda.current_stream())
        for d, s, z, n in calls:
            rc = fn(d, s, z, ctypes.c_size_t(n), ctypes.byref(attr), idx, ctypes.c_size_t(1), handle)
            if rc:
                raise RuntimeError(f"cuMemcpyBatchAsync: CUresult {rc}")
        torch.cuda.current_stream().wait_stream(st)

    return run


def main():
    import torch
    import gpuipc
    import gpuipc.torch as gt

    layers = int(sys.argv[1]) if len(sys.argv) > 1 else 340
    torch.cuda.set_device(0)
    out = {"device": torch.cuda.get_device_name(0), "torch": torch.__version__, "layers": layers}
    pool = gt.MemPool(f"copies{os.getpid()}", device=0)
    with torch.cuda.use_mem_pool(pool):
        sd = {n: torch.full(sh, 1.0, dtype=torch.bfloat16, device="cuda:0") for n, sh in spec(layers)}
    src = list(sd.values())
    dst = [torch.empty_like(t) for t in src]
    nbytes = sum(t.numel() * t.element_size() for t in src)
    out["bytes"], out["tensors"] = nbytes, len(src)

    def as_(ts, dt):
        return [t.view(-1).view(dt) for t in ts]

    s8, d8 = as_(src, torch.uint8), as_(dst, torch.uint8)
    s64, d64 = as_(src, torch.int64), as_(dst, torch.int64)
    s128, d128 = as_(src, torch.complex128), as_(dst, torch.complex128)
    methods = {
        "foreach_bf16": lambda: torch._foreach_copy_(dst, src),
        "foreach_u8": lambda: torch._foreach_copy_(d8, s8),
        "foreach_i64": lambda: torch._foreach_copy_(d64, s64),
        "foreach_c128": lambda: torch._foreach_copy_(d128, s128),
        "per_tensor": lambda: [d.copy_(s, non_blocking=True) for d, s in zip(dst, src)],
    }
    for mib in (1, 4, 16):
        big = [(d, s) for d, s in zip(dst, src) if d.numel() * 2 >= mib << 20]
        small_d = as_([d for d, s in zip(dst, src) if d.numel() * 2 < mib << 20], torch.int64)
        small_s = as_([s for d, s in zip(dst, src) if d.numel() * 2 < mib << 20], torch.int64)

        def hybrid(big=big, small_d=small_d, small_s=small_s):
            for d, s in big:
                d.copy_(s, non_blocking=True)
            if small_d:
                torch._foreach_copy_(small_d, small_s)

        methods[f"hybrid_{mib}"] = hybrid
        out[f"hybrid_{mib}_large_tensors"] = len(big)
    for per in (len(src), 96):
        try:
            methods["batch" if per == len(src) else f"batch_{per}"] = batch_copier(torch, dst, src, per)
        except (AttributeError, OSError) as e:
            out["batch_missing"] = str(e)
    res = {}
    for k, f in methods.items():
        try:
            res[k] = timed(torch, f)
        except RuntimeError as e:
            out[f"{k}_error"] = str(e)
    torch.cuda.synchronize()
    if "batch" in methods:  # the batch copies what it should: every destination zeroed, copied again, compared
        torch._foreach_zero_(dst)
        methods["batch"]()
        torch.cuda.synchronize()
        out["batch_copied_every_tensor"] = all(torch.equal(d, s) for d, s in zip(dst, src))
    flat_bytes = min(nbytes, 2 << 30)
    a = torch.empty(flat_bytes, dtype=torch.uint8, device="cuda:0")
    b = torch.empty_like(a)
    f = timed(torch, lambda: b.copy_(a))
    res["flat"] = {k: v * nbytes / flat_bytes for k, v in f.items()}
    del a, b
    for k, r in res.items():
        r["gbs"] = nbytes / r["ms_median"] / 1e6
    out["copies"] = res
    del dst, d8, d64, d128
    torch.cuda.empty_cache()

    # The publisher's walk, with no reader: nothing waits for a ring slot or a reader.
    pub = gpuipc.stream_publisher(f"walk{os.getpid()}", device=0, by_reference=True)
    items = list(sd.items())
    s = torch.cuda.current_stream()
    walk = []
    for i in range(6):
        torch.cuda.synchronize()
        prof = cProfile.Profile() if i == 5 else None
        t0 = time.perf_counter()
        if prof:
            prof.enable()
        pub.publish(items, stream=s)
        if prof:
            prof.disable()
        walk.append((time.perf_counter() - t0) * 1e3)
    out["publish_no_reader_ms"] = walk
    out["publish_no_reader_us_per_tensor"] = [w * 1e3 / len(items) for w in walk]
    txt = io.StringIO()
    pstats.Stats(prof, stream=txt).sort_stats("tottime").print_stats(25)
    pub.close()
    gpuipc.Pool.unlink(f"copies{os.getpid()}")  # its names outlive this process: the broker would keep its memory
    print(json.dumps(out, indent=1))
    print(txt.getvalue())


if __name__ == "__main__":
    main()
