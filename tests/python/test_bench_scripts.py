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
