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


def test_each_file_is_named_with_the_devices_and_commits_of_its_own_runs(tmp_path):
    # A file of several runs came first in a row, and the files after it were labelled with its second, third...
    # run: an H200 file read "NVIDIA H100".
    m = _module()
    runs = lambda dev, sha, n: {"runs": [{"device": dev, "commit": sha, "metrics": {"x": 1.0}}] * n}  # noqa: E731
    import json

    (tmp_path / "a.json").write_text(json.dumps(runs("GPU A", "a" * 40, 5)))
    (tmp_path / "b.json").write_text(json.dumps(runs("GPU B", "b" * 40, 5)))
    (tmp_path / "c.json").write_text(json.dumps({"runs": [{"device": "GPU A", "commit": "c" * 40},
                                                          {"device": "GPU B", "commit": "c" * 40}]}))
    assert m._made_on(m._load(str(tmp_path), "b.json")) == "GPU B, bbbbbbb"
    assert m._made_on(m._load(str(tmp_path), "c.json")) == "GPU A, ccccccc; GPU B, ccccccc"
    rows = [m.Row("x", "x", "us", ["a.json", "b.json"], [])]
    old = m.ROWS
    try:
        m.ROWS = rows
        table = m.render(str(tmp_path))
    finally:
        m.ROWS = old
    assert "(GPU A, aaaaaaa)" in table and "(GPU B, bbbbbbb)" in table and table.count("GPU A") == 1
