"""Channels: named producer/consumer rings of fixed-size buffers in GPU memory ("device") or host memory ("host").

Two levels, mirroring the C++ API:

* ``acquire`` -> write the :class:`Slot` -> ``publish``; ``receive`` -> read the :class:`Message` -> ``release``.
  Zero-copy: the producer writes straight into the slot (``slot.as_array(...)``), the consumer reads it in place.
* ``send(array)`` / ``recv()``: ``send`` copies an array (NumPy, PyTorch, CuPy, JAX, anything with DLPack or
  ``__cuda_array_interface__``) into a slot and records its dtype and shape in the message header; ``recv``
  returns a :class:`Message` whose ``.array`` is a zero-copy view of the slot (NumPy for host channels, an
  ArrayView for ``torch.from_dlpack`` / ``cupy.from_dlpack`` for device channels).

Every received message must be released (``msg.release()`` or ``with ch.recv() as msg:``): its slot is reused
afterwards, so views of it must not be used after release (they stay mapped, but the producer overwrites them). A
handle publishes and releases in order: on a host channel a slot published, or a message released, ahead of older
ones of the handle (threads sharing it) waits for them; on a device channel that is InvalidState (a handle per
thread).

The array header ``send`` writes and ``Message.array`` reads (dtype, shape, size, ``meta``) is defined once in C++,
``include/gpuipc/array_header.hpp``, where a C++ consumer decodes it; ``_array_header.py`` reads that layout.

What a handle holds (acquired slots, received messages) is the library's state, asked for through ``_ch.held``:
this module keeps no copy of it.
"""

from __future__ import annotations

import math
import operator
import time
from dataclasses import dataclass
from typing import Any, Dict, Iterator, Optional, Tuple

import numpy as np

from . import _gpuipc
from ._devices import Device, resolve as _device
from ._array_header import (
    ABORTED_HEADER,
    ARRAY_HEADER_MAGIC,
    ArrayInfo,
    header_bytes_needed,
    pack_header,
    unpack_header,
)
from ._arrays import Array, Shape, make_array
from ._copy_plans import Source, copy_dlpack, plan_copy
from ._dtypes import DType, dtype_of
from ._ints import U32, U64, as_bytes, in_range
from ._streams import stream_handle
from .errors import Closed, Error, InvalidArgument, InvalidState

__all__ = ["Channel", "ChannelStats", "Message", "Slot", "ARRAY_HEADER_MAGIC"]


def _ahead(messages: Optional[int]) -> Optional[int]:
    """pacing_ahead for the extension: None, or an int clamped to 2**32 - 1 (the channel clamps it to its slots)."""
    if messages is None:
        return None
    if isinstance(messages, bool):
        raise InvalidArgument(f"pacing_ahead must be an integer, not {messages!r}")
    return min(operator.index(messages), U32)


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

    __slots__ = ("_ch", "_tensors", "_headers", "_stream", "_acquired", "__weakref__")

    def __init__(self, _handle: _gpuipc.Channel) -> None:
        """Internal: use :meth:`create` or :meth:`open`."""
        self._ch = _handle
        # Message.tensor's and Slot.tensor's torch tensors, by (slot address, dtype, shape): made once, handed out
        # again, with the shape they were made with
        self._tensors: Dict[Tuple[Any, ...], Tuple[Any, Tuple[int, ...]]] = {}
        # Slot.publish_array's (nbytes, header), by (dtype, shape, meta) as the caller spelt them
        self._headers: Dict[Tuple[Any, Any, Any], Tuple[int, bytes]] = {}
        # The last stream object passed and its handle: a loop passes the same one every call, and asking torch for
        # it costs 0.13-0.30 us on the GPU machines (bench/results/experiments/py-channel-calls-*)
        self._stream: Tuple[Any, int] = (None, 0)
        # The stream each slot acquired and not yet published was acquired on (its handle, and the object, kept
        # alive with it), by sequence: a slot given up is published as aborted on that stream (Slot.__exit__, close)
        self._acquired: Dict[int, Tuple[int, Any]] = {}

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
        device: Device = 0,
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
                slots=in_range(slots, "slots", U32),
                slot_bytes=in_range(slot_bytes, "slot_bytes", U64),
                header_bytes=in_range(header_bytes, "header_bytes", U32),
                kind=kind,
                device=_device(device),
                mode=in_range(mode, "mode", U32),
                role=role,
                pacing=pacing,
                pacing_ahead=_ahead(pacing_ahead),
            )
        )

    @classmethod
    def open(
        cls,
        name: str,
        role: str,
        *,
        wait: Optional[float] = None,
        device: Optional[Device] = None,
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
                name, role=role, wait=wait, device=_device(device), pacing=pacing, pacing_ahead=_ahead(pacing_ahead)
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

    def _handle(self, stream: Any) -> int:
        """stream_handle(stream), remembered for the same object."""
        last = self._stream
        if stream is last[0]:
            return last[1]
        handle = stream_handle(stream)
        self._stream = (stream, handle)
        return handle

    # Producer ----------------------------------------------------------------------------------------------------
    def acquire(self, *, stream: Any = None, timeout: Optional[float] = None) -> "Slot":
        """Claims the next free slot, waiting up to ``timeout`` seconds (None: forever; 0: only look) while every
        slot is in flight. Device channels: work on ``stream`` after this waits until the slot's last reader
        released it. Raises Timeout/WouldBlock, PeerDied/Closed (no consumer left), InvalidState."""
        handle = self._handle(stream)
        view, sequence = self._ch.acquire(handle, timeout)
        self._acquired[sequence] = (handle, stream)
        return Slot(self, view, sequence)

    def publish(self, nbytes: int, *, header: bytes = b"", stream: Any = None) -> int:
        """Publishes the oldest acquired slot with ``nbytes`` of payload and ``header``, in ``stream`` order (None:
        the stream it was acquired on). Returns its sequence. Raises InvalidState (nothing acquired, too big),
        PeerDied/Closed, CudaError."""
        if stream is None and self._acquired:
            return self._publish(as_bytes(header, "header"), nbytes, next(iter(self._acquired.values()))[0])
        return self._publish(as_bytes(header, "header"), nbytes, self._handle(stream))

    def _publish(self, header: bytes, nbytes: int, handle: int, sequence: Optional[int] = None) -> int:
        """The extension's publish (``sequence``: the oldest acquired slot's, checked), forgetting the stream the
        slot was acquired on once it is published (or given up by a failed publish)."""
        try:
            sequence = self._ch.publish(header, nbytes, handle, sequence)
        except BaseException:
            for s in [s for s in self._acquired if not self._ch.holds(s)]:
                del self._acquired[s]
            raise
        self._acquired.pop(sequence, None)
        return sequence

    def _slot_handle(self, sequence: int, stream: Any) -> int:
        """The handle to publish acquired slot ``sequence`` on: ``stream``'s, or with None the one it was acquired
        on (where its writes most likely are)."""
        if stream is None:
            return self._acquired.get(sequence, (0, None))[0]
        return self._handle(stream)

    def _abort(self, sequence: int) -> int:
        """Publishes acquired slot ``sequence`` (the oldest) as aborted (consumers' recv skips it) on the stream it
        was acquired on: its `filled` is written once that stream has passed the work queued so far, which may
        still write the slot, so no later message of that slot is written before it has. A channel whose headers
        are too short for the aborted mark gets an empty message (no bytes, no header) instead."""
        header = ABORTED_HEADER if self._ch.header_bytes >= len(ABORTED_HEADER) else b""
        return self._publish(header, 0, self._slot_handle(sequence, None), sequence)

    def _abort_under(self, sequence: int, raised: bool) -> None:
        """_abort for a slot given up because of an exception (``raised``), which an error of the abort itself
        does not replace."""
        try:
            self._abort(sequence)
        except Error:
            if not raised:
                raise

    # Consumer ----------------------------------------------------------------------------------------------------
    def receive(self, *, stream: Any = None, timeout: Optional[float] = None) -> "Message":
        """Takes the next message, waiting up to ``timeout`` seconds (None: forever; 0: only look; Ctrl-C
        interrupts). Device channels: work on ``stream`` after this waits for the producer's stream. Raises
        Timeout/WouldBlock, PeerDied/Closed (no producer left and nothing to drain), InvalidState."""
        view, header, sequence = self._ch.receive(self._handle(stream), timeout)
        return Message(self, view, header, sequence, stream=stream)

    def release(self, *, stream: Any = None) -> None:
        """Releases the oldest received message in ``stream`` order (None: the legacy default stream; see
        :meth:`Message.release`, which defaults to the stream the message was received on)."""
        self._ch.release(self._handle(stream))

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
        if self._ch.held and self.role == "producer":
            raise InvalidState(f"send on channel '{self.name}': publish the slots taken with acquire() first")
        handle = self._handle(stream)
        meta = as_bytes(meta, "meta")
        plan = plan_copy(array, self._ch.kind == "device", handle)
        if isinstance(plan, Source):  # contiguous bytes at a known address: one call copies and publishes
            self._check_fits(plan.dtype, plan.shape, plan.nbytes, meta)
            header = pack_header(plan.dtype, plan.shape, plan.nbytes, meta)
            return self._ch.send_copy(plan.address, plan.nbytes, header, handle, timeout)
        if plan is not None:
            dt, shape, nbytes, _ = plan
            self._check_fits(dt, shape, nbytes, meta)
        slot = self.acquire(stream=stream, timeout=timeout)
        try:
            if plan is not None:
                plan[3](slot._view)
            else:  # a DLPack producer: its dtype and shape are known once the capsule is read
                dt, shape, nbytes = copy_dlpack(array, slot._view, handle)
                self._check_fits(dt, shape, nbytes, meta)
            header = pack_header(dt, shape, nbytes, meta)
        except BaseException:
            self._abort_under(slot.sequence, True)  # on `handle`, where it was acquired: consumers skip it
            raise
        return self.publish(nbytes, header=header, stream=handle)

    def recv(self, *, timeout: Optional[float] = None, stream: Any = None) -> "Message":
        """Receives the next message (see :meth:`receive`), skipping ones whose producer aborted them. Its
        ``.array`` is a zero-copy view when it was sent with :meth:`send`. Release it when done."""
        handle = self._handle(stream)
        deadline = None if timeout is None else time.monotonic() + timeout
        left = timeout
        while True:
            view, header, sequence = self._ch.receive(handle, left)
            try:
                info = unpack_header(header)
            except TypeError:  # an element type NumPy lacks (a float8 array from C++): refused by .array, not here
                return Message(self, view, header, sequence, False, stream)
            if info is None or not info.aborted:
                return Message(self, view, header, sequence, info, stream)
            self._ch.release(handle, sequence, True)  # (behind older held ones: released once they are)
            if deadline is not None and timeout:  # (a wait that ran out is Timeout, not 0's WouldBlock)
                left = max(1e-9, deadline - time.monotonic())

    def __iter__(self) -> Iterator["Message"]:
        """Receives messages until the producers have all closed (Closed ends the loop; PeerDied is raised).
        Release each one (``for msg in ch: with msg: ...``). On the legacy default stream: :meth:`messages` takes
        a stream."""
        return self.messages()

    def messages(self, *, stream: Any = None, timeout: Optional[float] = None) -> Iterator["Message"]:
        """Like iterating over the channel, with each message received on ``stream`` (see :meth:`recv`; leaving a
        message's ``with`` block releases it there) and waited for up to ``timeout`` seconds (Timeout is raised)."""
        while True:
            try:
                msg = self.recv(timeout=timeout, stream=stream)
            except Closed:
                if self.closed:  # this handle was closed: an error, not the producers' leaving
                    raise
                return
            yield msg

    def _array_header(self, dtype: Any, shape: Shape, meta: Any) -> Tuple[int, bytes]:
        """(payload bytes, array header) of an array of ``dtype`` and ``shape`` with ``meta``; remembered for the
        next message of the same spelling (a stream of arrays mostly repeats one)."""
        dt = dtype_of(dtype)
        # operator.index, as as_array's shapes: int() would cut a dimension of 1.9 to 1.
        dims = (operator.index(shape),) if isinstance(shape, (int, np.integer)) else tuple(
            operator.index(s) for s in (shape or ()))
        if any(d < 0 for d in dims):
            raise InvalidArgument(f"channel '{self.name}': negative dimension in shape {list(dims)}")
        nbytes = math.prod(dims) * dt.itemsize
        raw = as_bytes(meta, "meta")
        self._check_fits(dt, dims, nbytes, raw)
        out = (nbytes, pack_header(dt, dims, nbytes, raw))
        try:
            if len(self._headers) >= 64:  # messages that keep changing shape: start again
                self._headers.clear()
            self._headers[(dtype, shape, meta)] = out
        except TypeError:  # a spelling that cannot be a key (a list shape, bytearray meta): not remembered
            pass
        return out

    def _torch_view(self, view: _gpuipc.ArrayView, key: Tuple[Any, ...], dtype: Any, shape: Shape) -> Any:
        """A torch tensor of ``view`` as ``dtype`` and ``shape``: made once per ``key`` (the slot's address first)
        and handed out again while it still has that address and the shape it was made with."""
        hit = self._tensors.get(key)
        if hit is not None:
            t, dims = hit
            if t.data_ptr() == key[0] and t.shape == dims:
                return t
        import torch  # noqa: PLC0415 - only for this call

        t = torch.from_dlpack(make_array(view, dtype, shape))
        if len(self._tensors) >= 4 * max(self.slots, 1):  # a channel whose messages change shape: start again
            self._tensors.clear()
        self._tensors[key] = (t, tuple(t.shape))
        return t

    def _check_fits(self, dt: DType, shape: Tuple[int, ...], nbytes: int, meta: bytes) -> None:
        need = header_bytes_needed(len(shape), len(meta))
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
        ``GPUIPC_CHANNEL_PACING_AHEAD``, else the whole ring where the GPU time-slices the processes (no MPS), half
        the ring for 8 slots or more under MPS."""
        return self._ch.pacing_ahead

    @pacing_ahead.setter
    def pacing_ahead(self, messages: int) -> None:
        self._ch.pacing_ahead = _ahead(messages)

    @property
    def closed(self) -> bool:
        return self._ch.closed

    # Lifetime ----------------------------------------------------------------------------------------------------
    def close(self) -> None:
        """Leaves (idempotent): acquired slots are given up, held messages go back to the queue, and the last
        producer (or consumer) leaving tells the other side (Closed). Views of slots stay mapped.

        A device channel's acquired slots are first published as aborted, each on the stream it was acquired on
        (consumers' recv skips them): work still queued there may write the slot, and the slot's next message is
        written only after it (with a header_bytes under 24, as empty messages). Where the driver refuses, the
        slots are given up at once, as the C++ Channel's close does. Held messages go back at once, from the host:
        another consumer may take one and release it, letting the producer rewrite the slot while this consumer's
        reads of it are still queued; synchronize the streams that read held messages first (or release them on
        those streams)."""
        # A host channel's slots published ahead of older ones (threads sharing this handle) go once those are: the
        # older ones are published as aborted, so that the published ones are not given up with them.
        if self._acquired and not self._ch.closed and (self._ch.kind == "device" or self._ch.held_back):
            try:
                for sequence in self._ch.held:
                    self._abort(sequence)
            except Error:
                pass
        self._acquired.clear()
        self._ch.close()
        self._tensors.clear()
        self._stream = (None, 0)

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
    :meth:`publish_array`). Used as a context manager, a slot left unpublished is published as aborted on the
    stream it was acquired on (consumers' ``recv`` skips it, and the slot's next message is written only after
    the work queued on that stream so far); on a channel whose ``header_bytes`` is under 24, too short for that
    mark, as an empty message (no bytes, no header), which consumers receive. An error of that publish does not
    replace the exception that left the block."""

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
        """Published (or given up by closing the channel)."""
        return not self._channel._ch.holds(self.sequence)

    def as_array(self, dtype: Any = "uint8", shape: Shape = None, offset: int = 0) -> Array:
        """A zero-copy, writable view of the slot (see :meth:`gpuipc.Segment.as_array`)."""
        return make_array(self._view, dtype, shape, offset)

    def tensor(self, dtype: Any = "uint8", shape: Shape = None) -> Any:
        """A zero-copy, writable torch tensor of the slot (``shape=None``: as many elements as fit): write the
        message into it, then :meth:`publish_array` with the same dtype and shape.

        Made once per slot, dtype and shape and handed out again for later acquires of that slot (like
        :meth:`Message.tensor`): it is the slot's memory, to be written only between acquire and publish. Do not
        resize it or change its shape in place. Needs torch."""
        key = (self._view.address, dtype, shape if shape is None or isinstance(shape, (int, tuple)) else tuple(shape))
        return self._channel._torch_view(self._view, key, dtype, shape)

    def publish(self, nbytes: int, *, header: bytes = b"", stream: Any = None) -> int:
        """Publishes this slot with ``nbytes`` and a raw ``header``, in ``stream`` order (None: the stream it was
        acquired on). On a host channel a slot acquired after others of this handle that are not published yet is
        published once they are; on a device channel it must be the oldest acquired one (InvalidState)."""
        ch = self._channel
        return ch._publish(as_bytes(header, "header"), nbytes, ch._slot_handle(self.sequence, stream), self.sequence)

    def publish_array(self, dtype: Any, shape: Shape, *, meta: bytes = b"", stream: Any = None) -> int:
        """Publishes this slot as an array of ``dtype`` and ``shape`` written at its start (``recv().array``
        gives it back), in ``stream`` order (None: the stream it was acquired on)."""
        ch = self._channel
        try:
            nbytes, header = ch._headers[(dtype, shape, meta)]
        except (KeyError, TypeError):  # not seen yet, or a spelling that cannot be a key
            nbytes, header = ch._array_header(dtype, shape, meta)
        return ch._publish(header, nbytes, ch._slot_handle(self.sequence, stream), self.sequence)

    def __enter__(self) -> "Slot":
        return self

    def __exit__(self, *exc: object) -> None:
        if not self.published:  # (a closed channel gave it up already)
            self._channel._abort_under(self.sequence, exc[0] is not None)

    def __repr__(self) -> str:
        return f"<gpuipc.Slot {self.sequence} of {self._channel.name!r} capacity={self.capacity}>"


class Message:
    """A message a consumer received. Read it through :attr:`array` (sent with ``send``) or :attr:`data` /
    :meth:`as_array` (raw), then :meth:`release` it (or use ``with``, which releases it on the stream it was
    received on). Messages are released oldest first."""

    __slots__ = ("_channel", "_view", "header", "sequence", "_decoded", "_stream", "__weakref__")

    def __init__(self, channel: Channel, view: _gpuipc.ArrayView, header: bytes, sequence: int,
                 decoded: Any = False, stream: Any = None) -> None:
        self._channel = channel
        self._view = view
        self.header = header  #: the inline header the producer published (bytes)
        self.sequence = sequence  #: the message's position in the channel
        self._decoded: Any = decoded  # unpack_header(header), or False until asked
        self._stream = stream  # the stream it was received on (kept alive): where __exit__ releases it

    def _info(self) -> Optional[ArrayInfo]:
        if self._decoded is False:
            self._decoded = unpack_header(self.header)
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
        return not self._channel._ch.holds(self.sequence)

    @property
    def array(self) -> Array:
        """The array ``send`` sent, as a zero-copy read-only view: NumPy (host channels) or an ArrayView for
        ``torch.from_dlpack`` / ``cupy.from_dlpack`` (device channels). Valid until :meth:`release`."""
        info = self._require_info()
        self._check_held()
        return make_array(self._view, info.dtype, info.shape)

    def tensor(self) -> Any:
        """:attr:`array` as a torch tensor, zero-copy (device channels: on the channel's GPU; host channels: CPU).

        The tensor is made once per slot, dtype and shape and handed out again for later messages in that slot:
        ``torch.from_dlpack`` costs some 7 us a call (bench/results/python-quick-*.json, ``from_dlpack_us``), a
        cached tensor one dictionary lookup and a check that it still has its address and shape. So the tensor
        is the slot's memory: valid until :meth:`release`, like :attr:`array`, and the next message in the slot
        reuses the same object. Do not resize it or change its shape in place. Needs torch."""
        info = self._decoded
        if info is False or info is None:
            info = self._require_info()
        ch = self._channel
        if not ch._ch.holds(self.sequence):
            self._check_held()  # raises, naming the message
        view = self._view
        return ch._torch_view(view, (view.address, info.dtype.name, info.shape), info.dtype, info.shape)

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
        Check after this consumer's stream has passed receive (device channels: e.g. after synchronizing it). Also
        after :meth:`release` (or the ``with`` block) released it in stream order, while the channel is open."""
        return self._channel._ch.incomplete(self.sequence)

    def as_array(self, dtype: Any = "uint8", shape: Shape = None, offset: int = 0) -> Array:
        """A zero-copy, read-only view of the payload (see :meth:`gpuipc.Segment.as_array`)."""
        self._check_held()
        return make_array(self._view, dtype, shape, offset)

    def release(self, *, stream: Any = None) -> None:
        """Gives the slot back in ``stream`` order (device channels: once ``stream`` has finished reading; None:
        the stream it was received on). Idempotent. On a host channel in any order: one released ahead of older
        messages of this handle (threads sharing it) is given back once they are (and if the handle closes first,
        goes back to the queue with them). A device channel's messages are released oldest first: InvalidState
        otherwise (give each thread a handle of its own)."""
        ch = self._channel
        ch._ch.release(ch._handle(stream if stream is not None else self._stream), self.sequence)

    def _require_info(self) -> ArrayInfo:
        info = self._info()
        if info is None:
            raise InvalidState(
                f"message {self.sequence} was not sent with Channel.send: read .data, .header or .as_array()"
            )
        return info

    def _check_held(self) -> None:
        if not self._channel._ch.holds(self.sequence):
            raise InvalidState(f"message {self.sequence} of channel '{self._channel.name}' was released")

    def __enter__(self) -> "Message":
        return self

    def __exit__(self, *exc: object) -> None:
        # On the stream it was received on, where its reads most likely are: the legacy default stream does not
        # wait for a torch stream's reads, and the producer could write the slot under them.
        self.release()

    def __repr__(self) -> str:
        try:
            info = self._info()
        except TypeError:
            info = None
        what = f" {info.dtype.name}{list(info.shape)}" if info is not None and not info.aborted else ""
        state = " released" if self.released else ""
        return f"<gpuipc.Message {self.sequence} of {self._channel.name!r} size={self.size}{what}{state}>"
