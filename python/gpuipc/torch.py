"""PyTorch tensors born shareable: ``gpuipc.torch.MemPool``.

Import it explicitly (``import gpuipc.torch``); the ``gpuipc`` package itself never imports torch.

``MemPool(name, device=0)`` is a :class:`torch.cuda.MemPool` whose memory comes from a gpuipc device Pool named
``name``, through PyTorch's pluggable allocator. Everything allocated under ``torch.cuda.use_mem_pool(pool)``
lives in that pool, so another process can map it with no copy::

    pool = gpuipc.torch.MemPool("weights", device=0, max_bytes=64 << 30)
    with torch.cuda.use_mem_pool(pool):
        model = build().cuda()
    ref, base, pool_name = gpuipc.torch.block_of(model.lm_head.weight)

Pause and resume, like torch_memory_saver (an inference engine gives its weights' and KV cache's GPU memory to a
co-located trainer, then takes it back)::

    torch.cuda.synchronize()
    pool.pause(keep_contents=True)   # the GPU memory is released; tensors keep their addresses
    ...                              # the trainer runs; do not touch the pool's tensors meanwhile
    pool.resume()                    # same addresses, same bytes

Limits: one active MemPool per device and process (the allocator's C entry points carry no other context); a
block is at most ``chunk_bytes`` (1 GiB by default). See docs/torch.md.
"""

from __future__ import annotations

from typing import Any, Optional, Tuple

from . import _gpuipc
from .errors import Error

__all__ = ["MemPool", "block_of", "pool_stats", "detach", "pause", "resume", "paused"]

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
    try:
        allocator = torch.cuda.memory.CUDAPluggableAllocator(_gpuipc.__file__, _ALLOC, _FREE)
        # torch.cuda.MemPool routes the allocations of the *current* device's pool to the allocator
        # (at::cuda::MemPool takes c10::cuda::current_device()): made on another device, tensors under
        # use_mem_pool(pool, device=device) went to plain cudaMalloc memory, and those on the current device to a
        # device this allocator has no pool for.
        with torch.cuda.device(device):
            pool = torch.cuda.MemPool(allocator.allocator())
    except BaseException:
        # The name was made (or joined) for this MemPool only: not left behind for a retry to find taken.
        _gpuipc._torch_pool_detach(device)
        if create:
            try:
                _gpuipc.Pool.unlink(name)
            except Error:
                pass
        raise
    # Keep the allocator object alive as long as the pool (torch holds the C++ side; this is belt and braces).
    pool._gpuipc_allocator = allocator  # type: ignore[attr-defined]
    pool._gpuipc_name = name  # type: ignore[attr-defined]
    pool._gpuipc_device = device  # type: ignore[attr-defined]
    # torch_memory_saver's calls, on the pool object itself.
    pool.pause = lambda keep_contents=False, keep_buffer=False: pause(  # type: ignore[attr-defined]
        device, keep_contents=keep_contents, keep_buffer=keep_buffer)
    pool.resume = lambda: resume(device)  # type: ignore[attr-defined]
    pool.paused = _PausedQuery(device)  # type: ignore[attr-defined]
    return pool


class _PausedQuery:
    """``MemPool.paused``: a method (torch.cuda.MemPool takes no properties per instance), which refuses to be
    read as a bool (``if pool.paused:`` would always be true) rather than answer wrongly."""

    def __init__(self, device: int) -> None:
        self._device = device

    def __call__(self) -> bool:
        return paused(self._device)

    def __bool__(self) -> bool:
        raise TypeError("MemPool.paused is a method: call pool.paused()")


def pause(device: int = 0, *, keep_contents: bool = False, keep_buffer: bool = False) -> None:
    """Releases the GPU memory of the device's MemPool (``gpuipc.Pool.pause``): every tensor in it keeps its address
    but must not be used until :func:`resume`; with ``keep_contents`` their bytes are saved in host memory and
    restored on resume; with ``keep_buffer`` too, the pinned host buffer they were saved in is kept for the next
    pause (``gpuipc.Pool.pause``: pinning it is most of a pause's time). Allocate nothing under the pool meanwhile:
    a new segment is refused (torch reports out of memory), but torch may hand out a block of a segment it cached,
    whose memory is unmapped. Waits for this process's GPU work first. Raises InvalidState when the device has no
    MemPool or it is paused already."""
    _gpuipc._torch_pool_pause(device, keep_contents, keep_buffer)


def resume(device: int = 0) -> None:
    """Backs the device's MemPool with GPU memory again at the same addresses (``gpuipc.Pool.resume``), restoring
    the bytes pause kept. Raises InvalidState when it is not paused."""
    _gpuipc._torch_pool_resume(device)


def paused(device: int = 0) -> bool:
    """Whether the device's MemPool is paused. Raises InvalidState when the device has no MemPool."""
    return bool(_gpuipc._torch_pool_paused(device))


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
    torch still holds there (0: detached). Once detached, the handles that share_tensors and the stream publisher
    opened on MemPool pools are let go (each closes once nothing found through it is in use)."""
    held = _gpuipc._torch_pool_detach(device)
    if held == 0:
        from .pool import forget_torch_pools  # noqa: PLC0415

        forget_torch_pools()
    return held
