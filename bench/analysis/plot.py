#!/usr/bin/env python3
"""Draws the study's plots (PNG) from benchmark result files.

    python3 bench/analysis/plot.py bench/results --out docs/img

Reads the newest result of each suite and device (bench/results/<suite>-<device>-<YYYYMMDD>.json, the contract of
docs/benchmarks.md, Results files) and writes, per device:
  access-<device>-latency.png, access-<device>-bandwidth.png   latency / bandwidth vs size, log-log
  vmm-<device>.png                                             cost of each cuMem step vs size
  transfer-<device>.png                                        copy bandwidth, segment vs plain, grouped bars
  channels-<device>.png                                        round trips (log y) and two-process stream ratio
  segments-<device>.png                                        open cost: gpuipc vs legacy IPC vs raw VMM
A suite without a result file is skipped with a message. Standard library + matplotlib (Agg) only.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import sys
from typing import Any

# A suite's result on one device, as `gpuipc bench` names it: SUITE-DEVICE-DATE.json. Files with more in the name
# (`--quick` runs, a commit, several runs, an A/B) are records kept beside them, not the study's figures.
FILE_RE = re.compile(r"^(?P<suite>[A-Za-z0-9_]+)-(?P<device>[^-]+)-(?P<date>\d{8})\.json$")

# Colours and labels shared by every plot: the same thing looks the same everywhere.
KIND_LABEL = {"local": "local (cuMemAlloc)", "legacy": "legacy IPC (cuIpcOpenMemHandle)", "segment": "gpuipc segment"}
KIND_COLOR = {"local": "#4d4d4d", "legacy": "#e08214", "segment": "#2166ac", "plain": "#4d4d4d"}


# ---------------------------------------------------------------------------------------------------------------
# Loading (also used by study.py)


def load_results(results_dir: str) -> dict[tuple[str, str], dict[str, Any]]:
    """{(suite, device): document} with the newest document of each suite and device; each document gets
    "_file" (its path) and "_device_key" (the device part of its name: h100, h200, ...)."""
    best: dict[tuple[str, str], tuple[str, dict[str, Any]]] = {}
    if not os.path.isdir(results_dir):
        return {}
    for name in sorted(os.listdir(results_dir)):
        m = FILE_RE.match(name)
        if not m:
            continue
        path = os.path.join(results_dir, name)
        try:
            with open(path, encoding="utf-8") as f:
                doc = json.load(f)
        except (OSError, ValueError) as e:
            print(f"plot: skipping {path}: {e}", file=sys.stderr)
            continue
        if not isinstance(doc, dict):
            continue
        suite = str(doc.get("suite") or m.group("suite"))
        device = m.group("device")
        # Newest by the document's date (ISO-8601 sorts as text), then by the file's date stamp.
        order = f"{doc.get('date', '')}|{m.group('date')}"
        doc["_file"] = path
        doc["_device_key"] = device
        key = (suite, device)
        if key not in best or order > best[key][0]:
            best[key] = (order, doc)
    return {k: v[1] for k, v in best.items()}


def devices_of(results: dict[tuple[str, str], dict[str, Any]]) -> list[str]:
    return sorted({device for (_, device) in results})


def num(x: Any) -> float | None:
    """A finite float, or None."""
    if isinstance(x, bool) or x is None:
        return None
    try:
        v = float(x)
    except (TypeError, ValueError):
        return None
    return v if math.isfinite(v) else None


def metric(doc: dict[str, Any] | None, name: str) -> float | None:
    if not doc:
        return None
    return num((doc.get("metrics") or {}).get(name))


def samples(doc: dict[str, Any] | None, **match: Any) -> list[dict[str, Any]]:
    """The samples whose keys equal every `match` item."""
    if not doc:
        return []
    out = []
    for s in doc.get("samples") or []:
        if isinstance(s, dict) and all(s.get(k) == v for k, v in match.items()):
            out.append(s)
    return out


def size_label(n: float) -> str:
    for unit, div in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= div:
            v = n / div
            return f"{v:.0f} {unit}" if abs(v - round(v)) < 1e-9 else f"{v:.1f} {unit}"
    return f"{n:.0f} B"


def image_name(suite: str, device: str, part: str = "") -> str:
    return f"{suite}-{device}{'-' + part if part else ''}.png"


# ---------------------------------------------------------------------------------------------------------------
# Plots


def _plt():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    plt.rcParams.update({"figure.dpi": 110, "font.size": 10, "axes.grid": True, "grid.alpha": 0.3})
    return plt


def _subtitle(doc: dict[str, Any]) -> str:
    commit = str(doc.get("commit", "?"))
    short = commit[:10] + (" (dirty)" if commit.endswith("-dirty") else "")
    return f"{doc.get('device', '?')}, driver {doc.get('driver', '?')}, commit {short}, {str(doc.get('date', '?'))[:10]}"


def _size_axis(ax, sizes: list[float]) -> None:
    ax.set_xscale("log", base=2)
    ax.set_xticks(sizes)
    ax.set_xticklabels([size_label(s) for s in sizes], rotation=45, ha="right")
    ax.minorticks_off()


def plot_access(doc: dict[str, Any], out: str, device: str) -> list[str]:
    plt = _plt()
    written = []
    for what, key, unit, fname in (
        ("Per-launch time", "latency_us", "time per kernel launch (us)", "latency"),
        ("Bandwidth", "bw_gbs", "bandwidth (GB/s, 1e9 B/s)", "bandwidth"),
    ):
        fig, axes = plt.subplots(1, 2, figsize=(11, 4.4), sharey=True)
        any_line = False
        all_sizes: set[float] = set()
        for ax, op in zip(axes, ("read", "write")):
            for kind in ("local", "legacy", "segment"):
                pts = []
                for s in samples(doc, name="access", kind=kind, op=op):
                    size = num(s.get("size_bytes"))
                    v = num((s.get(key) or {}).get("median")) if isinstance(s.get(key), dict) else None
                    if size and v and v > 0:
                        pts.append((size, v))
                if not pts:
                    continue
                pts.sort()
                all_sizes.update(p[0] for p in pts)
                style = {"local": "-", "legacy": "--", "segment": ":"}[kind]
                marker = {"local": "o", "legacy": "s", "segment": "^"}[kind]
                ax.plot([p[0] for p in pts], [p[1] for p in pts], style, marker=marker, color=KIND_COLOR[kind],
                        label=KIND_LABEL[kind], linewidth=1.8, markersize=5)
                any_line = True
            ax.set_yscale("log")
            ax.set_title(f"{op} ({'read_sum' if op == 'read' else 'write_fill'} kernel)")
            ax.set_xlabel("buffer size")
        if not any_line:
            plt.close(fig)
            continue
        for ax in axes:
            _size_axis(ax, sorted(all_sizes))
        axes[0].set_ylabel(unit)
        axes[0].legend(loc="best")
        fig.suptitle(f"{what} of kernels over memory B allocated, opened by legacy IPC, or opened as a gpuipc segment\n"
                     f"{_subtitle(doc)}", fontsize=10)
        fig.tight_layout()
        path = os.path.join(out, image_name("access", device, fname))
        fig.savefig(path)
        plt.close(fig)
        written.append(path)
    return written


VMM_STEPS = [("create", "create (cuMemCreate)"), ("export", "export (cuMemExportToShareableHandle)"),
             ("import", "import (cuMemImportFromShareableHandle)"), ("reserve", "reserve (cuMemAddressReserve)"),
             ("map", "map (cuMemMap)"), ("set_access", "set access (cuMemSetAccess)"), ("unmap", "unmap (cuMemUnmap)"),
             ("free_va", "free VA (cuMemAddressFree)"), ("release", "release (cuMemRelease)")]


def plot_vmm(doc: dict[str, Any], out: str, device: str) -> list[str]:
    plt = _plt()
    fig, ax = plt.subplots(figsize=(11.5, 5))
    sizes: set[float] = set()
    cmap = plt.get_cmap("tab10")
    any_line = False
    for i, (step, label) in enumerate(VMM_STEPS):
        pts = sorted((num(s.get("size_bytes")), num(s.get("median"))) for s in samples(doc, name="vmm_step_us", step=step)
                     if num(s.get("size_bytes")) and num(s.get("median")) is not None)
        pts = [p for p in pts if p[1] and p[1] > 0]
        if not pts:
            continue
        sizes.update(p[0] for p in pts)
        ax.plot([p[0] for p in pts], [p[1] for p in pts], "-o", color=cmap(i % 10), label=label, markersize=4)
        any_line = True
    if not any_line:
        plt.close(fig)
        return []
    _size_axis(ax, sorted(sizes))
    ax.set_yscale("log")
    ax.set_xlabel("allocation size")
    ax.set_ylabel("time per call, median (us)")
    ax.set_title(f"Cost of each VMM step (A: create, export; B: import ... release)\n{_subtitle(doc)}", fontsize=10)
    ax.legend(fontsize=8, loc="center left", bbox_to_anchor=(1.01, 0.5))
    fig.tight_layout()
    path = os.path.join(out, image_name("vmm", device))
    fig.savefig(path)
    plt.close(fig)
    return [path]


TRANSFER_DIRS = [("h2d", "host -> device"), ("d2h", "device -> host"), ("d2d", "device -> device"),
                 ("p2p_out", "GPU 0 -> GPU 1"), ("p2p_in", "GPU 1 -> GPU 0")]


def plot_transfer(doc: dict[str, Any], out: str, device: str) -> list[str]:
    plt = _plt()
    dirs = [(d, lbl) for d, lbl in TRANSFER_DIRS
            if metric(doc, f"{d}_gbs_segment") is not None or metric(doc, f"{d}_gbs_plain") is not None]
    if not dirs:
        return []
    fig, ax = plt.subplots(figsize=(max(6, 1.8 * len(dirs) + 2), 4.5))
    width = 0.38
    for j, (kind, label) in enumerate((("plain", "plain (cuMemAlloc / cuMemHostAlloc)"),
                                       ("segment", "gpuipc segments (device / host_pinned)"))):
        xs, ys = [], []
        for i, (d, _) in enumerate(dirs):
            v = metric(doc, f"{d}_gbs_{kind}")
            if v is not None:
                xs.append(i + (j - 0.5) * width)
                ys.append(v)
        bars = ax.bar(xs, ys, width, label=label, color=KIND_COLOR[kind])
        ax.bar_label(bars, fmt="%.0f", fontsize=8, padding=2)
    ax.set_xticks(range(len(dirs)))
    ax.set_xticklabels([lbl for _, lbl in dirs])
    ax.set_ylabel("copy bandwidth, median (GB/s)")
    nbytes = next((num(s.get("bytes")) for s in samples(doc, name="transfer") if num(s.get("bytes"))), None)
    ax.set_title(f"Synchronous copies{' of ' + size_label(nbytes) if nbytes else ''}: segments vs plain allocations\n"
                 f"{_subtitle(doc)}", fontsize=10)
    ax.legend(loc="best", fontsize=9)
    ax.margins(y=0.15)
    fig.tight_layout()
    path = os.path.join(out, image_name("transfer", device))
    fig.savefig(path)
    plt.close(fig)
    return [path]


CHANNEL_RTTS = [("handoff_rtt_p50_us_1MiB", "gpuipc channel\nhandoff 1 MiB"),
                ("handoff_sustained_rtt_p50_us_1MiB", "gpuipc channel\nsustained 1 MiB"),
                ("host_handoff_rtt_p50_us_1MiB", "gpuipc host\nhandoff 1 MiB"),
                ("sem_rtt_us", "gpuipc semaphore\nstream RTT"),
                ("sem_rtt_us_mps", "semaphore RTT\n(MPS)"),
                ("sem_host_sync_rtt_us", "semaphore\nhost sync RTT"),
                ("ipc_event_rtt_us", "IPC event\nRTT"),
                ("ipc_event_rtt_us_mps", "IPC event\nRTT (MPS)"),
                ("cudacore_handoff_rtt_p50_us_1MiB", "cuda.core IPC\nhandoff 1 MiB"),
                ("torch_handoff_rtt_p50_us_1MiB", "torch.mp\nhandoff 1 MiB")]


def plot_channels(doc: dict[str, Any], out: str, device: str) -> list[str]:
    plt = _plt()
    bars = [(lbl, metric(doc, m), m) for m, lbl in CHANNEL_RTTS if metric(doc, m) is not None]
    stream = {}
    for what in ("stream", "stream_mps"):
        pts = sorted((num(s.get("slots")), num(s.get("ratio"))) for s in samples(doc, what=what)
                     if num(s.get("slots")) is not None and num(s.get("ratio")) is not None)
        if pts:
            stream[what] = pts
    if not bars and not stream:
        return []
    fig, axes = plt.subplots(1, 2, figsize=(13, 4.8), gridspec_kw={"width_ratios": [2.3, 1]})
    ax = axes[0]
    if bars:
        colors = ["#2166ac" if not (m.startswith("ipc_event") or m.startswith("torch") or m.startswith("cudacore"))
                  else "#e08214" for _, _, m in bars]
        b = ax.bar(range(len(bars)), [v for _, v, _ in bars], color=colors)
        ax.bar_label(b, labels=[f"{v:.3g}" for _, v, _ in bars], fontsize=8, padding=2)
        ax.set_xticks(range(len(bars)))
        ax.set_xticklabels([lbl.replace("\n", " ") for lbl, _, _ in bars], fontsize=8, rotation=30, ha="right")
        ax.set_yscale("log")
        ax.set_ylabel("round trip, median (us, log scale)")
        ax.set_title("Cross-process round trips (blue: gpuipc, orange: baselines)")
        ax.margins(y=0.2)
    else:
        ax.set_axis_off()
    ax = axes[1]
    if stream:
        for what, pts in stream.items():
            ax.plot([p[0] for p in pts], [p[1] for p in pts], "-o", label="MPS" if what == "stream_mps" else "no MPS",
                    color="#2166ac" if what == "stream" else "#1b7837")
        ax.set_xscale("log", base=2)
        ax.set_xticks([p[0] for p in next(iter(stream.values()))])
        ax.set_xticklabels([f"{p[0]:.0f}" for p in next(iter(stream.values()))])
        ax.minorticks_off()
        ax.set_ylim(0, 1.05)
        ax.set_xlabel("channel slots")
        ax.set_ylabel("two-process / one-process frame rate")
        ax.set_title("Streaming 8 MiB frames between processes")
        ax.legend()
    else:
        r = [(lbl, metric(doc, m)) for m, lbl in (("stream_throughput_ratio", "no MPS"),
                                                   ("stream_throughput_ratio_mps", "MPS")) if metric(doc, m) is not None]
        if r:
            ax.bar([x for x, _ in r], [v for _, v in r], color="#2166ac")
            ax.set_ylim(0, 1.05)
            ax.set_ylabel("two-process / one-process frame rate")
        else:
            ax.set_axis_off()
    fig.suptitle(f"Channels and semaphores — {_subtitle(doc)}", fontsize=10)
    fig.tight_layout()
    path = os.path.join(out, image_name("channels", device))
    fig.savefig(path)
    plt.close(fig)
    return [path]


def plot_segments(doc: dict[str, Any], out: str, device: str) -> list[str]:
    plt = _plt()
    labels = []
    for k in (doc.get("metrics") or {}):
        m = re.match(r"^open_first_us_(.+)$", k)
        if m:
            labels.append(m.group(1))
    size_of = {s.get("label"): num(s.get("size_bytes")) for s in doc.get("samples") or [] if isinstance(s, dict)}
    labels.sort(key=lambda lbl: size_of.get(lbl) or 0)
    if not labels:
        return []

    def sample_median(name: str, label: str) -> float | None:
        for s in samples(doc, name=name, label=label):
            return num(s.get("median"))
        return None

    series = [("gpuipc Segment::open (first)", "#2166ac", lambda lbl: metric(doc, f"open_first_us_{lbl}")),
              ("legacy cuIpcOpenMemHandle", "#e08214", lambda lbl: metric(doc, f"legacy_open_us_{lbl}")),
              ("raw VMM import (reserve each time)", "#b2abd2", lambda lbl: sample_median("vmm_raw_open_us", lbl)),
              ("VMM floor (range reserved)", "#5e3c99", lambda lbl: sample_median("vmm_floor_us", lbl))]
    fig, ax = plt.subplots(figsize=(9, 4.6))
    width = 0.8 / len(series)
    for j, (name, color, get) in enumerate(series):
        xs, ys = [], []
        for i, lbl in enumerate(labels):
            v = get(lbl)
            if v is not None:
                xs.append(i + (j - (len(series) - 1) / 2) * width)
                ys.append(v)
        if xs:
            b = ax.bar(xs, ys, width, label=name, color=color)
            ax.bar_label(b, fmt="%.0f", fontsize=7, padding=2)
    ax.set_xticks(range(len(labels)))
    ax.set_xticklabels(labels)
    ax.set_xlabel("segment / allocation size")
    ax.set_ylabel("first open in another process, median (us)")
    cached = metric(doc, "open_cached_us")
    extra = f"; a cached re-open costs {cached:.2f} us" if cached is not None else ""
    ax.set_title(f"Opening shared GPU memory{extra}\n{_subtitle(doc)}", fontsize=10)
    ax.legend(fontsize=8, loc="upper left")
    ax.margins(y=0.15)
    fig.tight_layout()
    path = os.path.join(out, image_name("segments", device))
    fig.savefig(path)
    plt.close(fig)
    return [path]


PLOTTERS = {"access": plot_access, "vmm": plot_vmm, "transfer": plot_transfer, "channels": plot_channels,
            "segments": plot_segments}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("results", nargs="?", default="bench/results", help="directory of result JSON files")
    ap.add_argument("--out", default="docs/img", help="directory for the PNG files")
    args = ap.parse_args(argv)
    results = load_results(args.results)
    if not results:
        print(f"plot: no result files in {args.results}", file=sys.stderr)
        return 1
    os.makedirs(args.out, exist_ok=True)
    written = []
    for suite, plotter in PLOTTERS.items():
        docs = [(d, results[(suite, d)]) for d in devices_of(results) if (suite, d) in results]
        if not docs:
            print(f"plot: {suite}: no {suite}-*.json in {args.results}; skipped")
            continue
        for device, doc in docs:
            try:
                paths = plotter(doc, args.out, device)
            except Exception as e:  # a malformed file must not stop the other plots
                print(f"plot: {suite} ({device}): failed: {type(e).__name__}: {e}", file=sys.stderr)
                continue
            if not paths:
                print(f"plot: {suite} ({device}): nothing to plot in {doc['_file']}; skipped")
            for p in paths:
                print(f"plot: {p}")
            written += paths
    return 0 if written else 1


if __name__ == "__main__":
    sys.exit(main())
