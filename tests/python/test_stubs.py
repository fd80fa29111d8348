"""The committed stubs (python/gpuipc/_gpuipc.pyi) match what nanobind's stubgen makes of the built module."""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest

#: The nanobind whose stubgen wrote the committed stubs (other versions format them differently).
STUB_NANOBIND_VERSION = "3.1.0"

# Python >= 3.12 gives types with buffer slots __buffer__ and __release_buffer__ methods (PEP 688), which stubgen
# then lists; the reference is generated on the Python `make test` uses, so compare without them.
_BUFFER = re.compile(r"\n    def __(release_)?buffer__\(self, [a-z]+, /\):\n        \"\"\"\n.*?\n        \"\"\"\n", re.S)

REFERENCE = os.path.join(os.path.dirname(__file__), "..", "..", "python", "gpuipc", "_gpuipc.pyi")


def test_stubs_match_the_committed_reference(tmp_path):
    nanobind = pytest.importorskip("nanobind", reason="nanobind (stubgen) is not installed here")
    if nanobind.__version__ != STUB_NANOBIND_VERSION:
        pytest.skip(f"the reference stubs come from nanobind {STUB_NANOBIND_VERSION}, this is {nanobind.__version__}")
    out = tmp_path / "_gpuipc.pyi"
    subprocess.run(
        [sys.executable, "-m", "nanobind.stubgen", "-q", "-P", "-m", "gpuipc._gpuipc", "-o", str(out)],
        check=True,
        timeout=120,
    )
    with open(REFERENCE) as f:
        want = f.read()
    got = out.read_text()
    assert _BUFFER.sub("", got) == _BUFFER.sub("", want), "stubs changed: run python/regen_stubs.sh and commit python/gpuipc/_gpuipc.pyi"


def test_installed_package_ships_the_stubs():
    import gpuipc

    pkg = os.path.dirname(gpuipc.__file__)
    assert os.path.exists(os.path.join(pkg, "_gpuipc.pyi")) and os.path.exists(os.path.join(pkg, "py.typed"))
