#!/usr/bin/env python3
"""Regenerates docs/study.md, the CUDA IPC study, from benchmark result files and the plots of bench/analysis/plot.py.

    python3 bench/analysis/study.py bench/results --img docs/img --out docs/study.md

Answers the four questions of the study in plain words, every figure pulled from the newest result of each suite
and device (never typed by hand), with the plots embedded and the commit, device, driver and date of every result:
  1. does sharing a chunk between two processes add memory or latency overhead? (access, segments, transfer,
     channels)
  2. is the memory coherent; what happens when one process writes while another reads? (coherence)
  3. does IPC work with VMM (cuMem) memory? (vmm, segments)
  4. what happens to shared memory when either side or the broker crashes? (faults)
Standard library only (plot.py's loader is reused; matplotlib is not needed here).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import plot  # noqa: E402  (the shared loader and helpers)

metric = plot.metric
samples = plot.samples
num = plot.num

BW_TOLERANCE = 0.05  # a ratio within 5% of 1 is called "no measurable difference"


# ---------------------------------------------------------------------------------------------------------------
# Formatting


def f(v: float | None, unit: str = "") -> str:
    """A number with sensible digits (3 significant for small values), or "n/a"."""
    if v is None:
        return "n/a"
    a = abs(v)
    if a >= 100:
        s = f"{v:,.0f}"
    elif a >= 10:
        s = f"{v:.1f}"
    elif a >= 1:
        s = f"{v:.2f}"
    elif a == 0:
        s = "0"
    else:
        s = f"{v:.3g}"
    return f"{s} {unit}".strip() if unit else s


def ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b not in (None, 0) else None


def x(r: float | None) -> str:
    if r is None:
        return "n/a"
    return f"{r:.0f}x" if r >= 20 else f"{r:.1f}x" if r >= 2 else f"{r:.3f}x"


def cell(v: Any) -> str:
    """A table cell: numbers formatted, nested values as compact JSON, pipes escaped."""
    if isinstance(v, bool):
        s = "yes" if v else "no"
    elif isinstance(v, (int, float)):
        s = f(float(v)) if isinstance(v, float) else str(v)
    elif isinstance(v, str):
        s = v
    elif v is None:
        s = ""
    else:
        s = json.dumps(v, separators=(",", ":"))
        if len(s) > 160:
            s = s[:157] + "..."
    return s.replace("|", "\\|").replace("\n", " ")


def table(headers: list[str], rows: list[list[Any]]) -> str:
    out = ["| " + " | ".join(cell(h) for h in headers) + " |", "|" + "---|" * len(headers)]
    for r in rows:
        out.append("| " + " | ".join(cell(c) for c in r) + " |")
    return "\n".join(out)


def short_commit(doc: dict[str, Any]) -> str:
    c = str(doc.get("commit", "unknown"))
    return c[:12] + (" (dirty)" if c.endswith("-dirty") else "")


def provenance(doc: dict[str, Any]) -> str:
    return (f"_{doc.get('suite', '?')} on {doc.get('device', '?')}, driver {doc.get('driver', '?')}, commit "
            f"`{short_commit(doc)}`, {doc.get('date', '?')}{', MPS' if doc.get('mps') else ''}_")


class Doc:
    """The study being written: markdown lines and the image directory relative to the document."""

    def __init__(self, results: dict, img_dir: str, out_path: str):
        self.results = results
        self.img_dir = img_dir
        self.rel_img = os.path.relpath(img_dir, os.path.dirname(os.path.abspath(out_path)) or ".")
        self.lines: list[str] = []

    def add(self, *text: str) -> None:
        self.lines.extend(text)

    def para(self, text: str) -> None:
        self.lines += [text, ""]

    def image(self, name: str, alt: str) -> bool:
        if os.path.isfile(os.path.join(self.img_dir, name)):
            self.para(f"![{alt}]({self.rel_img}/{name})")
            return True
        return False

    def images_of(self, suite: str, device: str, alt: str) -> None:
        """Every plot of a suite and device (for suites whose plots plot.py does not name, e.g. coherence)."""
        if not os.path.isdir(self.img_dir):
            return
        for name in sorted(os.listdir(self.img_dir)):
            if name.startswith(f"{suite}-{device}") and name.endswith(".png"):
                self.image(name, alt)

    def get(self, suite: str, device: str) -> dict[str, Any] | None:
        return self.results.get((suite, device))

    def devices(self, *suites: str) -> list[str]:
        return [d for d in plot.devices_of(self.results) if any((s, d) in self.results for s in suites)]


def verdict_bw(r: float | None) -> str:
    if r is None:
        return "not measured"
    if abs(r - 1) <= BW_TOLERANCE:
        return "no measurable difference"
    return f"{abs(r - 1) * 100:.1f}% {'slower' if r < 1 else 'faster'}"


# ---------------------------------------------------------------------------------------------------------------
# The questions


def q1_access(d: Doc, dev: str) -> bool:
    doc = d.get("access", dev)
    if not doc:
        return False
    d.para(f"**Kernel access** ({provenance(doc)}). Process A allocates the memory; process B runs `read_sum` and "
           "`write_fill` kernels over it and times them with events: B's own `cuMemAlloc` memory (local), A's memory "
           "opened with `cuIpcOpenMemHandle` (legacy IPC), and a gpuipc device segment A created and B opened by name.")
    rows = []
    for op in ("read", "write"):
        local = metric(doc, f"{op}_bw_gbs_local_1GiB")
        leg = metric(doc, f"{op}_bw_gbs_legacy_1GiB")
        seg = metric(doc, f"{op}_bw_gbs_segment_1GiB")
        rows.append([f"{op} bandwidth, 1 GiB (GB/s)", f(local), f"{f(leg)} ({x(ratio(leg, local))})",
                     f"{f(seg)} ({x(ratio(seg, local))})"])
    for op in ("read", "write"):
        local = metric(doc, f"{op}_latency_us_local_4KiB")
        leg = metric(doc, f"{op}_latency_us_legacy_4KiB")
        seg = metric(doc, f"{op}_latency_us_segment_4KiB")
        rows.append([f"{op} time per launch, 4 KiB (us)", f(local), f"{f(leg)} ({x(ratio(leg, local))})",
                     f"{f(seg)} ({x(ratio(seg, local))})"])
    d.para(table(["", "local", "legacy IPC (x local)", "gpuipc segment (x local)"], rows))

    # Over every size: the widest deviation of each kind from local, from the curves in `samples`.
    spans = []
    worst = None
    for kind, name in (("segment", "gpuipc segment"), ("legacy", "legacy IPC")):
        for op in ("read", "write"):
            local = {s.get("size_bytes"): num((s.get("bw_gbs") or {}).get("median"))
                     for s in samples(doc, name="access", kind="local", op=op)}
            rs = []
            for s in samples(doc, name="access", kind=kind, op=op):
                r = ratio(num((s.get("bw_gbs") or {}).get("median")), local.get(s.get("size_bytes")))
                if r is not None:
                    rs.append((r, s.get("label") or plot.size_label(num(s.get("size_bytes")) or 0)))
            if rs:
                lo, hi = min(rs), max(rs)
                spans.append(f"{name} {op}s run at {lo[0]:.3f}x ({lo[1]}) to {hi[0]:.3f}x ({hi[1]}) of local")
                for r in (lo, hi):
                    if worst is None or abs(r[0] - 1) > abs(worst[0] - 1):
                        worst = (r[0], f"{name} {op}s at {r[1]}")
    if spans:
        n = len({s.get("size_bytes") for s in samples(doc, name="access")})
        d.para(f"Over all {n} sizes, " + "; ".join(spans) + ".")
    if worst is not None:
        if abs(worst[0] - 1) <= BW_TOLERANCE:
            d.para(f"**Answer (bandwidth and latency): no overhead.** Memory reached through another process's "
                   f"mapping is the same HBM through the same kind of page table: the furthest any size strays from "
                   f"local is {worst[0]:.3f}x ({worst[1]}), within {BW_TOLERANCE * 100:.0f}% (bandwidth and per-launch time "
                   f"are two views of the same timings).")
        else:
            d.para(f"**Answer (bandwidth and latency): the furthest deviation from local is {worst[0]:.3f}x "
                   f"({worst[1]}), more than {BW_TOLERANCE * 100:.0f}%;** compare it with the spread of the local "
                   f"samples (p99/min in the result file) before calling it overhead.")
    seg_mib = metric(doc, "open_mem_overhead_mib_segment")
    leg_mib = metric(doc, "open_mem_overhead_mib_legacy")
    gran = metric(doc, "segment_granularity_bytes")
    mem = next(iter(samples(doc, name="memory")), {})
    local_mib = num(mem.get("alloc_free_drop_bytes_local"))
    buf = num(mem.get("buffer_bytes"))
    if seg_mib is not None:
        d.para(f"**Memory.** Opening A's {plot.size_label(buf) if buf else ''} segment lowered B's free GPU memory by "
               f"{f(seg_mib)} MiB and opening the legacy handle by {f(leg_mib)} MiB, where allocating the same size "
               f"in B took {f(local_mib / (1 << 20) if local_mib is not None else None)} MiB: sharing maps the "
               f"exporter's memory, it does not copy it. The cost of sharing is granularity: a segment's size is "
               f"rounded up to {plot.size_label(gran or 0)} (the allocation granularity), so a 4 KiB segment occupies that much (and each process "
               f"pays for its own CUDA context).")
    d.image(plot.image_name("access", dev, "latency"), "kernel time per launch vs size")
    d.image(plot.image_name("access", dev, "bandwidth"), "kernel bandwidth vs size")
    return True


def q1_segments(d: Doc, dev: str) -> bool:
    doc = d.get("segments", dev)
    if not doc:
        return False
    first = metric(doc, "open_first_us_1GiB")
    legacy = metric(doc, "legacy_open_us_1GiB")
    cached = metric(doc, "open_cached_us")
    floor = metric(doc, "vmm_floor_us_1GiB")
    parts = [f"**Opening** ({provenance(doc)}): the first `Segment::open` of a 1 GiB segment in another process takes "
             f"{f(first, 'us')} against {f(legacy, 'us')} for legacy `cuIpcOpenMemHandle` "
             f"({x(ratio(first, legacy))}) and {f(floor, 'us')} for the bare VMM import it is built on"]
    if cached is not None:
        parts.append(f"; opening it again in the same process is a cache hit: {f(cached, 'us')}")
    rb, wb = metric(doc, "read_bw_ratio"), metric(doc, "write_bw_ratio")
    if rb is not None:
        parts.append(f". Kernels read through the opened segment at {x(rb)} and write at {x(wb)} local speed")
    d.para("".join(parts) + ". The open is paid once per process and segment, not per access.")
    d.image(plot.image_name("segments", dev), "first open of a segment vs legacy IPC vs raw VMM")
    return True


def q1_transfer(d: Doc, dev: str) -> bool:
    doc = d.get("transfer", dev)
    if not doc:
        return False
    rows = []
    for key, what in plot.TRANSFER_DIRS:
        s, p = metric(doc, f"{key}_gbs_segment"), metric(doc, f"{key}_gbs_plain")
        if s is None and p is None:
            continue
        r = ratio(s, p)
        rows.append([what, f(s), f(p), x(r), verdict_bw(r)])
    nbytes = next((num(s.get("bytes")) for s in samples(doc, name="transfer") if num(s.get("bytes"))), None)
    d.para(f"**Copies** ({provenance(doc)}): synchronous copies of {plot.size_label(nbytes) if nbytes else '?'} into "
           "and out of segments (device segments and a host_pinned segment opened by B) beside the same copies on "
           "B's `cuMemAlloc` / `cuMemHostAlloc` memory, GB/s (median).")
    d.para(table(["copy", "segments", "plain", "segments / plain", "verdict"], rows))
    if metric(doc, "p2p_out_gbs_segment") is None:
        d.para("Peer copies: " + next((n for n in doc.get("notes") or [] if "peer" in n.lower()),
                                      "not measured on this machine") + ".")
    d.image(plot.image_name("transfer", dev), "copy bandwidth, segments vs plain")
    return True


def ordering_paragraph(d: Doc, dev: str) -> None:
    """Where two-process streaming time goes under MPS, from the ordering suite of the same device."""
    doc = d.get("ordering", dev)
    if not doc:
        return
    samples = {s.get("what"): s.get("result", {}) for s in doc.get("samples", [])}
    two, tl = samples.get("two_process_mps", {}), samples.get("timeline_mps", {})
    cost = samples.get("op_cost_mps", {}).get("kernel_8192KiB", {})
    if not two:
        return

    def r(name):
        v = two.get(name, {})
        return v.get("ratio") if isinstance(v, dict) else None

    def t(name, key):
        return tl.get(name, {}).get("timeline", {}).get(key)

    d.para(f"Where that time goes under MPS ({provenance(doc)}): each stream memory operation costs its stream "
           f"{f(cost.get('write64_host_extra'), 'us')} (a write) or {f(cost.get('wait64_met_host_extra'), 'us')} (a "
           f"wait already met) between kernels, an event record {f(max(0.0, cost.get('event_record_extra') or 0.0), 'us')}"
           ". Against "
           f"the one-process reference of the same run, the channel without pacing reaches "
           f"{x(r('channel_pacing_0us'))}, with its default pacing {x(r('channel'))}, and the same kernels in two "
           f"processes with no ordering at all {x(r('none'))}. Without pacing, the consumer reads each frame "
           f"{f(t('channel_pacing_0us', 'write_end_to_read_start_us'), 'us')} after it was written and its kernel "
           f"takes {f(t('channel_pacing_0us', 'consumer_kernel_us'), 'us')}; with pacing "
           f"{f(t('channel', 'write_end_to_read_start_us'), 'us')} and {f(t('channel', 'consumer_kernel_us'), 'us')} "
           f"(`timeline_mps` samples).")


def q1_channels(d: Doc, dev: str) -> bool:
    doc = d.get("channels", dev)
    if not doc:
        return False
    h = metric(doc, "handoff_rtt_p50_us_1MiB")
    t = metric(doc, "torch_handoff_rtt_p50_us_1MiB")
    c = metric(doc, "cudacore_handoff_rtt_p50_us_1MiB")
    sem, ev = metric(doc, "sem_rtt_us"), metric(doc, "ipc_event_rtt_us")
    sem_host = metric(doc, "sem_host_sync_rtt_us")
    d.para(f"**Handing buffers over** ({provenance(doc)}): a 1 MiB buffer handed to another process and acknowledged "
           f"through a gpuipc channel takes {f(h, 'us')} (median), against {f(t, 'us')} with torch.multiprocessing "
           f"({x(ratio(t, h))} slower) and {f(c, 'us')} with cuda.core IPC pools ({x(ratio(c, h))} slower). A "
           f"stream-ordered cross-process round trip through a gpuipc semaphore takes {f(sem, 'us')} enqueued back "
           f"to back"
           + (f" ({f(sem_host, 'us')} with the host waiting for each, as it must for IPC events)" if sem_host else "")
           + f", through IPC events {f(ev, 'us')}.")
    sr, srm = metric(doc, "stream_throughput_ratio"), metric(doc, "stream_throughput_ratio_mps")
    if sr is not None:
        d.para(f"Streaming 8 MiB frames from one process to another reaches {x(sr)} of the one-process frame rate "
               f"without MPS{f' and {x(srm)} under MPS' if srm is not None else ''}: without MPS the GPU time-slices "
               "between the two processes' contexts, which is a latency cost of running two processes, not of the "
               "shared memory.")
        ordering_paragraph(d, dev)
    d.image(plot.image_name("channels", dev), "cross-process round trips")
    return True


def generic_suite(d: Doc, suite: str, what: str) -> None:
    """Renders a suite this script does not know in detail (coherence, faults): notes, metrics, samples."""
    devs = d.devices(suite)
    if not devs:
        d.para(f"Not yet measured: there is no `{suite}-*.json` in the results ({what}).")
        return
    for dev in devs:
        doc = d.get(suite, dev)
        d.para(provenance(doc) + ".")
        notes = [n for n in doc.get("notes") or [] if isinstance(n, str)]
        if notes:
            d.add(*[f"- {n}" for n in notes])
            d.add("")
        metrics = doc.get("metrics") or {}
        if metrics:
            d.para(table(["metric", "value"], [[k, v] for k, v in sorted(metrics.items())]))
        rows = [s for s in doc.get("samples") or [] if isinstance(s, dict)]
        if rows:
            keys: list[str] = []
            for s in rows:
                for k in s:
                    if k not in keys and k != "values":
                        keys.append(k)
            # Keys most likely to carry the story first.
            pref = ["scenario", "name", "what", "outcome", "checked", "ok", "result"]
            keys.sort(key=lambda k: pref.index(k) if k in pref else len(pref))
            d.para(table(keys, [[s.get(k) for k in keys] for s in rows]))
        d.images_of(suite, dev, f"{suite} results")


def q3_vmm(d: Doc, dev: str) -> bool:
    doc = d.get("vmm", dev)
    if not doc:
        return False
    d.para(provenance(doc) + ".")
    leg = next(iter(samples(doc, name="legacy_handle_on_vmm")), None)
    if leg is not None:
        if leg.get("ok"):
            imp = leg.get("importer") or {}
            d.para("**Legacy IPC:** on this driver `cuIpcGetMemHandle` *accepted* memory from `cuMemCreate`; opening "
                   f"the handle in another process {'worked' if imp.get('ok') else 'failed with ' + str(imp.get('cu_result_name'))}.")
        else:
            d.para(f"**Legacy IPC: no.** `cuIpcGetMemHandle` on memory from `cuMemCreate` + `cuMemMap` (mapped and "
                   f"usable in its process) fails with `{leg.get('cu_result_name') or '?'}` ({leg.get('cu_result')}). "
                   f"The driver's message: \"{leg.get('error', '')}\". Legacy handles exist only for `cuMemAlloc` "
                   "(`cudaMalloc`) memory.")
    seg_leg = next(iter(samples(doc, name="legacy_handle_on_segment")), None)
    if seg_leg is not None and not seg_leg.get("ok"):
        d.para(f"The same holds for a gpuipc device segment's pointer: `{seg_leg.get('cu_result_name') or '?'}`.")
    chk = next(iter(samples(doc, name="segment_fd_path")), None)
    if chk is not None:
        ok = bool(chk.get("ok"))
        d.para(f"**gpuipc's path: {'yes' if ok else 'NO'}.** A created a {plot.size_label(num(chk.get('size_bytes')) or 0)} "
               f"device segment (`cuMemCreate` memory exported once as a POSIX fd, `cuMemExportToShareableHandle`) and "
               f"wrote a pattern; B opened it by name (the broker passed the fd; B imported and mapped it) and found "
               f"{chk.get('b_mismatches')} of {chk.get('words')} words wrong; B wrote another pattern and A found "
               f"{chk.get('a_mismatches_after_b_wrote')} wrong.")
    steps = [s for s, _ in plot.VMM_STEPS]
    labels = []
    for s in samples(doc, name="vmm_step_us"):
        if s.get("label") not in [lbl for lbl, _ in labels]:
            labels.append((s.get("label"), num(s.get("size_bytes")) or 0))
    labels.sort(key=lambda t: t[1])
    if labels:
        rows = []
        for step, name in plot.VMM_STEPS:
            rows.append([name] + [f(metric(doc, f"vmm_{step}_us_{lbl}")) for lbl, _ in labels])
        rows.append(["**open = import + reserve + map + set access**"] +
                    [f(metric(doc, f"vmm_open_total_us_{lbl}")) for lbl, _ in labels])
        d.para("**What each step costs** (median microseconds per call, a fresh exported allocation per repetition; "
               "A creates and exports, B imports, maps and tears down):")
        d.para(table(["step"] + [lbl for lbl, _ in labels], rows))
        big = labels[-1][0]
        costs = {s: metric(doc, f"vmm_{s}_us_{big}") for s in steps}
        known = {k: v for k, v in costs.items() if v is not None}
        if known:
            top = sorted(known.items(), key=lambda kv: -kv[1])[:2]
            d.para(f"At {big} the most expensive steps are {top[0][0]} ({f(top[0][1], 'us')})"
                   + (f" and {top[1][0]} ({f(top[1][1], 'us')})" if len(top) > 1 else "")
                   + ". Creating and exporting happen once per segment in its creator; an importer pays import + map "
                     "+ set access per open (gpuipc reserves its address range once per process).")
    d.image(plot.image_name("vmm", dev), "cost of each VMM step vs size")
    return True


# ---------------------------------------------------------------------------------------------------------------


def build(results: dict, img_dir: str, out_path: str) -> str:
    d = Doc(results, img_dir, out_path)
    d.add("# The CUDA IPC study: overhead, coherence, VMM, faults", "")
    d.para("_Generated by `bench/analysis/study.py` (`make study`) from the newest result file of each suite and device in "
           "`bench/results/`, with plots from `bench/analysis/plot.py`. Every figure below is read from those files; do not edit "
           "this page by hand: rerun the benchmarks (`gpuipc bench all`) and `make study`._")

    d.add("## Results used", "")
    rows = []
    for (suite, dev), doc in sorted(results.items()):
        if suite not in ("access", "vmm", "transfer", "segments", "channels", "coherence", "faults"):
            continue
        rows.append([suite, doc.get("device"), doc.get("driver"), f"`{short_commit(doc)}`", doc.get("date"),
                     bool(doc.get("mps")), f"`{os.path.relpath(doc['_file'])}`"])
    d.para(table(["suite", "device", "driver", "commit", "date", "MPS", "file"], rows) if rows
           else "No result files yet.")

    d.add("## 1. Does sharing a chunk between two processes add memory or latency overhead?", "")
    devs = d.devices("access", "segments", "transfer", "channels")
    if not devs:
        d.para("Not yet measured.")
    for dev in devs:
        if len(devs) > 1:
            d.add(f"### {dev}", "")
        found = [q1_access(d, dev), q1_segments(d, dev), q1_transfer(d, dev), q1_channels(d, dev)]
        if not found[0]:
            d.para("Kernel access through a shared mapping: not yet measured on this device (no access-*.json).")
        if not found[2]:
            d.para("Copies into and out of segments: not yet measured on this device (no transfer-*.json).")

    d.add("## 2. Is the memory coherent? What happens when one process writes while another reads?", "")
    generic_suite(d, "coherence", "the coherence suite")

    d.add("## 3. Does IPC work with VMM (cuMem) memory?", "")
    devs = d.devices("vmm")
    if not devs:
        d.para("Not yet measured: there is no `vmm-*.json` in the results.")
    for dev in devs:
        if len(devs) > 1:
            d.add(f"### {dev}", "")
        q3_vmm(d, dev)

    d.add("## 4. What happens to shared memory when either side or the broker crashes?", "")
    generic_suite(d, "faults", "the faults suite")

    d.add("## Notes of each run", "")
    d.para("The plain-language notes each suite wrote with its numbers, verbatim.")
    for (suite, dev), doc in sorted(results.items()):
        notes = [n for n in doc.get("notes") or [] if isinstance(n, str)]
        if not notes or suite in ("coherence", "faults"):
            continue
        d.add(f"### {suite} ({dev})", "", provenance(doc), "")
        d.add(*[f"- {n}" for n in notes])
        d.add("")
    return "\n".join(d.lines).rstrip() + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("results", nargs="?", default="bench/results", help="directory of result JSON files")
    ap.add_argument("--img", default="docs/img", help="directory of the PNG files from plot.py")
    ap.add_argument("--out", default="docs/study.md", help="the document to write")
    args = ap.parse_args(argv)
    results = plot.load_results(args.results)
    text = build(results, args.img, args.out)
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w", encoding="utf-8") as fh:
        fh.write(text)
    print(f"study: {args.out} ({len(results)} result files)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
