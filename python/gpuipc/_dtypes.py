"""Element types: what ``as_array`` and ``Channel.send`` accept, and their DLPack / array-interface spellings.

A dtype may be anything ``numpy.dtype`` accepts (``"float32"``, ``np.int8``, ``jnp.bfloat16`` through ml_dtypes),
a torch dtype (``torch.float16``) or a name such as ``"bfloat16"``.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any, Optional, Tuple

import numpy as np

# DLPack DLDataTypeCode values.
DL_INT, DL_UINT, DL_FLOAT, DL_BFLOAT, DL_COMPLEX, DL_BOOL = 0, 1, 2, 4, 5, 6

_NUMPY_KIND_TO_DL = {"i": DL_INT, "u": DL_UINT, "f": DL_FLOAT, "c": DL_COMPLEX, "b": DL_BOOL}
_DL_TO_NUMPY_KIND = {v: k for k, v in _NUMPY_KIND_TO_DL.items()}


@dataclass(frozen=True)
class DType:
    """One element type in every spelling gpuipc needs."""

    name: str  #: e.g. "float32", "bfloat16"
    code: int  #: DLPack type code
    bits: int
    lanes: int
    typestr: str  #: __cuda_array_interface__ / __array_interface__ type string, e.g. "<f4"
    numpy: Optional[np.dtype]  #: None where NumPy has no such type (bfloat16 without ml_dtypes)

    @property
    def itemsize(self) -> int:
        return (self.bits * self.lanes + 7) // 8

    @property
    def dlpack(self) -> Tuple[int, int, int]:
        return (self.code, self.bits, self.lanes)


def _bfloat16() -> DType:
    try:
        import ml_dtypes  # type: ignore[import-not-found]

        npdt: Optional[np.dtype] = np.dtype(ml_dtypes.bfloat16)
    except ImportError:
        npdt = None
    return DType("bfloat16", DL_BFLOAT, 16, 1, "<V2", npdt)


def _from_numpy(dt: np.dtype) -> DType:
    if dt.name == "bfloat16":
        return _bfloat16()
    code = _NUMPY_KIND_TO_DL.get(dt.kind)
    if code is None or dt.subdtype is not None or dt.fields is not None:
        raise TypeError(f"gpuipc arrays hold numbers and bools, not {dt!r}")
    if not dt.isnative and dt.itemsize > 1:
        raise TypeError(f"gpuipc arrays hold native byte order; convert {dt!r} with .astype(dt.newbyteorder('='))")
    return DType(dt.name, code, dt.itemsize * 8, 1, dt.str, dt)


_CACHE: dict = {}  # spelling -> DType (send and as_array look types up on every call)


def dtype_of(spec: Any) -> DType:
    """The DType for a dtype spelling (see the module docstring). TypeError for what is not one."""
    if isinstance(spec, DType):
        return spec
    try:
        return _CACHE[spec]
    except (KeyError, TypeError):  # not seen yet, or not hashable
        pass
    dt = _dtype_of(spec)
    try:
        if len(_CACHE) < 1024:
            _CACHE[spec] = dt
    except TypeError:
        pass
    return dt


def _dtype_of(spec: Any) -> DType:
    if isinstance(spec, str) and spec == "bfloat16":
        return _bfloat16()
    mod = type(spec).__module__
    if mod.startswith("torch"):  # torch.dtype: "torch.float32" -> "float32"
        name = str(spec).rsplit(".", 1)[-1]
        if name == "bfloat16":
            return _bfloat16()
        spec = name
    try:
        return _from_numpy(np.dtype(spec))
    except (TypeError, ValueError, SyntaxError) as e:  # np.dtype("i4,(") raises SyntaxError
        raise TypeError(f"not an element type gpuipc understands: {spec!r} ({e})") from None


@functools.lru_cache(maxsize=256)
def from_dlpack(code: int, bits: int, lanes: int) -> DType:
    """The DType of a DLPack (code, bits, lanes)."""
    if code == DL_BFLOAT and bits == 16 and lanes == 1:
        return _bfloat16()
    kind = _DL_TO_NUMPY_KIND.get(code)
    missing = TypeError(f"DLPack type (code={code}, bits={bits}, lanes={lanes}) has no NumPy equivalent")
    if kind is None or lanes != 1 or bits % 8 != 0:
        raise missing
    try:
        dt = np.dtype(f"{kind}{bits // 8}" if kind != "b" else "?")
    except TypeError:  # a width NumPy lacks (8-bit floats)
        raise missing from None
    return _from_numpy(dt)


_BFLOAT16_LAYOUT = ((DL_BFLOAT, 16, 1), "<V2")


@functools.lru_cache(maxsize=64)
def dlpack_of_name(name: str) -> Optional[Tuple[Tuple[int, int, int], str]]:
    """((code, bits, lanes), typestr) of a dtype name such as torch records it ("bfloat16", "float32"), without
    importing ml_dtypes for bfloat16 (7 ms); None for a name NumPy does not know (float8 types, ...)."""
    if name == "bfloat16":
        return _BFLOAT16_LAYOUT
    try:
        dt = _from_numpy(np.dtype(name))
    except (TypeError, ValueError, SyntaxError):  # names from shared memory: np.dtype("i4,(") raises SyntaxError
        return None
    return dt.dlpack, dt.typestr
