"""CuPy allocations in a gpuipc device pool: ``gpuipc.cupy.set_allocator(pool)``.

Import it explicitly (``import gpuipc.cupy``); the ``gpuipc`` package itself never imports CuPy::

    pool = gpuipc.Pool.create("arrays", kind="device", chunk_bytes=256 << 20, max_bytes=8 << 30)
    gpuipc.cupy.set_allocator(pool)
    a = cupy.arange(1 << 20, dtype=cupy.float32)        # lives in the gpuipc pool
    shared = gpuipc.share_tensors("arrays.set", {"a": a})  # by BlockRef: no copy
    gpuipc.cupy.set_allocator(None)                      # back to CuPy's own memory pool

Each CuPy allocation is one pool block (at most the pool's ``chunk_bytes``), labelled with the pool's GPU, and freed
when CuPy frees the memory, in the order of the stream that was current when it was allocated (as CuPy's own pool
gives memory back to the stream it was allocated on): work still queued there keeps the block until it has run,
wherever the array is dropped. See docs/torch.md.
"""

from __future__ import annotations

from typing import Any, Optional, Tuple

from .errors import InvalidArgument
from .pool import Block, Pool, find_block

__all__ = ["set_allocator", "block_of"]


def _cupy() -> Any:
    try:
        import cupy  # noqa: PLC0415 - imported on demand, by design
    except ImportError as e:
        raise ImportError("gpuipc.cupy needs CuPy (pip install cupy-cuda12x, or the wheel for your CUDA)") from e
    return cupy


class _Owner:
    """Keeps a block while CuPy's Memory object lives; frees it when CuPy lets go, in the order of the stream that
    was current at the allocation (kept alive until then)."""

    __slots__ = ("block", "stream")

    def __init__(self, block: Block, stream: Any) -> None:
        self.block = block
        self.stream = stream

    def __del__(self) -> None:
        try:
            if not self.block.freed:
                self.block.free(self.stream.ptr)
        except Exception:  # noqa: BLE001 - at interpreter exit CuPy or the broker may be gone already
            pass


def set_allocator(pool: Optional[Pool]) -> None:
    """Routes CuPy's device allocations (``cupy.cuda.set_allocator``) to ``pool``, a device Pool; None restores
    CuPy's default memory pool. Allocations larger than the pool's ``chunk_bytes``, or beyond ``max_bytes``, raise
    gpuipc.InvalidArgument / QuotaExceeded from CuPy's allocation. Raises ImportError without CuPy, InvalidArgument
    for a pool that is not device memory."""
    cupy = _cupy()
    if pool is None:
        cupy.cuda.set_allocator(cupy.get_default_memory_pool().malloc)
        return
    if not isinstance(pool, Pool) or pool.kind != "device":
        raise InvalidArgument(f"gpuipc.cupy.set_allocator takes a device gpuipc.Pool, not {pool!r}")

    def malloc(nbytes: int) -> Any:
        block = pool.allocate(max(int(nbytes), 1))
        # The GPU the pool's memory is mapped for, not the current one: CuPy then refuses to use the array from a
        # kernel on another GPU rather than have it fault there.
        device = int(block.view().__dlpack_device__()[1])
        mem = cupy.cuda.UnownedMemory(block.address, block.size, _Owner(block, cupy.cuda.get_current_stream()),
                                      device)
        return cupy.cuda.MemoryPointer(mem, 0)

    cupy.cuda.set_allocator(malloc)


def block_of(array: Any) -> Optional[Tuple[bytes, int, str]]:
    """``(encoded BlockRef, block address, pool name)`` of the gpuipc block holding a CuPy array's memory, or None
    when it is not in a gpuipc pool block of this process (like :func:`gpuipc.torch.block_of`). The array's bytes
    start at ``array.data.ptr - block address`` inside the block."""
    ptr = int(array.data.ptr)
    block = find_block(ptr, max(int(array.nbytes), 1))
    if block is None:
        return None
    return bytes(block.ref), block.address, block.pool.name
