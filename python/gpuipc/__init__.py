"""gpuipc: share GPU memory between processes on one machine.

* :class:`Segment` — named, access-controlled shared memory (GPU, host or pinned host), zero-copy into NumPy,
  PyTorch, CuPy and JAX (``seg.as_array(dtype, shape)``; DLPack and ``__cuda_array_interface__``).
* :class:`Semaphore` — a cross-process timeline that GPU streams and host threads signal and wait on.
* :class:`CountingSemaphore` — named permits processes acquire and release; a dead holder's permits come back.
* :func:`holders` / :func:`heartbeat` — who holds a name open; heartbeats the broker turns into "hung" when missed.
* :class:`Channel` — a producer/consumer ring of GPU (or host) buffers: ``send(array)`` / ``recv().array``.
* :class:`Pool` — a named pool of shareable memory that hands out blocks between processes (:class:`BlockRef`);
  :func:`share` names GPU memory this process already has.
* :func:`share_tensors` / :func:`open_tensors` — a state dict under one name; :func:`publish_tensors` and
  :class:`Reader` add versions for weight sync.
* :func:`stream_publisher` / :func:`stream_reader` — bucketed streaming of versions of a state dict through a ring
  of staging buckets that readers map once (models larger than a spare copy).
* ``gpuipc.torch`` and ``gpuipc.cupy`` (imported on demand) — PyTorch and CuPy allocations in gpuipc pools.

A broker daemon (``gpuipcd``, shipped inside this package) holds names and permissions; the library starts it on
first use. ``GPUIPC_RUNTIME_DIR`` chooses its socket directory (default ``$XDG_RUNTIME_DIR/gpuipc``, else
``/tmp/gpuipc-$UID``). Errors are :class:`Error` subclasses (see :mod:`gpuipc.errors`).
"""

from __future__ import annotations

import atexit as _atexit
import os as _os

from . import _gpuipc

# At exit, a daemon thread still waiting in gpuipc parks instead of taking the GIL back (Python before 3.14 ends such
# a thread with pthread_exit, which aborted the process through the extension's C++ frames). Registered first, this
# runs after the exit handlers registered later.
_atexit.register(_gpuipc._exiting)
from ._devices import device_ordinal
from .channel import Channel, ChannelStats, Message, Slot
from . import errors as _errors
from .errors import (
    AlreadyExists,
    ChecksumMismatch,
    Closed,
    CudaError,
    Error,
    Interrupted,
    InvalidArgument,
    InvalidState,
    NoDevice,
    NoDriver,
    NotFound,
    PeerDied,
    PermissionDenied,
    ProtocolError,
    QuotaExceeded,
    SystemCallError,
    Timeout,
    Unsupported,
    WouldBlock,
)
from .pool import Block, BlockRef, BlockView, Pool
from .segment import Segment, SegmentInfo, share
from .semaphore import MAX_VALUE, Semaphore
from .counting_semaphore import COUNTING_MAX_COUNT, CountingSemaphore
from .liveness import heartbeat, holders
from .tensors import SharedTensors, open_tensors, share_tensors, unlink_tensors
from .versions import Pinned, Publisher, Reader, publish_tensors
from .streaming import StreamItem, StreamPublisher, StreamReader, stream_publisher, stream_reader, unlink_stream

ArrayView = _gpuipc.ArrayView

#: The release version, from project(VERSION) in CMakeLists.txt through the extension (the wheel's metadata reads
#: the same line).
__version__ = _gpuipc.version()
#: The git commit the extension was built from ("-dirty" appended when the tree had changes; "unknown" outside git):
#: what benchmark results of this module name.
__commit__: str = _gpuipc.build_commit()

__all__ = [
    "Segment",
    "SegmentInfo",
    "Semaphore",
    "MAX_VALUE",
    "CountingSemaphore",
    "COUNTING_MAX_COUNT",
    "holders",
    "heartbeat",
    "Channel",
    "ChannelStats",
    "Message",
    "Slot",
    "ArrayView",
    "Pool",
    "Block",
    "BlockRef",
    "BlockView",
    "share",
    "share_tensors",
    "open_tensors",
    "unlink_tensors",
    "SharedTensors",
    "publish_tensors",
    "Publisher",
    "Reader",
    "Pinned",
    "stream_publisher",
    "stream_reader",
    "unlink_stream",
    "StreamPublisher",
    "StreamReader",
    "StreamItem",
    "daemon_path",
    "device_ordinal",
    *_errors.__all__,
]


def daemon_path() -> str:
    """The gpuipcd the library starts when no broker runs: ``$GPUIPC_DAEMON``, else the one shipped in this
    package (next to the extension module), else one on ``$PATH``; "" when there is none."""
    return _gpuipc._daemon_path()


def _packaged_daemon() -> str:
    return _os.path.join(_os.path.dirname(_os.path.abspath(__file__)), "gpuipcd")


# The library looks for gpuipcd next to the shared object that contains it (the extension, in this folder). Say
# so explicitly where the package sits behind a symlink or a zipapp-like loader that hides that path.
if "GPUIPC_DAEMON" not in _os.environ and not _gpuipc._daemon_path() and _os.access(_packaged_daemon(), _os.X_OK):
    _os.environ["GPUIPC_DAEMON"] = _packaged_daemon()
