"""Bucketed streaming of named tensors, for weight sync of models larger than a spare copy (docs/torch.md).

A :class:`StreamPublisher` streams versions of a set of named tensors through a ring of ``buckets`` staging
buffers of ``bucket_bytes`` each, all in one gpuipc pool that every reader maps once: a sync opens no handles. Each
bucket carries its own layout (names, dtypes, shapes, byte ranges), so readers need no prior knowledge, and a
version is committed by its last bucket: a reader reports a version only once every bucket has arrived.

Names made by ``stream_publisher(NAME)``:

* ``NAME``: a host segment, the control block (format below, defined only here);
* ``NAME.pool``: the pool of staging buckets (device or host kind);
* ``NAME.filled``: a timeline the publisher signals with the sequence number ``s`` (1, 2, ...) of each bucket once
  its copy into the staging buffer is done (stream-ordered for device pools); bucket ``s`` lives in ring slot
  ``s % buckets``;
* ``NAME.reader.<i>``: one timeline per reader slot ``i < readers``, created by the reader that claims the slot
  (so that its death poisons it), signalled with ``s`` once that reader's copies out of bucket ``s`` are done.

Before it overwrites ring slot ``s % buckets`` with bucket ``s`` the publisher waits until every admitted reader has
consumed bucket ``s - buckets``: with two buckets, its copy of bucket k+1 overlaps the readers' load of bucket k.

Control block, little-endian::

    0    8 bytes  magic b"GPUIPCSB"
    8    u32      FORMAT (1)
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
         u64 used bytes, u64 checksum (sum of the used bytes, as unsigned bytes), u32 json bytes, u32 reserved,
         then JSON: [[name, dtype, shape, first byte in the tensor, bytes, offset in the bucket], ...]
"""

from __future__ import annotations

import json
import math
import struct
import sys
import time
import warnings
from dataclasses import dataclass, field
from typing import Any, Dict, Iterator, List, Mapping, Optional, Tuple

import numpy as np

from . import _gpuipc
from ._arrays import make_array
from ._dtypes import dtype_of
from ._streams import stream_handle
from ._tensorinfo import DL_CPU, TensorInfo, describe
from .errors import (
    AlreadyExists,
    ChecksumMismatch,
    Closed,
    Error,
    InvalidArgument,
    InvalidState,
    NotFound,
    PeerDied,
    ProtocolError,
    QuotaExceeded,
    Timeout,
    Unsupported,
)
from .pool import Block, BlockRef, Pool
from .segment import Segment
from .semaphore import Semaphore

__all__ = ["stream_publisher", "stream_reader", "unlink_stream", "StreamPublisher", "StreamReader", "StreamItem"]

MAGIC = b"GPUIPCSB"
FORMAT = 1
_HEAD = struct.Struct("<8sIIQIIIIiI")
_DESC = struct.Struct("<QQIIQQII")
_REF_BYTES = 40
#: Bytes of one bucket descriptor: a bucket closes early when its piece list would not fit.
DESC_BYTES = 128 << 10
#: Pieces start at multiples of this in a bucket (elements stay aligned; splits fall on element boundaries).
_ALIGN = 256
_F_CHECKSUM, _F_DEVICE = 1, 2
_D_LAST, _D_ABORT = 1, 2
_EVICTED = (1 << 64) - 1
_MAX_READERS = 64


def _align(n: int, a: int) -> int:
    return (n + a - 1) // a * a


def _admit_offset(buckets: int) -> int:
    return _align(64 + _REF_BYTES * buckets, 64)


def _desc_offset(buckets: int, readers: int) -> int:
    return _align(_admit_offset(buckets) + 8 * readers, 64)


def _control_bytes(buckets: int, readers: int) -> int:
    return _desc_offset(buckets, readers) + buckets * DESC_BYTES


def _slot_name(name: str, i: int) -> str:
    return f"{name}.reader.{i}"


def _torch() -> Any:
    torch = sys.modules.get("torch")
    if torch is None:
        try:
            import torch  # noqa: PLC0415 - only for torch tensors or device staging
        except ImportError:
            raise Unsupported("device staging buckets are read and written with PyTorch: pip install torch") from None
    return torch


def _is_torch(obj: Any) -> bool:
    return type(obj).__module__.startswith("torch") and hasattr(obj, "untyped_storage")


def _torch_stream(stream: Any, device: int) -> Any:
    torch = _torch()
    if stream is None:
        return torch.cuda.current_stream(device)
    if isinstance(stream, torch.cuda.Stream):
        return stream
    return torch.cuda.ExternalStream(stream_handle(stream), device=device)


def _contiguous(info: TensorInfo) -> bool:
    if info.empty:
        return True
    step = 1
    for n, s in zip(reversed(info.shape), reversed(info.strides)):
        if n > 1 and s != step:
            return False
        step *= n
    return True


def _nbytes(info: TensorInfo) -> int:
    return math.prod(info.shape) * info.dtype.itemsize


def _torch_bytes(t: Any) -> Any:
    """A contiguous tensor's bytes as a flat uint8 tensor (a view)."""
    torch = _torch()
    return t.reshape(-1).view(torch.uint8)


def _numpy_bytes(a: np.ndarray) -> np.ndarray:
    return a.reshape(-1).view(np.uint8)


def _checksum_np(b: np.ndarray) -> int:
    return int(b.sum(dtype=np.uint64))


def _checksum_torch(t: Any) -> int:
    torch = _torch()
    return int(t.sum(dtype=torch.int64).item())


def _raise_poisoned(sem: Semaphore, what: str) -> None:
    if sem.status == "peer_died":
        raise PeerDied(f"{what}: the publisher died")
    if sem.status == "closed":
        raise Closed(f"{what}: the publisher closed the stream")


@dataclass
class _Header:
    buckets: int
    bucket_bytes: int
    readers: int
    desc_bytes: int
    flags: int
    mode: int
    device: int
    refs: List[BlockRef]

    @property
    def checksum(self) -> bool:
        return bool(self.flags & _F_CHECKSUM)

    @property
    def device_staging(self) -> bool:
        return bool(self.flags & _F_DEVICE)


def _read_header(name: str, mem: np.ndarray) -> _Header:
    if mem.nbytes < 64 or bytes(mem[:8]) != MAGIC:
        raise InvalidArgument(f"segment {name!r} is not a gpuipc stream (made by stream_publisher)")
    _, fmt, buckets, bucket_bytes, readers, desc_bytes, flags, mode, device, _ = _HEAD.unpack(bytes(mem[: _HEAD.size]))
    if fmt != FORMAT:
        raise InvalidArgument(f"stream {name!r} has format {fmt}; this gpuipc reads format {FORMAT}: upgrade")
    if not (1 <= buckets <= 1024 and 1 <= readers <= _MAX_READERS and desc_bytes == DESC_BYTES) or mem.nbytes < _control_bytes(buckets, readers):
        raise InvalidArgument(f"stream {name!r} is malformed (sizes out of range)")
    raw = bytes(mem[64 : 64 + _REF_BYTES * buckets])
    refs = [BlockRef.from_bytes(raw[i * _REF_BYTES : (i + 1) * _REF_BYTES]) for i in range(buckets)]
    return _Header(buckets, bucket_bytes, readers, desc_bytes, flags, mode, device, refs)


@dataclass
class _Desc:
    seq: int
    version: int
    index: int
    flags: int
    used: int
    checksum: int
    pieces: List[List[Any]]


def _desc_view(mem: np.ndarray, buckets: int, readers: int, slot: int) -> np.ndarray:
    start = _desc_offset(buckets, readers) + slot * DESC_BYTES
    return mem[start : start + DESC_BYTES]


def _read_desc(mem: np.ndarray, buckets: int, readers: int, slot: int) -> _Desc:
    d = _desc_view(mem, buckets, readers, slot)
    seq, version, index, flags, used, checksum, jlen, _ = _DESC.unpack(bytes(d[: _DESC.size]))
    if jlen > DESC_BYTES - _DESC.size:
        raise ProtocolError(f"a bucket descriptor claims {jlen} bytes of layout")
    pieces = json.loads(bytes(d[_DESC.size : _DESC.size + jlen]).decode()) if jlen else []
    return _Desc(seq, version, index, flags, used, checksum, pieces)


# Publisher --------------------------------------------------------------------------------------------------------------
@dataclass
class _ReaderSlot:
    sem: Semaphore
    first: int = 0  #: the first bucket it reads (0: claimed, not admitted yet)


@dataclass
class _Bucket:
    seq: int
    slot: int
    index: int
    cursor: int = 0
    pieces: List[List[Any]] = field(default_factory=list)
    json_len: int = 2  # "[]"


class StreamPublisher:
    """Streams versions of named tensors to readers through a ring of staging buckets; see
    :func:`stream_publisher`. One version at a time: :meth:`publish`, or :meth:`start`, :meth:`update` (any number
    of times), :meth:`finish`. A context manager (``with`` closes)."""

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
    ) -> None:
        """Checks the arguments; :meth:`init` makes the names (:func:`stream_publisher` does both)."""
        kind = "device" if kind is None else kind
        if kind not in ("device", "host"):
            raise InvalidArgument(f"stream_publisher: kind must be 'device' or 'host', not {kind!r}")
        if not isinstance(bucket_bytes, int) or bucket_bytes < _ALIGN:
            raise InvalidArgument(f"stream_publisher: bucket_bytes must be an int >= {_ALIGN}, not {bucket_bytes!r}")
        if not isinstance(buckets, int) or not 1 <= buckets <= 1024:
            raise InvalidArgument(f"stream_publisher: buckets must be 1..1024, not {buckets!r}")
        if not isinstance(readers, int) or not 1 <= readers <= _MAX_READERS:
            raise InvalidArgument(f"stream_publisher: readers must be 1..{_MAX_READERS}, not {readers!r}")
        if reader_timeout is not None and reader_timeout <= 0:
            raise InvalidArgument(f"stream_publisher: reader_timeout must be > 0 or None, not {reader_timeout!r}")
        self.name = name
        self._bucket_bytes = _align(bucket_bytes, _ALIGN)
        self._nbuckets = buckets
        self._nreaders = readers
        self._device = device
        self._kind = kind
        self._checksum = checksum
        self._mode = mode
        self._reader_timeout = reader_timeout
        self._made: List[Tuple[str, str]] = []
        self._pool: Optional[Pool] = None
        self._blocks: List[Block] = []
        self._seg: Optional[Segment] = None
        self._mem: Optional[np.ndarray] = None
        self._filled: Optional[Semaphore] = None
        self._readers: List[Optional[_ReaderSlot]] = [None] * readers
        self._evicted: Dict[int, Semaphore] = {}
        self._seq = 0  # the last bucket filled
        self._version = 0  # the last version committed
        self._next_version = 1
        self._current: Optional[int] = None  # the version being written
        self._bucket: Optional[_Bucket] = None
        self._index = 0  # of the next bucket in the version
        self._names: set = set()
        self._stream: Any = None  # torch stream of the current version (device staging or torch sources)
        self._last_stream: Any = None
        self._stage_torch: List[Any] = []
        self._stage_np: List[Optional[np.ndarray]] = []
        self._closed = False
        self._initialised = False

    # Setup -----------------------------------------------------------------------------------------------------
    def init(self) -> "StreamPublisher":
        """Makes the names (idempotent). Raises AlreadyExists (a name is taken: close the earlier publisher or
        :func:`unlink_stream`), and what Pool.create and Semaphore.create raise (NoDriver for device kind without
        a GPU)."""
        if self._closed:
            raise InvalidArgument(f"stream publisher {self.name!r} is closed")
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
                self._filled = Semaphore.create(name + ".filled", initial=0, kind=sem_kind, device=self._device, mode=self._mode)
            except AlreadyExists:
                raise AlreadyExists(f"stream_publisher: semaphore {name + '.filled'!r} is taken: gpuipc.unlink_stream({name!r})") from None
            self._made.append(("semaphore", name + ".filled"))
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
            self._mem = mem
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
        for slot in self._readers:
            if slot is not None:
                slot.sem.close()
        self._readers = [None] * self._nreaders
        for sem in self._evicted.values():
            sem.close()
        self._evicted.clear()
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
    def _admit_word(self, i: int) -> np.ndarray:
        assert self._mem is not None
        off = _admit_offset(self._nbuckets) + 8 * i
        return self._mem[off : off + 8].view("<u8")

    def _drop(self, i: int) -> None:
        """Frees reader slot i (its reader died, closed, or was evicted and has gone): the same code for all."""
        slot = self._readers[i]
        self._readers[i] = None
        sem = slot.sem if slot is not None else self._evicted.pop(i, None)
        self._admit_word(i)[0] = 0
        if sem is not None:
            sem.close()
        try:
            Semaphore.unlink(_slot_name(self.name, i))
        except Error:
            pass

    def _scan(self) -> None:
        """Finds readers that claimed a slot, and frees the slots of readers that are gone."""
        for i in range(self._nreaders):
            ev = self._evicted.get(i)
            if ev is not None:
                if ev.status != "ok":
                    self._drop(i)
                continue
            slot = self._readers[i]
            if slot is not None:
                if slot.sem.status != "ok":
                    self._drop(i)
                continue
            try:
                sem = Semaphore.open(_slot_name(self.name, i), role="waiter", device=self._device)
            except NotFound:
                continue
            self._readers[i] = _ReaderSlot(sem)
            if sem.status != "ok":
                self._drop(i)

    @property
    def readers(self) -> int:
        """Reader slots claimed now (admitted or waiting for the next version)."""
        self._require()
        self._scan()
        return sum(1 for r in self._readers if r is not None)

    def wait_readers(self, count: int, timeout: Optional[float] = None) -> int:
        """Waits until at least ``count`` readers have joined (they are admitted at the next :meth:`start`); returns
        how many have. Raises Timeout."""
        self._require()
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            n = self.readers
            if n >= count:
                return n
            if deadline is not None and time.monotonic() > deadline:
                raise Timeout(f"stream {self.name!r}: {n} of {count} readers joined within {timeout:g} s")
            time.sleep(0.005)

    def _wait_for_slot(self, seq: int) -> None:
        """Before bucket ``seq`` overwrites ring slot seq % buckets: every admitted reader has consumed bucket
        seq - buckets. A dead or closed reader is dropped; one slower than reader_timeout is evicted."""
        need = seq - self._nbuckets
        if need <= 0:
            return
        for i, slot in enumerate(self._readers):
            if slot is None or slot.first == 0 or need < slot.first:
                continue
            try:
                slot.sem.wait_host(need, self._reader_timeout)
            except (PeerDied, Closed):
                self._drop(i)
            except Timeout:
                self._readers[i] = None
                self._evicted[i] = slot.sem
                self._admit_word(i)[0] = _EVICTED

    # Versions --------------------------------------------------------------------------------------------------
    def _require(self) -> None:
        if self._closed:
            raise InvalidArgument(f"stream publisher {self.name!r} is closed")
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
        self._scan()
        first = self._seq + 1
        for i, slot in enumerate(self._readers):
            if slot is not None and slot.first == 0:
                slot.first = first
                self._admit_word(i)[0] = first
        self._stream = None
        # Host staging copies synchronously; a stream matters there only for torch CUDA sources.
        if self._kind == "device" or (stream is not None and "torch" in sys.modules):
            s = _torch_stream(stream, self._device)
            cur = _torch().cuda.current_stream(self._device)
            if s != cur:
                s.wait_stream(cur)
            if self._last_stream is not None and self._last_stream != s:
                s.wait_stream(self._last_stream)  # the ring's earlier copies ran there
            self._stream = self._last_stream = s
        self._current = self._next_version
        self._next_version += 1
        self._bucket = None
        self._index = 0
        self._names = set()
        return self._current

    def update(self, named_tensors: Any) -> None:
        """Adds tensors to the version in progress: an iterable of (name, tensor) pairs or a mapping. Each is copied
        into the staging buckets at once (stream-ordered on the version's stream); a tensor larger than the room
        left is split across buckets. Contiguous tensors only travel as they are; others are copied contiguous
        first. Raises InvalidState (no version in progress), InvalidArgument (a name twice, a name too long for a
        descriptor), Unsupported (element types)."""
        self._require()
        if self._current is None:
            raise InvalidState(f"stream {self.name!r}: no version in progress: start() first")
        items = named_tensors.items() if isinstance(named_tensors, Mapping) else named_tensors
        for key, t in items:
            self._add(key, t)

    def finish(self) -> int:
        """Sends the last bucket of the version in progress and returns its number: readers commit it once they
        have it. Raises InvalidState (no version in progress)."""
        self._require()
        if self._current is None:
            raise InvalidState(f"stream {self.name!r}: no version in progress: start() first")
        if self._bucket is None:
            self._open_bucket()
        self._flush(_D_LAST)
        self._version = self._current
        self._current = None
        return self._version

    def abort(self) -> None:
        """Abandons the version in progress (no-op without one): readers in it raise InvalidState, with their tensors
        partly written, and go on with the next version."""
        if self._current is None or self._closed:
            return
        try:
            if self._bucket is None:
                self._open_bucket()
            self._bucket.pieces, self._bucket.cursor = [], 0
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
        self._wait_for_slot(seq)
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
        info = describe(t, f"tensor {key!r}")
        self._names.add(key)
        torch_src = _is_torch(t)
        src: Any = None
        if not _contiguous(info):
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
        if torch_src:
            src = _torch_bytes(t)
            if t.is_cuda and self._stream is not None:
                try:
                    t.record_stream(self._stream)  # the caching allocator keeps it until the copy ran
                except Exception:  # noqa: BLE001 - memory torch's allocator does not own: the caller keeps it
                    pass
        elif isinstance(t, np.ndarray):
            src = _numpy_bytes(t)
        meta = [key, info.dtype.name, list(info.shape)]
        pos = 0
        while True:
            b = self._bucket if self._bucket is not None else self._open_bucket()
            piece = [*meta, pos, 0, b.cursor]
            plen = len(json.dumps(piece, separators=(",", ":"))) + 1 + 24  # room for the byte counts' digits
            if plen > DESC_BYTES - _DESC.size - 2:
                raise InvalidArgument(f"tensor name {key[:40]!r}... is too long for a bucket descriptor")
            room = self._bucket_bytes - b.cursor
            if (room <= 0 and total > 0) or b.json_len + plen > DESC_BYTES - _DESC.size:
                self._flush(0)
                continue
            n = min(room, total - pos)
            if n > 0:
                self._copy_in(b.slot, b.cursor, src, info, pos, n, torch_src)
            piece[4] = n
            b.pieces.append(piece)
            b.json_len += plen
            b.cursor = _align(b.cursor + n, _ALIGN)
            pos += n
            if pos >= total:
                return

    def _copy_in(self, slot: int, off: int, src: Any, info: TensorInfo, pos: int, n: int, torch_src: bool) -> None:
        if torch_src:
            dst = self._stage_tensor(slot)[off : off + n]
            if self._stream is not None:
                with _torch().cuda.stream(self._stream):
                    dst.copy_(src[pos : pos + n], non_blocking=True)
            else:
                dst.copy_(src[pos : pos + n])
        elif self._kind == "host" and src is not None:
            stage = self._stage_np[slot]
            assert stage is not None
            stage[off : off + n] = src[pos : pos + n]
        else:
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
        used = min(b.cursor, self._bucket_bytes)
        checksum = 0
        if self._checksum:
            if self._kind == "device":
                with _torch().cuda.stream(self._stream):
                    checksum = _checksum_torch(self._stage_tensor(b.slot)[:used])
            else:
                if self._stream is not None:
                    self._stream.synchronize()  # torch CUDA sources copied into host staging
                stage = self._stage_np[b.slot]
                assert stage is not None
                checksum = _checksum_np(stage[:used])
        body = json.dumps(b.pieces, separators=(",", ":")).encode()
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

    def __repr__(self) -> str:
        return (f"<gpuipc.StreamPublisher {self.name!r} {self._nbuckets} x {self._bucket_bytes} B {self._kind} "
                f"version={self._version}>")


def stream_publisher(
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
) -> StreamPublisher:
    """Creates stream ``name``: ``buckets`` staging buffers of ``bucket_bytes`` (rounded up to 256) in a pool
    ``NAME.pool`` of ``kind`` ("device", the default, on GPU ``device``; or "host"), and room for ``readers``
    reader slots. checksum: a sum per bucket that readers verify (costs a host sync per bucket on both sides).
    reader_timeout: seconds the publisher waits for one reader to consume a bucket before evicting it (None: wait
    while it lives; a dead reader is dropped at once). mode: permission bits of every name (readers need read and
    write: they join the pool and create their slot). Raises AlreadyExists, InvalidArgument, NoDriver, ..."""
    return StreamPublisher(name, bucket_bytes, buckets, readers=readers, device=device, kind=kind, checksum=checksum,
                           mode=mode, reader_timeout=reader_timeout).init()


# Reader -----------------------------------------------------------------------------------------------------------------
class StreamItem(tuple):
    """One piece of a version, as :meth:`StreamReader.receive_iter` yields it: unpacks as ``(name, view)``. A
    tensor that fits in one bucket is one item with its full shape (``start == 0``, ``complete``); a split tensor
    comes as several items, each a flat 1-D view of ``count`` elements starting at element ``start`` of the
    flattened tensor. ``shape`` and ``dtype`` are those of the whole tensor."""

    name: str
    view: Any
    start: int
    count: int
    shape: Tuple[int, ...]
    dtype: str
    complete: bool

    def __new__(cls, name: str, view: Any, start: int, count: int, shape: Tuple[int, ...], dtype: str) -> "StreamItem":
        self = super().__new__(cls, (name, view))
        self.name, self.view, self.start, self.count, self.shape, self.dtype = name, view, start, count, shape, dtype
        self.complete = start == 0 and count == math.prod(shape)
        return self


class StreamReader:
    """A reader of stream ``name`` (:func:`stream_reader`): :meth:`receive` or :meth:`receive_iter` per version.
    A context manager (``with`` closes)."""

    def __init__(self, name: str, *, device: Optional[int] = None, wait: Optional[float] = None) -> None:
        self.name = name
        self._closed = False
        self._slot_sem: Optional[Semaphore] = None
        self._filled: Optional[Semaphore] = None
        self._pool: Optional[Pool] = None
        self._views: List[Any] = []
        self._stage_torch: List[Any] = []
        self._stage_np: List[np.ndarray] = []
        self._token = 0  # the first bucket this reader reads (its admit word), 0 until admitted
        self._next = 0  # the next bucket to read
        self._in_version = False  # a version was left half read (error, timeout): skip its rest first
        self._version = 0
        #: Names the last receive() skipped (sent, but not in its ``into``).
        self.skipped: List[str] = []
        self._seg = Segment.open(name, readonly=True, wait=wait)
        try:
            mem = self._seg.as_array("uint8")
            deadline = time.monotonic() + 5.0
            while not mem[:8].any() and time.monotonic() < deadline:  # created a moment before it is written
                time.sleep(0.001)
            self._mem = mem
            self._head = h = _read_header(name, mem)
            self._device = device if device is not None else h.device
            try:
                self._pool = Pool.open(name + ".pool", readonly=True, device=self._device if h.device_staging else None)
            except NotFound:
                raise PeerDied(f"stream {name!r}: its pool is gone (the publisher closed or died)") from None
            self._views = [self._pool._pool.view(r._tuple(), True, True) for r in h.refs]  # held: mapped once
            self._filled = Semaphore.open(name + ".filled", role="waiter", wait=wait, device=self._device)
            self._slot = self._claim(wait)
        except BaseException:
            self.close()
            raise

    def _claim(self, wait: Optional[float]) -> int:
        h = self._head
        kind = "host_pinned" if h.device_staging else "host"
        deadline = None if wait is None else time.monotonic() + wait
        while True:
            for i in range(h.readers):
                try:
                    self._slot_sem = Semaphore.create(_slot_name(self.name, i), initial=0, kind=kind,
                                                      device=self._device, mode=h.mode)
                    return i
                except AlreadyExists:
                    continue
            if deadline is None or time.monotonic() > deadline:
                raise QuotaExceeded(
                    f"stream {self.name!r}: all {h.readers} reader slots are taken (readers= of stream_publisher; "
                    "slots of readers that left are freed at the publisher's next version)"
                )
            time.sleep(0.01)

    # ---------------------------------------------------------------------------------------------------------------
    @property
    def version(self) -> int:
        """The last version this reader received completely (0 before the first)."""
        return self._version

    @property
    def slot(self) -> int:
        """This reader's slot (0 .. readers-1)."""
        return self._slot

    def _admit(self) -> int:
        off = _admit_offset(self._head.buckets) + 8 * self._slot
        return int(self._mem[off : off + 8].view("<u8")[0])

    @staticmethod
    def _left(deadline: Optional[float]) -> Optional[float]:
        return None if deadline is None else max(0.0, deadline - time.monotonic())

    def _wait_filled(self, value: int, deadline: Optional[float], what: str) -> None:
        assert self._filled is not None
        try:
            self._filled.wait_host(value, self._left(deadline))
        except Timeout:
            raise Timeout(f"stream {self.name!r}: {what}: nothing arrived in time") from None
        except PeerDied:
            raise PeerDied(f"stream {self.name!r}: the publisher died ({what})") from None
        except Closed:
            raise Closed(f"stream {self.name!r}: the publisher closed the stream ({what})") from None

    def _check_evicted(self) -> None:
        if self._admit() != self._token:
            raise InvalidState(
                f"stream {self.name!r}: this reader was evicted (it did not consume a bucket within the publisher's "
                "reader_timeout): close it and open a new reader"
            )

    def _next_bucket(self, deadline: Optional[float]) -> _Desc:
        if self._closed:
            raise InvalidArgument(f"stream reader {self.name!r} is closed")
        assert self._filled is not None
        while self._token == 0:
            seen = self._filled.value
            _raise_poisoned(self._filled, f"stream {self.name!r}")
            admit = self._admit()
            if admit == _EVICTED:
                raise InvalidState(f"stream {self.name!r}: this reader was evicted: close it and open a new reader")
            if admit:
                self._token = self._next = admit
                break
            self._wait_filled(seen + 1, deadline, "waiting to be admitted at the publisher's next version")
        self._check_evicted()
        e = self._next
        self._wait_filled(e, deadline, f"waiting for bucket {e}")
        self._check_evicted()
        d = _read_desc(self._mem, self._head.buckets, self._head.readers, e % self._head.buckets)
        self._check_evicted()
        if d.seq != e:
            raise ProtocolError(f"stream {self.name!r}: ring slot {e % self._head.buckets} holds bucket {d.seq}, not {e}")
        if not self._in_version and d.index != 0:
            raise ProtocolError(f"stream {self.name!r}: bucket {e} is bucket {d.index} of a version, not its first")
        return d

    def _release(self, seq: int, stream: Any) -> None:
        assert self._slot_sem is not None
        if self._head.device_staging:
            self._slot_sem.signal(seq, stream, wake_host=True)
        else:
            self._slot_sem.signal_host(seq)
        self._next = seq + 1

    def _drain(self, deadline: Optional[float], stream: Any) -> None:
        """Skips the rest of a version left half read."""
        while self._in_version:
            d = self._next_bucket(deadline)
            self._release(d.seq, stream)
            if d.flags & (_D_LAST | _D_ABORT):
                self._in_version = False

    def _host(self, slot: int) -> np.ndarray:
        if not self._stage_np:
            self._stage_np = [np.asarray(v) for v in self._views]
        return self._stage_np[slot]

    def _stage(self, slot: int) -> Any:
        if not self._stage_torch:
            torch = _torch()
            self._stage_torch = [torch.from_dlpack(v.__dlpack__()) for v in self._views]
        return self._stage_torch[slot]

    def _verify(self, d: _Desc, slot: int, stream_obj: Any) -> None:
        if not self._head.checksum:
            return
        if self._head.device_staging:
            torch = _torch()
            with torch.cuda.stream(stream_obj):
                got = _checksum_torch(self._stage(slot)[: d.used])
        else:
            got = _checksum_np(self._host(slot)[: d.used])
        if got != d.checksum:
            names = sorted({p[0] for p in d.pieces})
            raise ChecksumMismatch(
                f"stream {self.name!r}: bucket {d.index} of version {d.version} (sequence {d.seq}) has checksum {got}, "
                f"the publisher sent {d.checksum}; it holds {', '.join(map(repr, names[:8]))}"
                f"{' ...' if len(names) > 8 else ''}"
            )

    def _streams(self, stream: Any) -> Tuple[Any, Any]:
        """(torch stream or None, what to signal on)."""
        if not self._head.device_staging:
            return None, None
        s = _torch_stream(stream, self._device)
        return s, s

    def _begin(self, timeout: Optional[float], stream: Any) -> Tuple[Optional[float], Any, Any]:
        deadline = None if timeout is None else time.monotonic() + timeout
        s, sig = self._streams(stream)
        self._drain(deadline, sig)
        return deadline, s, sig

    def receive(self, into: Mapping[str, Any], stream: Any = None, timeout: Optional[float] = None) -> int:
        """Receives the next version into the tensors of ``into`` (name to tensor, contiguous, of the dtype and
        shape sent) and returns its number once every bucket has arrived and been applied. Device staging: torch
        tensors, copied on ``stream`` (None: torch's current stream) and returned before the copies ran: use the
        tensors on that stream or synchronize it. Host staging: NumPy arrays or torch tensors. Names sent that
        ``into`` lacks are skipped (listed in :attr:`skipped`).

        Raises Timeout, PeerDied (the publisher died: ``into`` may hold part of the new version, never reported as
        received), Closed, ChecksumMismatch (naming the bucket), InvalidState (the publisher abandoned the version,
        or evicted this reader), InvalidArgument (dtype, shape or kind of a tensor). After an error in the middle
        of a version the next call skips what is left of it."""
        if not isinstance(into, Mapping):
            raise InvalidArgument(f"receive takes a mapping of names to tensors, not a {type(into).__name__}")
        deadline, s, sig = self._begin(timeout, stream)
        dsts: Dict[str, Any] = {}
        self.skipped = []
        while True:
            d = self._next_bucket(deadline)
            self._in_version = True
            slot = d.seq % self._head.buckets
            try:
                if d.flags & _D_ABORT:
                    raise InvalidState(f"stream {self.name!r}: the publisher abandoned version {d.version}; the "
                                       "tensors given may hold part of it")
                self._verify(d, slot, s)
                for key, dtype, shape, pos, n, off in d.pieces:
                    if key not in into:
                        if key not in self.skipped:
                            self.skipped.append(key)
                        continue
                    dst = dsts.get(key)
                    if dst is None:
                        dst = dsts[key] = self._destination(key, into[key], dtype, shape)
                    if n:
                        self._copy_out(slot, off, dst, pos, n, s)
            finally:
                self._release(d.seq, sig)
                if d.flags & (_D_LAST | _D_ABORT):
                    self._in_version = False
            if d.flags & _D_LAST:
                self._version = d.version
                return d.version

    def _destination(self, key: str, t: Any, dtype: str, shape: List[int]) -> Any:
        info = describe(t, f"into[{key!r}]")
        if info.dtype.name != dtype or list(info.shape) != list(shape):
            raise InvalidArgument(f"into[{key!r}] is {info.dtype.name}{list(info.shape)}; the publisher sent {dtype}{shape}")
        if not _contiguous(info):
            raise InvalidArgument(f"into[{key!r}] is not contiguous")
        if _is_torch(t):
            if t.is_cuda or self._head.device_staging:
                return ("torch", _torch_bytes(t))
            return ("numpy", _torch_bytes(t).numpy())
        if isinstance(t, np.ndarray) and not self._head.device_staging:
            if not t.flags.writeable:
                raise InvalidArgument(f"into[{key!r}] is read-only")
            return ("numpy", _numpy_bytes(t))
        raise InvalidArgument(
            f"into[{key!r}] is a {type(t).__name__}: receive copies into torch tensors (device staging) or NumPy "
            "arrays and torch tensors (host staging); use receive_iter for other frameworks"
        )

    def _copy_out(self, slot: int, off: int, dst: Tuple[str, Any], pos: int, n: int, s: Any) -> None:
        how, out = dst
        if how == "numpy":
            out[pos : pos + n] = self._host(slot)[off : off + n]
            return
        torch = _torch()
        if self._head.device_staging:
            with torch.cuda.stream(s):
                out[pos : pos + n].copy_(self._stage(slot)[off : off + n], non_blocking=True)
        else:  # host staging into a CUDA tensor: a synchronous copy
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")  # the staging is mapped read-only; torch only reads it
                src = torch.from_numpy(self._host(slot)[off : off + n])
            out[pos : pos + n].copy_(src)

    def receive_iter(self, stream: Any = None, timeout: Optional[float] = None) -> Iterator[StreamItem]:
        """Yields the next version piece by piece, as :class:`StreamItem` ``(name, view)`` over the staging bucket
        (read-only; torch tensors for device staging, NumPy arrays for host staging): copy each before asking for
        the next, on ``stream`` (device staging; None: torch's current stream), since the bucket goes back to the
        publisher when the iterator moves past it. Ends after the version's last bucket (:attr:`version` is then
        that version). Raises what :meth:`receive` raises. Leaving the loop early skips the rest of the version at
        the next call."""
        deadline, s, sig = self._begin(timeout, stream)
        while True:
            d = self._next_bucket(deadline)
            self._in_version = True
            slot = d.seq % self._head.buckets
            try:
                if d.flags & _D_ABORT:
                    raise InvalidState(f"stream {self.name!r}: the publisher abandoned version {d.version}")
                self._verify(d, slot, s)
                for key, dtype, shape, pos, n, off in d.pieces:
                    yield self._item(slot, key, dtype, shape, pos, n, off)
            finally:
                self._release(d.seq, sig)
                if d.flags & (_D_LAST | _D_ABORT):
                    self._in_version = False
            if d.flags & _D_LAST:
                self._version = d.version
                return

    def _item(self, slot: int, key: str, dtype: str, shape: List[int], pos: int, n: int, off: int) -> StreamItem:
        dt = dtype_of(dtype)
        full = tuple(shape)
        count = n // dt.itemsize
        start = pos // dt.itemsize
        dims = full if (start == 0 and count == math.prod(full)) else (count,)
        if n == 0:  # an empty tensor: nothing in the bucket; a fresh empty array of its shape
            if self._head.device_staging:
                torch = _torch()
                view: Any = torch.empty(full, dtype=getattr(torch, dt.name), device=f"cuda:{self._device}")
            else:
                view = np.empty(full, dtype=dt.numpy) if dt.numpy is not None else None
                if view is not None:
                    view.flags.writeable = False  # like every other view of a bucket
            return StreamItem(key, view, start, 0, full, dtype)
        typed = make_array(self._views[slot], dt, dims, off)
        if self._head.device_staging:
            typed = _torch().from_dlpack(typed.__dlpack__())
        return StreamItem(key, typed, start, count, full, dtype)

    def close(self) -> None:
        """Leaves (idempotent): frees this reader's slot (the publisher stops waiting for it at once)."""
        if self._closed:
            return
        self._closed = True
        self._stage_torch = []
        self._stage_np = []
        self._views = []
        for sem in (self._slot_sem, self._filled):
            if sem is not None:
                sem.close()
        if self._pool is not None:
            self._pool.close()
        self._seg.close()

    def __enter__(self) -> "StreamReader":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"<gpuipc.StreamReader {self.name!r} slot={getattr(self, '_slot', None)} version={getattr(self, '_version', 0)}>"


def stream_reader(name: str, *, device: Optional[int] = None, wait: Optional[float] = None) -> StreamReader:
    """Joins stream ``name`` as a reader: maps its staging buckets once and claims a reader slot. The reader is
    admitted at the publisher's next version (:meth:`StreamPublisher.start`); a :meth:`StreamReader.receive`
    before that waits for it. wait: seconds to wait for the stream to be created, and for a free slot. device: the
    GPU that maps device staging (None: the publisher's). Raises NotFound, Timeout, QuotaExceeded (every slot is
    taken), PeerDied (the stream's pool is gone), PermissionDenied."""
    return StreamReader(name, device=device, wait=wait)


def unlink_stream(name: str) -> None:
    """Removes the names of stream ``name`` (NAME, NAME.pool, NAME.filled, NAME.reader.*) after its publisher died
    without closing. Raises NotFound when none exists."""
    found = False
    for unlink, n in ((Segment.unlink, name), (Pool.unlink, name + ".pool"), (Semaphore.unlink, name + ".filled"),
                      *((Semaphore.unlink, _slot_name(name, i)) for i in range(_MAX_READERS))):
        try:
            unlink(n)
            found = True
        except NotFound:
            pass
    if not found:
        raise NotFound(f"no stream named {name!r}")
