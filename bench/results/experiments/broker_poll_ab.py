"""GPUIPC_BROKER_POLL_US=0 (sleep at once, as before) against the default (poll 1000 us before sleeping), in turns
on one machine: the weights suite's open part (the 2 GiB dict of 291 bf16 tensors, gpuipc.open_tensors in fresh
processes) and the bench's segments suite (broker round trip, first opens), for issue 13's open and issue 17's
broker round trip.

    python3 bench/results/experiments/broker_poll_ab.py ROUNDS GPUIPC_BIN

Prints one JSON line per run: {"poll_us", "what", ...} with the open part's open_ms/call_ms lists, or the segments
suite's metrics.
"""
import json
import os
import subprocess
import sys
import tempfile

here = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, here)
from _statedict_spec import spec  # noqa: E402

SUITES = os.path.join(here, "..", "..", "suites")


def weights_open(poll, spec_path, consumers):
    env = dict(os.environ, GPUIPC_BROKER_POLL_US=str(poll))
    p = subprocess.run([sys.executable, os.path.join(SUITES, "weights.py"), "--part", "open", "--spec", spec_path,
                        "--consumers", str(consumers)], env=env, capture_output=True, text=True, timeout=240)
    lines = [line for line in p.stdout.splitlines() if line.startswith("{")]
    r = json.loads(lines[-1]) if lines else {"error": p.stderr[-2000:]}
    keep = ("open_ms", "call_ms", "touch_ms", "reopen_ms", "error", "skipped")
    return {k: r[k] for k in keep if k in r}


def segments(poll, gpuipc_bin):
    env = dict(os.environ, GPUIPC_BROKER_POLL_US=str(poll))
    out = tempfile.mkdtemp(prefix="poll-ab-")
    p = subprocess.run([gpuipc_bin, "bench", "segments", "--quick", "--no-progress", "--out-dir", out], env=env,
                       capture_output=True, text=True, timeout=240)
    files = [f for f in os.listdir(out) if f.endswith(".json")]
    if not files:
        return {"error": (p.stdout + p.stderr)[-2000:]}
    with open(os.path.join(out, files[0])) as f:
        m = json.load(f)["metrics"]
    return {k: round(v, 2) for k, v in m.items() if isinstance(v, (int, float)) and ("open" in k or "stat" in k or "broker" in k)}


def main():
    rounds = int(sys.argv[1])
    gpuipc_bin = sys.argv[2]
    with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as f:
        json.dump([{"name": n, "shape": list(s)} for n, s in spec(32)], f)
        spec_path = f.name
    for r in range(rounds):
        for poll in (0, 1000) if r % 2 == 0 else (1000, 0):
            print(json.dumps({"round": r, "poll_us": poll, "what": "weights_open", **weights_open(poll, spec_path, 5)}), flush=True)
            print(json.dumps({"round": r, "poll_us": poll, "what": "segments", **segments(poll, gpuipc_bin)}), flush=True)


if __name__ == "__main__":
    main()
