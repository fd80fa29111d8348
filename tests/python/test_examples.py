"""The Python examples run: pipeline.py in CPU mode here (tests/python/test_gpu.py runs it on a GPU); the examples
that need a GPU and PyTorch (weights_server.py, rl_weight_sync.py) where there are both, else they skip saying
which is missing."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys

import pytest

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
