"""Pool.tensors_of_index's cost per tensor on a host pool (no GPU): the call open_tensors makes for torch tensors,
with holds (as open_tensors) and without. Run it under two wheels in turns to compare them.

    python toi_local.py [calls]

The dict: the bench's 291 names with shapes cut 64-fold, float16 NumPy arrays shared with share_tensors (packed into
a host pool); the call covers the tensors alone at the start of their storage. Prints medians over the calls.
"""
import json
import os
import statistics
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _statedict_spec import spec  # noqa: E402


def main():
    import gpuipc
    from gpuipc import _index
    from gpuipc.tensors import _Opened, read_index

    calls = int(sys.argv[1]) if len(sys.argv) > 1 else 2000
    name = f"toi{os.getpid()}"
    sd = {n: np.ones(tuple(max(1, s // 64) for s in sh), dtype=np.float16) for n, sh in spec(32)}
    with gpuipc.share_tensors(name, sd):
        index, seg, mem = read_index(name, None)
        raw = _index.read_refs_raw(index, mem, 0)
        opened = _Opened(name, index, True, None)
        pool = next(iter(opened.pools.values()))._pool
        layouts = opened._dtype_layouts()
        out = {"gpuipc": os.path.dirname(gpuipc.__file__)}
        for hold in (True, False):
            ts = []
            for _ in range(calls):
                t = time.perf_counter()
                made = pool.tensors_of_index(raw, 0, index.flat_bytes, index.storage_bytes, layouts, True, hold)
                ts.append(time.perf_counter() - t)
                del made
            n = len(pool.tensors_of_index(raw, 0, index.flat_bytes, index.storage_bytes, layouts, True, hold))
            out[f"hold{int(hold)}_us_per_call"] = round(statistics.median(ts) * 1e6, 1)
            out[f"hold{int(hold)}_us_per_tensor"] = round(statistics.median(ts) * 1e6 / n, 3)
            out["tensors"] = n
        opened.close()
        seg.close()
    print(json.dumps(out), flush=True)


if __name__ == "__main__":
    main()
