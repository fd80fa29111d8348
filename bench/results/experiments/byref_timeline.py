"""Where the time of a by-reference stream goes, bucket by bucket: the publisher's walk and flushes, the reader's
wake, its enqueue, and when the GPU finished its copies of each bucket.

Run on a GPU machine with torch and the gpuipc wheel on the path:
    python byref_timeline.py [layers] [bucket MiB] [ring] [side|legacy]
(340 512 2: the weights suite's 16 GiB by-ref run; the reader receives on a side stream, or with "legacy" on torch's
current stream, the legacy default stream, as the suite's reader does)

Prints, for the last of 4 versions, one line per bucket (ms from publish()'s start, host CLOCK_MONOTONIC in both
processes): the publisher's flush (start, end), the time it waited for a ring slot before it, the reader's return from
_next_bucket, its copies enqueued, and the GPU's end of those copies (a CUDA event on the reader's stream, placed on
the host clock through an event recorded when the reader's stream was idle). Then the totals.
$TL_PIN="P,R" pins the publisher to CPU P and the reader to CPU R (os.sched_setaffinity). $TL_NO_REPLAY=1 makes
every version walk its tensors (the publisher forgets the version it could send again).
"""

import json
import multiprocessing as mp
import os
import sys
import time

from _statedict_spec import spec  # noqa: E402 - this folder, beside the script


def reader(name, layers, versions, legacy, q, go):
    import torch
    import gpuipc
    from gpuipc import _stream_format

    if os.environ.get("TL_PIN"):
        os.sched_setaffinity(0, {int(os.environ["TL_PIN"].split(",")[1])})
    torch.cuda.set_device(0)
    into = {n: torch.empty(sh, dtype=torch.bfloat16, device="cuda:0") for n, sh in spec(layers)}
    s = torch.cuda.current_stream() if legacy else torch.cuda.Stream()
    torch.cuda.synchronize()
    rd = gpuipc.stream_reader(name, wait=60)
    log = []
    nb = rd._next_bucket
    run = _stream_format._Copies.run

    def next_bucket(deadline):
        d = nb(deadline)
        log.append({"seq": d.seq, "woke": time.monotonic_ns(), "used": d.used, "pieces": len(d.pieces)})
        return d

    def copies_run(self, torch_, non_blocking):
        run(self, torch_, non_blocking)
        ev = torch.cuda.Event(enable_timing=True)
        ev.record()
        log[-1]["enqueued"] = time.monotonic_ns()
        log[-1]["event"] = ev

    rd._next_bucket = next_bucket
    _stream_format._Copies.run = copies_run
    out = []
    for v in range(versions):
        log.clear()
        s.synchronize()
        base = torch.cuda.Event(enable_timing=True)
        base.record(s)
        base.synchronize()
        base_ns = time.monotonic_ns()  # the stream is idle: base ran about now
        go.put(v)
        got = rd.receive(into, stream=s, timeout=120)
        s.synchronize()
        done = time.monotonic_ns()
        rows = []
        for e in log:
            ev = e.pop("event", None)
            if ev is not None:
                e["gpu_done"] = base_ns + int(base.elapsed_time(ev) * 1e6)
            rows.append(e)
        out.append({"version": got, "buckets": rows, "synced": done})
    q.put(out)
    rd.close()


def main():
    import torch
    import gpuipc
    import gpuipc.torch as gt

    layers = int(sys.argv[1]) if len(sys.argv) > 1 else 340
    bucket = (int(sys.argv[2]) if len(sys.argv) > 2 else 512) << 20
    ring = int(sys.argv[3]) if len(sys.argv) > 3 else 2
    legacy = len(sys.argv) > 4 and sys.argv[4] == "legacy"
    versions = 4
    name = f"tl{os.getpid()}"
    ctx = mp.get_context("spawn")
    q, go = ctx.Queue(), ctx.Queue()
    p = ctx.Process(target=reader, args=(name, layers, versions, legacy, q, go))
    if os.environ.get("TL_PIN"):
        os.sched_setaffinity(0, {int(os.environ["TL_PIN"].split(",")[0])})
    torch.cuda.set_device(0)
    pool = gt.MemPool(name + ".w", device=0)
    with torch.cuda.use_mem_pool(pool):
        sd = {n: torch.full(sh, 1.0, dtype=torch.bfloat16, device="cuda:0") for n, sh in spec(layers)}
    items = list(sd.items())
    s = torch.cuda.current_stream()
    pub = gpuipc.stream_publisher(name, bucket_bytes=bucket, buckets=ring, device=0, by_reference=True)
    p.start()
    pub.wait_readers(1, timeout=120)
    flush, slot_wait = pub._flush, pub._slots.wait_for_slot
    plog, wlog = [], []

    def timed_flush(flags):
        t0 = time.monotonic_ns()
        seq = pub._bucket.seq
        flush(flags)
        plog.append({"seq": seq, "flush_start": t0, "flush_end": time.monotonic_ns()})

    def timed_wait(seq):
        t0 = time.monotonic_ns()
        slot_wait(seq)
        wlog.append({"seq": seq, "slot_wait_us": (time.monotonic_ns() - t0) / 1e3})

    start_fn, admit_fn = pub.start, pub._slots.admit
    marks = {}

    def timed_start(stream=None):
        v = start_fn(stream)
        marks["start_end"] = time.monotonic_ns()
        return v

    def timed_admit(first):
        t = time.monotonic_ns()
        admit_fn(first)
        marks["admit_ns"] = time.monotonic_ns() - t

    pub._flush, pub._slots.wait_for_slot = timed_flush, timed_wait
    pub.start, pub._slots.admit = timed_start, timed_admit
    runs = []
    for v in range(versions):
        go.get(timeout=120)
        time.sleep(0.01)  # the reader is in receive
        plog.clear()
        wlog.clear()
        torch.cuda.synchronize()
        if os.environ.get("TL_NO_REPLAY"):
            pub._replay = None
        t0 = time.monotonic_ns()
        pub.publish(items, stream=s)
        t1 = time.monotonic_ns()
        s.synchronize()
        runs.append((t0, t1, list(plog), list(wlog), dict(marks)))
    reads = q.get(timeout=300)
    p.join(60)
    pub.close()
    gpuipc.Pool.unlink(name + ".w")  # its names outlive this process: the broker would keep its memory
    print(json.dumps({"device": torch.cuda.get_device_name(0), "layers": layers, "bucket_bytes": bucket, "ring": ring,
                      "reader_stream": "legacy" if legacy else "side", "tensors": len(items)}))
    for (t0, t1, pl, wl, mk), rv in zip(runs, reads):
        ms = lambda t: (t - t0) / 1e6  # noqa: E731
        waits = {w["seq"]: w["slot_wait_us"] for w in wl}
        rows = {r["seq"]: r for r in rv["buckets"]}
        print(f"version {rv['version']}: publish() returned at {ms(t1):.2f} ms, reader synced at {ms(rv['synced']):.2f} ms"
              f" (start() returned at {ms(mk.get('start_end', t0)):.2f} ms, its admit() took "
              f"{mk.get('admit_ns', 0) / 1e6:.2f} ms)")
        print("  seq  slot_wait_us  flush_start  flush_end  reader_woke  enqueued  gpu_done  pieces")
        for f in pl:
            r = rows.get(f["seq"], {})
            print(f"  {f['seq']:4d} {waits.get(f['seq'], 0):12.1f} {ms(f['flush_start']):11.2f} {ms(f['flush_end']):10.2f} "
                  f"{ms(r['woke']) if 'woke' in r else float('nan'):11.2f} "
                  f"{ms(r['enqueued']) if 'enqueued' in r else float('nan'):9.2f} "
                  f"{ms(r['gpu_done']) if 'gpu_done' in r else float('nan'):9.2f} {r.get('pieces', 0):6d}")


if __name__ == "__main__":
    main()
