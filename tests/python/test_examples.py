"""The Python examples run: pipeline.py in CPU mode here (tests/python/test_gpu.py runs it on a GPU); the examples
that need a GPU and PyTorch (weights_server.py, rl_weight_sync.py) where there are both, else they skip saying
which is missing."""

from __future__ import annotations

import importlib.util
import os
import signal
import subprocess
import sys
import time

import pytest

import helpers
from test_gpu import _NO_GPU  # the GPU probe runs in a child: this process never initialises CUDA

EXAMPLES = os.path.join(os.path.dirname(__file__), "..", "..", "examples", "python")


def _run(script, args, timeout):
    return subprocess.run([sys.executable, os.path.join(EXAMPLES, script), *args], capture_output=True, text=True,
                          timeout=timeout)


@pytest.mark.parametrize(
    "script, args, expect",
    [
        ("pipeline.py", ["--cpu", "--frames", "40", "--size", "64", "--slots", "2"], "40 frames of 64x64"),
    ],
)
def test_example_runs(script, args, expect):
    r = _run(script, args, 100)
    assert r.returncode == 0, r.stdout + r.stderr
    assert expect in r.stdout, r.stdout


def _registered(prefix):
    import gpuipc  # (no CUDA in this process: listing names asks the broker only)

    return [s.name for s in gpuipc.Segment.list() if s.name.startswith(prefix)]


def _running_pipeline():
    """Starts pipeline.py on a host channel with more frames than it will send before the test stops it; returns
    (process, channel name, producer pid) once the channel is there and the producer (a spawned child) runs."""
    p = subprocess.Popen([sys.executable, os.path.join(EXAMPLES, "pipeline.py"), "--cpu", "--frames", "100000000",
                          "--size", "64", "--slots", "2"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    name = f"pipeline-{p.pid}"
    deadline = time.monotonic() + 30
    while True:
        assert p.poll() is None and time.monotonic() < deadline, "pipeline.py did not start its channel"
        with open(f"/proc/{p.pid}/task/{p.pid}/children") as f:
            children = [int(c) for c in f.read().split()]
        producers = []
        for c in children:
            try:
                with open(f"/proc/{c}/cmdline", "rb") as f:
                    if b"--multiprocessing-fork" in f.read():  # not the resource tracker
                        producers.append(c)
            except FileNotFoundError:
                pass
        if producers and name in _registered(name):
            time.sleep(1)  # frames flowing
            return p, name, producers[0]
        time.sleep(0.1)


@pytest.mark.parametrize("how", ["producer-killed", "sigint"])
def test_pipeline_fails_promptly_and_removes_its_names(how):
    """A producer SIGKILLed mid-run makes the consumer fail (PeerDied), and SIGINT stops the parent; either way it
    exits non-zero within seconds (not after the producer's 30 s send timeout) and removes NAME and NAME.slots."""
    p, name, producer = _running_pipeline()
    try:
        t0 = time.monotonic()
        if how == "producer-killed":
            os.kill(producer, signal.SIGKILL)
        else:
            p.send_signal(signal.SIGINT)
        out, err = p.communicate(timeout=60)
        seconds = time.monotonic() - t0
    finally:
        if p.poll() is None:
            p.kill()
            p.wait()
    assert p.returncode != 0, out + err
    assert seconds < 10, f"took {seconds:.1f} s to exit\n{err[-2000:]}"
    assert _registered(name) == [], err[-2000:]


@pytest.mark.parametrize(
    "script, args, error",
    [
        ("rl_weight_sync.py", ["--steps", "0"], "--steps must be at least 1"),
        ("rl_weight_sync.py", ["--steps", "-1"], "--steps must be at least 1"),
        ("rl_weight_sync.py", ["--hidden", "0"], "--hidden must be at least 1"),
        ("weights_server.py", ["--workers", "0"], "--workers must be at least 1"),
        ("weights_server.py", ["--mib", "0"], "--mib must be at least 1"),
        ("pipeline.py", ["--size", "0"], "--size must be at least 1"),
        ("pipeline.py", ["--slots", "0"], "--slots must be at least 1"),
        ("pipeline.py", ["--frames", "-3"], "--frames must be at least 1"),
    ],
)
def test_example_rejects_bad_numbers(script, args, error):
    """Checked before anything else (a GPU included): a usage error, not a crash after the work."""
    r = _run(script, args, 60)
    assert r.returncode == 2, r.stdout + r.stderr
    assert error in r.stderr, r.stderr


def _example(script):
    spec = importlib.util.spec_from_file_location(script.removesuffix(".py"), os.path.join(EXAMPLES, script))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("fn, error", [(helpers.check_fails, "^worker 1: output differs"),
                                       (helpers.killed, "terminated abruptly")])
def test_weights_server_reports_a_failed_worker(fn, error):
    """weights_server.py's worker processes, the part of it that needs no GPU: a worker whose check fails, or that
    is SIGKILLed, raises RuntimeError in the server (which then removes its names and exits 1) instead of leaving it
    waiting for that worker's result forever."""
    run_workers = _example("weights_server.py").run_workers
    assert run_workers(pow, [(2, 3), (3, 2)]) == [8, 9]
    with pytest.raises(RuntimeError, match=error):
        run_workers(fn, [("worker 1: output differs from the server",)])


def _gpu_torch_missing() -> str:
    if _NO_GPU:
        return f"needs a GPU: {_NO_GPU}"
    if importlib.util.find_spec("torch") is None:
        return "needs PyTorch"
    return ""


@pytest.mark.skipif(bool(_gpu_torch_missing()), reason=_gpu_torch_missing() or "runs")
@pytest.mark.parametrize(
    "script, args, expect",
    [
        ("weights_server.py", ["--workers", "2", "--mib", "16"],
         ["by reference, no copy", "output equal to the server's bit for bit"]),
        ("rl_weight_sync.py", ["--steps", "20", "--hidden", "512"],
         ["20 versions, each picked up by both readers with no copy", "outputs match the trainer's"]),
    ],
)
def test_gpu_example_runs(script, args, expect):
    import gpuipc  # (no CUDA in this process: listing names asks the broker only)

    name = f"example-{os.getpid()}"
    r = _run(script, [*args, "--name", name], 110)  # under the conftest's per-test limit of 120 s
    if r.returncode == 2 and "needs a GPU" in r.stderr:
        pytest.skip(r.stderr.strip())  # torch without CUDA
    assert r.returncode == 0, r.stdout + r.stderr
    for line in expect:
        assert line in r.stdout, r.stdout
    # Nothing left registered: a name left behind keeps its memory (weights_server.py's MemPool pool kept 1 GiB).
    left = [s.name for s in gpuipc.Segment.list() if s.name.startswith(name)]
    assert left == [], left
