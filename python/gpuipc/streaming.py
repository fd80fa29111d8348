"""Bucketed streaming of named tensors, for weight sync of models larger than a spare copy (docs/torch.md).

A :class:`StreamPublisher` streams versions of a set of named tensors through a ring of ``buckets`` staging
buffers of ``bucket_bytes`` each, all in one gpuipc pool that every reader maps once: a sync opens no handles. Each
bucket carries its own layout (names, dtypes, shapes, byte ranges), so readers need no prior knowledge, and a
version is committed by its last bucket: a reader reports a version only once every bucket has arrived.

A tensor that already lives in gpuipc pool memory (a block of a :class:`gpuipc.Pool`, or a tensor allocated under
``gpuipc.torch.MemPool``: what :func:`gpuipc.share_tensors` shares with no copy) travels as a *reference piece*
instead (``by_reference``): the descriptor names its block and readers copy straight out of the publisher's
memory, one copy in one process instead of two. Readers keep what they resolved (pool joins, chunk mappings, block
holds) while versions keep naming the same blocks. A bucket is sent once its reference pieces name 512 MiB
(``by_reference=True``: ``bucket_bytes``), so readers copy while the publisher walks the rest, and a
reader gives a bucket with no staged bytes back as soon as it has read it (below).

Names made by ``stream_publisher(NAME)``:

* ``NAME``: a host segment, the control block (format below, defined only here);
* ``NAME.pool``: the pool of staging buckets (device or host kind);
* ``NAME.filled``: a timeline the publisher signals with the sequence number ``s`` (1, 2, ...) of each bucket once
  its copy into the staging buffer is done (stream-ordered for device pools); bucket ``s`` lives in ring slot
  ``s % buckets``;
* ``NAME.joins``: raised by each reader once it has claimed its slot (to the value it read plus one): the publisher
  looks at the free reader slots (a broker round trip each) only when it moved, and at least once a second;
* ``NAME.reader.<i>``: one timeline per reader slot ``i < readers``, created by the reader that claims the slot
  (so that its death poisons it), signalled with ``s`` once that reader's copies out of bucket ``s`` are done,
  reference pieces included (stream-ordered for device pools). A bucket with no staged bytes (``used`` 0) that is
  not the last of its version holds nothing to copy out of the ring: it is signalled as soon as the reader has read
  its descriptor (from the host, where the reader's stream has passed its last stream-ordered signal: the value
  only says "every bucket up to s", and a stream's write would lower it). Its reference pieces are copied later,
  from the publisher's blocks, which stay as they are until the version's last bucket is consumed.

Before it overwrites ring slot ``s % buckets`` with bucket ``s`` the publisher waits until every admitted reader has
consumed bucket ``s - buckets``: with two buckets, its copy of bucket k+1 overlaps the readers' load of bucket k.
After the last bucket of a version that sent reference pieces, :meth:`StreamPublisher.finish` waits (on its stream
for device staging, on the host for host staging) until every admitted reader has consumed that bucket, which a
reader signals only after all its copies of the version (they run in order on one stream).

Control block, little-endian::

    0    8 bytes  magic b"GPUIPCSB"
    8    u32      FORMAT (2; 1 was staged pieces only, a JSON list per descriptor)
    12   u32      buckets
    16   u64      bucket_bytes
    24   u32      readers (slots)
    28   u32      desc_bytes (bytes of one bucket descriptor)
    32   u32      flags: 1 checksum, 2 device staging
    36   u32      mode (of every name; readers create their slot with it)
    40   i32      device
    44   u32      reserved
    64   buckets x 40 bytes: the BlockRef of each staging bucket
    A = align64(64 + 40 * buckets): readers x u64 admit[i]: 0 free or not yet admitted, else the sequence number
         of the first bucket the reader in slot i reads; 2**64 - 1: evicted (too slow, see reader_timeout)
    D = align64(A + 8 * readers): buckets x desc_bytes descriptors, one per ring slot:
         u64 seq, u64 version, u32 index (of the bucket in its version), u32 flags (1 last, 2 aborted),
         u64 used bytes (of staging), u64 checksum, u32 json bytes, u32 reserved, then the JSON layout:
         {"pieces": [piece, ...], "blocks": [[pool name, BlockRef], ...]}

A piece is one of:

==========  ================================================================================================
staged      ``[name, dtype, shape, first byte in the tensor, bytes, offset in the bucket]``
reference   ``[name, dtype, shape, first byte in the tensor, bytes, offset in the block, block]``: the bytes lie
            at that offset of entry ``block`` of ``blocks``, whose BlockRef is the 40-byte encoding in hex
==========  ================================================================================================

A reference piece uses no staging bytes: a bucket of reference pieces only has ``used`` 0, and exists for its
descriptor. A version takes several such buckets: one closes when the next tensor comes once its pieces name
512 MiB (``bucket_bytes`` for ``by_reference=True``), or when its 128 KiB descriptor is full. The checksum is the
sum, modulo 2**64, of the used staging bytes and of the bytes every reference piece names, as unsigned bytes, read
by the publisher when it sends the bucket and by a reader before it copies them.
"""

from __future__ import annotations

import contextlib
import inspect
import json
import operator
import sys
import time
import warnings
import weakref
from typing import Any, Callable, Dict, List, Mapping, Optional, Tuple

import numpy as np

from . import _gpuipc
from ._ints import seconds
from ._tensorinfo import DL_CPU, TensorInfo, describe
from .errors import (
    AlreadyExists,
    Closed,
    Error,
    InvalidArgument,
    InvalidState,
    NotFound,
    Timeout,
)
from .pool import Block, Pool, recheck_torch_blocks, torch_frees
from .segment import Segment
from .semaphore import Semaphore
from .tensors import shared_block

from ._names import unlink_names
from ._stream_format import (
    _D_ABORT,
    _D_LAST,
    _EMPTY_BODY,
    _F_CHECKSUM,
    _F_DEVICE,
    DESC_BYTES,
    FORMAT,
    MAGIC,
    _ALIGN,
    _Bucket,
    _Copies,
    _DESC,
    _HEAD,
    _MASK64,
    _MAX_READERS,
    _Ref,
    _align,
    _body,
    _checksum_np,
    _checksum_torch,
    _contiguous,
    _control_bytes,
    _desc_view,
    _is_torch,
    _nbytes,
    _numpy_bytes,
    _join_mode,
    _signal_mode,
    _join_name,
    _slot_name,
    _torch,
    _torch_bytes,
    _torch_stream,
)
from ._stream_reader import StreamItem, StreamReader, stream_reader
from ._stream_slots import _ReaderSlots

__all__ = ["stream_publisher", "stream_reader", "unlink_stream", "StreamPublisher", "StreamReader", "StreamItem"]


#: A bucket whose reference pieces name this many bytes is sent when the next tensor comes instead of when its
#: descriptor is full, so that readers copy while the publisher still walks the dict. 512 MiB: a reader's work per
#: bucket (its wake, the descriptor, the plan check, one _foreach_copy_ launch, its signal) stays well below the copy
#: it enqueues (about 0.4 ms at the ~1.3 TB/s of a device-to-device copy on an H200), and a ring of 2 makes the
#: publisher wait for a reader's reading once per bucket. Over three runs of the 16 GiB dict (3063 tensors; H200
#: and H100, five versions each: bench/results/weights-stream-92abd6b-*, experiments/weights-stream-refsweep-*) the
#: two bounds' medians were within 11% of each other either way, but with 128 MiB the first measured version took
#: 121-135 ms in all three, with 512 MiB 20-22 ms.
_REF_BUCKET_BYTES = 512 << 20


def _numpy_buffer_fixed() -> bool:
    """Whether a NumPy array keeps its buffer for its lifetime (NumPy 2 refuses ``a.data = ...``; older NumPy
    only warns)."""
    a = np.zeros(1)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            a.data = np.zeros(1).data  # type: ignore[misc]
    except Exception:  # noqa: BLE001 - refused (AttributeError in NumPy 2): the buffer stays
        return True
    return False


_NUMPY_BUFFER_FIXED = _numpy_buffer_fixed()


def _identity(t: Any, torch_src: bool) -> Tuple[Any, ...]:
    """What must stay the same for a remembered tensor to be sent as before: its address (a torch tensor's storage
    is replaced in place by ``t.data = ...``), shape, strides (``as_strided_`` keeps the address) and dtype. A NumPy
    array's address is read only where its buffer can move: ``__array_interface__`` costs about 1 us an array."""
    if torch_src:
        return (t.data_ptr(), t.shape, t.stride(), t.dtype)
    if _NUMPY_BUFFER_FIXED:
        return (t.shape, t.strides, t.dtype)
    return (t.__array_interface__["data"][0], t.shape, t.strides, t.dtype)


class _Seen:
    """What the publisher learnt of a torch tensor or NumPy array it sent, kept while that object lives: given the
    same object again with the same _identity, it skips describing it, finding its block and laying out its
    reference piece."""

    __slots__ = ("wref", "torch", "key", "info", "meta", "mlen", "total", "src", "ref", "piece", "plen", "stream")

    def __init__(self, wref: Any, torch_src: bool, key: Tuple[Any, ...], info: TensorInfo, meta: List[Any], mlen: int,
                 total: int, src: Any, ref: Optional[_Ref]) -> None:
        self.wref, self.torch, self.key, self.info = wref, torch_src, key, info
        self.meta, self.mlen, self.total = meta, mlen, total
        self.src = src  #: its bytes as a uint8 torch view (None for NumPy: a view would keep the array alive)
        self.ref = ref  #: where it lies in pool memory, when it goes by reference
        self.piece: Optional[List[Any]] = None  #: its last reference piece, and that piece's JSON length
        self.plen = 0
        self.stream: Optional[int] = None  #: the stream record_stream was called with for it (its CUstream)


class _Replay:
    """A version update() sent the common way in one call (every tensor a torch tensor sent by reference as the
    version before): its tensors in order, by name, weak reference and _identity, the distinct blocks they lie in,
    and its buckets as flushed. The next version that passes the same tensors in the same order, each unchanged,
    sends those buckets again without walking them (StreamPublisher._send_again: 1.3-1.8 us a tensor against 2.8-4.0
    for the walk on the H200s of bench/results/experiments/publish-walk-*). It holds no tensor and no _Seen (whose
    byte views would keep a dropped tensor's memory)."""

    __slots__ = ("handle", "keys", "wrefs", "idents", "refs", "blocks", "buckets")

    def __init__(self, handle: Optional[int]) -> None:
        self.handle = handle  #: the version's CUstream: record_stream was called with it for every tensor
        self.keys: List[str] = []
        self.wrefs: List[Any] = []
        self.idents: List[Tuple[Any, ...]] = []
        self.refs: Optional[List[_Ref]] = []  #: while recording; close() keeps their distinct blocks
        self.blocks: List[Any] = []
        #: each bucket as flushed: pieces, table of blocks, block index, JSON length, bytes referenced, and how many
        #: of the version's tensors were laid out when it went (its last tensor's position + 1)
        self.buckets: List[Tuple[List[Any], List[List[str]], Dict[Tuple[str, str], int], int, int, int]] = []

    def add(self, key: str, seen: _Seen) -> None:
        assert self.refs is not None and seen.ref is not None
        self.keys.append(key)
        self.wrefs.append(seen.wref)
        self.idents.append(seen.key)
        self.refs.append(seen.ref)

    def close(self) -> bool:
        """Ends the recording; False when there is nothing to send again."""
        assert self.refs is not None
        self.blocks = list({id(r.block): r.block for r in self.refs}.values())
        self.refs = None
        return bool(self.keys and self.buckets)

    def fits(self, items: List[Any], handle: Optional[int]) -> bool:
        """Whether ``items`` may be this version again: as many tensors, the same stream, no block freed."""
        return handle == self.handle and len(items) == len(self.keys) and not any(b.freed for b in self.blocks)

    def matches(self, items: List[Any], start: int, end: int) -> bool:
        """Whether ``items[start:end]`` are this version's tensors there, in its order, each the same object,
        unchanged (_identity)."""
        for i in range(start, end):
            key, t = items[i]
            if key != self.keys[i] or self.wrefs[i]() is not t or \
                    (t.data_ptr(), t.shape, t.stride(), t.dtype) != self.idents[i]:
                return False
        return True



#: The most bytes of a ring of staging buckets: it is one pool chunk, and a chunk is at most 1 TiB.
_MAX_RING_BYTES = 1 << 40


def _count(value: Any) -> Optional[int]:
    """An int argument as an int (NumPy ints too), or None for what is no integer (bools included)."""
    if isinstance(value, bool):
        return None
    try:
        return operator.index(value)
    except TypeError:
        return None

class StreamPublisher:
    """Streams versions of named tensors to readers through a ring of staging buckets, or by reference to the
    tensors where they live in gpuipc pool memory; see :func:`stream_publisher`. One version at a time:
    :meth:`publish`, or :meth:`start`, :meth:`update` (any number of times), :meth:`finish`; :meth:`wait_consumed`.
    A context manager (``with`` closes)."""

    def __init__(
        self,
        name: str,
        bucket_bytes: int = 1 << 30,
        buckets: int = 2,
        *,
        readers: int = 4,
        device: int = 0,
        kind: Optional[str] = None,
        checksum: bool = False,
        mode: int = 0o600,
        reader_timeout: Optional[float] = None,
        by_reference: Any = "auto",
    ) -> None:
        """Checks the arguments; :meth:`init` makes the names (:func:`stream_publisher` does both)."""
        kind = "device" if kind is None else kind
        if not (by_reference is True or by_reference is False or by_reference == "auto"):
            raise InvalidArgument(f"stream_publisher: by_reference must be 'auto', True or False, not {by_reference!r}")
        if kind not in ("device", "host"):
            raise InvalidArgument(f"stream_publisher: kind must be 'device' or 'host', not {kind!r}")
        given = (bucket_bytes, buckets, readers)  # (for the messages)
        bucket_bytes, buckets, readers = _count(bucket_bytes), _count(buckets), _count(readers)  # NumPy ints too
        if bucket_bytes is None or bucket_bytes < _ALIGN:
            raise InvalidArgument(f"stream_publisher: bucket_bytes must be an int >= {_ALIGN}, not {given[0]!r}")
        if buckets is None or not 1 <= buckets <= 1024:
            raise InvalidArgument(f"stream_publisher: buckets must be 1..1024, not {given[1]!r}")
        if bucket_bytes * buckets > _MAX_RING_BYTES:
            raise InvalidArgument(
                f"stream_publisher: {buckets} buckets of {bucket_bytes} bytes are more than a ring holds (1 TiB, one "
                "pool chunk): smaller or fewer buckets"
            )
        if readers is None or not 1 <= readers <= _MAX_READERS:
            raise InvalidArgument(f"stream_publisher: readers must be 1..{_MAX_READERS}, not {given[2]!r}")
        if reader_timeout is not None and not (isinstance(reader_timeout, (int, float)) and reader_timeout > 0):
            raise InvalidArgument(f"stream_publisher: reader_timeout must be > 0 or None, not {reader_timeout!r}")
        self.name = name
        # by_reference=True stages nothing (an empty tensor takes no bytes): the ring carries descriptors only, and
        # bucket_bytes bounds the bytes a bucket's reference pieces name instead
        self._bucket_bytes = _ALIGN if by_reference is True else _align(bucket_bytes, _ALIGN)
        self._ref_bucket_bytes = _align(bucket_bytes, _ALIGN) if by_reference is True else _REF_BUCKET_BYTES
        self._by_reference = by_reference
        self._reader_timeout = reader_timeout
        self._nbuckets = buckets
        self._nreaders = readers
        self._device = device
        self._kind = kind
        self._checksum = checksum
        self._mode = mode
        self._made: List[Tuple[str, str]] = []
        self._pool: Optional[Pool] = None
        self._blocks: List[Block] = []
        self._seg: Optional[Segment] = None
        self._mem: Optional[np.ndarray] = None
        self._filled: Optional[Semaphore] = None
        self._slots = _ReaderSlots(name, buckets, readers, device, reader_timeout)
        self._seq = 0  # the last bucket filled
        self._version = 0  # the last version committed
        self._committed_seq = 0  # the last bucket of that version
        self._referenced = False  # the version in progress sent a reference piece
        self._next_version = 1
        self._current: Optional[int] = None  # the version being written
        self._bucket: Optional[_Bucket] = None
        self._index = 0  # of the next bucket in the version
        self._names: set = set()
        self._stream: Any = None  # torch stream of the current version (device staging or torch sources)
        self._last_stream: Any = None
        self._stage_torch: List[Any] = []
        self._stage_np: List[Optional[np.ndarray]] = []
        # What _add learnt of each torch tensor and NumPy array it was given, by name: the same one again skips
        # describing it. An entry goes when its tensor does.
        self._seen: Dict[str, _Seen] = {}
        self._torch_frees = torch_frees()  # when the blocks of _seen and _replay were last rechecked
        self._stream_handle: Optional[int] = None  # the CUstream of self._stream
        # The last descriptor body sent for each bucket of a version, by its index: (pieces, blocks, JSON)
        self._bodies: Dict[int, Tuple[List[Any], List[List[str]], bytes]] = {}
        # The last version, where update() sent every tensor the common way in one call: what to send again when
        # the next version passes the same tensors in the same order (_replay); and what the version in progress
        # records for that (None: it will not be replayable).
        self._replay: Optional[_Replay] = None
        self._record: Optional[_Replay] = None
        self._replaying = False
        self._updates = 0
        self._closed = False
        self._initialised = False

    # Setup -----------------------------------------------------------------------------------------------------
    def init(self) -> "StreamPublisher":
        """Makes the names (idempotent). Raises AlreadyExists (a name is taken: close the earlier publisher or
        :func:`unlink_stream`), and what Pool.create and Semaphore.create raise (NoDriver for device kind without
        a GPU)."""
        if self._closed:
            raise Closed(f"stream publisher {self.name!r}: this handle was closed (close() or with); create it again to use it")
        if self._initialised:
            return self
        name, B, N = self.name, self._nbuckets, self._nreaders
        device_kind = self._kind == "device"
        try:
            try:
                Segment.stat(name)
                raise AlreadyExists(
                    f"stream_publisher: the name {name!r} is taken (an earlier stream_publisher?): close it, remove it "
                    f"with gpuipc.unlink_stream({name!r}), or pick another name"
                )
            except NotFound:
                pass
            for i in range(_MAX_READERS):  # slots a reader of a dead stream of this name left behind
                try:
                    Semaphore.unlink(_slot_name(name, i))
                except NotFound:
                    pass
            step = (2 << 20) if device_kind else 4096
            chunk = _align(B * self._bucket_bytes, step)
            try:
                self._pool = Pool.create(name + ".pool", kind=self._kind, device=self._device, mode=self._mode,
                                         chunk_bytes=chunk, max_bytes=chunk, max_blocks=B + 16)
            except AlreadyExists:
                raise AlreadyExists(f"stream_publisher: pool {name + '.pool'!r} is taken: gpuipc.unlink_stream({name!r})") from None
            self._made.append(("pool", name + ".pool"))
            self._blocks = [self._pool.allocate(self._bucket_bytes) for _ in range(B)]
            sem_kind = "host_pinned" if device_kind else "host"
            try:
                self._filled = Semaphore.create(name + ".filled", initial=0, kind=sem_kind, device=self._device,
                                                mode=_signal_mode(self._mode))
            except AlreadyExists:
                raise AlreadyExists(f"stream_publisher: semaphore {name + '.filled'!r} is taken: gpuipc.unlink_stream({name!r})") from None
            self._made.append(("semaphore", name + ".filled"))
            try:
                self._slots.joins = Semaphore.create(_join_name(name), initial=0, kind="host",
                                                     mode=_join_mode(self._mode))
            except AlreadyExists:
                raise AlreadyExists(f"stream_publisher: semaphore {_join_name(name)!r} is taken: "
                                    f"gpuipc.unlink_stream({name!r})") from None
            self._made.append(("semaphore", _join_name(name)))
            try:
                self._seg = Segment.create(name, _control_bytes(B, N), kind="host", mode=self._mode)
            except AlreadyExists:
                raise AlreadyExists(f"stream_publisher: the name {name!r} is taken: gpuipc.unlink_stream({name!r})") from None
            self._made.append(("segment", name))
            mem = self._seg.as_array("uint8")
            raw = b"".join(bytes(b.ref) for b in self._blocks)
            mem[64 : 64 + len(raw)] = np.frombuffer(raw, dtype=np.uint8)
            flags = (_F_CHECKSUM if self._checksum else 0) | (_F_DEVICE if device_kind else 0)
            head = _HEAD.pack(MAGIC, FORMAT, B, self._bucket_bytes, N, DESC_BYTES, flags, self._mode, self._device, 0)
            mem[8 : _HEAD.size] = np.frombuffer(head[8:], dtype=np.uint8)
            mem[:8] = np.frombuffer(MAGIC, dtype=np.uint8)  # last: readers wait for it
            self._mem = self._slots.mem = mem
            if device_kind:
                self._stage_np = [None] * B
            else:
                self._stage_np = [b.numpy() for b in self._blocks]
        except BaseException:
            self._teardown()
            raise
        self._initialised = True
        return self

    def _teardown(self) -> None:
        for b in self._blocks:
            if not b.freed:
                b.free()
        self._blocks = []
        self._stage_torch = []
        self._stage_np = []
        self._seen.clear()
        self._bodies.clear()
        self._replay = self._record = None
        self._slots.close()
        if self._filled is not None:
            self._filled.close()
        for what, n in reversed(self._made):
            try:
                {"pool": Pool.unlink, "segment": Segment.unlink, "semaphore": Semaphore.unlink}[what](n)
            except Error:
                pass
        if self._made:
            for i in range(self._nreaders):
                try:
                    Semaphore.unlink(_slot_name(self.name, i))
                except Error:
                    pass
        self._made.clear()
        self._mem = None
        if self._seg is not None:
            self._seg.close()
        if self._pool is not None:
            self._pool.close()

    def close(self) -> None:
        """Removes every name and frees the staging buckets (idempotent). Readers' waits raise Closed; a version
        in progress is abandoned (readers in it raise Closed, their tensors partly written)."""
        if self._closed:
            return
        self._closed = True
        if self._last_stream is not None:
            self._last_stream.synchronize()
        self._teardown()

    def __enter__(self) -> "StreamPublisher":
        return self.init()

    def __exit__(self, *exc: object) -> None:
        self.close()

    # Readers ---------------------------------------------------------------------------------------------------
    @property
    def readers(self) -> int:
        """Reader slots claimed now (admitted or waiting for the next version)."""
        self._require()
        return self._slots.scan()

    def wait_readers(self, count: int, timeout: Optional[float] = None) -> int:
        """Waits until at least ``count`` readers have joined (they are admitted at the next :meth:`start`); returns
        how many have. Raises Timeout, InvalidArgument for more readers than the stream has slots for."""
        self._require()
        timeout = seconds(timeout, "wait_readers: timeout", "wait for ever")
        if count > self._nreaders:
            raise InvalidArgument(
                f"stream {self.name!r}: wait_readers({count}) can never return: it has slots for {self._nreaders} "
                "readers (stream_publisher(readers=...))"
            )
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            n = self.readers
            if n >= count:
                return n
            if deadline is not None and time.monotonic() > deadline:
                raise Timeout(f"stream {self.name!r}: {n} of {count} readers joined within {timeout:g} s")
            time.sleep(0.005)

    # Versions --------------------------------------------------------------------------------------------------
    def _require(self) -> None:
        if self._closed:
            raise Closed(f"stream publisher {self.name!r}: this handle was closed (close() or with); create it again to use it")
        if not self._initialised:
            self.init()

    @property
    def version(self) -> int:
        """The last version committed (0 before the first)."""
        return self._version

    @property
    def bucket_bytes(self) -> int:
        return self._bucket_bytes

    @property
    def buckets(self) -> int:
        return self._nbuckets

    @property
    def pool(self) -> Optional[Pool]:
        """The pool of staging buckets."""
        return self._pool

    def start(self, stream: Any = None) -> int:
        """Begins the next version and returns its number; readers that joined since the last version are
        admitted from it. stream: device staging or torch tensors: the CUDA stream the copies run on (None:
        torch's current stream; a side stream first waits for the current one, so the copies follow the work
        that made the tensors). Raises InvalidState when a version is in progress."""
        self._require()
        if self._current is not None:
            raise InvalidState(f"stream {self.name!r}: version {self._current} is in progress: finish() it first")
        self._slots.admit(self._seq + 1)
        frees = torch_frees()
        if frees != self._torch_frees:  # torch gave MemPool memory back: a remembered block may be gone, its address
            self._torch_frees = frees  # taken by another; sending its ref again would fail the readers
            recheck_torch_blocks(s.ref.block for s in self._seen.values() if s.ref is not None)
            if self._replay is not None:
                recheck_torch_blocks(self._replay.blocks)
        self._stream = self._stream_handle = None
        # Host staging copies synchronously; a stream matters there only for torch CUDA sources.
        if self._kind == "device" or (stream is not None and "torch" in sys.modules):
            s = _torch_stream(stream, self._device)
            cur = _torch().cuda.current_stream(self._device)
            if s != cur:
                s.wait_stream(cur)
            if self._last_stream is not None and self._last_stream != s:
                s.wait_stream(self._last_stream)  # the ring's earlier copies ran there
            self._stream = self._last_stream = s
            self._stream_handle = int(s.cuda_stream)
        self._current = self._next_version
        self._next_version += 1
        self._bucket = None
        self._index = 0
        self._names = set()
        self._referenced = False
        self._record = _Replay(self._stream_handle) if not self._checksum else None
        self._replaying = False
        self._updates = 0
        return self._current

    def update(self, named_tensors: Any) -> None:
        """Adds tensors to the version in progress: an iterable of (name, tensor) pairs or a mapping. Each is copied
        into the staging buckets before this returns (stream-ordered on the version's stream: enqueued there; the
        copies of one call go together), so a tensor may change once the call returned (on the host, or on a stream
        ordered after the version's), not before: a generator that refills one buffer for each name it yields
        refills it under copies not enqueued yet. A tensor larger than the room left is split across buckets. Contiguous tensors only travel as they are; others are copied contiguous
        first. A tensor in gpuipc pool memory goes by reference instead (by_reference "auto" or True): readers copy
        it from where it lies, so it must not change before :meth:`finish`'s wait. Raises InvalidState (no version
        in progress), InvalidArgument (a name twice, a name too long for a descriptor; by_reference=True and a
        tensor that cannot go by reference, named), Unsupported (element types)."""
        self._require()
        if self._current is None:
            raise InvalidState(f"stream {self.name!r}: no version in progress: start() first")
        items = named_tensors.items() if isinstance(named_tensors, Mapping) else named_tensors
        self._updates += 1
        if self._updates > 1:  # more than one call: the version is not the one recorded or replayed
            self._record = None
            self._replaying = False
        elif self._replay is not None:
            items = list(items)
            if self._replay.fits(items, self._stream_handle):
                items = items[self._send_again(self._replay, items) :]
        self._walk(items)
        self._copy_pending()

    def _copy_pending(self) -> None:
        """Enqueues the open bucket's copies of torch sources (made together, at the end of an update() call or when
        the bucket is sent): update() reads its tensors before it returns, not when their bucket fills."""
        b = self._bucket
        if b is None or not b.dsts:
            return
        torch = _torch()
        with torch.cuda.stream(self._stream) if self._stream is not None else contextlib.nullcontext():
            _Copies(torch, b.dsts, b.srcs).run(torch, non_blocking=self._stream is not None)
        b.dsts, b.srcs = [], []

    def _walk(self, items: Any) -> None:
        """Lays ``items`` into buckets (sending each once full), recording the version for _Replay while every
        tensor takes the common way."""
        names, seen_of, add = self._names, self._seen, self._add
        # The common case of a version like the last, inline: a torch tensor sent by reference as before, whose
        # piece goes into the open bucket unchanged (what _add and _add_reference check, with nothing they would
        # change). A tensor's Python cost, times thousands of tensors, is on the path of every version: this one is
        # a few attribute reads and one torch call per property of _identity. Anything else takes the general way.
        limit = DESC_BYTES - _DESC.size
        bound = self._ref_bucket_bytes
        handle = self._stream_handle if self._stream is not None else None
        fast = not self._checksum
        record = self._record
        for key, t in items:
            seen = seen_of.get(key) if fast and type(key) is str else None
            if (seen is not None and seen.torch and seen.ref is not None and seen.piece is not None
                    and key not in names and seen.wref() is t and (handle is None or seen.stream == handle)
                    and not seen.ref.block.freed and (t.data_ptr(), t.shape, t.stride(), t.dtype) == seen.key):
                ref, piece = seen.ref, seen.piece
                b = self._bucket
                if b is not None and b.referenced >= bound:
                    self._flush(0)  # readers copy from it while the rest is laid out
                    b = None
                if b is None:
                    b = self._open_bucket()
                # its block's entry in the bucket's table: there already, or added now (torch's allocator gives a
                # large MemPool tensor an allocation, so a block, of its own), at the index its piece names
                k = b.block_index.get(ref.key)
                extra = 0
                if k is None:
                    k, extra = len(b.blocks), ref.entry_len + 1
                if k == piece[-1] and b.json_len + seen.plen + extra <= limit:
                    if extra:
                        b.block_index[ref.key] = k
                        b.blocks.append(ref.entry)
                        b.json_len += extra
                    names.add(key)
                    b.pieces.append(piece)
                    b.json_len += seen.plen
                    b.referenced += seen.total
                    self._referenced = True
                    if record is not None:
                        record.add(key, seen)
                    continue
            record = self._record = None
            add(key, t)

    def _send_again(self, rp: _Replay, items: List[Any]) -> int:
        """Sends the recorded version's buckets again, each once its tensors are found the same as then
        (_Replay.matches), the last one left open for finish() as update() leaves it: what the walk would send.
        Checked and sent a bucket at a time, so readers copy while the rest is checked. Returns how many of
        ``items`` it sent: all, or up to the first bucket whose tensors changed, which the walk then lays out
        (the buckets before it were sent where the walk sends them: a bucket goes once it names ``bound`` bytes)."""
        last = len(rp.buckets) - 1
        start = 0
        for i, (pieces, blocks, block_index, json_len, referenced, end) in enumerate(rp.buckets):
            if not rp.matches(items, start, end):
                return start
            self._record = None  # a version partly sent again is not recorded (the walk records one it lays out)
            self._names.update(rp.keys[start:end])
            b = self._open_bucket()
            b.pieces, b.blocks, b.block_index = list(pieces), list(blocks), dict(block_index)
            b.json_len, b.referenced = json_len, referenced
            self._referenced = True
            if i < last:
                self._flush(0)
            start = end
        self._replaying = True
        return start

    def finish(self) -> int:
        """Sends the last bucket of the version in progress and returns its number: readers commit it once they
        have it. When the version sent reference pieces, readers copy from the tensors themselves, so they must
        not change before every reader is done: device staging makes the version's stream wait (stream-ordered:
        work enqueued on it after finish() runs once every admitted reader has consumed the last bucket; with
        ``reader_timeout`` set, a host wait that evicts a reader slower than that instead); host staging waits on
        the host. A reader that dies or closes does not hold it. Writes on other streams must wait for the
        version's stream. Raises InvalidState (no version in progress)."""
        self._require()
        if self._current is None:
            raise InvalidState(f"stream {self.name!r}: no version in progress: start() first")
        if self._bucket is None:
            self._open_bucket()
        self._flush(_D_LAST)
        if not self._replaying:
            rp = self._record
            self._replay = rp if rp is not None and rp.close() else None
        self._version = self._current
        self._committed_seq = self._seq
        self._current = None
        if self._referenced:
            if self._kind == "device" and self._reader_timeout is None:
                self._slots.wait_on_stream(self._seq, self._stream)
            else:
                self._slots.wait_consumed(self._seq)
        return self._version

    def wait_consumed(self, timeout: Optional[float] = None) -> int:
        """Waits on the host until every admitted reader has consumed the last committed version (its copies out
        of the last bucket, reference pieces included, ran) and returns that version (0 before the first). A
        reader that dies or closes meanwhile is dropped; one that takes longer than ``reader_timeout`` is
        evicted. Raises Timeout, naming the reader's slot, when ``timeout`` seconds pass first."""
        self._require()
        self._slots.wait_consumed(self._committed_seq, timeout)
        return self._version

    def abort(self) -> None:
        """Abandons the version in progress (no-op without one): readers in it raise InvalidState, with their tensors
        partly written, and go on with the next version."""
        if self._current is None or self._closed:
            return
        self._replay = self._record = None
        try:
            if self._bucket is None:
                self._open_bucket()
            b = self._bucket
            b.pieces, b.cursor, b.dsts, b.srcs = [], 0, [], []  # copies not enqueued yet are dropped
            b.blocks, b.ref_bytes = [], []
            self._flush(_D_ABORT)
        finally:
            self._current = None

    def publish(self, named_tensors: Any, stream: Any = None) -> int:
        """:meth:`start`, :meth:`update` with every tensor, :meth:`finish`: returns the committed version. On an
        error the version is abandoned (:meth:`abort`) and the error raised."""
        self.start(stream)
        try:
            self.update(named_tensors)
            return self.finish()
        except BaseException:
            try:
                self.abort()
            except Error:
                pass
            raise

    def _open_bucket(self) -> _Bucket:
        seq = self._seq + 1
        self._slots.wait_for_slot(seq)
        self._bucket = _Bucket(seq, seq % self._nbuckets, self._index)
        self._index += 1
        self._seq = seq
        return self._bucket

    def _stage_tensor(self, slot: int) -> Any:
        """The torch uint8 view of staging bucket ``slot`` (device staging, or host staging for torch sources)."""
        torch = _torch()
        if not self._stage_torch:
            if self._kind == "device":
                self._stage_torch = [torch.from_dlpack(b.view().__dlpack__()) for b in self._blocks]
            else:
                self._stage_torch = [torch.from_numpy(a) for a in self._stage_np]
        return self._stage_torch[slot]

    def _add(self, key: Any, t: Any) -> None:
        if not isinstance(key, str):
            raise InvalidArgument(f"tensor names must be str, not {type(key).__name__} ({key!r})")
        if key in self._names:
            raise InvalidArgument(f"stream {self.name!r}: tensor {key!r} twice in version {self._current}")
        seen = self._seen.get(key)
        if (seen is not None and seen.wref() is t and seen.key == _identity(t, seen.torch)
                and (seen.ref is None or not seen.ref.block.freed)):
            if seen.torch:
                if self._stream is not None and seen.stream != self._stream_handle:
                    self._keep_for_copy(t, seen)
                src = seen.src
            else:  # a NumPy array's bytes view would keep the array alive: made again where it is read
                src = _numpy_bytes(t) if seen.ref is None or self._checksum else None
            self._names.add(key)  # (only once accepted: a tensor refused can be passed again, corrected)
            self._add_pieces(key, seen.meta, seen.mlen, seen.total, src, seen.info, seen.torch, seen.ref, seen)
            return
        source = t
        try:
            info = describe(t, f"tensor {key!r}")
        except InvalidArgument:
            if not isinstance(t, np.ndarray):
                raise
            t = np.ascontiguousarray(t)  # negative or unaligned strides, which describe refuses: sent as a copy
            info = describe(t, f"tensor {key!r}")
        torch_src = _is_torch(t)
        src: Any = None
        ref = self._reference(key, info) if self._by_reference is not False else None
        if ref is None and not _contiguous(info):
            if torch_src:
                if self._stream is not None:
                    with _torch().cuda.stream(self._stream):
                        t = t.contiguous()
                else:
                    t = t.contiguous()
            elif isinstance(t, np.ndarray):
                t = np.ascontiguousarray(t)
            else:
                raise InvalidArgument(f"tensor {key!r} is strided: pass a contiguous copy")
            info = describe(t, f"tensor {key!r}")
        total = _nbytes(info)
        entry = None
        if torch_src:
            src = _torch_bytes(t)
        elif isinstance(t, np.ndarray):
            src = _numpy_bytes(t)
        meta = [key, info.dtype.name, list(info.shape)]
        mlen = len(json.dumps(meta, separators=(",", ":")))
        # The most a piece of it can take in an empty bucket: two numbers of up to 20 digits, the separators (at
        # most 33) and its block's entry; below that a too-long name would flush empty buckets for ever.
        if mlen + 73 + (ref.entry_len + 1 if ref is not None else 0) > DESC_BYTES - _DESC.size - len(_EMPTY_BODY):
            raise InvalidArgument(f"tensor name {key[:40]!r}... (or its pool's) is too long for a bucket descriptor")
        if (torch_src or isinstance(t, np.ndarray)) and t is source:  # contiguous as given: remembered, while it lives
            wref = weakref.ref(t)
            if seen is None or seen.wref is not wref:  # one finalizer per tensor, however often its storage changes
                weakref.finalize(t, _forget, self._seen, key, wref)
            entry = self._seen[key] = _Seen(wref, torch_src, _identity(t, torch_src), info, meta, mlen, total,
                                            src if torch_src else None, ref)
        if torch_src:
            self._keep_for_copy(t, entry)  # reference pieces too: its memory is not reused before finish()'s wait
        self._names.add(key)
        self._add_pieces(key, meta, mlen, total, src, info, torch_src, ref, entry)

    def _reference(self, key: str, info: TensorInfo) -> Optional[_Ref]:
        """Where tensor ``key`` lies in gpuipc pool memory that readers can copy from (what share_tensors shares by
        reference), or None: by_reference="auto" stages it, by_reference=True raises InvalidArgument saying why. An
        empty tensor has nothing to copy: a staged piece of no bytes."""
        if info.empty:
            return None
        why = None
        contiguous = _contiguous(info)
        block = shared_block(info) if contiguous else None
        if not contiguous:
            why = "it is strided (a reference is one byte range): pass a contiguous tensor"
        elif block is None:
            why = ("it is not in gpuipc pool memory (a block of a gpuipc.Pool, or a tensor allocated under "
                   "gpuipc.torch.MemPool)")
        elif bool(block.is_cuda) != (self._kind == "device"):
            why = (f"its block is {'GPU' if block.is_cuda else 'host'} memory and this stream's staging is "
                   f"{self._kind} kind")
        elif block.is_cuda and info.device_id != self._device:
            why = f"it lives on GPU {info.device_id}, the stream on GPU {self._device}"
        if why is None:
            assert block is not None
            return _Ref(block.pool.name, bytes(block.ref).hex(), info.address - block.address, block)
        if self._by_reference is True:
            raise InvalidArgument(f"stream {self.name!r}: tensor {key!r} cannot be sent by reference "
                                  f"(by_reference=True): {why}")
        return None

    def _keep_for_copy(self, t: Any, seen: Optional[_Seen] = None) -> None:
        if t.is_cuda and self._stream is not None:
            # Once per tensor and stream: the allocator keeps the streams recorded on a block until it is freed
            if seen is not None and seen.stream == self._stream_handle:
                return
            try:
                t.record_stream(self._stream)  # the caching allocator keeps it until the copy ran
            except Exception:  # noqa: BLE001 - memory torch's allocator does not own: the caller keeps it
                pass
            if seen is not None:
                seen.stream = self._stream_handle

    def _add_pieces(self, key: str, meta: List[Any], mlen: int, total: int, src: Any, info: Optional[TensorInfo],
                    torch_src: bool, ref: Optional[_Ref] = None, seen: Optional[_Seen] = None) -> None:
        """Lays tensor ``key`` (``total`` bytes of ``src``; ``info`` where it is not torch's) into buckets,
        splitting it where one is full; or, with ``ref``, one reference piece (``seen``: what the publisher
        remembers of the tensor, where its last piece is kept)."""
        b = self._bucket
        if b is not None and b.referenced >= self._ref_bucket_bytes:
            self._flush(0)  # readers copy from it while the rest is laid out
        if ref is not None:
            self._add_reference(meta, mlen, total, src, ref, seen)
            return
        pos = 0
        while True:
            b = self._bucket if self._bucket is not None else self._open_bucket()
            # the JSON of [*meta, pos, n, cursor] (n <= 20 digits), and its separating comma
            plen = mlen + len(str(pos)) + len(str(b.cursor)) + 4 + 1 + 24
            room = self._bucket_bytes - b.cursor
            if (room <= 0 and total > 0) or b.json_len + plen > DESC_BYTES - _DESC.size:
                self._flush(0)
                continue
            n = min(room, total - pos)
            if n > 0:
                self._copy_in(b.slot, b.cursor, src, info, pos, n, torch_src)
            b.pieces.append([*meta, pos, n, b.cursor])
            b.json_len += plen
            b.cursor = _align(b.cursor + n, _ALIGN)
            pos += n
            if pos >= total:
                return

    def _add_reference(self, meta: List[Any], mlen: int, total: int, src: Any, ref: _Ref,
                       seen: Optional[_Seen] = None) -> None:
        """One reference piece: no staging bytes, only its descriptor entry (and its block's, once per bucket).
        The piece a tensor sent last time is sent again where its block has the same index in the table."""
        while True:
            b = self._bucket if self._bucket is not None else self._open_bucket()
            k = b.block_index.get(ref.key)
            kk = len(b.blocks) if k is None else k
            if seen is not None and seen.piece is not None and seen.piece[-1] == kk:
                piece, plen = seen.piece, seen.plen
            else:
                piece = [*meta, 0, total, ref.offset, kk]
                # the JSON of the piece (total <= 20 digits) and its comma
                plen = mlen + len(str(ref.offset)) + len(str(kk)) + 32
                if seen is not None:
                    seen.piece, seen.plen = piece, plen
            extra = 0 if k is not None else ref.entry_len + 1  # a new block's entry and its comma
            if b.json_len + plen + extra > DESC_BYTES - _DESC.size:
                self._flush(0)
                continue
            if k is None:
                b.block_index[ref.key] = kk
                b.blocks.append(ref.entry)
                b.json_len += extra
            b.pieces.append(piece)
            b.json_len += plen
            b.referenced += total
            if self._checksum:
                b.ref_bytes.append(src[:total] if src is not None else self._block_bytes(ref, total))
            self._referenced = True
            return

    def _block_bytes(self, ref: _Ref, n: int) -> Any:
        """The ``n`` bytes a reference piece names, as a uint8 array (host) or torch tensor (device)."""
        whole = ref.block.view()
        if self._kind == "device":
            return _torch().from_dlpack(whole.__dlpack__())[ref.offset : ref.offset + n]
        return np.asarray(whole)[ref.offset : ref.offset + n]

    def _copy_in(self, slot: int, off: int, src: Any, info: Optional[TensorInfo], pos: int, n: int, torch_src: bool) -> None:
        if torch_src:  # enqueued with the call's other copies when update() returns, or its bucket goes (_copy_pending)
            b = self._bucket
            assert b is not None
            b.dsts.append(self._stage_tensor(slot)[off : off + n])
            b.srcs.append(src[pos : pos + n])
        elif self._kind == "host" and src is not None:
            stage = self._stage_np[slot]
            assert stage is not None
            stage[off : off + n] = src[pos : pos + n]
        else:
            assert info is not None  # only torch sources come without one
            address = info.address + pos
            if src is not None:  # a NumPy array into device staging
                address = int(src.__array_interface__["data"][0]) + pos
            handle = int(self._stream.cuda_stream) if self._stream is not None else 0
            _gpuipc._copy_to_view(self._blocks[slot].view(), off, address,
                                  DL_CPU if src is not None else info.device_type, info.device_id, n, handle)

    def _flush(self, flags: int) -> None:
        """Publishes the open bucket: its descriptor, then the filled signal (after the copies, in stream order)."""
        b = self._bucket
        assert b is not None and self._mem is not None and self._filled is not None and self._current is not None
        if self._record is not None:
            if b.cursor or b.dsts or flags & _D_ABORT:  # staged bytes: copies a replay would not make
                self._record = None
            else:
                self._record.buckets.append((b.pieces, b.blocks, b.block_index, b.json_len, b.referenced,
                                             len(self._record.keys)))
        self._copy_pending()
        used = min(b.cursor, self._bucket_bytes)
        checksum = 0
        if self._checksum:
            if self._kind == "device":
                with _torch().cuda.stream(self._stream):
                    checksum = _checksum_torch(self._stage_tensor(b.slot)[:used]) if used else 0
                    checksum += sum(_checksum_torch(x) for x in b.ref_bytes)
            else:
                if self._stream is not None:
                    self._stream.synchronize()  # torch CUDA sources copied into host staging
                stage = self._stage_np[b.slot]
                assert stage is not None
                checksum = _checksum_np(stage[:used])
                checksum += sum(_checksum_torch(x) if _is_torch(x) else _checksum_np(x) for x in b.ref_bytes)
            checksum &= _MASK64
        body = self._body_of(b)
        d = _desc_view(self._mem, self._nbuckets, self._nreaders, b.slot)
        d[: _DESC.size] = np.frombuffer(
            _DESC.pack(b.seq, self._current, b.index, flags, used, checksum, len(body), 0), dtype=np.uint8)
        d[_DESC.size : _DESC.size + len(body)] = np.frombuffer(body, dtype=np.uint8)
        if self._kind == "device":
            self._filled.signal(b.seq, self._stream, wake_host=True)
        else:
            if self._stream is not None and not self._checksum:
                self._stream.synchronize()
            self._filled.signal_host(b.seq)
        self._bucket = None

    def _body_of(self, b: _Bucket) -> bytes:
        """The JSON of bucket ``b``'s descriptor: the one sent for the same bucket of the last version again when its
        pieces are the same objects (reference pieces of tensors sent as before) and its table of blocks the same."""
        last = self._bodies.get(b.index)
        if (last is not None and len(last[0]) == len(b.pieces) and last[1] == b.blocks
                and all(map(operator.is_, last[0], b.pieces))):
            return last[2]
        body = _body(b.pieces, b.blocks)
        self._bodies[b.index] = (b.pieces, b.blocks, body)
        return body

    def __repr__(self) -> str:
        return (f"<gpuipc.StreamPublisher {self.name!r} {self._nbuckets} x {self._bucket_bytes} B {self._kind} "
                f"version={self._version}>")


def _signature_of(cls: Any) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """Gives the decorated factory the parameters of ``cls`` (as help() and inspect show them): it passes them on."""

    def wrap(factory: Callable[..., Any]) -> Callable[..., Any]:
        factory.__signature__ = inspect.signature(cls).replace(  # type: ignore[attr-defined]
            return_annotation=inspect.signature(factory).return_annotation)
        return factory

    return wrap


def _forget(seen: Dict[str, "_Seen"], key: str, ref: Any) -> None:
    """Drops what a publisher remembered of a tensor that is gone (its bytes view would keep its memory)."""
    entry = seen.get(key)
    if entry is not None and entry.wref is ref:
        del seen[key]


@_signature_of(StreamPublisher)
def stream_publisher(*args: Any, **kwargs: Any) -> StreamPublisher:
    """Creates stream ``name``: ``buckets`` staging buffers of ``bucket_bytes`` (rounded up to 256) in a pool
    ``NAME.pool`` of ``kind`` ("device", the default, on GPU ``device``; or "host"), and room for ``readers``
    reader slots. checksum: a sum per bucket that readers verify (costs a host sync per bucket on both sides).
    reader_timeout: seconds the publisher waits for one reader to consume a bucket before evicting it (None: wait
    while it lives; a dead reader is dropped at once). mode: permission bits of every name (readers need read and
    write: they join the pool and create their slot).

    by_reference: "auto" (the default) sends a contiguous tensor that lies in a gpuipc pool block of this process
    (a :class:`gpuipc.Block`'s memory, a tensor allocated under ``gpuipc.torch.MemPool``), on the staging's side
    (GPU ``device`` for device staging, host memory for host staging), as a reference piece: readers copy it
    straight from there, and :meth:`StreamPublisher.finish` then orders later writes after the readers' copies.
    Other tensors are staged. True: every non-empty tensor must go by reference (InvalidArgument names the one
    that cannot, and why); nothing is staged, so the buckets are 256 bytes, and ``bucket_bytes`` is how many bytes a
    bucket's reference pieces name before it is sent (512 MiB for "auto"). False: always stage.
    Raises AlreadyExists, InvalidArgument, NoDriver, ..."""
    return StreamPublisher(*args, **kwargs).init()


# Reader -----------------------------------------------------------------------------------------------------------------


def unlink_stream(name: str) -> None:
    """Removes the names of stream ``name`` (NAME, NAME.pool, NAME.filled, NAME.joins, NAME.reader.*) after its
    publisher died
    without closing. Raises NotFound when none exists."""
    unlink_names(((Segment.unlink, name), (Pool.unlink, name + ".pool"), (Semaphore.unlink, name + ".filled"),
                  (Semaphore.unlink, _join_name(name)),
                  *((Semaphore.unlink, _slot_name(name, i)) for i in range(_MAX_READERS))), f"no stream named {name!r}")
