"""Semaphores: named cross-process timelines (64-bit counters that only grow) for GPU streams and host threads."""

from __future__ import annotations

from typing import Any, Optional

from . import _gpuipc
from ._devices import Device, resolve as _device
from ._ints import U32, in_range
from ._streams import stream_handle
from .errors import InvalidArgument, InvalidState

__all__ = ["Semaphore", "MAX_VALUE"]

#: The largest value a semaphore takes (2**62 - 1).
MAX_VALUE = (1 << 62) - 1


def _refuse(value: Any, call: str) -> None:
    """Raises for a value outside 0..MAX_VALUE: InvalidState above it, as the library says for a value it takes as
    a number, InvalidArgument below it or for what is no integer."""
    try:
        big = value > MAX_VALUE
    except TypeError:
        big = False
    if big:
        raise InvalidState(f"{call}({value}): a semaphore's value is at most MAX_VALUE (2**62 - 1)")
    raise InvalidArgument(f"{call}({value!r}): a semaphore's value is an integer from 0 to MAX_VALUE (2**62 - 1)")


class Semaphore:
    """A cross-process timeline semaphore.

    GPU streams signal and wait on it in stream order (:meth:`signal`, :meth:`wait`; the default "host_pinned"
    kind), host threads with :meth:`signal_host` / :meth:`wait_host` (every kind; "host" needs no GPU). When the
    last signaller goes away (exit, crash or close) the broker poisons it: every wait returns at once and raises
    :class:`gpuipc.PeerDied` (crash) or :class:`gpuipc.Closed` (clean close).
    """

    __slots__ = ("_sem", "__weakref__")

    def __init__(self, _handle: _gpuipc.Semaphore) -> None:
        """Internal: use :meth:`create` or :meth:`open`."""
        self._sem = _handle

    @classmethod
    def create(
        cls, name: str, *, initial: int = 0, kind: str = "host_pinned", device: Device = 0, mode: int = 0o600
    ) -> "Semaphore":
        """Creates semaphore ``name`` at ``initial``; this process is a signaller.

        kind: "host_pinned" (GPU streams and host threads; needs a driver) or "host" (host threads only).
        mode: r lets a process wait, w lets it signal. Raises AlreadyExists, InvalidArgument, NoDriver, ...
        """
        initial = in_range(initial, "initial", MAX_VALUE)
        mode = in_range(mode, "mode", U32)
        return cls(_gpuipc.Semaphore.create(name, initial=initial, kind=kind, device=_device(device), mode=mode))

    @classmethod
    def open(
        cls, name: str, *, role: str = "waiter", wait: Optional[float] = None, device: Device = 0
    ) -> "Semaphore":
        """Opens semaphore ``name`` as a "signaller" (needs write permission) or a "waiter" (read).

        wait: seconds to wait for it to be created (None: fail at once with NotFound). Raises NotFound, Timeout,
        PermissionDenied, InvalidArgument (not a semaphore).
        """
        return cls(_gpuipc.Semaphore.open(name, role=role, wait=wait, device=_device(device)))

    @staticmethod
    def unlink(name: str) -> None:
        """Removes the name (like :meth:`gpuipc.Segment.unlink`)."""
        _gpuipc.Semaphore.unlink(name)

    def signal(self, value: int, stream: Any = None, *, wake_host: bool = False) -> None:
        """Stream-ordered: when ``stream`` reaches this point the value becomes ``value``.

        stream: None (legacy default stream), an int handle, torch/cupy streams or ``__cuda_stream__`` objects.
        wake_host: also wake host waiters at once (else within 1 ms); on an idle stream the value is then raised
        from the host at once, as signal_host does. Raises PeerDied/Closed (poisoned),
        InvalidState (a waiter, a host-kind semaphore, value > MAX_VALUE), CudaError.
        """
        if not 0 <= value <= MAX_VALUE:
            _refuse(value, "signal")
        self._sem.signal(value, stream_handle(stream), wake_host)

    def wait(self, value: int, stream: Any = None) -> None:
        """Stream-ordered: work enqueued on ``stream`` after this waits until the value reaches ``value``.

        Raises PeerDied/Closed (already poisoned: nothing is enqueued), InvalidState (host-kind semaphore),
        CudaError.
        """
        if not 0 <= value <= MAX_VALUE:
            _refuse(value, "wait")
        self._sem.wait(value, stream_handle(stream))

    def signal_host(self, value: int) -> None:
        """Raises the value to ``value`` from the host (never lowers it) and wakes host waiters. Raises
        PeerDied/Closed, InvalidState (a waiter, value > MAX_VALUE)."""
        if not 0 <= value <= MAX_VALUE:
            _refuse(value, "signal_host")
        self._sem.signal_host(value)

    def wait_host(self, value: int, timeout: Optional[float] = None, spin: Optional[float] = None) -> int:
        """Waits (without the GIL; Ctrl-C interrupts) until the value reaches ``value``; returns the value seen.

        timeout: seconds (None: forever; 0: only look). spin: seconds to poll before sleeping (None: 20 us). A
        stream's signal wakes no sleeper by itself: a waiter that must see it within microseconds spins for as
        long as it expects to wait, at the cost of a CPU core (``math.inf``: for the whole wait). Raises Timeout
        (WouldBlock for 0), PeerDied, Closed (poisoned, or this handle closed by another thread while it waited),
        InvalidState (value > MAX_VALUE, which the value never reaches).
        """
        if not 0 <= value <= MAX_VALUE:
            _refuse(value, "wait_host")
        return self._sem.wait_host(value, timeout, spin)

    @property
    def value(self) -> int:
        """The current value."""
        return self._sem.value

    @property
    def status(self) -> str:
        """"ok", or why it is poisoned: "peer_died" or "closed"."""
        return self._sem.status

    @property
    def name(self) -> str:
        return self._sem.name

    @property
    def role(self) -> str:
        """"signaller" or "waiter"."""
        return self._sem.role

    @property
    def closed(self) -> bool:
        return self._sem.closed

    def close(self) -> None:
        """Leaves (idempotent). The last signaller leaving poisons the semaphore (Closed) for the waiters. A thread
        of this process waiting in :meth:`wait_host` on this handle raises Closed within 50 ms."""
        self._sem.close()

    def __enter__(self) -> "Semaphore":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        if self.closed:
            return "<gpuipc.Semaphore closed>"
        return f"<gpuipc.Semaphore {self.name!r} role={self.role} value={self.value} status={self.status}>"
