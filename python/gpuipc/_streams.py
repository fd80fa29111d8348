"""CUDA streams from any framework, as the integer handle (CUstream / cudaStream_t) the C++ library takes."""

from __future__ import annotations

from typing import Any


def stream_handle(stream: Any) -> int:
    """The CUstream of ``stream``; 0 (the legacy default stream) for None.

    Accepts an int handle, an object with the CUDA stream protocol (``__cuda_stream__()`` returning
    ``(version, handle)``: cuda.core, recent CuPy and PyTorch), a ``.cuda_stream`` attribute (torch.cuda.Stream)
    or a ``.ptr`` attribute (cupy.cuda.Stream). TypeError otherwise.
    """
    if stream is None:
        return 0
    if isinstance(stream, bool):
        raise TypeError("a stream cannot be a bool")
    if isinstance(stream, int):
        if stream < 0:
            raise ValueError(f"stream handle {stream} is negative")
        return stream
    proto = getattr(stream, "__cuda_stream__", None)
    if proto is not None:
        value = proto() if callable(proto) else proto
        if isinstance(value, tuple) and len(value) == 2:
            return int(value[1])
        raise TypeError(f"{type(stream).__name__}.__cuda_stream__ did not return (version, handle)")
    for attr in ("cuda_stream", "ptr", "handle"):
        value = getattr(stream, attr, None)
        if isinstance(value, int) and not isinstance(value, bool):
            return value
    raise TypeError(
        f"not a CUDA stream: {type(stream).__name__} (pass None, an int handle, a torch.cuda.Stream, a "
        "cupy.cuda.Stream or an object with __cuda_stream__)"
    )
