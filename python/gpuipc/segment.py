"""Segments: named, access-controlled shared memory (GPU, pageable host or pinned host) opened by name, zero-copy."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, List, Optional, Tuple

from . import _gpuipc
from ._devices import Device, resolve as _device
from ._arrays import Array, Shape, make_array
from ._ints import U32, U64, in_range
from .errors import InvalidArgument

__all__ = ["Segment", "SegmentInfo", "share"]


@dataclass(frozen=True)
class SegmentInfo:
    """What the broker knows about a segment (:meth:`Segment.stat`, :meth:`Segment.list`, ``gpuipc ls``)."""

    id: int  #: unique for the broker's lifetime
    name: str  #: empty once unlinked
    kind: str  #: "device", "host" or "host_pinned"
    size: int  #: bytes as mapped
    device_uuid: str  #: "GPU-..." for device segments, "" for host kinds
    owner_uid: int
    owner_gid: int
    mode: int  #: permission bits, e.g. 0o600
    created_unix_ns: int
    references: int  #: open references over all processes
    mapper_pids: Tuple[int, ...]  #: processes holding references (at most 16 listed)
    mapper_count: int


class Segment:
    """A mapped segment. Like a file: create or open it by name, use it, close it (or use ``with``).

    >>> with gpuipc.Segment.create("weights", 1 << 20, kind="device") as seg:
    ...     w = torch.from_dlpack(seg.as_array("float16", (512, 1024)))

    Opening the same name again in this process shares the mapping. The memory stays alive while any process
    maps it or the name exists; arrays made by :meth:`as_array` keep the mapping alive after :meth:`close`.
    """

    __slots__ = ("_seg", "__weakref__")

    def __init__(self, _handle: _gpuipc.Segment) -> None:
        """Internal: use :meth:`create` or :meth:`open`."""
        self._seg = _handle

    # Construction ------------------------------------------------------------------------------------------------
    @classmethod
    def create(cls, name: str, size: int, *, kind: str = "host", device: Device = 0, mode: int = 0o600) -> "Segment":
        """Creates segment ``name`` of at least ``size`` bytes and maps it read-write.

        kind: "host" (pageable memory; no GPU needed), "device" (GPU memory of ``device``) or "host_pinned"
        (host memory registered with ``device``'s context). mode: permission bits like a file's (0o640: the
        group may open it read-only). Raises AlreadyExists, QuotaExceeded, InvalidArgument, NoDriver, NoDevice,
        Unsupported, CudaError.
        """
        size, mode = in_range(size, "size", U64), in_range(mode, "mode", U32)
        return cls(_gpuipc.Segment.create(name, size, kind=kind, device=_device(device), mode=mode))

    @classmethod
    def open(
        cls, name: str, *, readonly: bool = False, wait: Optional[float] = None, device: Optional[Device] = None
    ) -> "Segment":
        """Opens segment ``name``.

        readonly: map it read-only (writes fault; needs only read permission). wait: seconds to wait for the
        segment to be created (None: fail at once with NotFound; ``math.inf``: forever; Ctrl-C interrupts).
        device: device segments: the GPU whose context maps it (None: the current context's device, else the
        one the memory lives on). Raises NotFound, Timeout, PermissionDenied, Unsupported, NoDriver, CudaError.
        """
        return cls(_gpuipc.Segment.open(name, readonly=readonly, wait=wait, device=_device(device)))

    @staticmethod
    def unlink(name: str) -> None:
        """Removes the name. Mappings stay valid; the memory goes with the last one. Raises NotFound,
        PermissionDenied (only the owner or root may unlink)."""
        _gpuipc.Segment.unlink(name)

    @staticmethod
    def stat(name: str) -> SegmentInfo:
        """The broker's record of segment ``name``. Raises NotFound."""
        return SegmentInfo(**_gpuipc.Segment.stat(name))

    @staticmethod
    def list() -> List[SegmentInfo]:
        """Every segment the broker knows (unlinked ones still mapped included)."""
        return [SegmentInfo(**d) for d in _gpuipc.Segment.list()]

    # Properties --------------------------------------------------------------------------------------------------
    @property
    def name(self) -> str:
        return self._seg.name

    @property
    def size(self) -> int:
        """Usable bytes (rounded up to a page, or to the GPU allocation granularity)."""
        return self._seg.size

    @property
    def kind(self) -> str:
        """"device", "host" or "host_pinned"."""
        return self._seg.kind

    @property
    def access(self) -> str:
        """"read_only" or "read_write"."""
        return "read_only" if self._seg.readonly else "read_write"

    @property
    def readonly(self) -> bool:
        return self._seg.readonly

    @property
    def device(self) -> int:
        """The GPU ordinal whose context mapped it (device, host_pinned); -1 for host segments."""
        return self._seg.device

    @property
    def id(self) -> int:
        """The broker's id of this segment."""
        return self._seg.id

    @property
    def owner_uid(self) -> int:
        """The uid that owns the segment, as the broker said when this process created or opened it."""
        return self._seg.owner_uid

    @property
    def owner_gid(self) -> int:
        """The gid of the segment's owner (as :attr:`owner_uid`)."""
        return self._seg.owner_gid

    @property
    def mode(self) -> int:
        """The segment's permission bits (as :attr:`owner_uid`)."""
        return self._seg.mode

    @property
    def address(self) -> int:
        """Host address (host kinds) or device address (device) of the first byte."""
        return self._seg.address

    @property
    def device_pointer(self) -> int:
        """The GPU-visible address (device, host_pinned); 0 for host segments."""
        return self._seg.device_pointer

    @property
    def closed(self) -> bool:
        return self._seg.closed

    # Data --------------------------------------------------------------------------------------------------------
    def as_array(self, dtype: Any = "uint8", shape: Shape = None, offset: int = 0) -> Array:
        """``shape`` elements of ``dtype`` starting ``offset`` bytes in, without a copy.

        Host kinds: a NumPy array (read-only when the segment was opened read-only). Device: an ArrayView with
        ``__dlpack__`` / ``__dlpack_device__`` (kDLCUDA, this device) and ``__cuda_array_interface__``, for
        ``torch.from_dlpack``, ``cupy.from_dlpack``/``cupy.asarray`` or ``jax.dlpack.from_dlpack``. The array keeps
        the mapping alive even after :meth:`close`. ``shape=None``: as many elements as fit. Raises
        InvalidArgument when it does not fit.
        """
        return make_array(self._seg.view(), dtype, shape, offset)

    def view(self) -> _gpuipc.ArrayView:
        """The whole segment as bytes (an ArrayView; host kinds also support ``memoryview(seg.view())``)."""
        return self._seg.view()

    # Lifetime ----------------------------------------------------------------------------------------------------
    def close(self) -> None:
        """Drops this handle (idempotent). Arrays made from it keep the mapping until they go; whichever goes last
        (this handle, or an array the garbage collector frees) unmaps without holding the GIL, so other threads run
        while it tells the broker."""
        self._seg.close()

    def __enter__(self) -> "Segment":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        if self.closed:
            return "<gpuipc.Segment closed>"
        return (
            f"<gpuipc.Segment {self.name!r} kind={self.kind} size={self.size} access={self.access}"
            f"{f' device={self.device}' if self.device >= 0 else ''}>"
        )


def share(
    name: str, array_or_ptr: Any, nbytes: Optional[int] = None, *, mode: int = 0o600, device: Optional[Device] = -1
) -> Segment:
    """Shares GPU memory this process already has under ``name``, with no copy; other processes open it with
    :meth:`Segment.open`. Returns the exporter's segment.

    array_or_ptr: an object with ``__cuda_array_interface__`` or ``__dlpack__`` (a torch tensor, a CuPy array; its
    bytes from the first element to the last are shared unless ``nbytes`` says otherwise) or an int device pointer
    (then ``nbytes`` is required). device: the GPU the memory must be on, an ordinal or a UUID (-1 or None: any).
    cudaMalloc memory (PyTorch's default allocator, CuPy) lives only as long as the exporter keeps it and the
    returned segment; VMM memory (expandable segments) lives like any device segment (docs/segments.md). Raises InvalidArgument (host, managed or
    freed memory, another device, a range past the allocation), Unsupported, AlreadyExists, NoDriver, CudaError.
    """
    from ._tensorinfo import describe

    mode = in_range(mode, "mode", U32)
    if device is None or (isinstance(device, int) and not isinstance(device, bool) and device == -1):
        device = -1
    elif isinstance(device, int) and not isinstance(device, bool) and device < -1:
        raise InvalidArgument(f"share: device must be -1 or None (any GPU), a GPU ordinal or a GPU UUID, not {device}")
    else:
        device = _device(in_range(device, "device", 2**31 - 1) if isinstance(device, int) else device)
    if isinstance(array_or_ptr, bool):
        raise TypeError("share takes an array or an int pointer, not a bool")
    if isinstance(array_or_ptr, int):
        if nbytes is None:
            raise InvalidArgument("share(name, ptr): pass nbytes with a raw pointer")
        ptr = in_range(array_or_ptr, "the pointer", U64)
    else:
        info = describe(array_or_ptr, f"the array shared as {name!r}")
        if not info.is_cuda:
            raise InvalidArgument(
                f"share({name!r}) takes GPU memory; this array is in host memory: copy it into a host segment "
                "(gpuipc.Segment.create) or use gpuipc.share_tensors"
            )
        ptr = info.address
        if nbytes is None:
            nbytes = info.extent
    if nbytes is None or in_range(nbytes, "nbytes", U64) == 0:
        raise InvalidArgument(f"share({name!r}): nothing to share (0 bytes)")
    return Segment(_gpuipc.share(name, ptr, nbytes, mode=mode, device=device))
