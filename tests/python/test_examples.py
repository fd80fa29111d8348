"""The Python examples run (CPU mode here; tests/python/test_gpu.py runs them on a GPU)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

EXAMPLES = os.path.join(os.path.dirname(__file__), "..", "..", "examples", "python")


@pytest.mark.parametrize(
    "script, args, expect",
    [
        ("weights_server.py", ["--cpu", "--workers", "2", "--mib", "4"], "read-only"),
        ("pipeline.py", ["--cpu", "--frames", "40", "--size", "64", "--slots", "2"], "40 frames of 64x64"),
    ],
)
def test_example_runs(script, args, expect):
    r = subprocess.run([sys.executable, os.path.join(EXAMPLES, script), *args], capture_output=True, text=True,
                       timeout=100)
    assert r.returncode == 0, r.stdout + r.stderr
    assert expect in r.stdout, r.stdout
