"""The array header: how :meth:`Channel.send` describes an array (dtype, shape, size, user metadata) at offset 0 of
a message's inline header, and how :attr:`Message.array` reads it back.

The layout is defined once, in C++ (``include/gpuipc/array_header.hpp``, where a C++ consumer decodes what Python
sends); this module reads it from the extension (``_gpuipc.array_header_layout``) rather than declaring it again.
Little-endian: a fixed part (magic ``GPYA``, version, ndim, flags, DLPack type code, bits, lanes, meta_len, nbytes),
then the shape (int64 each, C order), then ``meta_len`` bytes of metadata.
"""

from __future__ import annotations

import functools
import struct
from dataclasses import dataclass
from typing import Optional, Tuple

from . import _gpuipc
from ._dtypes import DType, dtype_of, from_dlpack
from .errors import InvalidArgument

_LAYOUT = _gpuipc.array_header_layout
ARRAY_HEADER_MAGIC: bytes = _LAYOUT["magic"]
_HEADER = struct.Struct(_LAYOUT["format"])
assert _HEADER.size == _LAYOUT["fixed_bytes"], "the extension's array header layout does not match its format"
_VERSION: int = _LAYOUT["version"]
_FLAG_ABORTED: int = _LAYOUT["flag_aborted"]
_MAX_NDIM: int = _LAYOUT["max_ndim"]


def header_bytes_needed(ndim: int, meta_len: int) -> int:
    """The header bytes an array of ``ndim`` dimensions with ``meta_len`` bytes of metadata takes."""
    return _HEADER.size + 8 * ndim + meta_len


def pack_header(dt: DType, shape: Tuple[int, ...], nbytes: int, meta: bytes) -> bytes:
    """The header describing an array of ``dt`` and ``shape`` (``nbytes`` of payload) with ``meta``."""
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


#: The header of a message its producer gave up while filling it (consumers' ``recv`` skips it).
ABORTED_HEADER = _HEADER.pack(ARRAY_HEADER_MAGIC, _VERSION, 0, _FLAG_ABORTED, 1, 8, 1, 0, 0)


@dataclass(frozen=True)
class ArrayInfo:
    """A decoded array header."""

    dtype: DType
    shape: Tuple[int, ...]
    nbytes: int
    meta: bytes
    aborted: bool


@functools.lru_cache(maxsize=1024)
def unpack_header(header: bytes) -> Optional[ArrayInfo]:
    """The array ``header`` describes; None when it is not an array header of this version (or is cut short)."""
    if len(header) < _HEADER.size or header[:4] != ARRAY_HEADER_MAGIC:
        return None
    _, version, ndim, flags, code, bits, lanes, meta_len, nbytes = _HEADER.unpack_from(header)
    if version != _VERSION or len(header) < header_bytes_needed(ndim, meta_len):
        return None
    if flags & _FLAG_ABORTED:
        return ArrayInfo(dtype_of("uint8"), (0,), 0, b"", True)
    shape = struct.unpack_from(f"<{ndim}q", header, _HEADER.size)
    start = _HEADER.size + 8 * ndim
    meta = bytes(header[start : start + meta_len])
    return ArrayInfo(from_dlpack(code, bits, lanes), tuple(shape), nbytes, meta, False)
