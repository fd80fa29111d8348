"""CUDA streams from any framework, as the integer handle (CUstream / cudaStream_t) the C++ library takes."""

from __future__ import annotations

from typing import Any, Dict

#: Stream types whose handle an int attribute gives, by type: the attribute's name. Through ``__cuda_stream__()``
#: (which builds a tuple) stream_handle took 0.77 us for a torch.cuda.Stream on an H100 machine (``send_parts_us`` in
#: bench/results/experiments/python-quick-sendparts-6fabbba-h100-*), asked four times a channel round trip; its
#: ``cuda_stream`` is the same handle, read directly.
_INT_ATTRIBUTE: Dict[type, str] = {}


def stream_handle(stream: Any) -> int:
    """The CUstream of ``stream``; 0 (the legacy default stream) for None.

    Accepts an int handle, an object with the CUDA stream protocol (``__cuda_stream__()`` returning
    ``(version, handle)``: cuda.core, recent CuPy and PyTorch), a ``.cuda_stream`` attribute (torch.cuda.Stream)
    or a ``.ptr`` attribute (cupy.cuda.Stream). TypeError otherwise.
    """
    if stream is None:
        return 0
    if type(stream) is int and stream >= 0:
        return stream
    attr = _INT_ATTRIBUTE.get(type(stream))
    if attr is not None:
        value = getattr(stream, attr, None)
        if type(value) is int and value >= 0:
            return value
    return _stream_handle(stream)


def _stream_handle(stream: Any) -> int:
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
            handle = int(value[1])
            _remember(stream, handle)
            return handle
        raise TypeError(f"{type(stream).__name__}.__cuda_stream__ did not return (version, handle)")
    for attr in ("cuda_stream", "ptr", "handle"):
        value = getattr(stream, attr, None)
        if isinstance(value, int) and not isinstance(value, bool):
            _remember(stream, value)
            return value
    raise TypeError(
        f"not a CUDA stream: {type(stream).__name__} (pass None, an int handle, a torch.cuda.Stream, a "
        "cupy.cuda.Stream or an object with __cuda_stream__)"
    )


def _remember(stream: Any, handle: int) -> None:
    """Remembers which int attribute of ``stream``'s type gives ``handle`` (the first of the attributes above that
    does), so that the next stream of its type is read in one step."""
    if len(_INT_ATTRIBUTE) >= 64 or handle < 0:
        return
    for attr in ("cuda_stream", "ptr", "handle"):
        value = getattr(stream, attr, None)
        if type(value) is int and value == handle:
            _INT_ATTRIBUTE[type(stream)] = attr
            return
