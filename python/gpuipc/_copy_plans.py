"""Per-framework copy plans for :meth:`Channel.send`: how an array (NumPy, PyTorch, CuPy, ``__cuda_array_interface__``,
DLPack) gets into a slot. Contiguous bytes at a known address become a :class:`Source` that the C++ ``send`` copies
in one call; other arrays are copied by their own framework on the caller's stream.
"""

from __future__ import annotations

from typing import Any, Callable, NamedTuple, Tuple, Union

import numpy as np

from . import _gpuipc
from ._arrays import as_host_array, make_array
from ._dtypes import DType, dtype_of, from_dlpack
from .errors import InvalidArgument

#: (dtype, shape, nbytes, copy(view)): the framework copies into the slot's view.
Plan = Tuple[DType, Tuple[int, ...], int, Callable[[_gpuipc.ArrayView], None]]


class Source(NamedTuple):
    """Contiguous bytes at a known address (host memory, or GPU memory for device channels): the C++ send copies
    them itself, in stream order (cuMemcpyAsync) or with memcpy (host channels)."""

    dtype: DType
    shape: Tuple[int, ...]
    nbytes: int
    address: int
    owner: Any  #: keeps the memory alive until the copy is enqueued


def _framework(array: Any) -> str:
    return type(array).__module__.split(".", 1)[0]


def plan_copy(array: Any, to_gpu: bool, stream: int) -> Union[Source, Plan, None]:
    """How to copy ``array`` into a slot: a Source (the C++ send copies), (dtype, shape, nbytes, copy(view)), or
    None for the DLPack path."""
    fw = _framework(array)
    if fw == "torch":
        return _plan_torch(array, to_gpu, stream)
    if fw == "cupy" and to_gpu:
        return _plan_cupy(array, stream)
    host = as_host_array(array)
    if host is not None:
        return _plan_host(host)
    if hasattr(array, "__dlpack__"):
        return None
    cai = getattr(array, "__cuda_array_interface__", None)
    if cai is not None:
        if not to_gpu:
            raise InvalidArgument(
                f"cannot send a GPU {type(array).__name__} through a host channel: copy it to host memory first"
            )
        return _plan_cai(cai, array)
    raise TypeError(f"cannot send a {type(array).__name__}: not an array (no DLPack, no array interface)")


def _plan_host(arr: np.ndarray) -> Source:
    dt = dtype_of(arr.dtype)
    if not arr.flags.c_contiguous:
        arr = arr.copy(order="C")  # (np.ascontiguousarray would turn a 0-d array into 1-d)
    # To a device channel: cuMemcpyAsync from pageable memory returns once the bytes are staged, so the array may
    # change right after send (from pinned memory the copy reads it when the stream gets there).
    return Source(dt, tuple(arr.shape), arr.nbytes, arr.ctypes.data, arr)


def _plan_torch(t: Any, to_gpu: bool, stream: int) -> Union[Source, Plan]:
    dt = dtype_of(t.dtype)
    shape = tuple(t.shape)
    nbytes = t.numel() * t.element_size()
    where = t.device.type
    if (
        (where == "cuda" and to_gpu or where == "cpu")
        and t.is_contiguous()
        and not t.is_conj()
        and not t.is_neg()  # lazy conjugation/negation: the bytes in memory are not the values
    ):
        return Source(dt, shape, nbytes, t.data_ptr() if nbytes else 0, t)
    import torch  # type: ignore[import-not-found]

    def copy(view: _gpuipc.ArrayView) -> None:
        dst = torch.from_dlpack(make_array(view, dt, shape))
        if to_gpu:
            s = torch.cuda.ExternalStream(stream) if stream else torch.cuda.default_stream(dst.device)
            with torch.cuda.stream(s):
                dst.copy_(t.detach(), non_blocking=True)
        else:
            dst.copy_(t.detach())  # to host memory: torch synchronises a GPU source itself

    return dt, shape, nbytes, copy


def _plan_cupy(a: Any, stream: int) -> Union[Source, Plan]:
    dt = dtype_of(a.dtype)
    shape = tuple(int(s) for s in a.shape)
    if a.flags.c_contiguous:
        return Source(dt, shape, int(a.nbytes), int(a.data.ptr), a)
    import cupy  # type: ignore[import-not-found]

    def copy(view: _gpuipc.ArrayView) -> None:
        s = cupy.cuda.ExternalStream(stream) if stream else cupy.cuda.Stream.null
        with s:
            cupy.copyto(cupy.asarray(make_array(view, dt, shape)), a)

    return dt, shape, int(a.nbytes), copy


def _plan_cai(cai: dict, owner: Any) -> Source:
    dt = dtype_of(np.dtype(cai["typestr"]))
    shape = tuple(int(s) for s in cai["shape"])
    nbytes = int(np.prod(shape, dtype=np.int64)) * dt.itemsize
    strides = cai.get("strides")
    if strides is not None:
        expect = dt.itemsize
        for dim, stride in zip(reversed(shape), reversed(strides)):
            if dim > 1 and stride != expect:
                raise InvalidArgument("cannot send a strided __cuda_array_interface__ array: make it contiguous")
            expect *= dim
    return Source(dt, shape, nbytes, int(cai["data"][0]), owner)


def copy_dlpack(array: Any, view: _gpuipc.ArrayView, stream: int) -> Tuple[DType, Tuple[int, ...], int]:
    dev_type = array.__dlpack_device__()[0]
    if dev_type == 2:  # kDLCUDA: ask the producer to order the data before our stream (1: legacy default)
        capsule = array.__dlpack__(stream=stream or 1)
    else:
        capsule = array.__dlpack__()
    info = _gpuipc._copy_from_dlpack(view, capsule, stream)
    if info is None:
        raise InvalidArgument(f"cannot send a strided {type(array).__name__}: make it contiguous first")
    code, bits, lanes, shape, nbytes = info
    return from_dlpack(code, bits, lanes), tuple(shape), nbytes
