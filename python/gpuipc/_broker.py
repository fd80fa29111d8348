"""Stopping a broker by its runtime directory's pid file, for test and benchmark harnesses that start one of their
own (a private GPUIPC_RUNTIME_DIR) and must leave nothing running."""

from __future__ import annotations

import os
import signal
import time


def _alive(pid: int) -> bool:
    """Whether process ``pid`` exists and is not a zombie."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def stop_broker(runtime_dir: str, grace: float = 5.0) -> None:
    """SIGTERMs the broker of ``runtime_dir`` (its ``broker.pid``) and waits ``grace`` seconds for it to go, then
    SIGKILLs it and waits as long again. Nothing when no broker.pid names a live process."""
    try:
        with open(os.path.join(runtime_dir, "broker.pid")) as f:
            pid = int(f.read().strip() or 0)
    except (OSError, ValueError):
        return
    if pid <= 0:
        return
    for sig in (signal.SIGTERM, signal.SIGKILL):
        try:
            os.kill(pid, sig)
        except ProcessLookupError:
            return
        deadline = time.monotonic() + grace
        while time.monotonic() < deadline:
            if not _alive(pid):
                return
            time.sleep(0.01)
