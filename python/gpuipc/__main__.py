"""``python -m gpuipc``: the checks and listings of the ``gpuipc`` command-line tool for those who installed only
the wheel (python/README.md).

* ``python -m gpuipc doctor [--json]``: the package's version, the CUDA driver (loaded as the library loads it),
  the runtime directory, the broker (reachable, pid) and the gpuipcd the library would start.
* ``python -m gpuipc ls [--json]``: the segments the broker shows this user (name, kind, size, owner, mode,
  references, mapper pids), like ``gpuipc ls``.
* ``python -m gpuipc stat [--json] NAME``: one segment, like ``gpuipc stat``.

Exit status, as the C++ tool's (docs/cli/gpuipc.md): 0 success; 1 doctor found a problem, or another error;
2 bad command line; 5 no such segment; 6 permission denied or an unsafe runtime directory; 7 the broker could not
be reached, started or heard from.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import stat as _stat
import sys
from typing import Any, Dict, Optional, Sequence

EXIT_OK = 0
EXIT_FAILURE = 1
EXIT_USAGE = 2
EXIT_NOT_FOUND = 5
EXIT_PERMISSION = 6
EXIT_BROKER = 7

#: Calls whose failure means the broker could not be reached, started or heard from (as tools/common/cli.hpp).
_BROKER_CALLS = ("connect", "hello", "send", "recv")


def _human_bytes(n: int) -> str:
    units = ["B", "KiB", "MiB", "GiB", "TiB"]
    v = float(n)
    u = 0
    while v >= 1024.0 and u < 4:
        v /= 1024.0
        u += 1
    return f"{n} B" if u == 0 else f"{v:.1f} {units[u]}"


def _exit_code_of(e: BaseException) -> int:
    from . import errors

    if isinstance(e, errors.Error) and getattr(e, "call", "") in _BROKER_CALLS:
        return EXIT_BROKER
    if isinstance(e, errors.NotFound):
        return EXIT_NOT_FOUND
    if isinstance(e, errors.PermissionDenied):
        return EXIT_PERMISSION
    return EXIT_FAILURE


def _runtime_dir_report(path: Optional[str]) -> Dict[str, Any]:
    """Whether `path` exists (it is made as the broker would make it), is private to this user (or root) and is
    writable; the same checks as ``gpuipc doctor``'s."""
    report: Dict[str, Any] = {"path": path, "usable": False, "error": None}
    if not path:
        report["error"] = "no runtime directory could be chosen"
        return report
    try:
        os.makedirs(path, mode=0o755, exist_ok=True)
        st = os.lstat(path.rstrip("/") or "/")  # (the library's rule, src/os/process.cpp: a link is refused)
        if _stat.S_ISLNK(st.st_mode):
            report["error"] = f"{path} is a symbolic link: remove it, or use a directory that you own"
        elif not _stat.S_ISDIR(st.st_mode):
            report["error"] = f"{path} is not a directory"
        elif st.st_uid not in (os.getuid(), 0):
            report["error"] = f"{path} belongs to uid {st.st_uid}, not to you: set GPUIPC_RUNTIME_DIR elsewhere"
        elif st.st_mode & 0o022 and not st.st_mode & _stat.S_ISVTX:
            report["error"] = (f"{path} is writable by group or others and not sticky (mode {st.st_mode & 0o7777:04o}): "
                               f"run 'chmod go-w {path}'")
        elif not os.access(path, os.W_OK | os.X_OK):
            report["error"] = f"cannot create a file in {path}: check its owner and mode, or set GPUIPC_RUNTIME_DIR"
        else:
            report["usable"] = True
    except OSError as e:
        report["error"] = f"{path}: {e.strerror or e}"
    return report


def doctor() -> Dict[str, Any]:
    """What ``python -m gpuipc doctor`` reports, as a dict (the keys of its ``--json`` output)."""
    from . import __version__, _gpuipc, daemon_path

    d = _gpuipc._doctor()
    report: Dict[str, Any] = {
        "schema": 1,
        "version": __version__,
        "python": sys.version.split()[0],
        "driver": None,
        "driver_error": d["driver_error"],
        "devices": d["device_count"],
        "runtime_dir": _runtime_dir_report(d["runtime_dir"]),
        "broker": {"socket": d["socket_path"], "listening": d["broker_listening"], "reachable": False, "pid": None,
                   "error": None},
        "daemon": daemon_path(),
        "problems": [],
        "advice": [],
    }
    if d["runtime_dir_error"]:
        report["runtime_dir"]["error"] = d["runtime_dir_error"]
    if d["driver_available"]:
        report["driver"] = {"version": d["driver_version"], "library": d["driver_library"]}
        if d["device_error"]:
            report["advice"].append(f"the driver loaded but listing GPUs failed: {d['device_error']}")
        elif d["device_count"] == 0:
            report["advice"].append("the driver reports no GPU: host segments and host channels still work")
    else:
        report["advice"].append(
            "no CUDA driver: device and host_pinned segments need the NVIDIA driver; host segments, host channels, "
            "host semaphores and host pools work without it"
        )
    if not report["runtime_dir"]["usable"]:
        report["problems"].append(
            f"runtime directory {report['runtime_dir']['path']} is not usable: {report['runtime_dir']['error']}"
        )
    else:
        try:
            report["broker"]["pid"] = int(_gpuipc._broker_pid())
            report["broker"]["reachable"] = True
        except Exception as e:  # any failure to reach it is what doctor reports
            report["broker"]["error"] = str(e)
            report["problems"].append(f"the broker could not be reached or started: {e}")
            if not report["daemon"]:
                report["advice"].append(
                    "no gpuipcd found: reinstall the wheel (it ships one) or point GPUIPC_DAEMON at one"
                )
    report["ok"] = not report["problems"]
    report["exit_code"] = EXIT_OK if report["ok"] else EXIT_FAILURE
    return report


def _print_doctor(r: Dict[str, Any]) -> None:
    print(f"gpuipc {r['version']} (Python {r['python']})")
    if r["driver"]:
        v = r["driver"]["version"]
        devices = "unknown" if r["devices"] is None else r["devices"]
        print(f"driver:      CUDA {v // 1000}.{(v % 1000) // 10} from {r['driver']['library']}, {devices} GPU(s)")
    else:
        print(f"driver:      none ({r['driver_error']})")
    rd = r["runtime_dir"]
    print(f"runtime dir: {rd['path']} ({'usable' if rd['usable'] else 'NOT usable: ' + str(rd['error'])})")
    b = r["broker"]
    if b["reachable"]:
        print(f"broker:      running, pid {b['pid']} ({b['socket']})")
    else:
        print(f"broker:      not reachable ({b['error'] or 'not checked'})")
    print(f"gpuipcd:     {r['daemon'] or 'not found'}")
    for p in r["problems"]:
        print(f"problem: {p}")
    for a in r["advice"]:
        print(f"advice:  {a}")


def _info_dict(i: Any) -> Dict[str, Any]:
    """The keys and values of ``gpuipc ls --json`` / ``gpuipc stat --json`` (tools/gpuipc/cmd_segments.cpp), so that a
    script reads either tool's output the same way."""
    return {
        "id": i.id,
        "name": i.name,
        "unlinked": not i.name,
        "kind": i.kind,
        "size": i.size,
        "device": i.device_uuid,
        "owner_uid": i.owner_uid,
        "owner_gid": i.owner_gid,
        "mode": f"{i.mode:04o}",
        "created": datetime.datetime.fromtimestamp(i.created_unix_ns / 1e9, datetime.timezone.utc).strftime(
            "%Y-%m-%dT%H:%M:%SZ"
        ),
        "references": i.references,
        "mapper_count": i.mapper_count,
        "mapper_pids": list(i.mapper_pids),
    }


def _pids(i: Any) -> str:
    s = ",".join(str(p) for p in i.mapper_pids)
    if i.mapper_count > len(i.mapper_pids):
        s += f",+{i.mapper_count - len(i.mapper_pids)}"
    return s or "-"


def _cmd_ls(args: argparse.Namespace) -> int:
    from .segment import Segment

    infos = Segment.list()
    if args.json:
        print(json.dumps([_info_dict(i) for i in infos], indent=2, sort_keys=True))
        return EXIT_OK
    print(f"{'NAME':<32} {'KIND':<12} {'SIZE':>10} {'OWNER':>6} {'MODE':>5} {'REFS':>4} PIDS")
    for i in infos:
        name = i.name or f"(unlinked #{i.id})"
        print(f"{name:<32} {i.kind:<12} {_human_bytes(i.size):>10} {i.owner_uid:>6} {i.mode:04o}  {i.references:>4} "
              f"{_pids(i)}")
    return EXIT_OK


def _cmd_stat(args: argparse.Namespace) -> int:
    from .segment import Segment

    i = Segment.stat(args.name)
    if args.json:
        print(json.dumps(_info_dict(i), indent=2, sort_keys=True))
        return EXIT_OK
    d = _info_dict(i)
    print(f"name:       {i.name}")
    print(f"id:         {i.id}")
    print(f"kind:       {i.kind}")
    print(f"size:       {_human_bytes(i.size)} ({i.size} bytes)")
    print(f"device:     {i.device_uuid or '-'}")
    print(f"owner:      uid {i.owner_uid} gid {i.owner_gid}")
    print(f"mode:       {i.mode:04o}")
    print(f"created:    {d['created']}")
    print(f"references: {i.references}")
    print(f"mappers:    {i.mapper_count} (pids {_pids(i)})")
    return EXIT_OK


def _cmd_doctor(args: argparse.Namespace) -> int:
    r = doctor()
    if args.json:
        print(json.dumps(r, indent=2, sort_keys=True))
    else:
        _print_doctor(r)
    return int(r["exit_code"])


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m gpuipc",
        description="gpuipc checks and listings for a wheel-only install (the gpuipc tool's doctor, ls and stat).",
    )
    p.add_argument("--version", action="store_true", help="print the package's version and exit")
    sub = p.add_subparsers(dest="command", metavar="COMMAND")
    d = sub.add_parser("doctor", help="check the driver, the runtime directory and the broker")
    d.add_argument("--json", action="store_true", help="print one JSON object")
    d.set_defaults(run=_cmd_doctor)
    ls = sub.add_parser("ls", help="list segments: name, kind, size, owner, mode, references, mapper pids")
    ls.add_argument("--json", action="store_true", help="print a JSON array (the keys of gpuipc ls --json)")
    ls.set_defaults(run=_cmd_ls)
    st = sub.add_parser("stat", help="show one segment")
    st.add_argument("name", metavar="NAME")
    st.add_argument("--json", action="store_true", help="print one JSON object")
    st.set_defaults(run=_cmd_stat)
    return p


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Runs ``python -m gpuipc`` with `argv` (default: sys.argv[1:]); returns the exit status."""
    p = _parser()
    args = p.parse_args(argv)  # exits 2 on a bad command line
    if args.version:
        from . import __version__

        print(f"gpuipc {__version__}")
        return EXIT_OK
    if not getattr(args, "command", None):
        p.print_usage(sys.stderr)
        print("python -m gpuipc: a command is required (doctor, ls, stat)", file=sys.stderr)
        return EXIT_USAGE
    from .errors import Error

    try:
        return int(args.run(args))
    except Error as e:
        print(f"gpuipc: {e}", file=sys.stderr)
        return _exit_code_of(e)


if __name__ == "__main__":
    sys.exit(main())
