#!/usr/bin/env python3
"""The README's table of figures, made from the result files so that nobody types a number into it.

    python3 bench/analysis/readme_table.py            # rewrites the table between the markers in README.md
    python3 bench/analysis/readme_table.py --check    # exits 1 when README.md differs from what the files give

`make study` runs the first; tests/python/test_readme_table.py runs the second in CI. Each row of ROWS names a metric
and the result files (bench/results) it is read from, and its baselines, which come from the same files (the same
runs). With several files a cell gives the median over them, "over N runs", and the range when the runs differ by
more than 20% of the median. The file column names each file with its device and commit, as the files record them.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
from dataclasses import dataclass, field
from typing import Dict, List, Optional, Sequence, Tuple

ROOT = os.path.normpath(os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))
BEGIN = ("<!-- figures table: made by `make study` (bench/analysis/readme_table.py) from the files it names; "
         "do not edit -->")
END = "<!-- end of figures table -->"
SPREAD = 0.20  # runs that differ by more than this fraction of their median are given as a range


@dataclass
class Row:
    what: str
    metric: str
    unit: str  #: "us", "ms", "GB/s", "x" (a ratio)
    files: Sequence[str]
    #: (name, metric, unit) or (name, metric, unit, the row's metric it is compared with; default the row's own; ""
    #: none: they were not measured alike)
    baselines: Sequence[Tuple[str, ...]] = field(default_factory=tuple)
    also: Sequence[Tuple[str, str]] = field(default_factory=tuple)  #: (label, metric) in the row's unit
    note: str = ""


#: Ten `gpuipc bench channels --quick` runs at one commit, five on an H100 and five on an H200 (issue 17's set; the
#: ordering, pools and weights suites ran at the same commit on the same machines).
CHANNELS_RUNS = ["channels-quick-f03d8ba-h100-5runs-20261127.json", "channels-quick-f03d8ba-h200-5runs-20261127.json"]

#: Ten `gpuipc bench python --quick` runs at that commit, five on each of the same two machines.
PYTHON_RUNS = ["python-quick-f03d8ba-h100-5runs-20261127.json", "python-quick-f03d8ba-h200-5runs-20261127.json"]

#: The pools and weights suites (--quick) at that commit, once on each of the two machines.
POOLS_RUNS = ["pools-quick-f03d8ba-h100-20261127.json", "pools-quick-f03d8ba-h200-20261127.json"]
WEIGHTS_RUNS = ["weights-quick-f03d8ba-h100-20261127.json", "weights-quick-f03d8ba-h200-20261127.json"]

ROWS: List[Row] = [
    Row("1 MiB buffer handoff round trip, C++ channel (p50)", "handoff_rtt_p50_us_1MiB", "us",
        CHANNELS_RUNS,
        [("torch.multiprocessing", "torch_handoff_rtt_p50_us_1MiB", "us"),
         ("cuda.core IPC pool", "cudacore_handoff_rtt_p50_us_1MiB", "us")]),
    Row("1 MiB torch tensor handoff from Python, zero-copy (`acquire`, `slot.tensor()`, `publish_array`; `recv`, "
        "`msg.tensor()`, `release`; p50)", "py_zero_copy_handoff_rtt_p50_us_1MiB", "us", PYTHON_RUNS,
        [("torch.multiprocessing", "torch_handoff_rtt_p50_us_1MiB", "us"),
         ("cuda.core", "cudacore_handoff_rtt_p50_us_1MiB", "us")],
        also=[("on torch's default stream", "py_zero_copy_handoff_legacy_stream_rtt_p50_us_1MiB")],
        note="[channels.md](docs/channels.md#from-python)"),
    Row("the same with `Channel.send(tensor)`, which copies it into the slot (p50)", "py_handoff_rtt_p50_us_1MiB", "us",
        PYTHON_RUNS,
        [("torch.multiprocessing", "torch_handoff_rtt_p50_us_1MiB", "us"),
         ("cuda.core", "cudacore_handoff_rtt_p50_us_1MiB", "us")]),
    # IPC events need the host in the loop (record, synchronise, hand over): their ratio is to the semaphore's round
    # trip timed the same way; no such semaphore figure under MPS, so no ratio there.
    Row("stream-ordered cross-process round trip (semaphore; enqueued back to back, no host in the loop)", "sem_rtt_us",
        "us", CHANNELS_RUNS,
        [("IPC events (the host relays each round trip)", "ipc_event_rtt_us", "us", "sem_host_sync_rtt_us"),
         ("IPC events under MPS", "ipc_event_rtt_us_mps", "us", "")],
        also=[("with the host waiting for each, as IPC events do", "sem_host_sync_rtt_us"),
              ("under MPS", "sem_rtt_us_mps")]),
    Row("8 MiB frames streamed between two processes, frame rate against one process", "stream_throughput_ratio", "x",
        CHANNELS_RUNS,
        [("one process", "stream_fps_one_process", "fps")],
        also=[("under MPS", "stream_throughput_ratio_mps")],
        note="the one-process reference moves between runs: [channels.md](docs/channels.md#throughput)"),
    Row("first open of a 1 GiB device segment in another process", "open_first_us_1GiB", "us",
        ["segments-h200-20261121.json"],
        [("cudaIpcOpenMemHandle", "legacy_open_us_1GiB", "us"),
         ("raw VMM import+map+access", "vmm_raw_open_us_1GiB", "us")]),
    Row("a 2 GiB state dict of 291 bf16 tensors, from its name to every device pointer in a fresh process (C++ Pool)",
        "statedict_open_ms", "ms", POOLS_RUNS,
        [("torch.multiprocessing", "torch_mp_statedict_ms", "ms")]),
    Row("the same from Python: `gpuipc.open_tensors` to 291 torch tensors", "weights_open_ms", "ms",
        WEIGHTS_RUNS,
        [("torch.multiprocessing", "torch_mp_weights_open_ms", "ms")],
        note="target 1 ms, not met: [torch.md](docs/torch.md#where-it-stands-measured) says where the time goes"),
    Row("a 16 GiB state dict of 3063 bf16 tensors streamed by reference to another process "
        "(`stream_publisher(by_reference=True)`), against a local copy of the dict", "weights_stream_byref_ratio", "x",
        ["weights-stream-919ec64-h100-run1-20261126.json", "weights-stream-919ec64-h100-run2-20261126.json",
         "weights-stream-919ec64-h200-run1-20261126.json", "weights-stream-919ec64-h200-run2-20261126.json",
         "weights-stream-13ee819-h100-20261126.json"],
        [("local copy", "local_d2d_gbs", "GB/s")],
        note="three H100 and two H200 runs; the local copy is the faster of two ways: "
             "[torch.md](docs/torch.md#where-it-stands-measured)"),
    Row("`Pool::resolve` of a block in a chunk this process has mapped", "pool_resolve_cached_p50_us", "us",
        POOLS_RUNS),
    Row("open of a segment this process has open (cache hit)", "open_cached_us", "us", ["segments-h200-20261121.json"]),
    Row("kernel read bandwidth through a 1 GiB segment, against local memory", "read_bw_ratio", "x",
        ["segments-h200-20261121.json"], [("local", "read_bw_gbs_local", "GB/s")],
        also=[("write", "write_bw_ratio")]),
    # Like with like: the copy engine through the segment against cuMemcpyPeer, a kernel against a kernel on raw peer
    # memory (peer_read_gbs is the faster of the two ways, which no single baseline matches).
    Row("GPU 0 reading a segment of GPU 1 over NVLink (copy engine)", "peer_read_gbs_copy", "GB/s",
        ["multigpu-h200-20261126.json"],
        [("cuMemcpyPeer", "memcpy_peer_read_gbs", "GB/s"),
         ("a kernel reading raw peer memory", "raw_peer_read_gbs_kernel", "GB/s")],
        also=[("a kernel reading the segment", "peer_read_gbs_kernel")]),
]


def _fmt(v: float, unit: str) -> str:
    if unit == "x":
        return f"{v:.3f}x" if v < 10 else f"{v:.1f}x"
    digits = 2 if abs(v) < 1 else 1 if abs(v) < 100 else 0
    text = f"{v:.{digits}f}"
    return {"us": f"{text} us", "ms": f"{text} ms", "GB/s": f"{text} GB/s", "fps": f"{text} frames/s"}.get(unit, text)


def _cell(values: List[float], unit: str) -> str:
    """The median; with several runs "over N runs", and the range when they differ by more than SPREAD."""
    if not values:
        return "-"
    mid = statistics.median(values)
    text = _fmt(mid, unit)
    if len(values) > 1:
        lo, hi = min(values), max(values)
        if mid and (hi - lo) / abs(mid) > SPREAD:
            text = f"{_fmt(lo, unit)} to {_fmt(hi, unit)} (median {text})"
        text += f" over {len(values)} runs"
    return text


def _load(results: str, name: str) -> List[Dict]:
    """The runs of a result file: one, or each of a file of several runs ({"runs": [...]})."""
    with open(os.path.join(results, name)) as f:
        doc = json.load(f)
    return list(doc["runs"]) if isinstance(doc.get("runs"), list) else [doc]


def _values(docs: List[Dict], metric: str) -> List[float]:
    return [float(d["metrics"][metric]) for d in docs if isinstance(d.get("metrics", {}).get(metric), (int, float))]


def _made_on(runs: List[Dict]) -> str:
    """The devices and commits a file's runs record, each once, in the order of the runs."""
    seen: List[str] = []
    for d in runs:
        text = f"{d.get('device', '?')}, {str(d.get('commit', '?'))[:7]}"
        if text not in seen:
            seen.append(text)
    return "; ".join(seen)


def render(results: str) -> str:
    """The table, markers included."""
    lines = [BEGIN, "| what | gpuipc | baseline (same runs) | files |", "|---|---|---|---|"]
    for row in ROWS:
        docs = [d for f in row.files for d in _load(results, f)]
        mine = _values(docs, row.metric)
        if not mine:
            raise SystemExit(f"readme_table: no {row.metric} in {', '.join(row.files)}")
        cell = _cell(mine, row.unit)
        for label, metric in row.also:
            cell += f"; {label} {_cell(_values(docs, metric), row.unit)}"
        if row.note:
            cell += f" ({row.note})"
        base = []
        for name, metric, unit, *against in row.baselines:
            vals = _values(docs, metric)
            ours = (_values(docs, against[0]) if against[0] else []) if against else mine
            if vals:
                ratio = ""
                if unit == row.unit and row.unit in ("us", "ms") and ours and statistics.median(ours):
                    ratio = f" ({statistics.median(vals) / statistics.median(ours):.1f}x gpuipc's time)"
                base.append(f"{name} {_cell(vals, unit)}{ratio}")
        where = ", ".join(f"[`{f}`](bench/results/{f}) ({_made_on(_load(results, f))})" for f in row.files)
        lines.append(f"| {row.what} | {cell} | {'; '.join(base) or '-'} | {where} |")
    lines.append(END)
    return "\n".join(lines)


def rewrite(readme: str, table: str) -> Optional[str]:
    """README text with the table between the markers replaced; None when the markers are missing."""
    a, b = readme.find(BEGIN), readme.find(END)
    if a < 0 or b < a:
        return None
    return readme[:a] + table + readme[b + len(END):]


def main(argv: Optional[List[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--results", default=os.path.join(ROOT, "bench", "results"))
    ap.add_argument("--readme", default=os.path.join(ROOT, "README.md"))
    ap.add_argument("--check", action="store_true", help="exit 1 when the README's table is not what the files give")
    a = ap.parse_args(argv)
    with open(a.readme) as f:
        text = f.read()
    new = rewrite(text, render(a.results))
    if new is None:
        print(f"readme_table: {a.readme} lacks the markers {BEGIN!r} ... {END!r}", file=sys.stderr)
        return 2
    if a.check:
        if new != text:
            print("readme_table: README.md's table differs from the result files: run `make study` and commit "
                  "README.md", file=sys.stderr)
            return 1
        return 0
    if new != text:
        with open(a.readme, "w") as f:
            f.write(new)
    return 0


if __name__ == "__main__":
    sys.exit(main())
