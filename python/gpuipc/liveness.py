"""Liveness: who holds a name open, and heartbeats that the broker turns into "hung" when they stop."""

from __future__ import annotations

from typing import Any, Dict, List

from . import _gpuipc

__all__ = ["holders", "heartbeat"]


def holders(name: str) -> List[Dict[str, Any]]:
    """The processes that hold ``name`` open (a segment, semaphore, channel, pool or counting semaphore), by pid.

    Each is a dict: ``pid``, ``uid``, ``role`` ("creator+holder", "signaller", "read-only", ...), ``references``,
    ``read_write``, ``creator``, ``heartbeat`` ("none", "alive" or "hung") and ``heartbeat_deadline`` (seconds, 0
    when none). Raises NotFound when there is no such name or you may not read it.
    """
    return _gpuipc.holders(name)


def heartbeat(name: str, deadline: float) -> None:
    """Promises the broker the next heartbeat for ``name`` within ``deadline`` seconds (0 stops beating).

    When the deadline passes first, :func:`holders` and ``gpuipc watch`` show this process as hung until it beats
    again. This process must hold ``name`` open. Raises InvalidArgument otherwise, or for a deadline above an hour.
    """
    _gpuipc.heartbeat(name, deadline)
