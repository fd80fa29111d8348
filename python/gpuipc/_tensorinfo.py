"""Where an array of any framework lives: address, device, element type, shape and strides, read from the array
itself (torch, NumPy, DLPack, ``__cuda_array_interface__``) without importing any framework."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional, Tuple

import numpy as np

from . import _gpuipc
from ._dtypes import DType, dtype_of, from_dlpack
from .errors import InvalidArgument, Unsupported

# DLPack device types.
DL_CPU, DL_CUDA, DL_CUDA_HOST, DL_CUDA_MANAGED = 1, 2, 3, 13


@dataclass(frozen=True)
class TensorInfo:
    """One array, as share_tensors and share see it."""

    address: int  #: of the first element (host or device address)
    device_type: int  #: DLPack device type (1 host, 2 CUDA, 3 pinned host, 13 managed)
    device_id: int
    dtype: DType
    shape: Tuple[int, ...]
    strides: Tuple[int, ...]  #: in elements, all >= 0
    framework: str  #: "torch", "numpy" or "dlpack" (what open_tensors gives back)
    storage: Optional[Tuple[int, int]] = None  #: torch: the bytes of the tensor's storage [start, end)

    @property
    def is_cuda(self) -> bool:
        return self.device_type in (DL_CUDA, DL_CUDA_MANAGED)

    @property
    def empty(self) -> bool:
        return any(s == 0 for s in self.shape)

    @property
    def extent(self) -> int:
        """Bytes from the first element to the end of the last one (0 for an empty array)."""
        if self.empty:
            return 0
        return (sum((n - 1) * s for n, s in zip(self.shape, self.strides)) + 1) * self.dtype.itemsize


def _contiguous_strides(shape: Tuple[int, ...]) -> Tuple[int, ...]:
    out, step = [], 1
    for n in reversed(shape):
        out.append(step)
        step *= max(n, 1)
    return tuple(reversed(out))


def _element_strides(what: str, byte_strides: Optional[Tuple[int, ...]], shape: Tuple[int, ...], item: int) -> Tuple[int, ...]:
    if byte_strides is None:
        return _contiguous_strides(shape)
    out = []
    for n, s in zip(shape, byte_strides):
        if n <= 1:
            out.append(0 if s < 0 else s // item if s % item == 0 else 0)
            continue
        if s < 0:
            raise InvalidArgument(f"{what} has a negative stride: gpuipc keeps strides >= 0; pass a copy (.copy())")
        if s % item != 0:
            raise InvalidArgument(f"{what} has a stride of {s} bytes, not a multiple of its {item}-byte elements; pass a copy")
        out.append(s // item)
    return tuple(out)


def _dtype(what: str, spec: Any) -> DType:
    try:
        return dtype_of(spec)
    except TypeError as e:
        raise Unsupported(f"{what}: unsupported element type ({e}); convert it to a number or bool type") from None


def _from_torch(what: str, t: Any) -> TensorInfo:
    dev = t.device
    if dev.type == "cuda":
        dtype, did = DL_CUDA, dev.index if dev.index is not None else 0
    elif dev.type == "cpu":
        dtype, did = DL_CPU, 0
    else:
        raise Unsupported(f"{what} lives on {dev}: gpuipc shares CPU and CUDA tensors")
    dt = _dtype(what, t.dtype)
    if t.is_conj() or t.is_neg():  # torch's lazy conjugation/negation: the bytes in memory are not the values
        raise InvalidArgument(f"{what} is a lazily conjugated or negated view (t.is_conj() or t.is_neg()): its bytes "
                              "are not its values; pass t.resolve_conj().resolve_neg()")
    strides = tuple(int(s) for s in t.stride())
    if any(s < 0 for s in strides):
        raise InvalidArgument(f"{what} has a negative stride; pass t.contiguous()")
    st = t.untyped_storage()
    start = int(st.data_ptr())
    return TensorInfo(int(t.data_ptr()), dtype, did, dt, tuple(int(n) for n in t.shape), strides, "torch",
                      (start, start + int(st.nbytes())))


def _from_numpy(what: str, a: np.ndarray) -> TensorInfo:
    dt = _dtype(what, a.dtype)
    shape = tuple(int(n) for n in a.shape)
    strides = _element_strides(what, tuple(int(s) for s in a.strides), shape, a.dtype.itemsize)
    return TensorInfo(int(a.__array_interface__["data"][0]), DL_CPU, 0, dt, shape, strides, "numpy")


def _from_dlpack(what: str, obj: Any) -> TensorInfo:
    try:
        capsule = obj.__dlpack__(max_version=(1, 0))
    except TypeError:
        capsule = obj.__dlpack__()
    address, dev_type, dev_id, (code, bits, lanes), shape, strides, _ = _gpuipc._dlpack_info(capsule)
    del capsule  # unconsumed: its deleter runs; `obj` keeps the memory
    try:
        dt = from_dlpack(code, bits, lanes)
    except TypeError as e:
        raise Unsupported(f"{what}: unsupported element type ({e})") from None
    shape = tuple(shape)
    el = _contiguous_strides(shape) if strides is None else tuple(strides)
    if any(s < 0 for n, s in zip(shape, el) if n > 1):
        raise InvalidArgument(f"{what} has a negative stride; pass a contiguous copy")
    return TensorInfo(address, dev_type, dev_id, dt, shape, tuple(max(s, 0) for s in el), "dlpack")


def _from_cai(what: str, obj: Any) -> TensorInfo:
    cai = obj.__cuda_array_interface__
    dt = _dtype(what, np.dtype(cai["typestr"]))
    shape = tuple(int(n) for n in cai["shape"])
    strides = cai.get("strides")
    el = _element_strides(what, None if strides is None else tuple(int(s) for s in strides), shape, dt.itemsize)
    return TensorInfo(int(cai["data"][0]), DL_CUDA, 0, dt, shape, el, "dlpack")


def describe(obj: Any, what: str = "the array") -> TensorInfo:
    """A TensorInfo for a torch tensor, NumPy array, anything with ``__dlpack__`` or ``__cuda_array_interface__``.
    Raises InvalidArgument (negative or unaligned strides, a lazily conjugated or negated torch view), Unsupported (element types, devices), TypeError (not an
    array)."""
    if type(obj).__module__.startswith("torch") and hasattr(obj, "untyped_storage"):
        return _from_torch(what, obj)
    if isinstance(obj, np.ndarray):
        return _from_numpy(what, obj)
    if hasattr(obj, "__dlpack__") and hasattr(obj, "__dlpack_device__"):
        return _from_dlpack(what, obj)
    if hasattr(obj, "__cuda_array_interface__"):
        return _from_cai(what, obj)
    raise TypeError(
        f"{what} is a {type(obj).__name__}: pass a NumPy array, a torch tensor or an object with __dlpack__ or "
        "__cuda_array_interface__"
    )
