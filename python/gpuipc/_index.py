"""The index of a set of shared tensors (share_tensors, publish_tensors): the one host segment NAME that an opener
reads. Its format is defined here and only here (docs/torch.md describes it).

Layout, little-endian::

    0   8 bytes  magic b"GPUIPCTS"
    8   u32      FORMAT (1)
    12  u32      json_bytes
    16  u32      slots: 1 (share_tensors, publish_tensors(versions=1)) or 2 (versions=2)
    20  u32      storages: number of storages
    24  u64      slot_offset: where slot 0 starts (a multiple of 64)
    32  json_bytes of UTF-8 JSON: {"format": 1, "tensors": [...], "storages": [...], "versioning": null | {...}}
    slot_offset + k * slot_bytes(storages): slot k:
        u64 stamp: the version whose refs the slot holds; 0 while the publisher rewrites it
        u64 reserved (0)
        storages x 40 bytes: the BlockRef of each storage (gpuipc::encode_block_ref)

A tensor: {"name", "dtype" (e.g. "float32", "bfloat16"), "shape", "strides" (elements), "offset" (elements into
its storage), "storage" (index; -1 for an empty tensor), "framework" ("numpy", "torch", "dlpack")}. A storage:
{"pool": pool name, "nbytes", "device": "cpu" | "cuda"}. Versioning: {"semaphore": name, "versions": 1 | 2}.
A reader of version v uses slot v % slots; it checks the stamp before and after reading the refs (a seqlock).
"""

from __future__ import annotations

import json
import struct
from dataclasses import dataclass
from typing import Any, Dict, List, Optional

import numpy as np

from .errors import InvalidArgument
from .pool import BlockRef

MAGIC = b"GPUIPCTS"
FORMAT = 1
_HEADER = struct.Struct("<8sIIIIQ")
_REF_BYTES = 40
_SLOT_HEADER = 16


def slot_bytes(storages: int) -> int:
    """Bytes of one slot, rounded up to 64."""
    return (_SLOT_HEADER + storages * _REF_BYTES + 63) // 64 * 64


@dataclass
class Index:
    """A decoded index."""

    tensors: List[Dict[str, Any]]
    storages: List[Dict[str, Any]]
    versioning: Optional[Dict[str, Any]]
    slots: int
    slot_offset: int

    def encode(self) -> bytes:
        """Header and JSON (slots follow at slot_offset; the caller writes them)."""
        body = json.dumps(
            {"format": FORMAT, "tensors": self.tensors, "storages": self.storages, "versioning": self.versioning},
            separators=(",", ":"),
        ).encode()
        self.slot_offset = (_HEADER.size + len(body) + 63) // 64 * 64
        head = _HEADER.pack(MAGIC, FORMAT, len(body), self.slots, len(self.storages), self.slot_offset)
        return head + body

    @property
    def total_bytes(self) -> int:
        return self.slot_offset + self.slots * slot_bytes(len(self.storages))


def decode(name: str, mem: np.ndarray) -> Index:
    """Decodes the index in ``mem`` (uint8). Raises InvalidArgument when it is not one or not this format."""
    if mem.nbytes < _HEADER.size or bytes(mem[:8]) != MAGIC:
        raise InvalidArgument(f"segment {name!r} is not a gpuipc tensor index (made by share_tensors)")
    magic, fmt, json_bytes, slots, storages, slot_offset = _HEADER.unpack(bytes(mem[: _HEADER.size]))
    if fmt != FORMAT:
        raise InvalidArgument(f"tensor index {name!r} has format {fmt}; this gpuipc reads format {FORMAT}: upgrade")
    end = _HEADER.size + json_bytes
    if slots not in (1, 2) or end > slot_offset or slot_offset + slots * slot_bytes(storages) > mem.nbytes:
        raise InvalidArgument(f"tensor index {name!r} is malformed (sizes out of range)")
    body = json.loads(bytes(mem[_HEADER.size : end]).decode())
    if len(body.get("storages", ())) != storages:
        raise InvalidArgument(f"tensor index {name!r} is malformed (storage count)")
    return Index(body["tensors"], body["storages"], body.get("versioning"), slots, slot_offset)


def _slot(index: Index, mem: np.ndarray, k: int) -> np.ndarray:
    start = index.slot_offset + k * slot_bytes(len(index.storages))
    return mem[start : start + slot_bytes(len(index.storages))]


def read_stamp(index: Index, mem: np.ndarray, k: int) -> int:
    return int(_slot(index, mem, k)[:8].view("<u8")[0])


def read_refs(index: Index, mem: np.ndarray, k: int) -> List[BlockRef]:
    """The refs of slot k, decoded without validation (a stale or torn read fails in hold, and the stamp check)."""
    raw = bytes(_slot(index, mem, k)[_SLOT_HEADER : _SLOT_HEADER + len(index.storages) * _REF_BYTES])
    out = []
    for i in range(len(index.storages)):
        pool, gen, off, size, chunk, idx = struct.unpack_from("<QQQQII", raw, i * _REF_BYTES)
        out.append(BlockRef(pool=pool, chunk=chunk, offset=off, size=size, generation=gen, index=idx))
    return out


def read_refs_raw(index: Index, mem: np.ndarray, k: int) -> bytes:
    """The refs of slot k as they lie (40 bytes each, in storage order), for Pool views_of."""
    return bytes(_slot(index, mem, k)[_SLOT_HEADER : _SLOT_HEADER + len(index.storages) * _REF_BYTES])


def write_slot(index: Index, mem: np.ndarray, k: int, version: int, refs: "List[BlockRef] | bytes") -> None:
    """Rewrites slot k: stamp 0, the refs (BlockRefs, or their 40-byte forms joined), then the stamp ``version``
    (readers check it before and after)."""
    slot = _slot(index, mem, k)
    stamp = slot[:8].view("<u8")
    stamp[0] = 0
    raw = refs if isinstance(refs, bytes) else b"".join(bytes(r) for r in refs)
    slot[_SLOT_HEADER : _SLOT_HEADER + len(raw)] = np.frombuffer(raw, dtype=np.uint8)
    stamp[0] = version
