"""Versioned tensors for weight sync: a Publisher updates a set of shared tensors, Readers see each version
(docs/torch.md).

The version counter is a gpuipc Semaphore NAME.version (a timeline: signal = a new version; the broker poisons it
when the publisher dies, so readers' waits raise PeerDied). versions=1: the publisher writes in place and readers
see the same memory (an update may be seen half done unless readers wait for it). versions=2: writes go to a back
buffer of freshly allocated blocks; update() publishes their refs in index slot v % 2 and signals v; the old front
is freed, and its memory is reused only when no reader holds it: a reader that pins a version never sees it change.
"""

from __future__ import annotations

import contextlib
import time
from typing import Any, Dict, Iterator, List, Mapping, Optional, Tuple

from . import _gpuipc, _index
from ._stream_format import _signal_mode
from ._streams import stream_handle
from ._tensorinfo import DL_CUDA, describe
from .errors import AlreadyExists, Closed, Error, InvalidArgument, InvalidState, PeerDied, QuotaExceeded
from .pool import Block
from .semaphore import Semaphore
from .tensors import (
    SharedTensors,
    _Opened,
    _plan,
    _pool_kind,
    _taken,
    build,
    current_stream_of,
    read_index,
    storage_views,
    vouch_of,
)

__all__ = ["publish_tensors", "Publisher", "Reader"]

#: How long update() waits for readers to release old versions when the pool is full (seconds).
BACK_BUFFER_WAIT = 10.0


class Publisher(SharedTensors):
    """What :func:`publish_tensors` returns. Write new weights into :attr:`tensors` (versions=1: the live memory;
    versions=2: the back buffer), then :meth:`update`; or call :meth:`update_from` with a state dict."""

    _what = "publisher", "publish"

    def __init__(self, name: str, tensors: Mapping[str, Any], versions: int, mode: int, kind: Optional[str]) -> None:
        if type(versions) is not int or versions not in (1, 2):  # (2.0 and True are "in" (1, 2) too)
            raise InvalidArgument(f"versions must be 1 (in place) or 2 (double buffered), not {versions!r}")
        self._versions = versions
        self._sem: Optional[Semaphore] = None
        self._version = 1
        self._back: Optional[List[Block]] = None
        self._back_raw = b""
        # The stream the last update() was ordered after: the front's writes ran there, so a copy of the front into
        # a new back buffer follows it (None: the legacy default stream, or the writes were done from the host).
        self._written_on: Any = None
        plan = _plan(tensors, adopt=versions == 1)
        kind, device = _pool_kind(plan, kind)
        if versions == 2 and any(s.block is not None for s in plan.storages):
            raise InvalidArgument("internal: versions=2 packs every tensor")
        copies = 1 if versions == 1 else 4  # versions=2: front, back, and room for versions readers still pin
        # update(stream=...) orders its signal after the stream only on a host_pinned counter: one is needed whenever
        # a tensor lives on a GPU, packed or shared by reference (a dict born in a gpuipc.torch.MemPool packs
        # nothing, and its pool kind then reads "host").
        gpus = sorted({s.device_id for s in plan.storages if s.device_type == DL_CUDA})
        self._sem_device = gpus[0] if gpus else device
        sem_kind = "host_pinned" if kind != "host" or gpus else "host"
        super().__init__(name, plan, kind, device, mode, copies, sem_kind)

    def _setup_extra(self) -> None:
        try:
            self._sem = Semaphore.create(
                self.name + ".version", initial=1, kind=self._sem_kind, device=self._sem_device,
                mode=_signal_mode(self._mode)
            )
        except AlreadyExists:
            raise _taken(self.name, ".version", "semaphore") from None
        self._made.append(("semaphore", self.name + ".version"))

    def _versioning(self) -> Optional[Dict[str, Any]]:
        return {"semaphore": self.name + ".version", "versions": self._versions}

    def _slots(self) -> int:
        return self._versions

    def _teardown(self) -> None:
        if self._back is not None:
            for b in self._back:
                b.free()
            self._back = None
        for what, n in list(self._made):
            if what == "semaphore":
                try:
                    _gpuipc.Semaphore.unlink(n)
                except Error:
                    pass
                self._made.remove((what, n))
        if self._sem is not None:
            self._sem.close()
            self._sem = None
        super()._teardown()

    @property
    def version(self) -> int:
        """The last version published (1 after publish_tensors)."""
        return self._version

    @property
    def versions(self) -> int:
        return self._versions

    def _ensure_back(self, copy_front: bool) -> List[Block]:
        """versions=2: the back buffer, allocated (waiting for readers to let old versions go) and, when asked,
        filled with the front's contents."""
        if self._back is not None:
            return self._back
        if self._pool is None:  # nothing to pack: every tensor is empty
            self._back, self._back_raw = [], b""
            return self._back
        deadline = time.monotonic() + BACK_BUFFER_WAIT
        back: List[Block] = []
        try:
            for st in self._plan.storages:
                while True:
                    try:
                        back.append(self._pool.allocate(st.hi - st.lo))
                        break
                    except QuotaExceeded as e:
                        if time.monotonic() > deadline:
                            raise QuotaExceeded(
                                f"publisher {self.name!r}: no room for a back buffer for {BACK_BUFFER_WAIT:g} s: readers "
                                f"still pin old versions (leave Reader.pin() sooner, drop old arrays): {e}"
                            ) from None
                        time.sleep(0.005)
        except BaseException:
            for b in back:
                b.free()
            raise
        if copy_front:
            after = stream_handle(self._written_on)  # the front's last writes ran there: the copy synchronizes it
            for dst, src in zip(back, self._blocks):
                assert src is not None
                v = src.view()
                _gpuipc._copy_to_view(dst.view(), 0, src.address, DL_CUDA if v.is_cuda else 1, _device(v), src.size,
                                      after)
        self._back = back
        self._back_raw = b"".join(bytes(b.ref) for b in back)  # the slot's contents, ready before update()
        return back

    @property
    def tensors(self) -> Dict[str, Any]:
        """Writable views to put the next version in: versions=1 the live memory, versions=2 the back buffer
        (holding a copy of the current version at first). versions=2: take them again after each update(); views
        from before it are of the version just published, and after the next one of freed memory."""
        self._check_open()
        if self._versions == 1:
            return self._views(self._blocks)
        return self._views(list(self._ensure_back(copy_front=True)))

    def update(self, stream: Any = None) -> int:
        """Publishes the next version once the new weights are in place and returns its number. stream: device
        pools: signal in stream order after the work that wrote them (None: from the host, now)."""
        self._check_open()
        handle = stream_handle(stream)  # a bad stream raises here, before anything is published
        v = self._version + 1
        if self._versions == 2:
            back = self._ensure_back(copy_front=True)
            _index.write_slot(self._index, self._mem, v % 2, v, self._back_raw)
        if stream is not None and self._sem_kind == "host_pinned":
            self._sem.signal(v, handle, wake_host=True)
        else:
            self._sem.signal_host(v)
        self._version = v
        self._written_on = stream
        if self._versions == 2:
            old, self._blocks, self._back = self._blocks, list(back), None
            for b in old:
                if b is not None:
                    b.free(handle)  # readers that hold it keep it
        return v

    def update_from(self, state_dict: Mapping[str, Any], stream: Any = None) -> int:
        """Copies ``state_dict`` (names of the published tensors to new values of the same dtype and shape) into
        place, then :meth:`update`. Tensors it leaves out keep their values. The copies follow ``stream`` (None:
        torch's current stream on the values' device, for torch tensors) and are done when this returns. Raises
        InvalidArgument for unknown names, or another dtype or shape."""
        self._check_open()
        # Every entry is checked before anything is written: a bad one leaves the live memory (versions=1) and the
        # back buffer (versions=2) as they were.
        known = {t["name"]: t for t in self._index.tensors}
        gpu_back = self._kind == "device"  # versions=2 packs every tensor into the pool
        live = storage_views(self._blocks, self._index.storages) if self._versions == 1 else None
        copies = []
        for key, value in state_dict.items():
            meta = known.get(key) if isinstance(key, str) else None
            if meta is None:
                raise InvalidArgument(f"update_from: {key!r} is not one of the tensors published as {self.name!r}")
            info = describe(value, f"update_from[{key!r}]")
            if info.dtype.name != meta["dtype"] or list(info.shape) != meta["shape"]:
                raise InvalidArgument(
                    f"update_from[{key!r}]: {info.dtype.name}{list(info.shape)} does not match the published "
                    f"{meta['dtype']}{meta['shape']}"
                )
            if meta["storage"] < 0:
                continue
            flat = _contiguous(info.shape, info.strides) and _contiguous(info.shape, tuple(meta["strides"]))
            if not flat and (live[meta["storage"]].is_cuda if live is not None else gpu_back):
                raise InvalidArgument(f"update_from[{key!r}]: a strided GPU tensor: copy it into pub.tensors[{key!r}] yourself")
            copies.append((key, value, meta, info, flat))
        # The copies follow the work that made the values: the stream given, else torch's current stream.
        handle = stream_handle(stream) if stream is not None else current_stream_of(state_dict.values())
        full = {t["name"] for t in self._index.tensors if t["storage"] >= 0} <= set(state_dict)
        fresh = self._versions == 2 and self._back is None
        blocks = self._blocks if self._versions == 1 else self._ensure_back(copy_front=not full)
        views = storage_views(blocks, self._index.storages)
        try:
            for key, value, meta, info, flat in copies:
                dst = views[meta["storage"]]
                if flat:
                    _gpuipc._copy_to_view(dst, meta["offset"] * info.dtype.itemsize, info.address, info.device_type,
                                          info.device_id, info.extent, handle)
                else:
                    build([meta], views, False)[key][...] = value
        except BaseException:
            if fresh and self._back is not None:  # a back buffer this call made and did not fill: not kept
                for b in self._back:
                    b.free()
                self._back, self._back_raw = None, b""
            raise
        return self.update(stream)


def _contiguous(shape: Tuple[int, ...], strides: Tuple[int, ...]) -> bool:
    step = 1
    for n, s in zip(reversed(shape), reversed(strides)):
        if n > 1 and s != step:
            return False
        step *= n
    return True


def _device(view: Any) -> int:
    return view.__dlpack_device__()[1]


def publish_tensors(
    name: str, tensors: Mapping[str, Any], *, versions: int = 1, mode: int = 0o600, kind: Optional[str] = None
) -> Publisher:
    """Shares ``tensors`` like :func:`gpuipc.share_tensors` as version 1, with a version counter readers follow
    (:class:`Reader`, ``open_tensors(name, versioned=True)``). versions=1: updates are written in place;
    versions=2: double buffered, so a reader that pins a version never sees half an update (the pool holds up to
    4 copies: front, back and versions readers still pin). Raises what share_tensors raises."""
    return Publisher(name, tensors, versions, mode, kind)


class Reader:
    """A reader of published tensors: :attr:`version`, :meth:`wait_version`, :meth:`pin`, :attr:`tensors`."""

    def __init__(
        self, name: str, *, readonly: bool = True, wait: Optional[float] = None, device: Optional[int] = None,
        trust_pools: bool = False, _index: Optional[Tuple[Any, Any, Any]] = None,
    ) -> None:
        self.name = name
        index, self._seg, self._mem = _index if _index is not None else read_index(name, wait)
        self._owns_seg = _index is None
        if not index.versioning:
            self._let_go_of_index()
            raise InvalidArgument(f"tensors {name!r} were shared without versions: use gpuipc.open_tensors({name!r})")
        self._index = index
        self._readonly = readonly
        try:
            # A host_pinned counter is registered in the context of the GPU this reader was given (`device`), as
            # its pools are mapped; None: the current context's GPU (say torch's current device), else GPU 0. It was
            # GPU 0's whatever `device` said, a context every reader on another GPU made (hundreds of MiB there, or
            # an error when GPU 0 is exclusive).
            self._sem = Semaphore.open(index.versioning["semaphore"], role="waiter", wait=wait,
                                       device=-1 if device is None else device)
            try:
                self._opened = _Opened(name, index, readonly, device, vouch_of(self._seg, trust_pools))
            except BaseException:
                self._sem.close()
                raise
        except BaseException:
            self._let_go_of_index()
            raise
        self._last: Optional[Tuple[int, Dict[str, Any]]] = None

    def _let_go_of_index(self) -> None:
        """A constructor that fails gives the index's mapping back at once, not with the garbage collector: the
        error's traceback keeps this half-made Reader, and an array over the mapping keeps the mapping."""
        self._mem = None
        if self._owns_seg:
            self._seg.close()

    @property
    def version(self) -> int:
        """The latest version published."""
        return self._sem.value

    @property
    def versions(self) -> int:
        return int(self._index.versioning["versions"])

    def wait_version(
        self, version: int, stream: Any = None, timeout: Optional[float] = None, spin: Optional[float] = None
    ) -> int:
        """Waits until version ``version`` is published.

        stream None: on the host (Ctrl-C interrupts); returns the latest version. Raises Timeout, PeerDied (the
        publisher died; the last version stays readable), Closed (it closed). spin: seconds to poll before
        sleeping (None: 20 us); an update signalled in stream order is seen within microseconds only by a waiter
        still polling (a sleeper is woken by a host callback, some 100 us later), at the cost of a CPU core.

        stream given (a torch.cuda.Stream, an int handle, or anything with ``cuda_stream`` / ``__cuda_stream__``):
        enqueues the wait on that stream and returns at once (the version seen now, maybe lower): work enqueued on
        the stream after it runs once the publisher has signalled ``version`` (stream-ordered after its copies with
        ``update(stream=...)``). ``timeout`` does not apply. Needs a GPU publisher (its counter is host_pinned);
        for tensors published from host memory it raises InvalidState. Raises PeerDied/Closed when the publisher
        is already gone (nothing is enqueued). If the publisher dies after the wait was enqueued, the broker's
        poison releases the stream: the work after the wait runs on whatever the memory holds then (versions=1:
        possibly a half-written update; versions=2: the snapshot this reader holds), and the next call on this
        reader (wait_version, :attr:`status`) reports it: after synchronizing the stream, check
        ``reader.status == "ok"`` before trusting what that work read."""
        if stream is None:
            return self._sem.wait_host(version, timeout, spin)
        try:
            self._sem.wait(version, stream)
        except InvalidState as e:
            if self._sem.status != "ok":
                raise
            raise InvalidState(
                f"wait_version({version}, stream=...) on {self.name!r}: its version counter is host memory only "
                f"(tensors published from host memory): wait on the host (stream=None) ({e})"
            ) from None
        return self._sem.value

    @property
    def status(self) -> str:
        """"ok" while the publisher lives; "peer_died" (it crashed or was killed) or "closed" (it closed)."""
        return self._sem.status

    def snapshot(self) -> Tuple[int, Dict[str, Any]]:
        """(version, tensors) of the latest version. With versions=2 the arrays hold that version's memory while
        they live: it never changes under them. Raises PeerDied when the publisher is gone and nothing was read."""
        idx, mem = self._index, self._mem
        stale_since: Optional[Tuple[int, float]] = None  # (version, when) a ref of that version was first stale
        for _ in range(10000):
            v = self._sem.value
            k = v % idx.slots
            # versions=1: one slot, written once (stamp 1); versions=2: slot v % 2 carries stamp v
            want = v if idx.slots == 2 else 1
            if _index.read_stamp(idx, mem, k) != want:
                if self._sem.status != "ok" and self._last is not None:
                    return self._last
                time.sleep(0.0005)
                continue
            raw = _index.read_refs_raw(idx, mem, k)
            try:
                out = self._opened.tensors(raw, self._readonly)
            except InvalidArgument as e:
                if not _index.is_stale(e):
                    raise
                if self._sem.value == v and self._sem.status != "ok":
                    if self._last is not None:
                        return self._last
                    raise PeerDied(f"the publisher of {self.name!r} died and its last version was freed") from None
                if self._sem.value == v:
                    # Freed, and no newer version: usually one on its way (update() frees the old front after it
                    # signals). One that stays so is a block the live publisher freed while its version was current
                    # (a tensor shared by reference, replaced without an update): say which, rather than retry
                    # 10000 times and call it a death.
                    now = time.monotonic()
                    if stale_since is None or stale_since[0] != v:
                        stale_since = (v, now)
                    elif now - stale_since[1] > 0.2:
                        raise InvalidArgument(
                            f"tensors {self.name!r}: version {v} names memory its publisher freed while it was "
                            f"current ({e}); the publisher must update() after replacing a tensor"
                        ) from None
                    time.sleep(0.0005)
                continue  # freed under us: a newer version is out
            if _index.read_stamp(idx, mem, k) == want:
                self._last = (v, out)
                return self._last
        raise PeerDied(f"tensors {self.name!r}: could not read a consistent version")

    @property
    def tensors(self) -> Dict[str, Any]:
        """The latest version's tensors (re-read when a newer version is out; after the publisher died, the last
        one read)."""
        if self._last is not None and (self._last[0] == self._sem.value or self._sem.status != "ok"):
            return self._last[1]
        return self.snapshot()[1]

    @contextlib.contextmanager
    def pin(self) -> Iterator["Pinned"]:
        """``with reader.pin() as p: use(p.tensors)``: a version that does not change while pinned (versions=2);
        on exit the reader drops its references (arrays you kept still hold their memory). Holds are dropped from
        the host, not in stream order: a stream still reading the tensors must be synchronized first (once a newer
        version is out, the publisher's next back buffer may take those blocks)."""
        v, tensors = self.snapshot()
        pinned = Pinned(v, tensors)
        try:
            yield pinned
        finally:
            pinned.tensors = {}
            self._last = None

    def close(self) -> None:
        """Leaves (idempotent); arrays already returned keep their memory."""
        self._last = None
        self._sem.close()
        self._opened.close()
        self._let_go_of_index()

    def __enter__(self) -> "Reader":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class Pinned:
    """A pinned version: :attr:`version` and its :attr:`tensors`."""

    __slots__ = ("version", "tensors")

    def __init__(self, version: int, tensors: Dict[str, Any]) -> None:
        self.version = version
        self.tensors = tensors
