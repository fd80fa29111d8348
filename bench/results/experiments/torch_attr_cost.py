import timeit, weakref, torch
torch.cuda.set_device(0)
t = torch.empty((1536, 1536), dtype=torch.bfloat16, device="cuda:0")
key = (t.data_ptr(), t.shape, t.stride(), t.dtype)
w = weakref.ref(t)
d = {"model.layers.0.mlp.up_proj.weight": 1}
n = 200000
for label, stmt in [("data_ptr", "t.data_ptr()"), ("shape", "t.shape"), ("stride", "t.stride()"), ("dtype", "t.dtype"),
                    ("identity tuple", "(t.data_ptr(), t.shape, t.stride(), t.dtype)"),
                    ("identity compare", "(t.data_ptr(), t.shape, t.stride(), t.dtype) == key"),
                    ("wref", "w() is t"), ("dict get", "d.get('model.layers.0.mlp.up_proj.weight')"),
                    ("is_cuda", "t.is_cuda"), ("storage_offset", "t.storage_offset()")]:
    s = timeit.timeit(stmt, globals=globals(), number=n)
    print(f"{label:18s} {s / n * 1e9:7.0f} ns")

# The same over the 3063 tensors of the 16 GiB bench dict (torch's own allocator): loops as the publisher's walk
# makes them, medians of 10 passes.
import statistics, time  # noqa: E402

from _statedict_spec import spec  # noqa: E402 - this folder, beside the script


sd = {n: torch.empty(sh, dtype=torch.bfloat16, device="cuda:0") for n, sh in spec(340)}
items = list(sd.items())
ts = [t for _, t in items]
keys = [(t.data_ptr(), t.shape, t.stride(), t.dtype) for t in ts]
ptrs = [t.data_ptr() for t in ts]
refs = [weakref.ref(t) for t in ts]


def loop_identity():
    return all((t.data_ptr(), t.shape, t.stride(), t.dtype) == k for t, k in zip(ts, keys))


def loop_ptr():
    return all(t.data_ptr() == p for t, p in zip(ts, ptrs))


def loop_items():
    n = 0
    for k, t in items:
        n += 1
    return n


def loop_replay():
    for (k, t), w, key in zip(items, refs, keys):
        if w() is not t or (t.data_ptr(), t.shape, t.stride(), t.dtype) != key:
            return False
    return True


for label, fn in [("items only", loop_items), ("data_ptr", loop_ptr), ("identity", loop_identity),
                  ("replay check", loop_replay)]:
    ms = []
    for _ in range(10):
        t0 = time.perf_counter()
        fn()
        ms.append((time.perf_counter() - t0) * 1e3)
    m = statistics.median(ms)
    print(f"{label:14s} over {len(ts)} tensors: {m:.3f} ms median ({m * 1e3 / len(ts):.2f} us a tensor)")
