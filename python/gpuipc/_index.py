"""The index of a set of shared tensors (share_tensors, publish_tensors): the one host segment NAME that an opener
reads. Its format is defined here and only here (docs/torch.md describes it).

Layout, little-endian::

    0   8 bytes  magic b"GPUIPCTS"
    8   u32      FORMAT (2)
    12  u32      json_bytes
    16  u32      slots: 1 (share_tensors, publish_tensors(versions=1)) or 2 (versions=2)
    20  u32      storages: number of storages
    24  u64      slot_offset: where slot 0 starts (a multiple of 64)
    32  json_bytes of UTF-8 JSON (below)
    columns_offset (32 + json_bytes rounded up to 8): the tensor column, then the storage column, as int64 (below)
    slot_offset + k * slot_bytes(storages): slot k:
        u64 stamp: the version whose refs the slot holds; 0 while the publisher rewrites it
        u64 reserved (0)
        storages x 40 bytes: the BlockRef of each storage (gpuipc::encode_block_ref)

The JSON holds the strings; the numbers are two binary columns, so that a reader of a few hundred tensors parses
nothing per tensor in Python (a JSON list of one object per tensor took 0.5-1.2 ms to decode for 291 tensors on an
H200 machine, and the same numbers as JSON lists 0.35 ms)::

    {"format": 2,
     "names": [tensor name, ...],
     "dtypes": [dtype name, ...]        distinct names ("float32", "bfloat16", ...), referred to by position
     "frameworks": [framework, ...]     distinct ("numpy", "torch", "dlpack"), referred to by position
     "pools": [pool name, ...]          distinct, referred to by position
     "tensor_words": n                  int64 words of the tensor column
     "versioning": null | {"semaphore": name, "versions": 1 | 2}}

    tensor column, per tensor: storage (-1: empty), dtype, framework, offset (elements into its storage), ndim,
        shape[ndim], strides[ndim] (elements)
    storage column, per storage: pool, nbytes, offset (bytes from the start of its block), device (0 cpu, 1 cuda)

A storage is a range of one pool block: a whole packed copy (offset 0), or for memory shared by reference the range of
the block that one framework storage (a torch storage) covers, so that several storages can lie in one block.
A reader of version v uses slot v % slots; it checks the stamp before and after reading the refs (a seqlock).
"""

from __future__ import annotations

import json
import struct
from typing import Any, Dict, List, Optional

import numpy as np

from ._dtypes import dlpack_of_name
from .errors import InvalidArgument
from .pool import BlockRef

MAGIC = b"GPUIPCTS"
FORMAT = 2
_HEADER = struct.Struct("<8sIIIIQ")
_REF_BYTES = 40
_SLOT_HEADER = 16


def slot_bytes(storages: int) -> int:
    """Bytes of one slot, rounded up to 64."""
    return (_SLOT_HEADER + storages * _REF_BYTES + 63) // 64 * 64


_DEVICES = ("cpu", "cuda")


def _words(data: bytes) -> List[int]:
    return np.frombuffer(data, dtype="<i8").tolist()


def _columns_offset(json_bytes: int) -> int:
    return (_HEADER.size + json_bytes + 7) // 8 * 8


class Index:
    """A decoded (or to be encoded) index: the JSON's string columns, the binary columns as they lie (``flat_bytes``
    and ``storage_bytes``, for Pool.tensors_of_index) and as lists (``flat``, ``storage_flat``), and ``tensors`` /
    ``storages`` as one dict per record ({"name", "dtype", "shape", "strides", "offset", "storage", "framework"}
    and {"pool", "nbytes", "offset", "device"}), made and checked on first use."""

    def __init__(self, body: Dict[str, Any], flat_bytes: bytes, storage_bytes: bytes, slots: int, slot_offset: int,
                 name: str = "") -> None:
        self.name = name
        self.body = body
        self.names: List[str] = body["names"]
        self.dtypes: List[str] = body["dtypes"]
        self.frameworks: List[str] = body["frameworks"]
        self.pools: List[str] = body["pools"]
        self.versioning: Optional[Dict[str, Any]] = body.get("versioning")
        self.flat_bytes = flat_bytes
        self.storage_bytes = storage_bytes
        self.slots = slots
        self.slot_offset = slot_offset
        self._flat: Optional[List[int]] = None
        self._storage_flat: Optional[List[int]] = None
        self._tensors: Optional[List[Dict[str, Any]]] = None
        self._storages: Optional[List[Dict[str, Any]]] = None

    @classmethod
    def of(cls, tensors: List[Dict[str, Any]], storages: List[Dict[str, Any]], versioning: Optional[Dict[str, Any]],
           slots: int) -> "Index":
        """The index of these records (as ``tensors`` and ``storages`` give them back)."""
        dtypes: Dict[str, int] = {}
        frameworks: Dict[str, int] = {}
        pools: Dict[str, int] = {}
        flat: List[int] = []
        for t in tensors:
            d = dtypes.setdefault(t["dtype"], len(dtypes))
            f = frameworks.setdefault(t["framework"], len(frameworks))
            flat += [t["storage"], d, f, t["offset"], len(t["shape"]), *t["shape"], *t["strides"]]
        sflat: List[int] = []
        for st in storages:
            sflat += [pools.setdefault(st["pool"], len(pools)), st["nbytes"], st.get("offset", 0), _DEVICES.index(st["device"])]
        body = {"format": FORMAT, "names": [t["name"] for t in tensors], "dtypes": list(dtypes),
                "frameworks": list(frameworks), "pools": list(pools), "tensor_words": len(flat), "versioning": versioning}
        as_bytes = lambda xs: np.asarray(xs, dtype="<i8").tobytes()  # noqa: E731
        return cls(body, as_bytes(flat), as_bytes(sflat), slots, 0)

    @property
    def tensor_count(self) -> int:
        return len(self.names)

    @property
    def storage_count(self) -> int:
        return len(self.storage_bytes) // 32

    @property
    def flat(self) -> List[int]:
        if self._flat is None:
            self._flat = _words(self.flat_bytes)
        return self._flat

    @property
    def storage_flat(self) -> List[int]:
        if self._storage_flat is None:
            self._storage_flat = _words(self.storage_bytes)
        return self._storage_flat

    @property
    def tensors(self) -> List[Dict[str, Any]]:
        """One dict per tensor, checked (InvalidArgument for a malformed record)."""
        if self._tensors is None:
            out, flat, k, n = [], self.flat, 0, self.storage_count
            for d in self.dtypes:  # (dlpack_of_name: no ml_dtypes import for bfloat16, 7 ms)
                if dlpack_of_name(d) is None:
                    raise _malformed(self.name, f"dtype {d!r}")
            for i, name in enumerate(self.names):
                rec = flat[k : k + 5]
                if len(rec) < 5:
                    raise _malformed(self.name, "tensor records")
                s, d, f, off, nd = rec
                shape, strides = flat[k + 5 : k + 5 + nd], flat[k + 5 + nd : k + 5 + 2 * nd]
                if not (-1 <= s < n and 0 <= d < len(self.dtypes) and 0 <= f < len(self.frameworks) and off >= 0
                        and 0 <= nd <= 64 and len(strides) == nd and min(shape + strides, default=0) >= 0):
                    raise _malformed(self.name, f"tensor {i}")
                if s < 0 and 0 not in shape:  # an empty record is made as a fresh array of its shape
                    raise _malformed(self.name, f"tensor {i} has elements and no storage")
                # (Where its elements lie is checked where views are made, in C++: strided_span.)
                out.append({"name": name, "dtype": self.dtypes[d], "shape": shape, "strides": strides, "offset": off,
                            "storage": s, "framework": self.frameworks[f]})
                k += 5 + 2 * nd
            if k != len(flat):
                raise _malformed(self.name, "tensor records")
            self._tensors = out
        return self._tensors

    @property
    def storages(self) -> List[Dict[str, Any]]:
        """One dict per storage, checked (InvalidArgument for a malformed record)."""
        if self._storages is None:
            f, out = self.storage_flat, []
            for i in range(0, len(f), 4):
                p, nbytes, off, dev = f[i : i + 4]
                if not (0 <= p < len(self.pools) and nbytes >= 0 and off >= 0 and dev in (0, 1)):
                    raise _malformed(self.name, f"storage {i // 4}")
                out.append({"pool": self.pools[p], "nbytes": nbytes, "offset": off, "device": _DEVICES[dev]})
            self._storages = out
        return self._storages

    def encode(self) -> bytes:
        """Header, JSON and columns (slots follow at slot_offset; the caller writes them)."""
        body = json.dumps(self.body, separators=(",", ":")).encode()
        start = _columns_offset(len(body))
        self.slot_offset = (start + len(self.flat_bytes) + len(self.storage_bytes) + 63) // 64 * 64
        head = _HEADER.pack(MAGIC, FORMAT, len(body), self.slots, self.storage_count, self.slot_offset)
        return head + body + bytes(start - _HEADER.size - len(body)) + self.flat_bytes + self.storage_bytes

    @property
    def total_bytes(self) -> int:
        return self.slot_offset + self.slots * slot_bytes(self.storage_count)


def _malformed(name: str, why: str) -> InvalidArgument:
    return InvalidArgument(f"tensor index {name!r} is malformed ({why})")


def is_stale(e: Exception) -> bool:
    """Whether an InvalidArgument from building views over an index's refs says that the refs went stale (their
    blocks freed: the pool's ``resolve`` or ``hold`` refused one), not that the index itself is wrong. Read from the
    error's ``call``, which the C++ library sets on every refusal of a BlockRef; any other InvalidArgument (the
    Python checks, tensors_of_index, the strided views) is a malformed index."""
    return getattr(e, "call", "") in ("resolve", "hold")


def decode(name: str, mem: np.ndarray) -> Index:
    """Decodes the index in ``mem`` (uint8). Raises InvalidArgument when it is not one or not this format."""
    if mem.nbytes < _HEADER.size or bytes(mem[:8]) != MAGIC:
        raise InvalidArgument(f"segment {name!r} is not a gpuipc tensor index (made by share_tensors)")
    magic, fmt, json_bytes, slots, storages, slot_offset = _HEADER.unpack(bytes(mem[: _HEADER.size]))
    if fmt != FORMAT:
        raise InvalidArgument(
            f"tensor index {name!r} has format {fmt}; this gpuipc reads format {FORMAT}: publisher and reader need the "
            "same gpuipc version"
        )
    end = _HEADER.size + json_bytes
    if slots not in (1, 2) or end > slot_offset or slot_offset + slots * slot_bytes(storages) > mem.nbytes:
        raise InvalidArgument(f"tensor index {name!r} is malformed (sizes out of range)")
    try:
        body = json.loads(bytes(mem[_HEADER.size : end]))
    except (ValueError, RecursionError) as e:  # (JSON nested thousands deep: RecursionError)
        raise InvalidArgument(f"tensor index {name!r} is malformed ({type(e).__name__}: {e})") from None
    columns = ("names", "dtypes", "frameworks", "pools")
    if not isinstance(body, dict) or any(not isinstance(body.get(k), list) for k in columns):
        raise _malformed(name, "missing columns")
    if any(not set(map(type, body[k])) <= {str} for k in columns):  # (map over C types: ~1 us for 291 names)
        raise _malformed(name, "a name, dtype, framework or pool that is no string")
    if len(set(body["names"])) != len(body["names"]):
        raise _malformed(name, "a tensor name twice")
    v = body.get("versioning")
    if v is None and slots != 1:  # (two slots are versions=2's)
        raise _malformed(name, "two slots and no versioning")
    if v is not None and not (isinstance(v, dict) and isinstance(v.get("semaphore"), str)
                              and v.get("versions") in (1, 2) and type(v.get("versions")) is int
                              and v["versions"] == slots):
        raise _malformed(name, "versioning")
    words = body.get("tensor_words")
    start = _columns_offset(json_bytes)
    if type(words) is not int or words < 0 or start + 8 * (words + 4 * storages) > slot_offset:
        raise _malformed(name, "column sizes")
    mid = start + 8 * words
    return Index(body, bytes(mem[start:mid]), bytes(mem[mid : mid + 32 * storages]), slots, slot_offset, name)


def _slot(index: Index, mem: np.ndarray, k: int) -> np.ndarray:
    start = index.slot_offset + k * slot_bytes(index.storage_count)
    return mem[start : start + slot_bytes(index.storage_count)]


def read_stamp(index: Index, mem: np.ndarray, k: int) -> int:
    return int(_slot(index, mem, k)[:8].view("<u8")[0])


def read_refs(index: Index, mem: np.ndarray, k: int) -> List[BlockRef]:
    """The refs of slot k, decoded without validation (a stale or torn read fails in hold, and the stamp check)."""
    raw = bytes(_slot(index, mem, k)[_SLOT_HEADER : _SLOT_HEADER + index.storage_count * _REF_BYTES])
    out = []
    for i in range(index.storage_count):
        pool, gen, off, size, chunk, idx = struct.unpack_from("<QQQQII", raw, i * _REF_BYTES)
        out.append(BlockRef(pool=pool, chunk=chunk, offset=off, size=size, generation=gen, index=idx))
    return out


def read_refs_raw(index: Index, mem: np.ndarray, k: int) -> bytes:
    """The refs of slot k as they lie (40 bytes each, in storage order), for Pool views_of."""
    return bytes(_slot(index, mem, k)[_SLOT_HEADER : _SLOT_HEADER + index.storage_count * _REF_BYTES])


def write_slot(index: Index, mem: np.ndarray, k: int, version: int, refs: "List[BlockRef] | bytes") -> None:
    """Rewrites slot k: stamp 0, the refs (BlockRefs, or their 40-byte forms joined), then the stamp ``version``
    (readers check it before and after)."""
    slot = _slot(index, mem, k)
    stamp = slot[:8].view("<u8")
    stamp[0] = 0
    raw = refs if isinstance(refs, bytes) else b"".join(bytes(r) for r in refs)
    slot[_SLOT_HEADER : _SLOT_HEADER + len(raw)] = np.frombuffer(raw, dtype=np.uint8)
    stamp[0] = version
