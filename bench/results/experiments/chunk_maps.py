"""Can the chunk mappings of an open_tensors overlap, and what does each tensor cost once they are mapped? (issue 13)

The owner publishes the bench's 2 GiB dict (291 bf16 tensors, gpuipc.torch.MemPool) as open_stages.py does. Fresh
spawned children (torch and CUDA initialised) then:
  serial     join the pool once and resolve one block of each chunk in turn (each resolve opens the chunk through
             the broker, imports, maps and sets access), then, the chunks mapped, time tensors_of_index (holds on
             and off) and torch's from_dlpack of its capsules;
  parallel   join the pool once per chunk (a handle each, so no shared lock), then resolve one block of each chunk
             from a thread per chunk, all started together.
Prints one JSON line per child. Usage: python chunk_maps.py [repeats]
"""
import os
import sys
import threading
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _open_owner import init_torch, report_error, serve  # noqa: E402



def child(variant, name, q):
    try:
        torch = init_torch()
        from gpuipc import _gpuipc, _index
        from gpuipc.tensors import _Opened, read_index

        index, seg, mem = read_index(name, None)
        refs = _index.read_refs(index, mem, 0)
        raw = _index.read_refs_raw(index, mem, 0)
        pool_name = index.pools[0]
        first = {}
        for r in refs:
            first.setdefault(r.chunk, r)
        chunks = sorted(first)
        tup = {c: (first[c].pool, first[c].generation, first[c].offset, first[c].size, first[c].chunk, first[c].index)
               for c in chunks}
        out = {"variant": variant, "chunks": len(chunks), "chunk_bytes": _gpuipc.Pool.stat(pool_name)["capacity_bytes"] // max(1, len(chunks))}
        if variant == "serial":
            p = _gpuipc.Pool.open(pool_name, readonly=True, wait=None, device=0)
            for c in chunks:
                t = time.perf_counter()
                p.resolve(tup[c])
                out[f"chunk{c}_us"] = round((time.perf_counter() - t) * 1e6, 1)
            opened = _Opened(name, index, True, 0)
            from_dlpack = getattr(torch._C, "_from_dlpack", None) or torch.utils.dlpack.from_dlpack
            keep = []
            for k in range(3):
                for hold in (True, False):
                    t = time.perf_counter()
                    caps = p.tensors_of_index(raw, 0, index.flat_bytes, index.storage_bytes, opened._dtype_layouts(), True, hold)
                    out[f"tensors_of_index_hold{int(hold)}_{k}_us"] = round((time.perf_counter() - t) * 1e6, 1)
                    t = time.perf_counter()
                    made = [from_dlpack(c) for _, c in caps]
                    out[f"from_dlpack_hold{int(hold)}_{k}_us"] = round((time.perf_counter() - t) * 1e6, 1)
                    keep.append(made)
            t = time.perf_counter()
            keep.clear()
            out["drop_us"] = round((time.perf_counter() - t) * 1e6, 1)
            opened.close()
        else:
            handles = [_gpuipc.Pool.open(pool_name, readonly=True, wait=None, device=0) for _ in chunks]
            go = threading.Barrier(len(chunks) + 1)
            done = {}

            def work(h, c):
                go.wait()
                t = time.perf_counter()
                h.resolve(tup[c])
                done[c] = time.perf_counter() - t

            threads = [threading.Thread(target=work, args=(h, c)) for h, c in zip(handles, chunks)]
            for th in threads:
                th.start()
            t = time.perf_counter()
            go.wait()
            for th in threads:
                th.join()
            out["all_us"] = round((time.perf_counter() - t) * 1e6, 1)
            for c, v in done.items():
                out[f"chunk{c}_us"] = round(v * 1e6, 1)
        seg.close()
        q.put(out)
    except BaseException as e:  # noqa: BLE001
        report_error(q, variant, e)


def main():
    serve(child, ("serial", "parallel"), "maps", 3)


if __name__ == "__main__":
    main()
