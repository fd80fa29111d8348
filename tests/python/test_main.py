"""``python -m gpuipc`` (python/gpuipc/__main__.py) on the CPU: doctor, ls and stat, their JSON and exit codes."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import gpuipc
from gpuipc import __main__ as cli


def _run(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    e = dict(os.environ)
    e.update(env or {})
    return subprocess.run(
        [sys.executable, "-m", "gpuipc", *args], capture_output=True, text=True, timeout=60, env=e
    )


def test_doctor_json_reports_version_runtime_dir_broker_and_driver(runtime_dir):
    # A driver library that cannot exist: the same report on a machine with a GPU.
    r = _run("doctor", "--json", env={"GPUIPC_CUDA_LIBRARY": "/nonexistent/libcuda.so.1"})
    assert r.returncode == 0, r.stdout + r.stderr
    d = json.loads(r.stdout)
    assert d["schema"] == 1 and d["ok"] is True and d["exit_code"] == 0
    assert d["version"] == gpuipc.__version__
    assert d["driver"] is None and "/nonexistent/libcuda.so.1" in d["driver_error"]
    assert d["runtime_dir"] == {"path": runtime_dir, "usable": True, "error": None}
    assert d["broker"]["reachable"] is True and d["broker"]["pid"] > 0
    assert d["broker"]["socket"] == os.path.join(runtime_dir, "broker.sock")
    assert d["daemon"] and os.access(d["daemon"], os.X_OK)
    assert any("host segments" in a for a in d["advice"])


def test_doctor_text_and_unreachable_broker(runtime_dir):
    r = _run("doctor", env={"GPUIPC_NO_AUTOSTART": "1", "GPUIPC_CUDA_LIBRARY": "/nonexistent/libcuda.so.1"})
    assert r.returncode == 1, r.stdout + r.stderr
    assert f"runtime dir: {runtime_dir} (usable)" in r.stdout
    assert "broker:      not reachable" in r.stdout
    assert "problem: the broker could not be reached" in r.stdout


def test_ls_and_stat_list_host_objects(name):
    seg = gpuipc.Segment.create(name, 8192, mode=0o640)
    sem = gpuipc.Semaphore.create(name + "-sem", kind="host")
    try:
        r = _run("ls", "--json")
        assert r.returncode == 0, r.stderr
        rows = {row["name"]: row for row in json.loads(r.stdout)}
        row = rows[name]
        assert row["kind"] == "host" and row["size"] == 8192 and row["mode"] == "0640"
        assert row["owner_uid"] == os.getuid() and row["unlinked"] is False
        assert os.getpid() in row["mapper_pids"] and row["mapper_count"] >= 1
        assert name + "-sem" in rows

        r = _run("ls")
        assert r.returncode == 0 and r.stdout.splitlines()[0].split()[:3] == ["NAME", "KIND", "SIZE"]
        line = next(l for l in r.stdout.splitlines() if l.startswith(name + " "))
        assert "host" in line and "8.0 KiB" in line and "0640" in line and str(os.getpid()) in line

        r = _run("stat", name, "--json")
        assert r.returncode == 0, r.stderr
        got = json.loads(r.stdout)
        assert got["name"] == name
        # The keys of `gpuipc stat --json` (docs/cli/stat.md), no others: it printed `device_uuid` for `device`, and
        # `created_unix_ns` besides `created`.
        assert set(got) == set(row) == {"id", "name", "unlinked", "kind", "size", "device", "owner_uid", "owner_gid",
                                        "mode", "created", "references", "mapper_count", "mapper_pids"}, sorted(got)
        assert got["device"] == ""  # a host segment's
        r = _run("stat", name)
        assert "size:       8.0 KiB (8192 bytes)" in r.stdout
    finally:
        sem.close()
        seg.close()
        gpuipc.Segment.unlink(name)
        gpuipc.Semaphore.unlink(name + "-sem")


def test_exit_codes(name, runtime_dir):
    r = _run("stat", name + "-none")
    assert r.returncode == 5 and r.stderr.startswith("gpuipc: "), r.stderr
    r = _run("ls", env={"GPUIPC_RUNTIME_DIR": os.path.join(runtime_dir, "empty"), "GPUIPC_NO_AUTOSTART": "1"})
    assert r.returncode == 7 and r.stderr.startswith("gpuipc: "), r.stderr
    r = _run("frobnicate")
    assert r.returncode == 2
    r = _run()
    assert r.returncode == 2
    assert cli.main(["--version"]) == 0
