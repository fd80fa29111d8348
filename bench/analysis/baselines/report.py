"""The result line of the baseline scripts: the one JSON object, printed last, that the suites' python runner
(bench/harness/programs.cpp) parses."""
import json
import traceback


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
