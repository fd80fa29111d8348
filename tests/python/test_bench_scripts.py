"""The Python parts of `gpuipc bench` start: each script under bench/suites that the suites run as a program imports
what it needs and answers --help (a broken import shows only on a GPU machine otherwise, as a suite with no result)."""
import os
import subprocess
import sys

import pytest

SUITES = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "bench", "suites")


@pytest.mark.parametrize("script", ["weights.py", "python_handoff.py"])
def test_bench_script_starts(script):
    path = os.path.join(SUITES, script)
    if not os.path.exists(path):
        pytest.skip("no bench/suites here (an installed package without the repository)")
    done = subprocess.run([sys.executable, path, "--help"], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert "usage" in done.stdout


def test_python_handoff_runs_both_protocols_on_a_host_channel():
    """The handoff script's whole protocol (copying send, then the zero-copy one) through a host channel: it
    completes, the consumer's data checks pass, and every figure the suite reads is there."""
    path = os.path.join(SUITES, "python_handoff.py")
    if not os.path.exists(path):
        pytest.skip("no bench/suites here (an installed package without the repository)")
    done = subprocess.run([sys.executable, path, "--host", "--iters", "100"], capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-4000:]
    import json

    out = json.loads(done.stdout.strip().splitlines()[-1])
    assert "error" not in out, out
    for key in ("p50_us", "nodrain_p50_us", "send_call_us", "zc_p50_us", "zc_p99_us", "zc_nodrain_p50_us",
                "zc_acquire_call_us", "zc_slot_view_us", "zc_publish_call_us", "zc_recv_wait_us", "zc_view_us",
                "zc_release_call_us", "recv_wait_us", "release_call_us"):
        assert isinstance(out.get(key), float) and out[key] > 0, (key, out.get(key))


def _load(path, name):
    import importlib.util

    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize(
    "samples, p99",
    [([5.0], 5.0), ([1.0, 2.0], 1.99), ([float(v) for v in range(10)], 8.91),
     ([float(v) for v in range(101)], 99.0), ([3.0, 1.0, 10.0, 2.0, 4.0], 9.76)],
)
def test_python_p99_is_interpolated_like_summarize(samples, p99, monkeypatch):
    """Every _p99, the C++ suites' (`summarize` in bench/harness/bench.cpp) and the Python scripts' they are compared
    with, is interpolated between the two nearest sorted samples (numpy.percentile's default), not the nearer one."""
    baselines = os.path.join(SUITES, "..", "analysis", "baselines")
    if not os.path.isdir(baselines):
        pytest.skip("no bench/ here (an installed package without the repository)")
    monkeypatch.syspath_prepend(baselines)  # the baselines import report.py, as they do when run
    handoff = _load(os.path.join(baselines, "handoff.py"), "baseline_handoff")
    py = _load(os.path.join(SUITES, "python_handoff.py"), "python_handoff")
    report = _load(os.path.join(baselines, "report.py"), "report")
    got = {"baselines/handoff.py": handoff.summarize(samples)["p99_us"],
           "suites/python_handoff.py": py.summarize(samples)["p99_us"],
           "baselines/report.py (statedict.py)": report.quantile(sorted(samples), 0.99)}
    for where, value in got.items():
        assert value == pytest.approx(p99, abs=1e-12), where
    np = pytest.importorskip("numpy")
    assert float(np.percentile(samples, 99)) == pytest.approx(p99, abs=1e-12)
