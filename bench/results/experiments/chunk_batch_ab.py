"""What does opening a pool's chunks with one broker round trip (Pool.map_chunks) save against one round trip per
chunk (a resolve of one block of each), with everything else the same? (issue 13)

The owner publishes the bench's dict under gpuipc.torch.MemPool as open_stages.py does (argv[2]: 32 layers, the
2 GiB dict in 3 chunks; 340, the 16 GiB dict in 17). One fresh spawned child (torch and CUDA initialised) then
joins the dict's pool again and again, a handle at a time, and maps all of its chunks with the handle, in turns:
  batched  h.map_chunks(every ref of the index): the chunks' Opens sent to the broker together, then each imported;
  serial   h.resolve(the first block of each chunk), chunk after chunk: a round trip, then the import, per chunk.
A device pool's handle maps its chunks at addresses of its own, so each handle imports every chunk afresh. Only
the mapping is timed (not the join, nor the close). Prints one JSON line: each variant's times (us), in order.
Usage: python chunk_batch_ab.py [rounds] [layers]
"""
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _open_owner import init_torch, report_error, serve  # noqa: E402


def child(variant, name, q):
    try:
        init_torch()
        from gpuipc import _gpuipc, _index
        from gpuipc.tensors import read_index

        index, seg, mem = read_index(name, None)
        raw = _index.read_refs_raw(index, mem, 0)
        first = {}
        for r in _index.read_refs(index, mem, 0):
            first.setdefault(r.chunk, (r.pool, r.generation, r.offset, r.size, r.chunk, r.index))
        rounds = int(variant.split("=")[1])
        times = {"batched": [], "serial": []}
        for k in range(rounds):
            for v in (("batched", "serial") if k % 2 == 0 else ("serial", "batched")):
                h = _gpuipc.Pool.open(index.pools[0], readonly=True, wait=None, device=0)
                t = time.perf_counter()
                if v == "batched":
                    h.map_chunks(raw)
                else:
                    for c in sorted(first):
                        h.resolve(first[c])
                times[v].append(round((time.perf_counter() - t) * 1e6, 1))
                h.close()
        seg.close()
        q.put({"variant": variant, "chunks": len(first), **times,
               **{f"median_{v}_us": statistics.median(t) for v, t in times.items()}})
    except BaseException as e:  # noqa: BLE001
        report_error(q, variant, e)


def main():
    rounds = sys.argv[1] if len(sys.argv) > 1 else "8"
    sys.argv[1:2] = ["1"]  # serve's repeats: one child, which runs the rounds itself
    serve(child, (f"rounds={rounds}",), "chunkbatch", 1)


if __name__ == "__main__":
    main()
