#!/usr/bin/env python3
"""The public/internal boundary (docs/architecture.md#layers): front ends use only include/gpuipc.

  tests/boundary/check_front_ends.py BUILD_DIR SOURCE_DIR

Fails when
- a front end (tools/gpuipc, tools/common, python/src) or a public header (include/gpuipc) includes a header of
  src/ (any quoted include that is neither gpuipc/... nor a file of its own folder);
- the CLI's compile command has src/ on its include path, or a file that includes "core/client.hpp" compiles with
  it (it must not find it), or one that includes every public header does not.
"""
import json
import pathlib
import re
import shlex
import subprocess
import sys
import tempfile

INCLUDE = re.compile(r'^\s*#\s*include\s*"([^"]+)"', re.M)
FRONT_ENDS = ["tools/gpuipc", "tools/common", "python/src", "include/gpuipc"]


def quoted_includes(src: pathlib.Path):
    problems = []
    for folder in FRONT_ENDS:
        for f in sorted((src / folder).glob("*.[ch]pp")):
            for name in INCLUDE.findall(f.read_text()):
                shared = folder.startswith("tools/") and (src / "tools/common" / name).is_file()
                own = (f.parent / name).is_file() or shared
                public = name.startswith("gpuipc/") and not (src / "src" / name).exists()
                if own or public:
                    continue
                where = "src/" + name if (src / "src" / name).exists() else "neither include/ nor its own folder"
                problems.append(f"{f.relative_to(src)} includes \"{name}\" ({where})")
    return problems


def cli_command(build: pathlib.Path, src: pathlib.Path):
    entries = json.loads((build / "compile_commands.json").read_text())
    main = str((src / "tools/gpuipc/main.cpp").resolve())
    for e in entries:
        if str(pathlib.Path(e["file"]).resolve()) == main:
            args = e.get("arguments") or shlex.split(e["command"])
            out, skip = [], False
            for a in args:
                if skip:
                    skip = False
                    continue
                if a in ("-o", "-c", "-MF", "-MT", "-MQ"):
                    skip = True
                    continue
                if a in ("-MD", "-MMD") or pathlib.Path(a).name == "ccache":
                    continue
                out.append(a)
            return out, e["directory"]
    raise SystemExit("tools/gpuipc/main.cpp is not in compile_commands.json: build the gpuipc CLI first")


def compiles(command, directory, text):
    with tempfile.TemporaryDirectory() as tmp:
        probe = pathlib.Path(tmp) / "probe.cpp"
        probe.write_text(text)
        r = subprocess.run(command + ["-fsyntax-only", str(probe)], cwd=directory, capture_output=True, text=True)
        return r.returncode == 0, r.stderr


def main():
    build, src = pathlib.Path(sys.argv[1]).resolve(), pathlib.Path(sys.argv[2]).resolve()
    problems = quoted_includes(src)
    command, directory = cli_command(build, src)
    src_dir = str(src / "src")
    for a in command:
        if a.startswith("-I") or a.startswith("-isystem"):
            path = a[2:] if a.startswith("-I") else a[len("-isystem"):]
            if path.strip() and str(pathlib.Path(path.strip()).resolve()) == src_dir:
                problems.append(f"the gpuipc CLI compiles with {src_dir} on its include path")
    ok, _ = compiles(command, directory, '#include "core/client.hpp"\n')
    if ok:
        problems.append('a file of the gpuipc CLI that includes "core/client.hpp" compiles: src/ is visible to it')
    headers = sorted(p.name for p in (src / "include/gpuipc").glob("*.hpp"))
    ok, err = compiles(command, directory, "".join(f'#include "gpuipc/{h}"\n' for h in headers) +
                       '#include "gpuipc/version.hpp"\n')
    if not ok:
        problems.append("the public headers do not compile with the gpuipc CLI's flags:\n" + err[-2000:])
    for p in problems:
        print("boundary:", p, file=sys.stderr)
    if problems:
        return 1
    print(f"front ends include only include/gpuipc; the CLI's include path has no src/ ({len(headers)} public headers)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
