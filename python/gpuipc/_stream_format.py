"""The control block of a stream (streaming.py) and the helpers its publisher and readers share. The format is
described in streaming.py's docstring."""

from __future__ import annotations

import json
import math
import struct
import sys
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Tuple

import numpy as np

from ._dtypes import dtype_of
from ._streams import stream_handle
from ._tensorinfo import TensorInfo
from .errors import (
    Closed,
    InvalidArgument,
    PeerDied,
    ProtocolError,
    Unsupported,
)
from .pool import BlockRef
from .semaphore import Semaphore


MAGIC = b"GPUIPCSB"
#: 2: descriptors carry reference pieces and a table of blocks (1: staged pieces only, a JSON list).
FORMAT = 2
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
_MASK64 = (1 << 64) - 1  #: checksums are sums of bytes modulo 2**64
_MAX_READERS = 64


def _align(n: int, a: int) -> int:
    return (n + a - 1) // a * a


def _admit_offset(buckets: int) -> int:
    return _align(64 + _REF_BYTES * buckets, 64)


def _desc_offset(buckets: int, readers: int) -> int:
    return _align(_admit_offset(buckets) + 8 * readers, 64)


def _control_bytes(buckets: int, readers: int) -> int:
    return _desc_offset(buckets, readers) + buckets * DESC_BYTES


def _join_name(name: str) -> str:
    """NAME.joins: raised by a reader once it has claimed a slot, so the publisher looks at the free slots only then."""
    return name + ".joins"


def _join_mode(mode: int) -> int:
    """NAME.joins's mode: who may read the stream may raise it (a raise only makes the publisher look at its slots)."""
    return mode | ((mode & 0o444) >> 1)


def _signal_mode(mode: int) -> int:
    """A timeline's mode (NAME.version, NAME.filled, a reader's slot): only its owner signals it, everyone who may
    read the object waits on it. With the object's own mode (0o660 for readers that record holds in its pool), any
    reader opened it as a signaller: it could announce versions or buckets never published, and, holding it open,
    keep the broker from poisoning it when the publisher died (the last signaller had not gone)."""
    return mode & ~0o022


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


#: A piece of at least this many bytes is copied on its own (Tensor.copy_: one cudaMemcpyAsync, about 1.5 TB/s on an
#: H100 but about 9 us to enqueue from Python); smaller ones together (_Copies).
_MEMCPY_BYTES = 32 << 20


class _Copies:
    """``dsts[i].copy_(srcs[i])`` for every i (uint8 torch views of equal length), laid out once and run any number of
    times. torch's _foreach_copy_ copies a uint8 list with 4-byte loads and 64 KiB a block: 830 GB/s for the 16 GiB
    bench dict on an H100, against 1110 GB/s for the same bytes as int64 views and 1490 GB/s for one large
    cudaMemcpyAsync (bench/results/experiments/copy-methods-8d7b371-h100-*). So the 8-byte-aligned bulk of each piece
    goes in one _foreach_copy_ as int64, what is left (odd ends, unaligned pieces) in one as uint8, and pieces of at
    least _MEMCPY_BYTES as one copy each. A torch without _foreach_copy_ copies each piece."""

    __slots__ = ("single", "lists")

    def __init__(self, torch: Any, dsts: List[Any], srcs: List[Any]) -> None:
        self.single: List[Tuple[Any, Any]] = []
        wide: Tuple[List[Any], List[Any]] = ([], [])
        narrow: Tuple[List[Any], List[Any]] = ([], [])
        foreach = hasattr(torch, "_foreach_copy_")
        for d, s in zip(dsts, srcs):
            n = d.numel()
            if n >= _MEMCPY_BYTES or not foreach:
                self.single.append((d, s))
                continue
            # view(int64) needs the storage offset, as well as the address, to be a multiple of 8
            k = n - n % 8 if (d.data_ptr() | s.data_ptr() | d.storage_offset() | s.storage_offset()) % 8 == 0 else 0
            if k:
                wide[0].append(d[:k].view(torch.int64))
                wide[1].append(s[:k].view(torch.int64))
            if k < n:
                narrow[0].append(d[k:])
                narrow[1].append(s[k:])
        self.lists = [x for x in (wide, narrow) if x[0]]

    def __bool__(self) -> bool:
        return bool(self.single or self.lists)

    def run(self, torch: Any, non_blocking: bool) -> None:
        """Enqueues the copies on torch's current stream."""
        for d, s in self.single:
            d.copy_(s, non_blocking=non_blocking)
        for ds, ss in self.lists:
            torch._foreach_copy_(ds, ss, non_blocking=non_blocking)


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
        raise InvalidArgument(
            f"stream {name!r} has format {fmt}; this gpuipc reads format {FORMAT} only (format 1 is bucketed "
            "streaming before reference pieces): run the same gpuipc version in the publisher and its readers"
        )
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
    blocks: List[List[str]]  #: [pool name, BlockRef in hex] of each reference piece's block
    staged: bool = False  #: some piece has bytes in the staging slot (read from the pieces, not from `used`)


#: Fields of a staged piece and of a reference piece (which adds the index of its block in the descriptor's table).
_STAGED, _REFERENCE = 6, 7
#: The JSON of a descriptor with no pieces; _body writes it with them.
_EMPTY_BODY = b'{"pieces":[],"blocks":[]}'


def _body(pieces: List[List[Any]], blocks: List[List[str]]) -> bytes:
    return json.dumps({"pieces": pieces, "blocks": blocks}, separators=(",", ":")).encode()


def _desc_view(mem: np.ndarray, buckets: int, readers: int, slot: int) -> np.ndarray:
    start = _desc_offset(buckets, readers) + slot * DESC_BYTES
    return mem[start : start + DESC_BYTES]


def _is_count(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and v >= 0


def _check_pieces(pieces: List[Any], blocks: List[Any], bucket_bytes: int) -> None:
    """ProtocolError unless every piece's bytes lie inside its tensor and inside its source: the staging bucket
    (``bucket_bytes``), or the block its table names (a BlockRef's size, bytes 24-31). A reader never trusts what a
    publisher wrote: a range past its source would copy less than it says, or broadcast one byte over a tensor."""
    sizes = []
    if not isinstance(blocks, list):
        raise ProtocolError("a bucket descriptor's table of blocks is no list")
    for entry in blocks:
        # [pool name, the block's 40-byte BlockRef in hex]
        if not (isinstance(entry, list) and len(entry) == 2 and isinstance(entry[0], str)
                and isinstance(entry[1], str) and len(entry[1]) == 80):
            raise ProtocolError("a bucket descriptor's table of blocks holds something that is no block")
        try:
            sizes.append(struct.unpack_from("<Q", bytes.fromhex(entry[1]), 24)[0])
        except ValueError:
            raise ProtocolError("a bucket descriptor's table of blocks holds something that is no block") from None
    for p in pieces:
        key, dtype, shape, pos, n, off = p[:_STAGED]
        try:
            item = dtype_of(dtype).itemsize
            total = math.prod(shape) * item
        except (TypeError, ValueError):
            raise ProtocolError(f"a bucket descriptor's piece {key!r} has no valid dtype and shape") from None
        if not (isinstance(key, str) and all(_is_count(x) for x in (*shape, pos, n, off)) and pos + n <= total):
            raise ProtocolError(f"a bucket descriptor's piece {key!r} lies outside its tensor")
        if pos % item or n % item:  # tensors are split on element boundaries
            raise ProtocolError(f"a bucket descriptor's piece {key!r} splits an element")
        if n == 0 and total != 0:  # (only an empty tensor is sent as a piece of no bytes)
            raise ProtocolError(f"a bucket descriptor's piece {key!r} has elements and no bytes")
        if len(p) == _STAGED:
            limit = bucket_bytes
        elif isinstance(p[6], int) and not isinstance(p[6], bool) and 0 <= p[6] < len(sizes):
            limit = sizes[p[6]]
        else:
            raise ProtocolError(f"a bucket descriptor's piece {key!r} names a block not in its table")
        if off + n > limit:
            raise ProtocolError(f"a bucket descriptor's piece {key!r} lies outside its source")


def _read_desc(mem: np.ndarray, buckets: int, readers: int, slot: int, layouts: Optional[Dict[bytes, Any]] = None,
               bucket_bytes: Optional[int] = None) -> _Desc:
    """The descriptor in ring slot ``slot``. ``layouts`` (body bytes to pieces) spares decoding a layout seen
    before: a publisher that sends the same tensors every version sends the same bodies. With ``bucket_bytes``
    (what readers pass), every piece is checked against its tensor and its source (_check_pieces)."""
    d = _desc_view(mem, buckets, readers, slot)
    seq, version, index, flags, used, checksum, jlen, _ = _DESC.unpack(bytes(d[: _DESC.size]))
    if jlen > DESC_BYTES - _DESC.size:
        raise ProtocolError(f"a bucket descriptor claims {jlen} bytes of layout")
    body = bytes(d[_DESC.size : _DESC.size + jlen])
    layout = layouts.get(body) if layouts is not None else None
    if layout is None:
        try:
            doc = json.loads(body.decode()) if jlen else {"pieces": [], "blocks": []}
            pieces, blocks = doc["pieces"], doc["blocks"]
        except (ValueError, TypeError, KeyError, RecursionError):
            raise ProtocolError(f"a bucket descriptor's layout is not format {FORMAT} JSON") from None
        shapes = (_STAGED, _REFERENCE)
        if not isinstance(pieces, list) or not all(isinstance(p, list) and len(p) in shapes for p in pieces):
            raise ProtocolError("a bucket descriptor has a piece of neither shape (staged or reference)")
        if bucket_bytes is not None:
            _check_pieces(pieces, blocks, bucket_bytes)
        layout = (pieces, blocks, any(len(p) == _STAGED and p[4] != 0 for p in pieces))
        if layouts is not None:
            if len(layouts) >= 4096:
                layouts.clear()
            layouts[body] = layout
    return _Desc(seq, version, index, flags, used, checksum, *layout)


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
    json_len: int = len(_EMPTY_BODY)
    # the table of blocks its reference pieces name: [pool name, ref hex], and each one's index in it
    blocks: List[List[str]] = field(default_factory=list)
    block_index: Dict[Tuple[str, str], int] = field(default_factory=dict)
    referenced: int = 0  #: bytes its reference pieces name (it is sent early past the publisher's bound)
    # checksum: the bytes of its reference pieces (NumPy arrays or torch tensors), summed when it is published
    ref_bytes: List[Any] = field(default_factory=list)
    # torch copies into the bucket not yet enqueued (destinations, sources): run together when it is published
    dsts: List[Any] = field(default_factory=list)
    srcs: List[Any] = field(default_factory=list)


@dataclass
class _Ref:
    """Where a tensor sent by reference lies: its block's pool name and BlockRef (hex of the 40 bytes), and the byte
    offset of its first byte in the block."""

    pool: str
    hex: str
    offset: int
    block: Any  #: the publisher's Block (or gpuipc.torch.MemPool block): the checksum reads the bytes through it
    entry_len: int = 0  #: the length of its entry in a descriptor's table of blocks
    key: Tuple[str, str] = ("", "")  #: (pool, hex): its block's entry in a bucket's table
    entry: List[str] = field(default_factory=list)  #: [pool, hex], that entry (shared by the tables, never changed)

    def __post_init__(self) -> None:
        self.entry = [self.pool, self.hex]
        self.entry_len = len(json.dumps(self.entry, separators=(",", ":")))
        self.key = (self.pool, self.hex)
