"""Sets of named tensors (a state dict) shared under one name: share_tensors / open_tensors (docs/torch.md).

Framework-neutral: NumPy for host memory; anything with DLPack or ``__cuda_array_interface__`` for GPU memory;
torch tensors when torch is importable (this module never imports torch unless a tensor or an index says torch).
Tensors already in gpuipc pool memory travel by BlockRef; the others are packed into a fresh pool NAME.pool with
one copy per storage. The index is the host segment NAME (format: gpuipc/_index.py).
"""

from __future__ import annotations

import math
import struct
import sys
import time
import warnings
from dataclasses import dataclass, field
from typing import Any, Dict, Iterable, Iterator, List, Mapping, Optional, Tuple

import numpy as np

from . import _gpuipc, _index
from ._dtypes import dlpack_of_name, dtype_of
from ._names import unlink_names
from ._tensorinfo import DL_CUDA, TensorInfo, describe
from .errors import AlreadyExists, Closed, Error, InvalidArgument, NotFound, PeerDied, PermissionDenied
from .pool import Block, BlockRef, Pool, find_block
from .segment import Segment

__all__ = ["share_tensors", "open_tensors", "unlink_tensors", "SharedTensors"]

# A packed storage starts at its first tensor's address rounded down to this: offsets keep every element aligned.
_ALIGN = 64


@dataclass
class _Storage:
    lo: int  #: first byte
    hi: int
    device_type: int
    device_id: int
    block: Optional[Block] = None  #: a Block of this process the tensors already live in (shared by ref)
    members: List[int] = field(default_factory=list)

    @property
    def block_offset(self) -> int:
        """Where the storage starts in its block (0 for packed copies, which fill theirs)."""
        return self.lo - self.block.address if self.block is not None else 0


@dataclass
class _Plan:
    infos: List[Tuple[str, TensorInfo]]
    storages: List[_Storage]
    placement: List[Tuple[int, int]]  #: per tensor: (storage index or -1, offset in elements)
    framework: str


def _plan(tensors: Mapping[str, Any], adopt: bool) -> _Plan:
    if not isinstance(tensors, Mapping):
        raise InvalidArgument(f"share_tensors takes a mapping of str to array (a state dict), not a {type(tensors).__name__}")
    infos: List[Tuple[str, TensorInfo]] = []
    for key, t in tensors.items():
        if not isinstance(key, str):
            raise InvalidArgument(f"tensor names must be str, not {type(key).__name__} ({key!r})")
        info = describe(t, f"tensor {key!r}")
        if info.address % info.dtype.itemsize != 0:
            raise InvalidArgument(f"tensor {key!r} is not aligned to its {info.dtype.itemsize}-byte elements; pass a copy")
        infos.append((key, info))
    storages: List[_Storage] = []
    adopted: Dict[int, List[Tuple[int, int, int]]] = {}  # block address -> (lo, hi, tensor) of its tensors
    blocks: Dict[int, Any] = {}
    loose: List[int] = []
    for i, (_, info) in enumerate(infos):
        if info.empty:
            continue
        block = shared_block(info) if adopt else None
        if block is None:
            loose.append(i)
            continue
        blocks.setdefault(block.address, block)
        adopted.setdefault(block.address, []).append((*_adopted_range(info, block), i))
    # In a block, a storage is what one framework storage covers (torch's caching allocator puts several tensors,
    # each its own storage, in one block); overlapping ranges (views, tied weights) make one storage.
    for address, ranges in adopted.items():
        block = blocks[address]
        current: Optional[_Storage] = None
        for lo, hi, i in sorted(ranges):
            info = infos[i][1]
            if current is not None and lo < current.hi:
                current.hi = max(current.hi, hi)
            else:
                current = _Storage(lo, hi, info.device_type, info.device_id, block)
                storages.append(current)
            current.members.append(i)
    # Tensors whose bytes overlap share a storage: one copy each, and views of one storage stay views of one.
    loose.sort(key=lambda i: (infos[i][1].is_cuda, infos[i][1].device_id, infos[i][1].address))
    current = None
    for i in loose:
        info = infos[i][1]
        lo, hi = info.address, info.address + info.extent
        if current is not None and current.device_type == info.device_type and current.device_id == info.device_id and lo < current.hi:
            current.hi = max(current.hi, hi)
        else:
            current = _Storage(lo - lo % _ALIGN, hi, info.device_type, info.device_id)
            storages.append(current)
        current.members.append(i)
    for st in storages:
        _align_start(st, infos)
    placement: List[Tuple[int, int]] = [(-1, 0)] * len(infos)
    for s, st in enumerate(storages):
        for i in st.members:
            info = infos[i][1]
            placement[i] = (s, (info.address - st.lo) // info.dtype.itemsize)
    frameworks = {info.framework for _, info in infos}
    return _Plan(infos, storages, placement, "torch" if "torch" in frameworks else "numpy")


def shared_block(info: TensorInfo) -> Optional[Any]:
    """The block of a gpuipc pool of this process that holds every byte of the tensor (a :class:`Block`, or a
    block of a gpuipc.torch.MemPool): what share_tensors and bucketed streaming send by BlockRef, with no copy.
    None when there is none (an empty tensor has none)."""
    if info.empty:
        return None
    return find_block(info.address, info.extent)


def _adopted_range(info: TensorInfo, block: Any) -> Tuple[int, int]:
    """The bytes of ``block`` that the tensor's storage covers: its framework storage (a torch storage) where that
    lies in the block, else from the tensor's first byte (rounded down to _ALIGN, not before the block) to its
    last. It starts at a whole number of the tensor's elements before the tensor (a block need only be aligned to
    what it was allocated with)."""
    lo, hi = info.address, info.address + info.extent
    item = info.dtype.itemsize
    if info.storage is not None and info.storage[0] <= lo and hi <= info.storage[1]:
        start = max(info.storage[0], block.address)
        return start + (lo - start) % item, min(info.storage[1], block.address + block.size)
    start = max(block.address, lo - lo % _ALIGN)
    return start + (lo - start) % item, hi


def _align_start(st: _Storage, infos: List[Tuple[str, TensorInfo]]) -> None:
    """Moves the storage's start up to a multiple of every member's element size, so that each member is a whole
    number of elements in (its offset is recorded in elements). Every member is aligned to its own element size,
    so such a start exists at or below the first member unless the storage cannot begin that early (an adopted
    block starts later): then two overlapping views of different element sizes cannot be one storage there."""
    step = 1
    for i in st.members:
        step = math.lcm(step, infos[i][1].dtype.itemsize)
    if st.lo % step == 0:
        return
    lo = st.lo + (-st.lo) % step
    first = min(st.members, key=lambda i: infos[i][1].address)
    if lo > infos[first][1].address:
        raise InvalidArgument(
            f"tensor {infos[first][0]!r} and the tensors overlapping it cannot be one storage: its block starts "
            f"{st.lo % step} bytes past a multiple of their largest element ({step} bytes); allocate the block "
            f"with alignment >= {step}, or pass copies"
        )
    st.lo = lo


def _pool_kind(plan: _Plan, kind: Optional[str]) -> Tuple[str, int]:
    if kind not in (None, "host", "host_pinned", "device"):  # (checked even when there is nothing to pack)
        raise InvalidArgument(f"share_tensors: kind must be None, 'host', 'host_pinned' or 'device', not {kind!r}")
    packed = [s for s in plan.storages if s.block is None]
    if kind is not None:
        devices = {s.device_id for s in packed if s.device_type == DL_CUDA}
        return kind, (devices.pop() if len(devices) == 1 else 0)
    places = {(s.device_type == DL_CUDA, s.device_id if s.device_type == DL_CUDA else 0) for s in packed}
    if len(places) > 1:
        raise InvalidArgument(
            "share_tensors packs into one pool: these tensors live on several devices (host and GPU, or two GPUs); "
            "pass kind= to copy them all into one kind, or share each device's tensors under its own name"
        )
    if not places:
        return "host", 0
    gpu, device = places.pop()
    return ("device" if gpu else "host"), device


def _source_stream(plan: _Plan) -> int:
    """torch's current stream on the tensors' device, so that copies follow the work that made the tensors."""
    torch = sys.modules.get("torch")
    gpus = [s.device_id for s in plan.storages if s.device_type == DL_CUDA]
    if torch is None or plan.framework != "torch" or not gpus:
        return 0
    return int(torch.cuda.current_stream(gpus[0]).cuda_stream)


def current_stream_of(values: Iterable[Any]) -> int:
    """torch's current stream on the device of the first CUDA tensor among ``values`` (0, the legacy default
    stream, when there is none): what a copy from them follows when its caller names no stream."""
    torch = sys.modules.get("torch")
    if torch is None:
        return 0
    for v in values:
        if isinstance(v, torch.Tensor) and v.is_cuda:
            return int(torch.cuda.current_stream(v.device).cuda_stream)
    return 0


def _round(n: int, kind: str) -> int:
    step = (2 << 20) if kind == "device" else 4096
    return max(step, (n + step - 1) // step * step)


def _taken(base: str, suffix: str, what: str) -> AlreadyExists:
    """``base + suffix`` (the name shared, and what share_tensors or publish_tensors made of it) is taken."""
    return AlreadyExists(
        f"{what} {base + suffix!r} is taken (an earlier share_tensors or publish_tensors of {base!r}?): close it, "
        f"or remove it with gpuipc.unlink_tensors({base!r}), or pick another name"
    )


class SharedTensors:
    """What :func:`share_tensors` returns: the names it made and the memory they hold. Keep it while the tensors
    should be shared; :meth:`close` (or leaving ``with``) removes the names and frees the packed copies (openers
    keep what they opened). If this process exits, the packed copies are freed once no opener holds them."""

    def __init__(self, name: str, plan: _Plan, kind: str, device: int, mode: int, copies: int, sem_kind: str) -> None:
        self.name = name
        self._plan = plan
        self._kind = kind
        self._mode = mode
        self._pool: Optional[Pool] = None
        self._index_seg: Optional[Segment] = None
        self._made: List[Tuple[str, str]] = []  # (what, name) to unlink on close
        self._blocks: List[Optional[Block]] = [s.block for s in plan.storages]
        self._closed = False
        self._copies = copies
        self._sem_kind = sem_kind
        packed = [i for i, s in enumerate(plan.storages) if s.block is None]
        try:
            if packed:
                sizes = [(plan.storages[i].hi - plan.storages[i].lo + 255) // 256 * 256 for i in packed]
                chunk = _round(sum(sizes), kind)
                try:
                    self._pool = Pool.create(
                        name + ".pool", kind=kind, device=device, mode=mode, chunk_bytes=chunk,
                        max_bytes=chunk * copies, max_blocks=len(packed) * copies + 16,
                    )
                except AlreadyExists:
                    raise _taken(name, ".pool", "pool") from None
                self._made.append(("pool", name + ".pool"))
                stream = _source_stream(plan)
                for i in packed:
                    st = plan.storages[i]
                    block = self._pool.allocate(st.hi - st.lo)
                    _gpuipc._copy_to_view(block.view(), 0, st.lo, st.device_type, st.device_id, st.hi - st.lo, stream)
                    self._blocks[i] = block
            self._setup_extra()
            index = _index.Index.of(self._tensor_meta(), self._storage_meta(), self._versioning(), self._slots())
            head = index.encode()
            try:
                self._index_seg = Segment.create(name, index.total_bytes, kind="host", mode=mode)
            except AlreadyExists:
                raise _taken(name, "", "name") from None
            self._made.append(("segment", name))
            mem = self._index_seg.as_array("uint8")
            mem[: len(head)] = np.frombuffer(head, dtype=np.uint8)
            self._index = index
            self._mem = mem
            _index.write_slot(index, mem, 1 % index.slots, 1, self._refs())  # version 1
        except BaseException:
            self._teardown()
            self._close_handles()  # (not left to the collector)
            raise

    # Hooks for the Publisher (gpuipc/versions.py) ------------------------------------------------------------------
    def _setup_extra(self) -> None:
        pass

    def _versioning(self) -> Optional[Dict[str, Any]]:
        return None

    def _slots(self) -> int:
        return 1

    def _refs(self) -> List[BlockRef]:
        return [b.ref for b in self._blocks if b is not None]

    # ----------------------------------------------------------------------------------------------------------------
    def _tensor_meta(self) -> List[Dict[str, Any]]:
        out = []
        for (key, info), (s, off) in zip(self._plan.infos, self._plan.placement):
            out.append({"name": key, "dtype": info.dtype.name, "shape": list(info.shape), "strides": list(info.strides),
                        "offset": off, "storage": s, "framework": info.framework})
        return out

    def _storage_meta(self) -> List[Dict[str, Any]]:
        out = []
        for st, b in zip(self._plan.storages, self._blocks):
            assert b is not None
            out.append({"pool": b.pool.name, "nbytes": st.hi - st.lo, "offset": st.block_offset,
                        "device": "cuda" if b.is_cuda else "cpu"})
        return out

    def _views(self, blocks: List[Optional[Block]]) -> Dict[str, Any]:
        """Writable views of this process's copies (the framework of the tensors given)."""
        return build(self._index.tensors, storage_views(blocks, self._index.storages), False)

    @property
    def pool(self) -> Optional[Pool]:
        """The pool NAME.pool holding the packed copies (None when every tensor was shared by ref)."""
        return self._pool

    @property
    def tensors(self) -> Dict[str, Any]:
        """This process's views of the shared memory (the packed copies, or the adopted blocks), writable."""
        self._check_open()
        return self._views(self._blocks)

    _what = "shared tensors", "share them"

    def _check_open(self) -> None:
        if self._closed:
            raise Closed(f"{self._what[0]} {self.name!r}: this handle was closed (close() or with); {self._what[1]} "
                         "again to use it")

    def _teardown(self) -> None:
        for b, st in zip(self._blocks, self._plan.storages):
            if b is not None and st.block is None and not b.freed:
                b.free()
        for what, n in reversed(self._made):
            try:
                (Pool.unlink if what == "pool" else Segment.unlink)(n)
            except Error:
                pass
        self._made.clear()

    def close(self) -> None:
        """Removes the names and frees the packed copies (idempotent). Openers keep what they opened."""
        if self._closed:
            return
        self._closed = True
        self._teardown()
        self._close_handles()

    def _close_handles(self) -> None:
        """Closes the handles and drops every reference to their memory: a mapping lives while an array or a Block
        of it does, so the packed copies, the pool's chunks and the index leave this process here, not when this
        object is collected (arrays the caller took from :attr:`tensors` keep theirs)."""
        if self._index_seg is not None:
            self._index_seg.close()
        if self._pool is not None:
            self._pool.close()
        self._blocks = [None] * len(self._blocks)
        self._mem = None
        self._index_seg = None

    def __enter__(self) -> "SharedTensors":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"<gpuipc.SharedTensors {self.name!r} tensors={len(self._plan.infos)} storages={len(self._plan.storages)}>"


def share_tensors(name: str, tensors: Mapping[str, Any], *, mode: int = 0o600, kind: Optional[str] = None) -> SharedTensors:
    """Shares a mapping of names to tensors (a state dict) under ``name``; other processes get it back with
    :func:`open_tensors`.

    Tensors in gpuipc pool memory (a :class:`gpuipc.Block` of this process) travel by BlockRef, with no copy; the
    others are packed into a fresh pool ``NAME.pool`` with one copy per storage (tensors whose bytes overlap are
    one storage, and stay views of one storage in the opener). dtype, shape, strides and storage offset are kept.
    kind: the kind of NAME.pool ("host", "host_pinned", "device"; None: where the tensors are). mode: permission
    bits of every name made (openers need read and write on NAME.pool: they record holds in it).

    Raises AlreadyExists (the name or NAME.pool is taken), InvalidArgument (negative or unaligned strides, tensors
    on several devices without ``kind``), Unsupported (element types), and what Pool.create raises.
    """
    plan = _plan(tensors, adopt=True)
    kind, device = _pool_kind(plan, kind)
    return SharedTensors(name, plan, kind, device, mode, 1, "host")


def unlink_tensors(name: str) -> None:
    """Removes the names a share_tensors or publish_tensors of ``name`` made (NAME, NAME.pool, NAME.version) after
    its owner died without closing. Raises NotFound when none of them exists."""
    unlink_names(((Segment.unlink, name), (Pool.unlink, name + ".pool"), (_gpuipc.Semaphore.unlink, name + ".version")),
                 f"no shared tensors named {name!r}")


def storage_views(blocks: List[Any], storages: List[Dict[str, Any]]) -> List[Any]:
    """Bytes views of each storage: its block's view (Blocks, or ArrayViews of blocks) cut to the storage's range."""
    out = []
    for b, st in zip(blocks, storages):
        v = b if b is None or isinstance(b, _gpuipc.ArrayView) else b.view()
        if v is not None and (st["offset"] or st["nbytes"] != v.nbytes):
            v = v.as_strided((1, 8, 1), "|u1", [st["nbytes"]], [1], st["offset"])
        out.append(v)
    return out


# Opening --------------------------------------------------------------------------------------------------------------
def _torch_if_all(index: _index.Index) -> Any:
    """torch, when every tensor record came from torch and torch is importable; else None."""
    if not index.names or index.frameworks != ["torch"]:
        return None
    try:
        import torch
    except ImportError:
        return None
    return torch


def warn_writable_cpu_tensors(out: Dict[str, Any], name: str) -> None:
    """A UserWarning when a read-only open gave torch CPU tensors: torch has no read-only tensors (a DLPack
    capsule's read-only flag, or a NumPy array's, is not kept), so they look writable over memory mapped read-only,
    and a write kills the process with SIGSEGV. torch.from_numpy warns the same way of a non-writable array."""
    for key, t in out.items():
        if getattr(t, "is_cpu", False) and t.numel() > 0:
            warnings.warn(
                f"open_tensors({name!r}, readonly=True) gave torch CPU tensors (e.g. {key!r}) over memory mapped "
                "read-only: torch has no read-only tensors, and writing to one (an in-place op, load_state_dict into "
                "it) kills the process with SIGSEGV. Copy (t.clone()) what you change, or open with readonly=False.",
                UserWarning,
                stacklevel=4,
            )
            return


def build(tensors: List[Dict[str, Any]], views: List[Any], readonly: bool) -> Dict[str, Any]:
    """Arrays for the tensor records over storage views (ArrayViews or, for torch, DLPack capsules of them; None
    for storages without memory)."""
    torch = None
    if any(t.get("framework") == "torch" for t in tensors):
        try:
            import torch  # noqa: F811 - only when the tensors came from torch
        except ImportError:
            torch = None
    storage_tensors: Dict[int, Any] = {}
    typed: Dict[Tuple[int, str], Any] = {}  # (storage, dtype) -> the storage's memory as a 1-D tensor of dtype
    out: Dict[str, Any] = {}
    for t in tensors:
        dt = dtype_of(t["dtype"])
        shape, strides, s = tuple(t["shape"]), tuple(t["strides"]), t["storage"]
        base = views[s] if s >= 0 else None
        if torch is not None and t.get("framework") == "torch":
            tdt = getattr(torch, dt.name)
            if base is None:
                out[t["name"]] = torch.empty(shape, dtype=tdt)
                continue
            st = storage_tensors.get(s)
            if st is None:
                st = storage_tensors[s] = torch.from_dlpack(base if not hasattr(base, "__dlpack__") else base.__dlpack__())
            key = (s, t["dtype"])
            b = typed.get(key)
            if b is None and st.numel() % dt.itemsize == 0:
                b = typed[key] = st.view(tdt)
            if b is not None:  # one as_strided over the storage (the common case, and the fast one)
                out[t["name"]] = b.as_strided(shape, strides, t["offset"])
            else:
                out[t["name"]] = torch.empty(0, dtype=tdt, device=st.device).set_(
                    st.untyped_storage(), t["offset"], shape, strides
                )
        elif base is None:
            arr = np.empty(shape, dtype=dt.numpy) if dt.numpy is not None else None
            if arr is not None and readonly:
                arr.flags.writeable = False
            out[t["name"]] = arr
        elif base.is_cuda or dt.numpy is None:
            out[t["name"]] = base.as_strided(dt.dlpack, dt.typestr, list(shape), list(strides), t["offset"] * dt.itemsize)
        else:
            try:
                out[t["name"]] = np.ndarray(
                    shape, dtype=dt.numpy, buffer=base, offset=t["offset"] * dt.itemsize,
                    strides=tuple(x * dt.itemsize for x in strides),
                )
            except (ValueError, TypeError, OverflowError) as e:  # NumPy refuses what lies outside the buffer
                raise InvalidArgument(f"tensor {t['name']!r} of a tensor index is malformed (outside its storage: {e})") from None
    return out


def build_torch(
    torch: Any, tensors: List[Dict[str, Any]], storages: List[Dict[str, Any]], capsules: List[Any], span: List[int], offset: List[int]
) -> Dict[str, Any]:
    """torch tensors for the records from one DLPack import per chunk (``_Opened.spans``): each storage is a slice
    of its chunk's storage (a storage of its own, which keeps the chunk's alive), each tensor a ``set_`` over its
    storage, so storage offsets and shared storage are as they were shared. ``offset``: each storage's block's
    byte offset in its chunk (the storage's own offset in its block is added here)."""
    chunks = [torch.from_dlpack(c) for c in capsules]
    whole = [c.untyped_storage() for c in chunks]
    devices = [c.device for c in chunks]
    sliced: Dict[int, Any] = {}
    dtypes: Dict[str, Any] = {}
    out: Dict[str, Any] = {}
    for t in tensors:
        tdt = dtypes.get(t["dtype"])
        if tdt is None:  # the record's name is torch's (not through dtype_of: bfloat16 there imports ml_dtypes, 7 ms)
            tdt = getattr(torch, t["dtype"], None)
            tdt = dtypes[t["dtype"]] = tdt if isinstance(tdt, torch.dtype) else getattr(torch, dtype_of(t["dtype"]).name)
        s = t["storage"]
        if s < 0:
            out[t["name"]] = torch.empty(t["shape"], dtype=tdt)
            continue
        st = sliced.get(s)
        if st is None:
            k, first = span[s], offset[s] + storages[s]["offset"]
            st = sliced[s] = whole[k][first : first + storages[s]["nbytes"]]
        out[t["name"]] = torch.empty(0, dtype=tdt, device=devices[span[s]]).set_(st, t["offset"], t["shape"], t["strides"])
    return out


def read_index(name: str, wait: Optional[float]) -> Tuple[_index.Index, Segment, np.ndarray]:
    seg = Segment.open(name, readonly=True, wait=wait)
    try:
        mem = np.frombuffer(seg.view(), dtype=np.uint8)  # its bytes (as_array's dtype machinery cost ~0.1 ms at first)
        # The name appears when the segment is created, a moment before its owner writes the index: a zero magic
        # means "being written" (segments start zeroed).
        deadline = time.monotonic() + 5.0
        while not mem[:8].any() and time.monotonic() < deadline:
            time.sleep(0.001)
        return _index.decode(name, mem), seg, mem
    except BaseException:
        # Given back now, not by the garbage collector: the traceback keeps this frame, so its locals must let go
        # of the mapping too (an array over it keeps it).
        mem = None  # type: ignore[assignment]
        seg.close()
        raise


#: (uid, gid) of the owner of what names a pool (a tensor index, a stream), which the pool is checked against; None:
#: every pool this process may join is taken (trust_pools=True).
Vouch = Optional[Tuple[int, int]]


def vouch_of(seg: Segment, trust_pools: bool) -> Vouch:
    """The Vouch of the index or stream ``seg``."""
    return None if trust_pools else (seg.owner_uid, seg.owner_gid)


def may_use(pool: Pool, vouch: Vouch, readonly: bool) -> bool:
    """Whether the owner ``vouch`` names could use ``pool`` as this reader will (read, or read and write), as the
    broker judges permissions (docs/segments.md#permissions) from the owner's uid and primary gid: its supplementary
    groups are not known here."""
    if vouch is None:
        return True
    uid, gid = vouch
    if uid == 0 or pool.owner_uid == uid:
        return True
    bits = (pool.mode >> 3) & 7 if pool.owner_gid == gid else pool.mode & 7
    need = 4 if readonly else 6
    return bits & need == need


def join_pool(pool_name: str, readonly: bool, device: Optional[int], owner: str, vouch: Vouch) -> Pool:
    """Joins the pool that another process's tensors live in, when what names it could use it itself (``vouch``):
    a hostile index or stream could otherwise point a reader at memory that only the reader may use (its own
    pools, or others' it may read), for it to load as weights or to write into. Raises PeerDied when it is gone
    (``owner`` names what the tensors belong to), PermissionDenied, and what Pool.open raises."""
    try:
        pool = Pool.open(pool_name, readonly=readonly, device=device)
    except NotFound:
        raise PeerDied(f"the pool {pool_name!r} of {owner} is gone (its owner removed it)") from None
    if may_use(pool, vouch, readonly):
        return pool
    assert vouch is not None
    facts = f"owner uid {pool.owner_uid}, gid {pool.owner_gid}, mode {pool.mode:04o}"
    pool.close()
    raise PermissionDenied(
        f"{owner} names pool {pool_name!r} ({facts}), which its owner (uid {vouch[0]}, gid {vouch[1]}) may not "
        f"{'read' if readonly else 'read and write'}: a reader joins only pools that the owner of what names them "
        "could use, so that nobody can point it at memory only the reader may use. Give the pool a mode that lets "
        "that owner in, or pass trust_pools=True where the owner reaches it through a supplementary group"
    )


@dataclass
class HeldBlock:
    """A block of another process, resolved and held by :class:`HeldBlocks`."""

    view: Any  #: the block's bytes (an ArrayView); it holds the block, so its memory is not reused while it lives
    made: Dict[str, Any] = field(default_factory=dict)  #: what the user made of the view (arrays), dropped with it


class HeldBlocks:
    """Blocks of other processes by (pool name, encoded BlockRef), each resolved and held once, with each pool joined
    once (:func:`join_pool`): for a reader that meets the same refs again and again and keeps them between uses
    (bucketed streaming's reference pieces). :meth:`retain` drops the blocks no longer named (their holds go back:
    the owner's frees take effect) and the pools left without blocks; :meth:`close` drops everything."""

    def __init__(self, readonly: bool, device: Optional[int], owner: str, vouch: Vouch) -> None:
        self._readonly = readonly
        self._device = device
        self._owner = owner
        self._vouch = vouch
        self._pools: Dict[str, Pool] = {}
        self._blocks: Dict[Tuple[str, bytes], HeldBlock] = {}

    def get(self, pool_name: str, ref: bytes) -> HeldBlock:
        """The held block ``ref`` (40 bytes) of pool ``pool_name``, resolved the first time only. Raises
        InvalidArgument when the ref is stale (the block was freed) or forged, PeerDied when the pool is gone,
        InvalidState while it is paused."""
        key = (pool_name, ref)
        held = self._blocks.get(key)
        if held is not None:
            return held
        pool = self._pools.get(pool_name)
        if pool is not None and pool.id != BlockRef.from_bytes(ref).pool:  # the name was made again: another pool
            pool.close()  # the blocks held in it keep it joined until retain drops them
            pool = None
        if pool is None:
            pool = self._pools[pool_name] = join_pool(
                pool_name, self._readonly, self._device, self._owner, self._vouch
            )
        # the one call open_tensors resolves and holds blocks with (_Opened.views)
        held = self._blocks[key] = HeldBlock(pool._pool.views_of(ref, self._readonly, True, False)[0])
        return held

    def map_chunks(self, keys: Iterable[Tuple[str, bytes]]) -> None:
        """Maps, for the blocks ``keys`` (pool name, encoded BlockRef) not held yet, the chunks they lie in: one broker
        round trip per pool (Pool.map_chunks) where resolving them one by one would take one per chunk. Joins their
        pools as :meth:`get` would. Errors are left to the :meth:`get` that needs the block, which raises them."""
        by_pool: Dict[str, List[bytes]] = {}
        for pool_name, ref in keys:
            if (pool_name, ref) not in self._blocks:
                by_pool.setdefault(pool_name, []).append(ref)
        for pool_name, refs in by_pool.items():
            try:
                pool = self._pools.get(pool_name)
                if pool is None:
                    pool = self._pools[pool_name] = join_pool(
                        pool_name, self._readonly, self._device, self._owner, self._vouch
                    )
                pool._pool.map_chunks(b"".join(refs))
            except Error:
                pass

    def retain(self, keys: Any) -> int:
        """Keeps only the blocks whose (pool name, ref) is in ``keys`` and the pools they lie in; returns how many
        blocks were dropped."""
        gone = [k for k in self._blocks if k not in keys]
        for k in gone:
            del self._blocks[k]
        if gone:
            left = {name for name, _ in self._blocks}
            for name in [n for n in self._pools if n not in left]:
                self._pools.pop(name).close()
        return len(gone)

    def close(self) -> None:
        self.retain(())


class _Opened:
    """The pools of one index, opened once each."""

    def __init__(self, name: str, index: _index.Index, readonly: bool, device: Optional[int], vouch: Vouch) -> None:
        self.name = name
        self.index = index
        self.readonly = readonly
        self.pools: Dict[str, Pool] = {}
        self._dtypes: Optional[List[Any]] = None
        used = {index.storage_flat[i] for i in range(0, len(index.storage_flat), 4)}
        if not all(type(k) is int and 0 <= k < len(index.pools) for k in used):
            raise InvalidArgument(f"tensor index {name!r} is malformed (a storage's pool)")
        try:
            for k, pool_name in enumerate(index.pools):
                if k not in used or pool_name in self.pools:
                    continue
                self.pools[pool_name] = join_pool(pool_name, readonly, device, f"tensors {name!r}", vouch)
        except BaseException:
            self.close()  # the pools joined so far, now: the error's traceback keeps this half-made object
            raise

    def map_chunks(self, raw: bytes) -> None:
        """Maps the chunks the slot's raw refs name, one broker round trip per pool (Pool.map_chunks) where
        resolving would take one per chunk. A chunk that cannot be mapped is left to the resolve that needs it,
        which raises its error where the open would have without this."""
        for pool, lo, hi in self._run_bounds():
            try:
                pool.map_chunks(raw[lo * 40 : hi * 40])
            except Error:
                pass

    def views(self, raw: bytes, dlpack: bool = False) -> List[Any]:
        """Held views of every storage (its range of its block; DLPack capsules of them with ``dlpack``), from the
        slot's raw refs (40 bytes each), one call per run of storages in one pool; InvalidArgument when a ref is
        stale (freed)."""
        self.map_chunks(raw)
        out: List[Any] = []
        for pool, lo, hi in self._run_bounds():
            out.extend(pool.views_of(raw[lo * 40 : hi * 40], self.readonly, True, False))
        out = storage_views(out, self.index.storages)
        return [v.__dlpack__() for v in out] if dlpack else out

    def spans(self, raw: bytes) -> Tuple[List[Any], List[int], List[int]]:
        """(capsules, span, offset): one held DLPack capsule per chunk the storages lie in, and for each storage the
        capsule it lies in and its block's byte offset there, from the slot's raw refs. The holds of a chunk's
        storages are given back together when everything made from its capsule is gone. InvalidArgument when a ref
        is stale."""
        self.map_chunks(raw)
        return self._spans_of(raw, list(range(self.index.storage_count)))

    def tensors(self, raw: bytes, readonly: bool) -> Dict[str, Any]:
        """The tensors of the index over the slot's raw refs: torch tensors when every record is torch's (see
        torch_tensors), else arrays over per-storage views."""
        torch = _torch_if_all(self.index)
        out = self.torch_tensors(torch, raw) if torch is not None else build(self.index.tensors, self.views(raw), readonly)
        if readonly and any(p.kind != "device" for p in self.pools.values()):
            warn_writable_cpu_tensors(out, self.name)
        return out

    def _dtype_layouts(self) -> List[Any]:
        """((code, bits, lanes), typestr) of each dtype of the index, or None where DLPack has none."""
        if self._dtypes is None:
            self._dtypes = [dlpack_of_name(d) for d in self.index.dtypes]
        return self._dtypes

    def torch_tensors(self, torch: Any, raw: bytes) -> Dict[str, Any]:
        """torch tensors over the slot's raw refs. A tensor alone on its storage, at its start (every tensor of a
        dict built under gpuipc.torch.MemPool but tied ones) is one DLPack import of a capsule typed in C++
        (Pool.tensors_of_index reads the index's columns: no Python work per tensor); its torch storage is the
        storage's bytes. The others go through build_torch: one import per chunk, a storage slice per storage, a
        set_ per tensor, so that tensors sharing a storage share one here too."""
        index = self.index
        from_dlpack = getattr(torch._C, "_from_dlpack", None) or torch.utils.dlpack.from_dlpack
        self.map_chunks(raw)
        made: List[Any] = [None] * index.tensor_count
        count = 0
        for pool, lo, hi in self._run_bounds():
            for i, capsule in pool.tensors_of_index(raw[lo * 40 : hi * 40], lo, index.flat_bytes, index.storage_bytes,
                                                    self._dtype_layouts(), self.readonly, True):
                if i >= len(made):  # more records than names: the index is malformed
                    raise InvalidArgument(f"tensor index {self.name!r} is malformed (tensor records)")
                made[i] = from_dlpack(capsule)
                count += 1
        if count == index.tensor_count:
            return dict(zip(index.names, made))
        tensors = index.tensors
        slow = sorted({t["storage"] for i, t in enumerate(tensors) if made[i] is None and t["storage"] >= 0})
        rest = [t for i, t in enumerate(tensors) if made[i] is None]
        if slow:
            for s in slow:  # a storage lies inside its block (the typed path checks this in C++)
                st = index.storages[s]
                block_bytes = struct.unpack_from("<Q", raw, 40 * s + 24)[0]  # BlockRef.size
                if not (0 <= st["offset"] and 0 <= st["nbytes"] and st["offset"] + st["nbytes"] <= block_bytes):
                    raise InvalidArgument(f"tensor index {self.name!r} is malformed (storage {s} outside its block)")
            renum = {s: k for k, s in enumerate(slow)}
            rest = [dict(t, storage=renum[t["storage"]]) if t["storage"] >= 0 else t for t in rest]
            capsules, span, offset = self._spans_of(raw, slow)
        else:
            capsules, span, offset = [], [], []
        built = build_torch(torch, rest, [index.storages[s] for s in slow], capsules, span, offset)
        return {name: made[i] if made[i] is not None else built[name] for i, name in enumerate(index.names)}

    def _run_bounds(self) -> Iterator[Tuple[Any, int, int]]:
        """(pool, first, end) for each run of consecutive storages in one pool."""
        f, pools = self.index.storage_flat, self.index.pools
        n = len(f) // 4
        i = 0
        while i < n:
            j = i
            while j < n and f[4 * j] == f[4 * i]:
                j += 1
            yield self.pools[pools[f[4 * i]]]._pool, i, j
            i = j

    def _spans_of(self, raw: bytes, which: List[int]) -> Tuple[List[Any], List[int], List[int]]:
        """spans for the storages ``which`` only (in that order), as ``spans`` makes them for all."""
        capsules: List[Any] = []
        span: List[int] = []
        offset: List[int] = []
        by_pool: Dict[str, List[int]] = {}
        for s in which:
            by_pool.setdefault(self.index.storages[s]["pool"], []).append(s)
        order: List[int] = []
        for pool_name, ss in by_pool.items():
            c, sp, o = self.pools[pool_name]._pool.spans_of(b"".join(raw[s * 40 : s * 40 + 40] for s in ss), self.readonly, True, True)
            first = len(capsules)
            capsules.extend(c)
            span.extend(k + first for k in sp)
            offset.extend(o)
            order.extend(ss)
        pos = {s: k for k, s in enumerate(order)}
        return capsules, [span[pos[s]] for s in which], [offset[pos[s]] for s in which]

    def close(self) -> None:
        for p in self.pools.values():
            p.close()


def open_tensors(
    name: str, *, readonly: bool = True, wait: Optional[float] = None, device: Optional[int] = None,
    versioned: bool = False, trust_pools: bool = False,
) -> Any:
    """The tensors shared under ``name``, as a dict of views (no copy): NumPy arrays for host memory, ArrayViews
    (DLPack, ``__cuda_array_interface__``) for GPU memory, torch tensors where torch tensors were shared and torch
    is importable. dtype, shape, strides, storage offset and shared storage are kept.

    One open of the index, one pool join per pool, one resolve (and hold) per storage; the views hold their memory
    until they go. readonly: map read-only (NumPy arrays are not writeable). wait: seconds to wait for the name.
    device: the GPU that maps device memory (None: the current one). versioned: return a :class:`gpuipc.Reader`
    (publish_tensors) instead of a dict. trust_pools: join every pool the index names that this process may join;
    by default only those the index's owner could use itself as this open will (read, or read and write), judged
    from its uid and primary gid (docs/torch.md#whose-pools). Raises NotFound, Timeout, InvalidArgument (not a
    tensor index), PeerDied (the owner freed the tensors or died before this open), PermissionDenied.
    """
    if versioned:
        from .versions import Reader

        return Reader(name, readonly=readonly, wait=wait, device=device, trust_pools=trust_pools)
    index, seg, mem = read_index(name, wait)
    try:
        opened = _Opened(name, index, readonly, device, vouch_of(seg, trust_pools))
        try:
            for _ in range(1000):
                v = _index.read_stamp(index, mem, 0) if index.slots == 1 else None
                if v == 0:  # the owner is rewriting the slot (its stamp goes back up once the refs are written)
                    time.sleep(0.001)
                    continue
                if v is None:
                    from .versions import Reader

                    with Reader(name, readonly=readonly, device=device, trust_pools=trust_pools,
                                _index=(index, seg, mem)) as r:
                        return r.snapshot()[1]
                raw = _index.read_refs_raw(index, mem, 0)
                try:
                    out = opened.tensors(raw, readonly)
                except InvalidArgument as e:
                    if not _index.is_stale(e):
                        raise
                    raise PeerDied(f"the tensors of {name!r} were freed (their owner closed or died): {e}") from None
                if _index.read_stamp(index, mem, 0) == v:
                    return out
            raise PeerDied(f"the index of {name!r} keeps changing")
        finally:
            opened.close()
    finally:
        del mem  # an error's traceback keeps this frame: the index's mapping must not stay with it
        seg.close()
