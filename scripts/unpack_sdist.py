"""Unpacks an sdist into a kept folder for an incremental build (scripts/build_wheel.sh).

    python scripts/unpack_sdist.py SDIST DEST

Writes only the files whose content or mode changed and removes those the sdist no longer has. Plain extraction
would not do: every entry of the sdist carries the same fixed mtime (reproducible archives), so an edited source
would look older than its object file and the build would not see the edit.
"""

from __future__ import annotations

import os
import sys
import tarfile


def unpack(sdist: str, dest: str) -> int:
    kept = set()
    written = 0
    with tarfile.open(sdist) as t:
        for m in t.getmembers():
            if not m.isfile():
                continue
            rel = m.name.split("/", 1)[1]  # below the sdist's top folder, gpuipc-<version>/
            if os.path.isabs(rel) or ".." in rel.split("/"):
                raise SystemExit(f"unpack_sdist: {sdist} holds {m.name!r}, outside its folder")
            kept.add(rel)
            data = t.extractfile(m).read()
            path = os.path.join(dest, rel)
            try:
                with open(path, "rb") as f:
                    if f.read() == data and os.stat(path).st_mode & 0o777 == m.mode & 0o777:
                        continue
            except FileNotFoundError:
                pass
            os.makedirs(os.path.dirname(path), exist_ok=True)
            with open(path + ".part", "wb") as f:
                f.write(data)
            os.chmod(path + ".part", m.mode & 0o777)
            os.replace(path + ".part", path)
            written += 1
    for root, _, files in os.walk(dest):
        for f in files:
            if os.path.relpath(os.path.join(root, f), dest) not in kept:
                os.remove(os.path.join(root, f))
    return written


if __name__ == "__main__":
    n = unpack(sys.argv[1], sys.argv[2])
    print(f"{sys.argv[2]}: {n} files written")
