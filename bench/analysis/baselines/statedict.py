#!/usr/bin/env python3
"""Baseline of the pools suite: a state dict handed to another process through torch.multiprocessing.

    python3 bench/analysis/baselines/statedict.py --spec SPEC.json --sends 20

SPEC.json lists the tensors ([{"name", "shape"}, ...]); `gpuipc bench pools` writes it from its generator
(bench/suites/statedict.cpp: 291 bf16 tensors, 2 GiB less 5 KiB) so that both sides hand over the same dict. The producer
makes every tensor on cuda:0 (bfloat16, filled), starts a consumer process (spawn) that initialises CUDA before it
says it is ready, and then sends the same dict `sends` times through an mp.Queue. For each send the consumer takes
the dict off the queue (torch rebuilds each tensor from its CUDA IPC handle), touches every tensor (data_ptr() of
each, then a synchronize of its stream, which includes the waits torch queues on the producer's events), drops
it and acknowledges. One send = from the producer's put to the acknowledgement, timed at the producer.
Prints one JSON line last: {"impl", "p50_ms", "p99_ms", "first_ms", "sends", "tensors", "bytes", "version"};
{"impl", "skipped": why} when torch or a GPU is missing; {"impl", "error"} when it fails.
"""
import argparse
import json
import statistics
import sys
import time

import report

IMPL = "torch_mp_statedict"


def consumer(spec_len, q_in, q_ack, n):
    import torch
    torch.cuda.set_device(0)
    torch.zeros(1, device="cuda:0")  # CUDA initialised before the first send, as gpuipc's consumers are
    q_ack.put("ready")
    for i in range(n):
        sd = q_in.get()
        assert len(sd) == spec_len
        for t in sd.values():
            assert t.is_cuda and t.data_ptr() != 0
        torch.cuda.current_stream().synchronize()
        del sd, t
        q_ack.put(i)


def run(spec, sends):
    import torch
    import torch.multiprocessing as mp
    if not torch.cuda.is_available():
        return {"skipped": "torch sees no CUDA device"}
    ctx = mp.get_context("spawn")
    sd = {}
    for i, e in enumerate(spec):
        sd[e["name"]] = torch.full(e["shape"], float(i % 7 + 1), dtype=torch.bfloat16, device="cuda:0")
    torch.cuda.synchronize()
    nbytes = sum(t.numel() * t.element_size() for t in sd.values())
    q_in, q_ack = ctx.Queue(), ctx.Queue()
    p = ctx.Process(target=consumer, args=(len(spec), q_in, q_ack, sends + 1))
    p.start()
    assert q_ack.get(timeout=240) == "ready"
    ms = []
    for i in range(sends + 1):
        t0 = time.perf_counter()
        q_in.put(sd)
        got = q_ack.get(timeout=120)
        ms.append((time.perf_counter() - t0) * 1e3)
        assert got == i
    p.join(timeout=60)
    rest = sorted(ms[1:])
    return {"p50_ms": statistics.median(rest), "p99_ms": report.quantile(rest, 0.99),
            "min_ms": rest[0], "first_ms": ms[0], "sends": sends, "tensors": len(sd), "bytes": nbytes,
            "values_ms": [round(x, 4) for x in ms], "version": torch.__version__}


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--spec", required=True)
    ap.add_argument("--sends", type=int, default=20)
    a = ap.parse_args()
    out = {"impl": IMPL}

    def body():
        try:
            import torch  # noqa: F401
        except Exception as e:  # noqa: BLE001 - the reason to skip
            return {"skipped": f"torch is not importable: {type(e).__name__}: {e}"}
        with open(a.spec) as f:
            spec = json.load(f)
        return run(spec, max(1, a.sends))

    return report.finish(out, body)


if __name__ == "__main__":
    sys.exit(main())
