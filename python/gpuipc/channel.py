"""Channels: named producer/consumer rings of fixed-size buffers in GPU memory ("device") or host memory ("host").

Two levels, mirroring the C++ API:

* ``acquire`` -> write the :class:`Slot` -> ``publish``; ``receive`` -> read the :class:`Message` -> ``release``.
  Zero-copy: the producer writes straight into the slot (``slot.as_array(...)``), the consumer reads it in place.
* ``send(array)`` / ``recv()``: ``send`` copies an array (NumPy, PyTorch, CuPy, JAX, anything with DLPack or
  ``__cuda_array_interface__``) into a slot and records its dtype and shape in the message header; ``recv``
  returns a :class:`Message` whose ``.array`` is a zero-copy view of the slot (NumPy for host channels, an
  ArrayView for ``torch.from_dlpack`` / ``cupy.from_dlpack`` for device channels).

Every received message must be released (``msg.release()`` or ``with ch.recv() as msg:``), oldest first: its
slot is reused afterwards, so views of it must not be used after release (they stay mapped, but the producer
overwrites them).

The array header (``send`` writes it, ``Message.array`` reads it): little-endian, at offset 0 of the message's
inline header::

    offset  size  field
    0       4     magic b"GPYA"
    4       2     version (1)
    6       1     ndim (0..64)
    7       1     flags (bit 0: aborted - the producer failed while filling the slot; recv skips the message)
    8       1     DLPack type code (0 int, 1 uint, 2 float, 4 bfloat, 5 complex, 6 bool)
    9       1     bits per lane
    10      2     lanes (1)
    12      4     meta_len: bytes of user metadata after the shape
    16      8     nbytes of payload
    24      8*n   shape, int64 each, C order
    24+8n   meta_len  user metadata (``send(..., meta=b"...")``, ``Message.meta``)

With the default ``header_bytes=256`` an array may have up to 29 dimensions (fewer with metadata).
"""

from __future__ import annotations

import functools
import struct
import time
from collections import deque
from dataclasses import dataclass
from typing import Any, Callable, Deque, Iterator, NamedTuple, Optional, Tuple, Union

import numpy as np

from . import _gpuipc
from ._arrays import Array, Shape, as_host_array, make_array
from ._dtypes import DType, dtype_of, from_dlpack
from ._streams import stream_handle
from .errors import Closed, InvalidArgument, InvalidState

__all__ = ["Channel", "ChannelStats", "Message", "Slot", "ARRAY_HEADER_MAGIC"]

ARRAY_HEADER_MAGIC = b"GPYA"
_HEADER = struct.Struct("<4sHBBBBHIQ")
_VERSION = 1
_FLAG_ABORTED = 1
_MAX_NDIM = 64


def _pack_header(dt: DType, shape: Tuple[int, ...], nbytes: int, meta: bytes) -> bytes:
    if len(shape) > _MAX_NDIM:
        raise InvalidArgument(f"arrays of more than {_MAX_NDIM} dimensions cannot be sent")
    return _packed(dt.code, dt.bits, dt.lanes, shape, nbytes, meta)


@functools.lru_cache(maxsize=1024)  # a stream of arrays mostly repeats one dtype and shape
def _packed(code: int, bits: int, lanes: int, shape: Tuple[int, ...], nbytes: int, meta: bytes) -> bytes:
    return (
        _HEADER.pack(ARRAY_HEADER_MAGIC, _VERSION, len(shape), 0, code, bits, lanes, len(meta), nbytes)
        + struct.pack(f"<{len(shape)}q", *shape)
        + meta
    )


_ABORTED_HEADER = _HEADER.pack(ARRAY_HEADER_MAGIC, _VERSION, 0, _FLAG_ABORTED, 1, 8, 1, 0, 0)


@dataclass(frozen=True)
class _ArrayInfo:
    dtype: DType
    shape: Tuple[int, ...]
    nbytes: int
    meta: bytes
    aborted: bool


@functools.lru_cache(maxsize=1024)
def _unpack_header(header: bytes) -> Optional[_ArrayInfo]:
    if len(header) < _HEADER.size or header[:4] != ARRAY_HEADER_MAGIC:
        return None
    _, version, ndim, flags, code, bits, lanes, meta_len, nbytes = _HEADER.unpack_from(header)
    if version != _VERSION or len(header) < _HEADER.size + 8 * ndim + meta_len:
        return None
    if flags & _FLAG_ABORTED:
        return _ArrayInfo(dtype_of("uint8"), (0,), 0, b"", True)
    shape = struct.unpack_from(f"<{ndim}q", header, _HEADER.size)
    start = _HEADER.size + 8 * ndim
    return _ArrayInfo(from_dlpack(code, bits, lanes), tuple(shape), nbytes, bytes(header[start : start + meta_len]), False)


@dataclass(frozen=True)
class ChannelStats:
    """Counters of a channel (monitoring and tests)."""

    head: int  #: messages claimed by producers
    tail: int  #: messages claimed by consumers
    producers: int  #: live producers
    consumers: int  #: live consumers
    redelivered: int  #: messages handed to another consumer after theirs died
    abandoned: int  #: slots a dead producer had claimed but not published
    free_slots: int  #: slots not holding a message
    published: int = 0  #: messages published, in total
    published_bytes: int = 0  #: payload bytes published, in total
    queued: int = 0  #: messages published and not received yet (the queue's depth)
    slots: int = 0  #: the ring's size
    slot_bytes: int = 0  #: capacity of each slot


class Channel:
    """A joined channel, as a "producer" or a "consumer". Any number of each; each message goes to one consumer.

    When the last producer is gone, consumers drain what was published, then get :class:`gpuipc.PeerDied`
    (crash) or :class:`gpuipc.Closed` (clean close). When a consumer dies holding a message, another consumer
    receives it. When the last consumer is gone, producers get PeerDied/Closed.
    """

    __slots__ = ("_ch", "_acquired", "_received", "__weakref__")

    def __init__(self, _handle: _gpuipc.Channel) -> None:
        """Internal: use :meth:`create` or :meth:`open`."""
        self._ch = _handle
        self._acquired: Deque[int] = deque()  # sequences of acquired, unpublished slots, oldest first
        self._received: Deque[int] = deque()  # sequences of received, unreleased messages, oldest first

    # Construction ------------------------------------------------------------------------------------------------
    @classmethod
    def create(
        cls,
        name: str,
        *,
        slots: int = 4,
        slot_bytes: int = 1 << 20,
        header_bytes: int = 256,
        kind: str = "device",
        device: int = 0,
        mode: int = 0o600,
        role: str = "producer",
        pacing: Optional[float] = None,
        pacing_ahead: Optional[int] = None,
    ) -> "Channel":
        """Creates channel ``name`` (segments ``name`` and ``name.slots``) and joins it as ``role``.

        slots: buffers in flight at most (1..4096). slot_bytes: capacity of each. header_bytes: inline header per
        message (0..4096; ``send`` needs 24 + 8 * ndim + len(meta)). kind: "device" (slots in GPU memory of
        ``device``) or "host". mode: every member needs rw (all update the shared ring; consumers still map the
        slots read-only). pacing, pacing_ahead: this handle's (see :attr:`pacing`, :attr:`pacing_ahead`); None:
        ``GPUIPC_CHANNEL_PACING_US`` and ``GPUIPC_CHANNEL_PACING_AHEAD``. Raises AlreadyExists, InvalidArgument, ...
        """
        return cls(
            _gpuipc.Channel.create(
                name,
                slots=slots,
                slot_bytes=slot_bytes,
                header_bytes=header_bytes,
                kind=kind,
                device=device,
                mode=mode,
                role=role,
                pacing=pacing,
                pacing_ahead=pacing_ahead,
            )
        )

    @classmethod
    def open(
        cls,
        name: str,
        role: str,
        *,
        wait: Optional[float] = None,
        device: Optional[int] = None,
        pacing: Optional[float] = None,
        pacing_ahead: Optional[int] = None,
    ) -> "Channel":
        """Joins channel ``name`` as a "producer" or a "consumer" (consumers map the slots read-only).

        wait: seconds to wait for it to be created (None: fail at once with NotFound). device: device channels:
        the GPU whose context maps the slots (None: the current context's, else the slots' own). pacing,
        pacing_ahead: this handle's (see :attr:`pacing`, :attr:`pacing_ahead`); None: ``GPUIPC_CHANNEL_PACING_US``
        and ``GPUIPC_CHANNEL_PACING_AHEAD``.
        """
        return cls(
            _gpuipc.Channel.open(
                name, role=role, wait=wait, device=device, pacing=pacing, pacing_ahead=pacing_ahead
            )
        )

    @staticmethod
    def stat(name: str) -> ChannelStats:
        """The counters of channel ``name`` without joining it (maps its control block read-only; no GPU needed).
        Raises NotFound, PermissionDenied, InvalidArgument (not a channel)."""
        return ChannelStats(**_gpuipc.Channel.stat(name))

    @staticmethod
    def unlink(name: str) -> None:
        """Removes both names; members keep working until they close."""
        _gpuipc.Channel.unlink(name)

    # Producer ----------------------------------------------------------------------------------------------------
    def acquire(self, *, stream: Any = None, timeout: Optional[float] = None) -> "Slot":
        """Claims the next free slot, waiting up to ``timeout`` seconds (None: forever; 0: only look) while every
        slot is in flight. Device channels: work on ``stream`` after this waits until the slot's last reader
        released it. Raises Timeout/WouldBlock, PeerDied/Closed (no consumer left), InvalidState."""
        view, sequence = self._ch.acquire(stream_handle(stream), timeout)
        self._acquired.append(sequence)
        return Slot(self, view, sequence)

    def publish(self, nbytes: int, *, header: bytes = b"", stream: Any = None) -> int:
        """Publishes the oldest acquired slot with ``nbytes`` of payload and ``header``, in ``stream`` order.
        Returns its sequence. Raises InvalidState (nothing acquired, too big), PeerDied/Closed, CudaError."""
        if not self._acquired:
            raise InvalidState(f"publish on channel '{self.name}': no slot is acquired")
        self._ch.publish(bytes(header), nbytes, stream_handle(stream))
        return self._acquired.popleft()

    # Consumer ----------------------------------------------------------------------------------------------------
    def receive(self, *, stream: Any = None, timeout: Optional[float] = None) -> "Message":
        """Takes the next message, waiting up to ``timeout`` seconds (None: forever; 0: only look; Ctrl-C
        interrupts). Device channels: work on ``stream`` after this waits for the producer's stream. Raises
        Timeout/WouldBlock, PeerDied/Closed (no producer left and nothing to drain), InvalidState."""
        view, header, sequence = self._ch.receive(stream_handle(stream), timeout)
        self._received.append(sequence)
        return Message(self, view, header, sequence)

    def release(self, *, stream: Any = None) -> None:
        """Releases the oldest received message in ``stream`` order (see :meth:`Message.release`)."""
        if not self._received:
            raise InvalidState(f"release on channel '{self.name}': no message is held")
        self._ch.release(stream_handle(stream))
        self._received.popleft()

    # Arrays ------------------------------------------------------------------------------------------------------
    def send(self, array: Any, *, stream: Any = None, timeout: Optional[float] = None, meta: bytes = b"") -> int:
        """Copies ``array`` into the next free slot and publishes it with its dtype and shape; returns its sequence.

        array: NumPy or anything NumPy takes (host channels and device channels), a PyTorch or CuPy array, a
        ``__cuda_array_interface__`` producer (Numba, ...; device channels), or any DLPack producer (JAX, ...: a
        synchronous copy after ``stream`` has finished). Contiguous arrays are copied by one call into the
        library: on ``stream`` with cuMemcpyAsync for device channels (nothing waits for the GPU; a pageable host
        array may change once send returns, one in pinned memory only once ``stream`` has passed the copy), with
        memcpy for host channels; others by their framework on ``stream``. stream: the stream the array was
        written on (None: the legacy default stream). timeout: for a free slot (see :meth:`acquire`). meta: bytes
        carried along (``Message.meta``). Raises InvalidArgument (too big for a slot or the header, strided
        foreign arrays, a GPU array without DLPack to a host channel), InvalidState (slots taken with
        :meth:`acquire` are unpublished), TypeError (not an array), and what :meth:`acquire` raises.
        """
        if self._acquired:
            raise InvalidState(f"send on channel '{self.name}': publish the slots taken with acquire() first")
        handle = stream_handle(stream)
        meta = bytes(meta)
        plan = _plan_copy(array, self._ch.kind == "device", handle)
        if isinstance(plan, _Source):  # contiguous bytes at a known address: one call copies and publishes
            self._check_fits(plan.dtype, plan.shape, plan.nbytes, meta)
            header = _pack_header(plan.dtype, plan.shape, plan.nbytes, meta)
            return self._ch.send_copy(plan.address, plan.nbytes, header, handle, timeout)
        if plan is not None:
            dt, shape, nbytes, _ = plan
            self._check_fits(dt, shape, nbytes, meta)
        slot = self.acquire(stream=stream, timeout=timeout)
        try:
            if plan is not None:
                plan[3](slot._view)
            else:  # a DLPack producer: its dtype and shape are known once the capsule is read
                dt, shape, nbytes = _copy_dlpack(array, slot._view, handle)
                self._check_fits(dt, shape, nbytes, meta)
            header = _pack_header(dt, shape, nbytes, meta)
        except BaseException:
            self._ch.publish(_ABORTED_HEADER, 0, handle)  # consumers skip it; the slot comes back
            self._acquired.popleft()
            raise
        return self.publish(nbytes, header=header, stream=handle)

    def recv(self, *, timeout: Optional[float] = None, stream: Any = None) -> "Message":
        """Receives the next message (see :meth:`receive`), skipping ones whose producer aborted them. Its
        ``.array`` is a zero-copy view when it was sent with :meth:`send`. Release it when done."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            msg = self.receive(stream=stream, timeout=left)
            info = msg._info()
            if info is None or not info.aborted:
                return msg
            msg.release(stream=stream)

    def __iter__(self) -> Iterator["Message"]:
        """Receives messages until the producers have all closed (Closed ends the loop; PeerDied is raised).
        Release each one (``for msg in ch: with msg: ...``)."""
        while True:
            try:
                msg = self.recv()
            except Closed:
                if self.closed:  # this handle was closed: an error, not the producers' leaving
                    raise
                return
            yield msg

    def _check_fits(self, dt: DType, shape: Tuple[int, ...], nbytes: int, meta: bytes) -> None:
        need = _HEADER.size + 8 * len(shape) + len(meta)
        if need > self.header_bytes:
            raise InvalidArgument(
                f"channel '{self.name}': a {len(shape)}-d array with {len(meta)} bytes of meta needs a {need}-byte "
                f"header; the channel has header_bytes={self.header_bytes}"
            )
        if nbytes > self.slot_bytes:
            raise InvalidArgument(
                f"channel '{self.name}': {nbytes} bytes ({dt.name}{list(shape)}) do not fit in a slot of "
                f"{self.slot_bytes} bytes"
            )

    # Properties --------------------------------------------------------------------------------------------------
    @property
    def name(self) -> str:
        return self._ch.name

    @property
    def role(self) -> str:
        """"producer" or "consumer"."""
        return self._ch.role

    @property
    def kind(self) -> str:
        """"device" or "host"."""
        return self._ch.kind

    @property
    def slots(self) -> int:
        return self._ch.slots

    @property
    def slot_bytes(self) -> int:
        return self._ch.slot_bytes

    @property
    def header_bytes(self) -> int:
        return self._ch.header_bytes

    @property
    def device(self) -> int:
        """The GPU ordinal whose context maps the slots (device channels), else -1."""
        return self._ch.device

    @property
    def stats(self) -> ChannelStats:
        return ChannelStats(**self._ch.stats)

    @property
    def pacing(self) -> float:
        """Seconds this handle's ``acquire`` and ``receive`` watch a peer's GPU progress on the host before they
        enqueue a stream wait (device channels; docs/channels.md#pacing). 0: only a look. Settable; the default is
        ``GPUIPC_CHANNEL_PACING_US`` (200 us)."""
        return self._ch.pacing

    @pacing.setter
    def pacing(self, seconds: float) -> None:
        self._ch.pacing = seconds

    @property
    def pacing_ahead(self) -> int:
        """How many messages this handle, a pacing producer, may run ahead of the consumers' streams (1 to
        :attr:`slots`; ``slots`` lets it fill the ring; larger values are clamped). Settable; the default is
        ``GPUIPC_CHANNEL_PACING_AHEAD``, else half the ring for 8 slots or more, else the whole ring."""
        return self._ch.pacing_ahead

    @pacing_ahead.setter
    def pacing_ahead(self, messages: int) -> None:
        self._ch.pacing_ahead = messages

    @property
    def closed(self) -> bool:
        return self._ch.closed

    # Lifetime ----------------------------------------------------------------------------------------------------
    def close(self) -> None:
        """Leaves (idempotent): acquired slots are given up, held messages go back to the queue, and the last
        producer (or consumer) leaving tells the other side (Closed). Views of slots stay mapped."""
        self._ch.close()
        self._acquired.clear()
        self._received.clear()

    def __enter__(self) -> "Channel":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        if self.closed:
            return "<gpuipc.Channel closed>"
        return (
            f"<gpuipc.Channel {self.name!r} role={self.role} kind={self.kind} slots={self.slots} "
            f"slot_bytes={self.slot_bytes}>"
        )


class Slot:
    """A slot a producer acquired: write up to :attr:`capacity` bytes, then :meth:`publish` (or
    :meth:`publish_array`). Used as a context manager, a slot left unpublished is published as aborted
    (consumers' ``recv`` skips it)."""

    __slots__ = ("_channel", "_view", "sequence", "__weakref__")

    def __init__(self, channel: Channel, view: _gpuipc.ArrayView, sequence: int) -> None:
        self._channel = channel
        self._view = view
        self.sequence = sequence  #: the message's position in the channel (0, 1, 2, ...)

    @property
    def capacity(self) -> int:
        return self._view.nbytes

    @property
    def address(self) -> int:
        """Host address (host channels) or device address (device channels) of the slot."""
        return self._view.address

    @property
    def data(self) -> _gpuipc.ArrayView:
        """The slot's bytes (writable)."""
        return self._view

    @property
    def published(self) -> bool:
        return self.sequence not in self._channel._acquired

    def as_array(self, dtype: Any = "uint8", shape: Shape = None, offset: int = 0) -> Array:
        """A zero-copy, writable view of the slot (see :meth:`gpuipc.Segment.as_array`)."""
        return make_array(self._view, dtype, shape, offset)

    def publish(self, nbytes: int, *, header: bytes = b"", stream: Any = None) -> int:
        """Publishes this slot (it must be the oldest acquired one) with ``nbytes`` and a raw ``header``."""
        self._check_oldest()
        return self._channel.publish(nbytes, header=header, stream=stream)

    def publish_array(self, dtype: Any, shape: Shape, *, meta: bytes = b"", stream: Any = None) -> int:
        """Publishes this slot as an array of ``dtype`` and ``shape`` written at its start (``recv().array``
        gives it back)."""
        self._check_oldest()
        dt = dtype_of(dtype)
        dims = (int(shape),) if isinstance(shape, (int, np.integer)) else tuple(int(s) for s in (shape or ()))
        nbytes = int(np.prod(dims, dtype=np.int64)) * dt.itemsize
        meta = bytes(meta)
        self._channel._check_fits(dt, dims, nbytes, meta)
        return self._channel.publish(nbytes, header=_pack_header(dt, dims, nbytes, meta), stream=stream)

    def _check_oldest(self) -> None:
        acquired = self._channel._acquired
        if not acquired or acquired[0] != self.sequence:
            raise InvalidState(
                f"slot {self.sequence} of channel '{self._channel.name}': "
                + ("already published" if self.published else "publish the older acquired slots first")
            )

    def __enter__(self) -> "Slot":
        return self

    def __exit__(self, *exc: object) -> None:
        if not self.published and not self._channel.closed:
            self._check_oldest()
            self._channel.publish(0, header=_ABORTED_HEADER)

    def __repr__(self) -> str:
        return f"<gpuipc.Slot {self.sequence} of {self._channel.name!r} capacity={self.capacity}>"


class Message:
    """A message a consumer received. Read it through :attr:`array` (sent with ``send``) or :attr:`data` /
    :meth:`as_array` (raw), then :meth:`release` it (or use ``with``). Messages are released oldest first."""

    __slots__ = ("_channel", "_view", "header", "sequence", "_decoded", "__weakref__")

    def __init__(self, channel: Channel, view: _gpuipc.ArrayView, header: bytes, sequence: int) -> None:
        self._channel = channel
        self._view = view
        self.header = header  #: the inline header the producer published (bytes)
        self.sequence = sequence  #: the message's position in the channel
        self._decoded: Any = False

    def _info(self) -> Optional[_ArrayInfo]:
        if self._decoded is False:
            self._decoded = _unpack_header(self.header)
        return self._decoded

    @property
    def size(self) -> int:
        """Payload bytes."""
        return self._view.nbytes

    @property
    def data(self) -> _gpuipc.ArrayView:
        """The payload's bytes (read-only; an ArrayView: ``numpy.asarray`` it for host channels)."""
        self._check_held()
        return self._view

    @property
    def released(self) -> bool:
        return self.sequence not in self._channel._received

    @property
    def array(self) -> Array:
        """The array ``send`` sent, as a zero-copy read-only view: NumPy (host channels) or an ArrayView for
        ``torch.from_dlpack`` / ``cupy.from_dlpack`` (device channels). Valid until :meth:`release`."""
        info = self._require_info()
        self._check_held()
        return make_array(self._view, info.dtype, info.shape)

    @property
    def dtype(self) -> Optional[np.dtype]:
        """The NumPy dtype of :attr:`array` (None for a type NumPy lacks, such as bfloat16)."""
        return self._require_info().dtype.numpy

    @property
    def dtype_name(self) -> str:
        """The name of :attr:`array`'s element type, e.g. "float32", "bfloat16"."""
        return self._require_info().dtype.name

    @property
    def shape(self) -> Tuple[int, ...]:
        return self._require_info().shape

    @property
    def meta(self) -> bytes:
        """The ``meta`` bytes passed to ``send``."""
        return self._require_info().meta

    @property
    def incomplete(self) -> bool:
        """The producer died after publishing but before its stream finished writing: the data may be partial.
        Check after this consumer's stream has passed receive (device channels: e.g. after synchronizing it)."""
        self._check_held()
        return self._channel._ch.incomplete(self.sequence)

    def as_array(self, dtype: Any = "uint8", shape: Shape = None, offset: int = 0) -> Array:
        """A zero-copy, read-only view of the payload (see :meth:`gpuipc.Segment.as_array`)."""
        self._check_held()
        return make_array(self._view, dtype, shape, offset)

    def release(self, *, stream: Any = None) -> None:
        """Gives the slot back in ``stream`` order (device channels: once ``stream`` has finished reading).
        Messages are released oldest first: InvalidState otherwise. Idempotent."""
        if self.released or self._channel.closed:
            return
        held = self._channel._received
        if held[0] != self.sequence:
            raise InvalidState(
                f"message {self.sequence} of channel '{self._channel.name}': release the older messages first "
                f"(held: {list(held)})"
            )
        self._channel.release(stream=stream)

    def _require_info(self) -> _ArrayInfo:
        info = self._info()
        if info is None:
            raise InvalidState(
                f"message {self.sequence} was not sent with Channel.send: read .data, .header or .as_array()"
            )
        return info

    def _check_held(self) -> None:
        if self.released:
            raise InvalidState(f"message {self.sequence} of channel '{self._channel.name}' was released")

    def __enter__(self) -> "Message":
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()

    def __repr__(self) -> str:
        info = self._info()
        what = f" {info.dtype.name}{list(info.shape)}" if info is not None and not info.aborted else ""
        state = " released" if self.released else ""
        return f"<gpuipc.Message {self.sequence} of {self._channel.name!r} size={self.size}{what}{state}>"


# Copies into slots ---------------------------------------------------------------------------------------------------
_Plan = Tuple[DType, Tuple[int, ...], int, Callable[[_gpuipc.ArrayView], None]]


class _Source(NamedTuple):
    """Contiguous bytes at a known address (host memory, or GPU memory for device channels): the C++ send copies
    them itself, in stream order (cuMemcpyAsync) or with memcpy (host channels)."""

    dtype: DType
    shape: Tuple[int, ...]
    nbytes: int
    address: int
    owner: Any  #: keeps the memory alive until the copy is enqueued


def _framework(array: Any) -> str:
    return type(array).__module__.split(".", 1)[0]


def _plan_copy(array: Any, to_gpu: bool, stream: int) -> Union[_Source, _Plan, None]:
    """How to copy ``array`` into a slot: a _Source (the C++ send copies), (dtype, shape, nbytes, copy(view)), or
    None for the DLPack path."""
    fw = _framework(array)
    if fw == "torch":
        return _plan_torch(array, to_gpu, stream)
    if fw == "cupy" and to_gpu:
        return _plan_cupy(array, stream)
    host = as_host_array(array)
    if host is not None:
        return _plan_host(host)
    if hasattr(array, "__dlpack__"):
        return None
    cai = getattr(array, "__cuda_array_interface__", None)
    if cai is not None:
        if not to_gpu:
            raise InvalidArgument(
                f"cannot send a GPU {type(array).__name__} through a host channel: copy it to host memory first"
            )
        return _plan_cai(cai, array)
    raise TypeError(f"cannot send a {type(array).__name__}: not an array (no DLPack, no array interface)")


def _plan_host(arr: np.ndarray) -> _Source:
    dt = dtype_of(arr.dtype)
    if not arr.flags.c_contiguous:
        arr = arr.copy(order="C")  # (np.ascontiguousarray would turn a 0-d array into 1-d)
    # To a device channel: cuMemcpyAsync from pageable memory returns once the bytes are staged, so the array may
    # change right after send (from pinned memory the copy reads it when the stream gets there).
    return _Source(dt, tuple(arr.shape), arr.nbytes, arr.ctypes.data, arr)


def _plan_torch(t: Any, to_gpu: bool, stream: int) -> Union[_Source, _Plan]:
    dt = dtype_of(t.dtype)
    shape = tuple(t.shape)
    nbytes = t.numel() * t.element_size()
    where = t.device.type
    if (
        (where == "cuda" and to_gpu or where == "cpu")
        and t.is_contiguous()
        and not t.is_conj()
        and not t.is_neg()  # lazy conjugation/negation: the bytes in memory are not the values
    ):
        return _Source(dt, shape, nbytes, t.data_ptr() if nbytes else 0, t)
    import torch  # type: ignore[import-not-found]

    def copy(view: _gpuipc.ArrayView) -> None:
        dst = torch.from_dlpack(make_array(view, dt, shape))
        if to_gpu:
            s = torch.cuda.ExternalStream(stream) if stream else torch.cuda.default_stream(dst.device)
            with torch.cuda.stream(s):
                dst.copy_(t.detach(), non_blocking=True)
        else:
            dst.copy_(t.detach())  # to host memory: torch synchronises a GPU source itself

    return dt, shape, nbytes, copy


def _plan_cupy(a: Any, stream: int) -> Union[_Source, _Plan]:
    dt = dtype_of(a.dtype)
    shape = tuple(int(s) for s in a.shape)
    if a.flags.c_contiguous:
        return _Source(dt, shape, int(a.nbytes), int(a.data.ptr), a)
    import cupy  # type: ignore[import-not-found]

    def copy(view: _gpuipc.ArrayView) -> None:
        s = cupy.cuda.ExternalStream(stream) if stream else cupy.cuda.Stream.null
        with s:
            cupy.copyto(cupy.asarray(make_array(view, dt, shape)), a)

    return dt, shape, int(a.nbytes), copy


def _plan_cai(cai: dict, owner: Any) -> _Source:
    dt = dtype_of(np.dtype(cai["typestr"]))
    shape = tuple(int(s) for s in cai["shape"])
    nbytes = int(np.prod(shape, dtype=np.int64)) * dt.itemsize
    strides = cai.get("strides")
    if strides is not None:
        expect = dt.itemsize
        for dim, stride in zip(reversed(shape), reversed(strides)):
            if dim > 1 and stride != expect:
                raise InvalidArgument("cannot send a strided __cuda_array_interface__ array: make it contiguous")
            expect *= dim
    return _Source(dt, shape, nbytes, int(cai["data"][0]), owner)


def _copy_dlpack(array: Any, view: _gpuipc.ArrayView, stream: int) -> Tuple[DType, Tuple[int, ...], int]:
    dev_type = array.__dlpack_device__()[0]
    if dev_type == 2:  # kDLCUDA: ask the producer to order the data before our stream (1: legacy default)
        capsule = array.__dlpack__(stream=stream or 1)
    else:
        capsule = array.__dlpack__()
    info = _gpuipc._copy_from_dlpack(view, capsule, stream)
    if info is None:
        raise InvalidArgument(f"cannot send a strided {type(array).__name__}: make it contiguous first")
    code, bits, lanes, shape, nbytes = info
    return from_dlpack(code, bits, lanes), tuple(shape), nbytes
