"""The README's table of figures is what the result files give (bench/analysis/readme_table.py, `make study`): a
figure typed by hand, or a result file changed without `make study`, fails here."""
from __future__ import annotations

import importlib.util
import os
import sys

import pytest

_ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..")
_SCRIPT = os.path.join(_ROOT, "bench", "analysis", "readme_table.py")


def _module():
    if not os.path.exists(os.path.join(_ROOT, "bench", "results")):
        pytest.skip("no bench/results here (an installed package without the repository)")
    spec = importlib.util.spec_from_file_location("readme_table", _SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod  # dataclasses look their module up there
    spec.loader.exec_module(mod)
    return mod


def test_readme_table_matches_the_result_files():
    assert _module().main(["--check"]) == 0, "README.md's figures table differs from bench/results: run `make study`"


def test_cells_give_medians_ranges_and_run_counts():
    m = _module()
    assert m._cell([8.8], "us") == "8.8 us"
    assert m._cell([1.0, 1.1, 1.05], "ms") == "1.1 ms over 3 runs"  # within 20%: the median alone (2 digits under 1)
    assert m._cell([3.2, 4.0], "ms") == "3.2 ms to 4.0 ms (median 3.6 ms) over 2 runs"  # 22% apart: the range
    assert m._cell([], "us") == "-"


def test_a_hand_edit_is_caught(tmp_path):
    m = _module()
    readme = tmp_path / "README.md"
    with open(os.path.join(_ROOT, "README.md")) as f:
        lines = f.read().split("\n")
    first_row = lines.index(m.BEGIN) + 3  # the marker, the header, the rule, then the first row
    cells = lines[first_row].split(" | ")
    cells[1] = "1.6 us"  # a figure typed by hand over what the files give
    lines[first_row] = " | ".join(cells)
    readme.write_text("\n".join(lines))
    assert m.main(["--check", "--readme", str(readme)]) == 1
    assert m.main(["--readme", str(readme)]) == 0 and m.main(["--check", "--readme", str(readme)]) == 0
