"""PyTorch tensors born shareable: ``gpuipc.torch.MemPool``.

Import it explicitly (``import gpuipc.torch``); the ``gpuipc`` package itself never imports torch.

``MemPool(name, device=0)`` is a :class:`torch.cuda.MemPool` whose memory comes from a gpuipc device Pool named
``name``, through PyTorch's pluggable allocator. Everything allocated under ``torch.cuda.use_mem_pool(pool)``
lives in that pool, so another process can map it with no copy::

    pool = gpuipc.torch.MemPool("weights", device=0, max_bytes=64 << 30)
    with torch.cuda.use_mem_pool(pool):
        model = build().cuda()
    ref, base, pool_name = gpuipc.torch.block_of(model.lm_head.weight)

Limits: one active MemPool per device and process (the allocator's C entry points carry no other context); a
block is at most ``chunk_bytes`` (1 GiB by default). See docs/torch.md.
"""

from __future__ import annotations

from typing import Any, Optional, Tuple

from . import _gpuipc

__all__ = ["MemPool", "block_of", "pool_stats", "detach"]

_ALLOC = "gpuipc_torch_alloc"
_FREE = "gpuipc_torch_free"


def _torch() -> Any:
    try:
        import torch  # noqa: PLC0415 - imported on demand, by design
    except ImportError as e:  # pragma: no cover - depends on the environment
        raise ImportError("gpuipc.torch needs PyTorch (pip install torch)") from e
    missing = [
        what
        for what, ok in (
            ("torch.cuda.MemPool", hasattr(torch.cuda, "MemPool")),
            ("torch.cuda.use_mem_pool", hasattr(torch.cuda, "use_mem_pool")),
            ("torch.cuda.memory.CUDAPluggableAllocator", hasattr(torch.cuda.memory, "CUDAPluggableAllocator")),
        )
        if not ok
    ]
    if missing:
        raise ImportError(
            f"gpuipc.torch needs {', '.join(missing)}, which torch {torch.__version__} does not have: "
            "use PyTorch 2.6 or later"
        )
    return torch


def MemPool(  # noqa: N802 - reads like the torch class it returns
    name: str,
    device: int = 0,
    *,
    create: bool = True,
    chunk_bytes: int = 1 << 30,
    max_bytes: int = 64 << 30,
    max_blocks: int = 65536,
    mode: int = 0o600,
) -> Any:
    """A ``torch.cuda.MemPool`` backed by the gpuipc device Pool ``name`` on ``device``.

    ``create=False`` opens an existing pool instead (a process that adds tensors to a pool another made).
    ``chunk_bytes`` is the largest single tensor storage; the pool grows a chunk at a time up to ``max_bytes``.
    Raises gpuipc errors like ``gpuipc.Pool`` (AlreadyExists when the name is taken or the device already has an
    active pool holding tensors) and ImportError when torch lacks the pluggable allocator.
    """
    torch = _torch()
    _gpuipc._torch_pool_attach(name, device, create, chunk_bytes, max_bytes, max_blocks, mode)
    allocator = torch.cuda.memory.CUDAPluggableAllocator(_gpuipc.__file__, _ALLOC, _FREE)
    pool = torch.cuda.MemPool(allocator.allocator())
    # Keep the allocator object alive as long as the pool (torch holds the C++ side; this is belt and braces).
    pool._gpuipc_allocator = allocator  # type: ignore[attr-defined]
    pool._gpuipc_name = name  # type: ignore[attr-defined]
    pool._gpuipc_device = device  # type: ignore[attr-defined]
    return pool


def block_of(tensor_or_address: Any) -> Optional[Tuple[bytes, int, str]]:
    """``(encoded BlockRef, block address, pool name)`` of the gpuipc block holding a tensor's storage (or an
    address), or None when it is not in a gpuipc MemPool of this process. The tensor's bytes start at
    ``address - block address`` inside the block."""
    address = tensor_or_address
    if not isinstance(address, int):
        address = tensor_or_address.untyped_storage().data_ptr()
    return _gpuipc._torch_block_of(address)


def pool_stats(device: int = 0) -> Optional[Tuple[int, int, int]]:
    """``(blocks torch holds, pool bytes used, allocations refused)`` of the device's active pool, or None."""
    return _gpuipc._torch_pool_stats(device)


def detach(device: int = 0) -> int:
    """Stops routing the device's allocations to its pool once torch holds nothing in it. Returns the blocks
    torch still holds there (0: detached)."""
    return _gpuipc._torch_pool_detach(device)
