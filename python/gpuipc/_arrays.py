"""Typed, zero-copy arrays over mapped gpuipc memory (segments and channel slots)."""

from __future__ import annotations

import math
import operator
from typing import Any, Optional, Sequence, Tuple, Union

import numpy as np

from . import _gpuipc
from ._dtypes import DType, dtype_of
from .errors import InvalidArgument

Shape = Union[int, Sequence[int], None]

#: What as_array returns: a NumPy array over host memory, an ArrayView (DLPack + __cuda_array_interface__) over
#: GPU memory.
Array = Union[np.ndarray, _gpuipc.ArrayView]


def _shape(shape: Shape, available: int, dt: DType) -> Tuple[int, ...]:
    if shape is None:
        return (available // dt.itemsize,)
    if isinstance(shape, (int, np.integer)):
        return (int(shape),)
    return tuple(operator.index(s) for s in shape)  # (int() would cut 1.5 to 1: TypeError for what is no integer)


def make_array(view: _gpuipc.ArrayView, dtype: Any, shape: Shape = None, offset: int = 0) -> Array:
    """``shape`` elements of ``dtype`` at byte ``offset`` of ``view``, without a copy.

    Host memory gives a NumPy array (read-only when the memory is); GPU memory gives an ArrayView for
    ``torch.from_dlpack`` / ``cupy.from_dlpack`` / ``cupy.asarray``. The result keeps the mapping alive.
    ``shape=None`` means as many elements as fit after ``offset``.
    """
    dt = dtype_of(dtype)
    offset = operator.index(offset)
    if not 0 <= offset < 1 << 63:
        raise InvalidArgument(f"offset {offset} is out of range")
    dims = _shape(shape, max(view.nbytes - offset, 0), dt)
    typed = view.typed(dt.dlpack, dt.typestr, list(dims), offset)
    if typed.is_cuda or dt.numpy is None:
        return typed  # GPU memory, or a host type NumPy lacks (bfloat16 without ml_dtypes): DLPack only
    count = math.prod(dims)
    return np.frombuffer(typed, dtype=dt.numpy, count=count).reshape(dims)


def as_host_array(array: Any) -> Optional[np.ndarray]:
    """``array`` as a NumPy array when it is host memory NumPy can take without a copy across devices, else None
    (GPU memory, or a DLPack type NumPy lacks such as bfloat16). TypeError for what is no array at all."""
    if isinstance(array, np.ndarray):
        return array
    dev = getattr(array, "__dlpack_device__", None)
    if dev is not None:
        try:
            if dev()[0] != 1:  # not kDLCPU
                return None
            return np.from_dlpack(array)
        except Exception:  # noqa: BLE001 - the caller copies through DLPack and reports what goes wrong there
            return None
    if hasattr(array, "__cuda_array_interface__"):
        return None
    arr = np.asarray(array)
    if arr.dtype == object:
        raise TypeError(f"cannot send a {type(array).__name__}: not an array of numbers")
    return arr
