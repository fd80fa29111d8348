"""The result line of the baseline scripts: the one JSON object, printed last, that the suites' python runner
(bench/harness/programs.cpp) parses; and their percentiles."""
import json
import math
import traceback


def quantile(s, q):
    """The q-quantile of the sorted samples `s`, interpolated between its neighbours as `summarize` in
    bench/harness/bench.cpp computes every _p99 of the suites (numpy.percentile's default, "linear")."""
    pos = q * (len(s) - 1)
    lo = math.floor(pos)
    hi = min(lo + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (pos - lo)


def finish(out, body):
    """Runs body() and adds what it returns to `out`, or {"error"} (with the traceback on stderr) when it raises;
    prints `out` as the last line and returns the exit status (1 on error)."""
    try:
        out.update(body())
    except Exception as e:  # noqa: BLE001 - reported as data, the suite records it
        traceback.print_exc()
        out["error"] = f"{type(e).__name__}: {e}"
    print(json.dumps(out), flush=True)
    return 0 if "error" not in out else 1
