"""The exceptions gpuipc raises.

Every error is a :class:`gpuipc.Error`; where a builtin exception means the same thing the class derives from it
too, so ``except FileNotFoundError`` and ``except gpuipc.NotFound`` both catch a missing segment. The C++ library's
``gpuipc::Error`` codes and the hot path's ``Status`` values are translated into these classes in one place
(python/src/errors.cpp).

Attributes of every instance: ``code`` (the C++ ErrorCode or Status name, e.g. ``"PermissionDenied"``), ``call``
(the failing call, e.g. ``"open"``, ``"cuMemCreate"``; may be empty), ``errno`` (errno of a failing system call or
None) and ``cu_result`` (CUresult of a failing driver call, 0 when none).
"""

from __future__ import annotations

from typing import Dict, Optional, Type

__all__ = [
    "Error",
    "InvalidArgument",
    "NotFound",
    "AlreadyExists",
    "PermissionDenied",
    "QuotaExceeded",
    "PeerDied",
    "Closed",
    "Timeout",
    "WouldBlock",
    "Interrupted",
    "InvalidState",
    "NoDriver",
    "NoDevice",
    "Unsupported",
    "CudaError",
    "SystemCallError",
    "ProtocolError",
    "ChecksumMismatch",
]


class Error(Exception):
    """Base class of every gpuipc error."""

    code: str
    call: str
    cu_result: int

    def __init__(
        self, message: str = "", *, code: Optional[str] = None, call: str = "", errno: int = 0, cu_result: int = 0
    ) -> None:
        super().__init__(message)
        self.code = code if code is not None else type(self).__name__
        self.call = call
        self.cu_result = cu_result
        # OSError subclasses keep errno in their own slot; the others get an attribute of the same name.
        self.errno = errno or None  # type: ignore[assignment]

    def __str__(self) -> str:
        return str(self.args[0]) if self.args else ""

    def __reduce__(self) -> tuple:  # type: ignore[override]
        # Pickled whole (multiprocessing sends a worker's exception back so): OSError's own reduce kept the message
        # only, and errno came back None.
        return (_rebuilt, (type(self), str(self), self.code, self.call, self.errno or 0, self.cu_result))


def _rebuilt(cls: Type[Error], message: str, code: str, call: str, errno: int, cu_result: int) -> Error:
    return cls(message, code=code, call=call, errno=errno, cu_result=cu_result)


class InvalidArgument(Error, ValueError):
    """A value passed in is out of range or malformed (also: using a closed object)."""


class NotFound(Error, FileNotFoundError):
    """No such segment, semaphore, channel, device or file."""


class AlreadyExists(Error, FileExistsError):
    """Create of a name that is taken."""


class PermissionDenied(Error, PermissionError):
    """The object's mode bits or owner refuse this process; the message names the owner and the mode."""


class QuotaExceeded(Error):
    """A per-user limit on bytes or objects would be exceeded."""


class PeerDied(Error):
    """The other side of a semaphore or channel is gone (crashed or killed); drained data was delivered first."""


class Closed(Error):
    """The other side closed cleanly (every producer, or every consumer, left), or this handle was closed (with
    ``close()`` or a ``with`` block) and used again."""


class Timeout(Error, TimeoutError):
    """A blocking call ran out of time."""


class WouldBlock(Timeout):
    """A call with ``timeout=0`` found nothing ready."""


class Interrupted(Error, InterruptedError):
    """A blocking call was interrupted by a signal."""


class InvalidState(Error, RuntimeError):
    """The call does not fit the object's state (release without receive, a waiter signalling, a paused pool, ...)."""


class NoDriver(Error):
    """The CUDA driver (libcuda.so.1) could not be loaded or initialised: only host kinds work."""


class NoDevice(Error):
    """The CUDA driver works but there is no such GPU."""


class Unsupported(Error):
    """The device or driver lacks a needed capability."""


class CudaError(Error):
    """A CUDA driver call failed; ``cu_result`` holds its CUresult."""


class SystemCallError(Error, OSError):
    """A system call failed; ``errno`` holds its errno."""


class ProtocolError(Error):
    """A malformed or unexpected message on the broker socket."""


class ChecksumMismatch(Error):
    """Data arrived with another checksum than its sender computed (a bucket of a stream, see
    gpuipc.stream_reader); the message names the bucket."""


_BY_NAME: Dict[str, Type[Error]] = {cls.__name__: cls for cls in (globals()[n] for n in __all__)}


def _class_for(name: str) -> Type[Error]:
    """The class the C++ translator raises for an ErrorCode/Status name (unknown names: Error)."""
    return _BY_NAME.get(name, Error)
