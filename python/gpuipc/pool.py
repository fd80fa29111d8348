"""Pools: named pools of shareable memory that hand out blocks between processes (docs/pools.md).

A :class:`Block` is allocated by one process; its :class:`BlockRef` (pool id, chunk, offset, size, generation, index)
travels in any message (``bytes(ref)`` is 40 bytes); another process opens the pool by name and resolves the ref to
the same memory with :meth:`Pool.resolve`, holding it with :meth:`Pool.hold` while it reads.
"""

from __future__ import annotations

import bisect
import contextlib
import weakref
from dataclasses import dataclass
from typing import Any, Dict, Iterable, Iterator, List, Optional, Tuple

from . import _gpuipc
from ._devices import Device, resolve as _device
from ._arrays import Array, Shape, make_array
from ._ints import U32, U64, in_range
from ._streams import stream_handle
from .errors import Closed, InvalidArgument

__all__ = ["Pool", "Block", "BlockRef", "BlockView"]


@dataclass(frozen=True)
class BlockRef:
    """A reference to a block of a pool, valid in any process. ``bytes(ref)`` and :meth:`from_bytes` round trip
    through the 40-byte little-endian form of the C++ ``gpuipc::encode_block_ref``."""

    pool: int  #: the pool's id (random, fixed at creation)
    chunk: int
    offset: int  #: bytes into the chunk
    size: int  #: bytes asked for
    generation: int  #: unique per allocation in the pool: a stale ref is detected
    index: int = 0  #: the block's record in the pool's control block

    def _tuple(self) -> Tuple[int, int, int, int, int, int]:
        return (self.pool, self.generation, self.offset, self.size, self.chunk, self.index)

    @classmethod
    def _from_tuple(cls, t: Tuple[int, int, int, int, int, int]) -> "BlockRef":
        pool, generation, offset, size, chunk, index = t
        return cls(pool=pool, chunk=chunk, offset=offset, size=size, generation=generation, index=index)

    def __bytes__(self) -> bytes:
        return _gpuipc._encode_block_ref(self._tuple())

    @classmethod
    def from_bytes(cls, data: bytes) -> "BlockRef":
        """Decodes 40 bytes. Raises InvalidArgument naming what is wrong (length, a zero id, a field out of range)."""
        return cls._from_tuple(_gpuipc._decode_block_ref(bytes(data)))


def _bad_fields(ref: Any) -> InvalidArgument:
    """The error for a BlockRef whose fields the extension cannot take (made by hand, with a negative or huge int)."""
    return InvalidArgument(
        f"{ref!r}: every field of a BlockRef is an integer from 0 to 2**64 - 1 (the pool's allocate makes them, and "
        "BlockRef.from_bytes decodes them)"
    )


class _Memory:
    """Array views of a block's bytes, shared by :class:`Block` and :class:`BlockView`."""

    __slots__ = ()

    def view(self) -> _gpuipc.ArrayView:  # pragma: no cover - overridden
        raise NotImplementedError

    @property
    def is_cuda(self) -> bool:
        return self.view().is_cuda

    def as_array(self, dtype: Any = "uint8", shape: Shape = None, offset: int = 0) -> Array:
        """``shape`` elements of ``dtype`` at byte ``offset``, without a copy: a NumPy array for host kinds, an
        ArrayView (DLPack, ``__cuda_array_interface__``) for device kinds. Raises InvalidArgument when it does not
        fit."""
        return make_array(self.view(), dtype, shape, offset)

    def numpy(self, dtype: Any = "uint8", shape: Shape = None, offset: int = 0) -> Any:
        """A NumPy array over the block (host kinds only; read-only when the memory is). Raises InvalidArgument for
        GPU memory (use DLPack: ``torch.from_dlpack(block)``)."""
        v = self.view()
        if v.is_cuda:
            raise InvalidArgument("a device block has no NumPy view: use torch.from_dlpack(block) or cupy.asarray(block)")
        return make_array(v, dtype, shape, offset)

    def __dlpack__(self, **kwargs: Any) -> Any:
        return self.view().__dlpack__(**kwargs)

    def __dlpack_device__(self) -> Tuple[int, int]:
        return self.view().__dlpack_device__()

    @property
    def __cuda_array_interface__(self) -> Dict[str, Any]:
        return self.view().__cuda_array_interface__


# Live blocks of this process by address, so that share_tensors finds tensors that already live in pool memory.
_BLOCKS: Dict[int, "weakref.ReferenceType[Block]"] = {}
_STARTS: List[int] = []
_STARTS_DIRTY = False


def _forget(address: int, ref: "weakref.ReferenceType[Block]") -> None:
    """A collected Block's entry goes, unless a later Block at the same address (the memory freed and handed out
    again) has taken it."""
    global _STARTS_DIRTY
    if _BLOCKS.get(address) is ref:
        del _BLOCKS[address]
        _STARTS_DIRTY = True


def find_block(address: int, nbytes: int) -> Optional["Block"]:
    """The live Block of this process that holds [address, address + nbytes), or None."""
    global _STARTS, _STARTS_DIRTY
    if _STARTS_DIRTY:
        _STARTS = sorted(_BLOCKS)
        _STARTS_DIRTY = False
    i = bisect.bisect_right(_STARTS, address) - 1
    ref = _BLOCKS.get(_STARTS[i]) if i >= 0 else None
    block = ref() if ref is not None else None
    if block is None or block.freed or address + nbytes > block.address + block.size:
        return _torch_block(address, nbytes)
    return block


class _TorchBlock:
    """A block of a gpuipc.torch.MemPool (held by PyTorch through the pluggable allocator, not by a Python
    Block): enough of Block's face for share_tensors to share it by reference. ``freed`` is as of the last
    :meth:`recheck` (a look-up per call would cost every tensor of every version a stream sends): a holder that
    keeps it across calls rechecks when :func:`torch_frees` moved."""

    is_cuda = True

    def __init__(self, ref: "BlockRef", address: int, pool: "Pool", ref_bytes: bytes) -> None:
        self.ref = ref
        self.address = address
        self.size = ref.size
        self.pool = pool
        self.freed = False
        self._ref_bytes = ref_bytes

    def recheck(self) -> bool:
        """Whether torch gave the block back: its address holds no gpuipc.torch block now, or another one (the same
        address, allocated again). Once freed, it stays freed."""
        if not self.freed:
            found = _gpuipc._torch_block_of(self.address)
            self.freed = found is None or found[1] != self.address or found[0] != self._ref_bytes
        return self.freed

    def view(self) -> _gpuipc.ArrayView:
        """The block as bytes, like Block.view (update_from and Publisher.tensors copy into it), where the MemPool's
        allocator mapped it: its pause and resume then apply to it (a view through ``self.pool``, a handle of its
        own, mapped the chunk again, which a pause did not release and a resume left unusable). InvalidArgument
        once torch gave the block back."""
        v = _gpuipc._torch_block_view(self.address)
        if v is None:
            raise InvalidArgument(f"the gpuipc.torch block at {self.address:#x} was given back to torch (its tensor "
                                  "was freed)")
        return v

    def free(self) -> None:  # PyTorch frees it, not share_tensors
        pass


_TORCH_POOLS: Dict[str, "Pool"] = {}  # a handle on each gpuipc.torch.MemPool pool met, by name


def forget_torch_pools() -> None:
    """Drops the cached handles (gpuipc.torch.detach): each closes once no block found through it is in use, so a
    detached and unlinked pool's memory is not kept by this process for good."""
    _TORCH_POOLS.clear()


def _torch_block(address: int, nbytes: int) -> Optional[_TorchBlock]:
    """The gpuipc.torch.MemPool block holding [address, address + nbytes), when gpuipc.torch is in use."""
    import sys  # noqa: PLC0415

    if "gpuipc.torch" not in sys.modules:
        return None
    found = _gpuipc._torch_block_of(address)
    if found is None:
        return None
    ref_bytes, base, pool_name = found
    ref = BlockRef.from_bytes(ref_bytes)
    if address + nbytes > base + ref.size:
        return None
    pool = _TORCH_POOLS.get(pool_name)
    if pool is None or pool.closed or pool.id != ref.pool:  # (a new pool made under the name since: opened again)
        pool = _TORCH_POOLS[pool_name] = Pool.open(pool_name)
    return _TorchBlock(ref, base, pool, ref_bytes)


def torch_frees() -> int:
    """How many blocks torch has given back through gpuipc.torch's allocator in this process (it only grows): a
    holder of _TorchBlocks rechecks them when it moved."""
    return _gpuipc._torch_frees()


def recheck_torch_blocks(blocks: Iterator[Any]) -> None:
    """Rechecks the _TorchBlocks among ``blocks`` (Blocks know when they are freed)."""
    for b in blocks:
        if type(b) is _TorchBlock:
            b.recheck()


class Block(_Memory):
    """A block allocated from a pool, owned by this process. A context manager: leaving ``with`` frees it. It is
    also freed when garbage collected, once no view made from it (an array, a tensor, a DLPack export) is left:
    views keep the block. :meth:`free` frees it whatever views are left: do not use them after (its memory may be
    reused). Unlike ``cudaFree``, freeing does not wait for the GPU:
    device and pinned blocks are reused once the stream given to :meth:`free` has passed the free; leaving ``with``
    frees on the legacy default stream, which waits for blocking streams only (not for a torch stream), and
    collection frees at once. Call ``free(stream=s)`` for a block that work on ``s`` still uses."""

    __slots__ = ("_blk", "_pool", "_address", "__weakref__")

    def __init__(self, _handle: _gpuipc.Block, pool: "Pool") -> None:
        """Internal: use :meth:`Pool.allocate`."""
        global _STARTS_DIRTY
        self._blk = _handle
        self._pool = pool
        self._address = _handle.address
        ref = weakref.ref(self)
        _BLOCKS[self._address] = ref
        _STARTS_DIRTY = True
        weakref.finalize(self, _forget, self._address, ref)

    @property
    def ref(self) -> BlockRef:
        """What to send to another process."""
        return BlockRef._from_tuple(self._blk.ref)

    @property
    def pool(self) -> "Pool":
        return self._pool

    @property
    def address(self) -> int:
        """Host address (host kinds) or device address (device) of the first byte."""
        return self._address

    @property
    def size(self) -> int:
        return self._blk.size

    @property
    def freed(self) -> bool:
        return self._blk.freed

    def view(self) -> _gpuipc.ArrayView:
        """The block as bytes (an ArrayView)."""
        return self._blk.view()

    def free(self, stream: Any = None) -> None:
        """Frees the block (see :meth:`Pool.free`); idempotent. Works after its Pool handle was closed (the block
        keeps the pool joined)."""
        if self._blk.freed:
            return
        self._blk.free(stream_handle(stream))
        entry = _BLOCKS.get(self._address)
        if entry is not None and entry() is self:  # (not a later Block's at the same address)
            _forget(self._address, entry)

    def __enter__(self) -> "Block":
        return self

    def __exit__(self, *exc: object) -> None:
        self.free()

    def __repr__(self) -> str:
        if self.freed:
            return "<gpuipc.Block freed>"
        return f"<gpuipc.Block of {self._blk.pool_name!r} size={self.size} address={self.address:#x}>"


class BlockView(_Memory):
    """A block of another process, resolved in this one (:meth:`Pool.resolve`). It does not hold the block: take
    :meth:`Pool.hold` (or :meth:`Pool.held`) while you use it."""

    __slots__ = ("_pool", "_ref", "_view")

    def __init__(self, pool: "Pool", ref: BlockRef, view: _gpuipc.ArrayView) -> None:
        self._pool = pool
        self._ref = ref
        self._view = view

    @property
    def ref(self) -> BlockRef:
        return self._ref

    @property
    def address(self) -> int:
        return self._view.address

    @property
    def size(self) -> int:
        return self._view.nbytes

    @property
    def readonly(self) -> bool:
        return self._view.readonly

    def view(self) -> _gpuipc.ArrayView:
        return self._view

    def __repr__(self) -> str:
        try:
            owner = repr(self._pool.name)
        except Closed:
            owner = f"pool id {self._ref.pool:#x}, its handle closed"
        return f"<gpuipc.BlockView of {owner} size={self.size} address={self.address:#x}>"


class Pool:
    """A joined pool. Create or open it by name; a context manager (``with`` closes this handle)."""

    __slots__ = ("_pool", "_readonly", "__weakref__")

    def __init__(self, _handle: _gpuipc.Pool, readonly: bool = False) -> None:
        """Internal: use :meth:`create` or :meth:`open`."""
        self._pool = _handle
        self._readonly = readonly

    @classmethod
    def create(
        cls,
        name: str,
        *,
        kind: str = "host",
        device: Device = 0,
        mode: int = 0o600,
        chunk_bytes: int = 64 << 20,
        max_bytes: int = 1 << 30,
        max_blocks: int = 16384,
        block_bytes: int = 0,
        block_count: int = 0,
    ) -> "Pool":
        """Creates and joins pool ``name`` (segments ``name`` and ``name.chunk.<i>``).

        kind: "host", "host_pinned" or "device". A variable pool grows by chunks of ``chunk_bytes`` (the largest
        block) up to ``max_bytes``, at most 1024 chunks (more is refused); ``block_bytes`` and ``block_count`` make
        a fixed-block pool instead. mode: permission bits; members (openers) need read and write. Raises
        AlreadyExists, InvalidArgument, QuotaExceeded, NoDriver, CudaError.
        """
        return cls(
            _gpuipc.Pool.create(
                name,
                kind=kind,
                device=_device(device),
                mode=in_range(mode, "mode", U32),
                chunk_bytes=in_range(chunk_bytes, "chunk_bytes", U64),
                max_bytes=in_range(max_bytes, "max_bytes", U64),
                max_blocks=in_range(max_blocks, "max_blocks", U32),
                block_bytes=in_range(block_bytes, "block_bytes", U64),
                block_count=in_range(block_count, "block_count", U32),
            )
        )

    @classmethod
    def open(
        cls, name: str, *, readonly: bool = False, wait: Optional[float] = None, device: Optional[Device] = None
    ) -> "Pool":
        """Opens and joins pool ``name``. readonly: map its chunks read-only (joining still needs read and write
        permission: holds are written to the pool). wait: seconds to wait for it to be created. device (device
        pools): the GPU that maps every chunk, which block views (and tensors made from them) are on; None: the
        current context's GPU at this call (say torch's current device), else the pool's. Raises NotFound, Timeout,
        PermissionDenied, InvalidArgument (not a pool), QuotaExceeded (64 members), NoDevice and Unsupported (that
        GPU cannot map the pool)."""
        return cls(_gpuipc.Pool.open(name, readonly=readonly, wait=wait, device=_device(device)), readonly)

    @staticmethod
    def unlink(name: str) -> None:
        """Removes the pool's names (control segment and chunks); mappings stay valid. Raises NotFound,
        PermissionDenied."""
        _gpuipc.Pool.unlink(name)

    @staticmethod
    def stat(name: str) -> Dict[str, Any]:
        """Statistics of pool ``name`` without joining it (see :meth:`stats`)."""
        return _gpuipc.Pool.stat(name)

    def allocate(self, nbytes: int, alignment: int = 256) -> Block:
        """Allocates a block of ``nbytes`` (aligned to ``alignment``, a power of two up to 4096). Raises
        QuotaExceeded when the pool is full, InvalidArgument for a size above the chunk or block size, InvalidState
        while the pool is paused."""
        return Block(self._pool.allocate(in_range(nbytes, "nbytes", U64), in_range(alignment, "alignment", U64)), self)

    def free(self, block: Block, stream: Any = None) -> None:
        """Frees ``block``. Device and host_pinned pools reuse it only once ``stream`` has passed this point; other
        processes' holds keep it until they release. Raises InvalidArgument for a double free or a block of
        another pool."""
        if not isinstance(block, Block):
            raise InvalidArgument(f"free takes a gpuipc.Block, not a {type(block).__name__}")
        if block._pool._pool is not self._pool and block._pool.id != self.id:
            raise InvalidArgument(f"the block belongs to pool {block._blk.pool_name!r}: free it through its own pool")
        _ = self.id  # a closed handle raises Closed, as its other calls do
        if block._blk.freed:
            raise InvalidArgument("the block was freed already (a double free?)")
        block.free(stream)

    def resolve(self, ref: BlockRef) -> BlockView:
        """The memory of the block ``ref`` names, mapping its chunk the first time. Raises InvalidArgument for a
        ref of another pool, out of range, or stale (freed or reused); InvalidState while the pool is paused, or
        when this process mapped the chunk before a pause and has not called :meth:`refresh` since."""
        try:
            return BlockView(self, ref, self._pool.view(ref._tuple(), self._readonly))
        except TypeError:
            raise _bad_fields(ref) from None

    def map_chunks(self, refs: Iterable[BlockRef]) -> None:
        """Maps the chunks that the blocks ``refs`` lie in and that this process has not mapped, asking the broker
        for all of them in one round trip (:meth:`resolve` takes one per chunk it maps): before resolving many
        blocks of a pool met for the first time. Refs of another pool are skipped. Raises the first chunk's error
        (NotFound, PermissionDenied, ...) after mapping the others; resolve tries that chunk again."""
        self._pool.map_chunks(b"".join(bytes(r) for r in refs))

    def hold(self, ref: BlockRef) -> None:
        """Takes a hold: the block's memory is not reused until this process releases it (or exits)."""
        try:
            self._pool.hold(ref._tuple())
        except TypeError:
            raise _bad_fields(ref) from None

    def release(self, ref: BlockRef) -> None:
        """Gives back one hold. Raises InvalidArgument when this process holds none."""
        try:
            self._pool.release(ref._tuple())
        except TypeError:
            raise _bad_fields(ref) from None

    @contextlib.contextmanager
    def held(self, ref: BlockRef) -> Iterator[BlockView]:
        """``with pool.held(ref) as view:`` holds the block and resolves it; releases on exit."""
        self.hold(ref)
        try:
            yield self.resolve(ref)
        finally:
            self.release(ref)

    def pause(self, keep_contents: bool = False, keep_buffer: bool = False) -> None:
        """Releases the memory of every chunk (torch_memory_saver's ``pause``), keeping the pool's name, its blocks
        and their addresses: Blocks, BlockRefs and arrays made from them stay, but their memory must not be touched
        until :meth:`resume` (device memory is unmapped: a kernel reading it faults; host pages read as zeros).
        With ``keep_contents`` the live blocks' bytes are saved in this process's host memory and come back on
        resume. With ``keep_buffer`` too, resume keeps that host buffer (pinned, for device pools) and the next
        pause of this handle reuses it: pinning host memory is most of a pause's time (seconds for 16 GiB), so a
        pool paused and resumed again and again (every RL step) pays it once; the buffer stays this process's
        memory until the handle goes or a resume after a pause without ``keep_buffer``. Waits for this process's GPU
        work first. Meanwhile allocate, hold and resolve raise InvalidState in every process, naming this one.
        Raises PermissionDenied for a read-only handle, InvalidState when it is paused already, Unsupported for
        host_pinned pools."""
        self._pool.pause(keep_contents=keep_contents, keep_buffer=keep_buffer)

    def resume(self) -> None:
        """Backs the chunks with memory again at the same addresses (restoring kept contents). Allowed to the
        handle that paused the pool (another handle, of this process too, is another member), or to any writer once
        that one is gone (its saved contents are then lost). Other processes that had the pool mapped call
        :meth:`refresh` before they resolve again. Raises InvalidState when the pool is not paused or another live
        handle paused it."""
        self._pool.resume()

    def refresh(self) -> None:
        """Drops this process's mappings of memory a pause released (device memory is returned to the GPU once no
        process maps it) and, once the pool is resumed, maps the new memory at the same addresses, so views made
        before the pause show the restored bytes. Call it when no kernel of this process uses the pool."""
        self._pool.refresh()

    @property
    def paused(self) -> bool:
        """Whether the pool is paused (or being paused or resumed) now."""
        return self._pool.paused

    def stats(self) -> Dict[str, Any]:
        """used_bytes, free_bytes, capacity_bytes, max_bytes, largest_free_block, chunks, max_chunks, live_blocks,
        draining_blocks, members, allocations, frees; state ("active", "pausing", "paused" or "resuming"),
        paused_by_pid (0 when active), pauser_gone (paused by a process that is gone) and epoch (pauses so far)."""
        return self._pool.stats()

    @property
    def name(self) -> str:
        return self._pool.name

    @property
    def kind(self) -> str:
        return self._pool.kind

    @property
    def id(self) -> int:
        """The pool's id (BlockRef.pool)."""
        return self._pool.id

    @property
    def owner_uid(self) -> int:
        """The uid that owns the pool's control block, as the broker said when this process created or opened it."""
        return self._pool.owner_uid

    @property
    def owner_gid(self) -> int:
        """The gid of the pool's control block's owner (as :attr:`owner_uid`)."""
        return self._pool.owner_gid

    @property
    def mode(self) -> int:
        """The pool's control block's permission bits (as :attr:`owner_uid`)."""
        return self._pool.mode

    @property
    def readonly(self) -> bool:
        return self._readonly

    @property
    def fixed(self) -> bool:
        return self._pool.fixed

    @property
    def chunk_bytes(self) -> int:
        return self._pool.chunk_bytes

    @property
    def block_bytes(self) -> int:
        return self._pool.block_bytes

    @property
    def closed(self) -> bool:
        return self._pool.closed

    def close(self) -> None:
        """Drops this handle (idempotent); blocks and views keep the pool joined until they go. Whichever goes last
        leaves the pool without holding the GIL, so other threads run while it tells the broker."""
        self._pool.close()

    def __enter__(self) -> "Pool":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        if self.closed:
            return "<gpuipc.Pool closed>"
        return f"<gpuipc.Pool {self.name!r} kind={self.kind}>"
