"""Counting semaphores: named sets of permits that processes acquire and release; a dead holder's come back."""

from __future__ import annotations

from typing import Dict, Optional

from . import _gpuipc
from ._ints import U32, in_range
from .errors import Timeout, WouldBlock

__all__ = ["CountingSemaphore", "COUNTING_MAX_COUNT"]

#: The most permits a counting semaphore has (2**31 - 1).
COUNTING_MAX_COUNT = (1 << 31) - 1


class CountingSemaphore:
    """A named counting semaphore shared between processes (host memory; no GPU needed).

    Like a POSIX named semaphore, with one difference: the permits a process holds come back when it dies
    (SIGKILL included) or closes its handle, because the broker counts them per holder. :meth:`acquire` and
    :meth:`release` touch only shared memory (no broker round trip). Waiters sleep (no spinning) and are served in
    the order they started waiting; an acquire that finds anyone waiting queues behind them. Releasing more
    permits than this handle holds raises :class:`gpuipc.InvalidArgument`.
    """

    __slots__ = ("_sem", "__weakref__")

    def __init__(self, _handle: _gpuipc.CountingSemaphore) -> None:
        """Internal: use :meth:`create` or :meth:`open`."""
        self._sem = _handle

    @classmethod
    def create(
        cls, name: str, *, initial: int = 1, max_count: Optional[int] = None, mode: int = 0o600
    ) -> "CountingSemaphore":
        """Creates counting semaphore ``name``: ``max_count`` permits (default: ``initial``), ``initial`` of them free.

        The creator holds the other ``max_count - initial``. mode: r lets a process read its counts (:meth:`stat`),
        w lets it acquire and release. Raises AlreadyExists, InvalidArgument (max_count not in 1..2**31-1, initial
        above it), PermissionDenied, QuotaExceeded.
        """
        initial = in_range(initial, "initial", U32)
        max_count = initial if max_count is None else in_range(max_count, "max_count", U32)
        mode = in_range(mode, "mode", U32)
        return cls(_gpuipc.CountingSemaphore.create(name, initial=initial, max_count=max_count, mode=mode))

    @classmethod
    def open(cls, name: str, *, wait: Optional[float] = None) -> "CountingSemaphore":
        """Opens counting semaphore ``name`` (read and write permission needed); this handle holds nothing.

        wait: seconds to wait for it to be created (None: fail at once with NotFound). Raises NotFound, Timeout,
        PermissionDenied, InvalidArgument (not a counting semaphore), QuotaExceeded (64 handles already).
        """
        return cls(_gpuipc.CountingSemaphore.open(name, wait=wait))

    @staticmethod
    def unlink(name: str) -> None:
        """Removes the name (like :meth:`gpuipc.Segment.unlink`); open handles keep working."""
        _gpuipc.CountingSemaphore.unlink(name)

    @staticmethod
    def stat(name: str) -> Dict[str, int]:
        """The counts of ``name`` without joining it: available, max_count, held, holders, waiting."""
        return _gpuipc.CountingSemaphore.stat(name)

    def acquire(self, n: int = 1, timeout: Optional[float] = None) -> None:
        """Takes ``n`` permits, waiting (without the GIL; Ctrl-C interrupts) up to ``timeout`` s (None: forever).

        Raises Timeout when they did not come in time (WouldBlock, a Timeout, for ``timeout=0``), InvalidArgument
        for n > max_count (or not a count), Closed when another thread closes this handle while it waits.
        """
        if not self._sem.acquire(in_range(n, "n", U32), timeout):
            cls = WouldBlock if timeout == 0 else Timeout
            raise cls(
                f"acquire({n}) of counting semaphore {self.name!r}: {n} permit(s) did not come within {timeout} s "
                f"({self.available} available, {self.waiting} waiting)",
                call="acquire",
            )

    def try_acquire(self, n: int = 1) -> bool:
        """Takes ``n`` permits if they are free now and nobody waits before this handle; returns whether it did."""
        return self._sem.acquire(in_range(n, "n", U32), 0)

    def release(self, n: int = 1) -> None:
        """Gives back ``n`` permits this handle holds and wakes waiters. Raises InvalidArgument if it holds fewer."""
        self._sem.release(in_range(n, "n", U32))

    @property
    def held(self) -> int:
        """Permits this handle holds."""
        return self._sem.held

    @property
    def available(self) -> int:
        """Permits nobody holds now."""
        return self._sem.available

    @property
    def waiting(self) -> int:
        """Handles waiting in acquire now."""
        return self._sem.waiting

    @property
    def max_count(self) -> int:
        return self._sem.max_count

    @property
    def name(self) -> str:
        return self._sem.name

    @property
    def closed(self) -> bool:
        return self._sem.closed

    def close(self) -> None:
        """Leaves (idempotent): every permit this handle holds is released, as when the process dies. A thread of
        this process waiting in :meth:`acquire` on this handle raises Closed within 50 ms."""
        self._sem.close()

    def __enter__(self) -> "CountingSemaphore":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        if self.closed:
            return "<gpuipc.CountingSemaphore closed>"
        return (
            f"<gpuipc.CountingSemaphore {self.name!r} held={self.held} available={self.available} "
            f"max_count={self.max_count}>"
        )

