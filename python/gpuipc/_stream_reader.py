"""StreamReader: the reading side of bucketed streaming (streaming.py describes the format)."""

from __future__ import annotations

import contextlib
import math
import time
import warnings
from typing import Any, Dict, Iterator, List, Mapping, Optional, Tuple

import numpy as np

from ._arrays import make_array
from ._dtypes import dtype_of
from ._ints import seconds
from ._tensorinfo import describe
from .errors import (
    AlreadyExists,
    ChecksumMismatch,
    Closed,
    Error,
    InvalidArgument,
    InvalidState,
    NotFound,
    PeerDied,
    ProtocolError,
    QuotaExceeded,
    Timeout,
)
from ._devices import device_ordinal, resolve as _device
from .pool import Pool
from .segment import Segment
from .semaphore import Semaphore
from ._index import is_stale
from .tensors import HeldBlock, HeldBlocks, vouch_of

from ._stream_format import (
    _D_ABORT,
    _D_LAST,
    _Desc,
    _EVICTED,
    _MASK64,
    _REFERENCE,
    _STAGED,
    _admit_offset,
    _checksum_np,
    _checksum_torch,
    _contiguous,
    _Copies,
    _is_torch,
    _numpy_bytes,
    _raise_poisoned,
    _read_desc,
    _read_header,
    _signal_mode,
    _join_name,
    _slot_name,
    _torch,
    _torch_bytes,
    _torch_stream,
)

class StreamItem(tuple):
    """One piece of a version, as :meth:`StreamReader.receive_iter` yields it: unpacks as ``(name, view)``. A
    tensor that fits in one bucket is one item with its full shape (``start == 0``, ``complete``); a split tensor
    comes as several items, each a flat 1-D view of ``count`` elements starting at element ``start`` of the
    flattened tensor. ``shape`` and ``dtype`` are those of the whole tensor."""

    name: str
    view: Any
    start: int
    count: int
    shape: Tuple[int, ...]
    dtype: str
    complete: bool

    def __new__(cls, name: str, view: Any, start: int, count: int, shape: Tuple[int, ...], dtype: str) -> "StreamItem":
        self = super().__new__(cls, (name, view))
        self.name, self.view, self.start, self.count, self.shape, self.dtype = name, view, start, count, shape, dtype
        self.complete = start == 0 and count == math.prod(shape)
        return self


def _staging_device(name: str, head: Any) -> int:
    """This process's ordinal of the GPU the staging pool lives on (device staging), else 0. The header's
    ``device`` is the publisher's ordinal, which names another GPU here when CUDA_VISIBLE_DEVICES differs: the
    pool's first chunk names it by UUID. A GPU this process does not see: its first GPU maps the pool (peer)."""
    if not head.device_staging:
        return 0
    ordinal = device_ordinal(Segment.stat(name + ".pool.chunk.0").device_uuid)
    return ordinal if ordinal >= 0 else 0


class StreamReader:
    """A reader of stream ``name`` (:func:`stream_reader`): :meth:`receive` or :meth:`receive_iter` per version.
    A context manager (``with`` closes)."""

    def __init__(
        self, name: str, *, device: Optional[int] = None, wait: Optional[float] = None, trust_pools: bool = False
    ) -> None:
        self.name = name
        self._closed = False
        self._slot_sem: Optional[Semaphore] = None
        self._filled: Optional[Semaphore] = None
        self._pool: Optional[Pool] = None
        self._views: List[Any] = []
        self._stage_torch: List[Any] = []
        self._stage_np: List[np.ndarray] = []
        self._token = 0  # the first bucket this reader reads (its admit word), 0 until admitted
        self._next = 0  # the next bucket to read
        self._in_version = False  # a version was left half read (error, timeout): skip its rest first
        self._walks = 0  # calls that read buckets (_buckets) so far: an older one's iterator is stale
        self._handed_all = False  # the bucket _buckets yielded last was read whole (every piece handed out)
        self._stream_released = 0  # the last bucket given back on a stream (device staging)
        self._last_stream: Any = None  # the torch stream of the last receive (device staging)
        self._broken: Optional[str] = None  # why a malformed bucket stopped this reader
        self._version = 0
        self._layouts: Dict[bytes, Any] = {}  # bucket layouts seen (descriptor bodies), decoded once
        # receive's copy plans: (id of a layout's pieces, ring slot) -> (pieces, names, their tensors, their data
        # pointers, destination views, source views, skipped names, the publisher's blocks it copies from): a
        # version laid out like the last one, into the same tensors, costs a check per tensor and one copy call per
        # bucket. Holds views of those tensors.
        self._plans: Dict[Tuple[int, int], Any] = {}
        # The publisher's blocks that reference pieces named (pools joined, blocks resolved and held), kept while
        # versions keep naming them; and those the version being read named (what is kept after it).
        self._held: Optional[HeldBlocks] = None
        self._used: set = set()
        self._sent: Dict[str, List[Any]] = {}  # this version's tensors so far: [dtype, shape, bytes sent, bytes]
        # The tables of blocks (descriptors' `blocks` lists, by id, kept alive here so that an id is not reused) whose
        # chunks were mapped ahead (_map_ahead), cleared with the held blocks. A publisher that sends the same tensors
        # sends the same descriptor bodies, which decode to the same table objects (_read_desc's layouts).
        self._mapped: Dict[int, Any] = {}
        #: Names the last receive() skipped (sent, but not in its ``into``).
        self.skipped: List[str] = []
        self._mem: Optional[np.ndarray] = None  # the control segment's bytes
        self._seg = Segment.open(name, readonly=True, wait=wait)
        try:
            mem = self._seg.as_array("uint8")
            deadline = time.monotonic() + 5.0
            while not mem[:8].any() and time.monotonic() < deadline:  # created a moment before it is written
                time.sleep(0.001)
            self._mem = mem
            self._head = h = _read_header(name, mem)
            self._device = _device(device) if device is not None else _staging_device(name, h)
            try:
                self._pool = Pool.open(name + ".pool", readonly=True, device=self._device if h.device_staging else None)
            except NotFound:
                raise PeerDied(f"stream {name!r}: its pool is gone (the publisher closed or died)") from None
            try:  # the buckets' chunks in one broker round trip; a chunk that fails is tried again by its view
                self._pool.map_chunks(h.refs)
            except Error:
                pass
            self._views = [self._pool._pool.view(r._tuple(), True, True) for r in h.refs]  # held: mapped once
            if any(v.nbytes < h.bucket_bytes for v in self._views):
                # Pieces are checked against bucket_bytes: a header claiming more than its staging blocks hold
                # would let a piece past a block's end through, and its copy read less than it says.
                raise InvalidArgument(f"stream {name!r} is malformed (its header's bucket_bytes {h.bucket_bytes} "
                                      f"is more than its staging blocks hold)")
            self._held = HeldBlocks(True, self._device if h.device_staging else None, f"stream {name!r}",
                                    vouch_of(self._seg, trust_pools))
            self._filled = Semaphore.open(name + ".filled", role="waiter", wait=wait, device=self._device)
            self._slot = self._claim(wait)
        except BaseException:
            self.close()
            raise

    def _claim(self, wait: Optional[float]) -> int:
        h = self._head
        kind = "host_pinned" if h.device_staging else "host"
        deadline = None if wait is None else time.monotonic() + wait
        while True:
            for i in range(h.readers):
                try:
                    self._slot_sem = Semaphore.create(_slot_name(self.name, i), initial=0, kind=kind,
                                                      device=self._device, mode=_signal_mode(h.mode))
                except AlreadyExists:
                    continue
                self._announce()
                return i
            if deadline is None or time.monotonic() > deadline:
                raise QuotaExceeded(
                    f"stream {self.name!r}: all {h.readers} reader slots are taken (readers= of stream_publisher; "
                    "slots of readers that left are freed at the publisher's next version)"
                )
            time.sleep(0.01)

    def _announce(self) -> None:
        """Raises NAME.joins, after this reader's slot exists: the publisher's next start() then looks for it. Where
        that cannot be done (a publisher without it, or no permission), the publisher still finds the slot within a
        second."""
        try:
            joins = Semaphore.open(_join_name(self.name), role="signaller")
        except Error:
            return
        try:
            joins.signal_host(joins.value + 1)
        except Error:
            pass
        finally:
            joins.close()

    # ---------------------------------------------------------------------------------------------------------------
    @property
    def version(self) -> int:
        """The last version this reader received completely (0 before the first)."""
        return self._version

    @property
    def slot(self) -> int:
        """This reader's slot (0 .. readers-1)."""
        return self._slot

    def _admit(self) -> int:
        off = _admit_offset(self._head.buckets) + 8 * self._slot
        return int(self._mem[off : off + 8].view("<u8")[0])

    @staticmethod
    def _left(deadline: Optional[float]) -> Optional[float]:
        return None if deadline is None else max(0.0, deadline - time.monotonic())

    def _wait_filled(self, value: int, deadline: Optional[float], what: str) -> None:
        assert self._filled is not None
        try:
            self._filled.wait_host(value, self._left(deadline))
        except Timeout:
            raise Timeout(f"stream {self.name!r}: {what}: nothing arrived in time") from None
        except PeerDied:
            raise PeerDied(f"stream {self.name!r}: the publisher died ({what})") from None
        except Closed:
            raise Closed(f"stream {self.name!r}: the publisher closed the stream ({what})") from None

    def _check_evicted(self) -> None:
        if self._admit() != self._token:
            raise InvalidState(
                f"stream {self.name!r}: this reader was evicted (it did not consume a bucket within the publisher's "
                "reader_timeout): close it and open a new reader"
            )

    def _next_bucket(self, deadline: Optional[float]) -> _Desc:
        if self._closed:
            raise Closed(f"stream reader {self.name!r}: this handle was closed (close() or with); open it again to use it")
        assert self._filled is not None
        while self._token == 0:
            seen = self._filled.value
            _raise_poisoned(self._filled, f"stream {self.name!r}")
            admit = self._admit()
            if admit == _EVICTED:
                raise InvalidState(f"stream {self.name!r}: this reader was evicted: close it and open a new reader")
            if admit:
                self._token = self._next = admit
                break
            self._wait_filled(seen + 1, deadline, "waiting to be admitted at the publisher's next version")
        self._check_evicted()
        e = self._next
        self._wait_filled(e, deadline, f"waiting for bucket {e}")
        self._check_evicted()
        try:
            d = _read_desc(self._mem, self._head.buckets, self._head.readers, e % self._head.buckets, self._layouts,
                           self._head.bucket_bytes)
            self._check_evicted()
            if d.seq != e:
                raise ProtocolError(f"stream {self.name!r}: ring slot {e % self._head.buckets} holds bucket {d.seq}, not {e}")
            if not self._in_version and d.index != 0:
                raise ProtocolError(f"stream {self.name!r}: bucket {e} is bucket {d.index} of a version, not its first")
        except ProtocolError as err:
            self._check_evicted()  # (evicted, the slot may have been rewritten under the read: InvalidState)
            # Not read past: every later call would meet the same bucket. The reader stops here.
            self._broken = str(err)
            raise
        return d

    def _release(self, seq: int, stream: Any, early: bool = False) -> None:
        """Gives bucket ``seq`` back to the publisher: from the host for host staging (its copies ran), on
        ``stream`` after the copies enqueued so far for device staging. ``early``: a bucket with no staged bytes that
        is not the last of its version, whose ring slot holds nothing left to read: from the host at once for device
        staging too, where the stream has passed this reader's last stream-ordered signal. The value says every
        bucket up to ``seq`` is consumed (and a stream's write sets it, lowering a larger value signalled from the
        host), so before that it goes on the stream, still ahead of its own copies."""
        assert self._slot_sem is not None
        if not self._head.device_staging or (early and self._slot_sem.value >= self._stream_released):
            self._slot_sem.signal_host(seq)
        else:
            self._slot_sem.signal(seq, stream, wake_host=True)
            self._stream_released = seq
        self._next = seq + 1

    def _drain(self, deadline: Optional[float], stream: Any) -> None:
        """Skips the rest of a version left half read."""
        while self._in_version:
            d = self._next_bucket(deadline)
            self._release(d.seq, stream)
            if d.flags & (_D_LAST | _D_ABORT):
                self._in_version = False

    def _host(self, slot: int) -> np.ndarray:
        if not self._stage_np:
            self._stage_np = [np.asarray(v) for v in self._views]
        return self._stage_np[slot]

    def _stage(self, slot: int) -> Any:
        if not self._stage_torch:
            torch = _torch()
            self._stage_torch = [torch.from_dlpack(v.__dlpack__()) for v in self._views]
        return self._stage_torch[slot]

    def _block_key(self, d: _Desc, k: Any) -> Tuple[str, bytes]:
        """(pool name, encoded BlockRef) of entry ``k`` of the descriptor's table of blocks."""
        try:
            pool, ref = d.blocks[k]
            return pool, bytes.fromhex(ref)
        except (IndexError, TypeError, ValueError):
            raise ProtocolError(f"stream {self.name!r}: bucket {d.seq} names block {k!r}, not in its table") from None

    def _map_ahead(self, d: _Desc) -> None:
        """Maps the chunks of the bucket's blocks that this reader does not hold, one broker round trip per pool
        (HeldBlocks.map_chunks), before its pieces resolve them one by one: a reader's first version would otherwise
        take a round trip per chunk. Once per table of blocks: a version sent like the last one costs a dict look-up
        a bucket (a look-up per block cost 0.58 ms a version for the 3063 blocks of the 16 GiB dict)."""
        assert self._held is not None
        blocks = d.blocks
        if not blocks or id(blocks) in self._mapped:
            return
        if len(self._mapped) >= 4096:
            self._mapped.clear()
        self._mapped[id(blocks)] = blocks
        self._held.map_chunks((e[0], bytes.fromhex(e[1])) for e in blocks if isinstance(e[0], str))

    def _ref_block(self, d: _Desc, k: Any) -> HeldBlock:
        """The publisher's block of entry ``k``, resolved and held the first time a version names it."""
        assert self._held is not None
        key = self._block_key(d, k)
        self._used.add(key)
        try:
            return self._held.get(*key)
        except InvalidArgument as e:
            if not is_stale(e):  # not a freed block: the name is no pool of this gpuipc, or the ref is forged
                raise ProtocolError(
                    f"stream {self.name!r}: version {d.version} names block {k!r} of {key[0]!r}, which this reader "
                    f"cannot use ({e})"
                ) from None
            raise InvalidState(
                f"stream {self.name!r}: version {d.version} names a block of pool {key[0]!r} that is no longer there "
                f"({e}): the publisher freed or replaced a tensor before its readers had copied it"
            ) from None

    def _src(self, d: _Desc, piece: List[Any], slot: int, as_torch: bool) -> Any:
        """The bytes a piece lies in, from its first: the staging bucket, or the publisher's block (reference
        pieces), as a uint8 torch tensor or NumPy array."""
        if len(piece) == _STAGED:
            return self._stage(slot) if as_torch else self._host(slot)
        held = self._ref_block(d, piece[6])
        what = "torch" if as_torch else "numpy"
        arr = held.made.get(what)
        if arr is None:
            arr = held.made[what] = _torch().from_dlpack(held.view.__dlpack__()) if as_torch else np.asarray(held.view)
        return arr

    def _verify(self, d: _Desc, slot: int, stream_obj: Any) -> None:
        """The bucket's checksum: its used staging bytes and the bytes each reference piece names, read now, before
        they are copied."""
        if not self._head.checksum:
            return
        device = self._head.device_staging
        refs = [self._src(d, p, slot, device)[p[5] : p[5] + p[4]] for p in d.pieces if len(p) == _REFERENCE and p[4]]
        if device:
            torch = _torch()
            with torch.cuda.stream(stream_obj):
                got = _checksum_torch(self._stage(slot)[: d.used]) if d.used else 0
                got += sum(_checksum_torch(x) for x in refs)
        else:
            got = _checksum_np(self._host(slot)[: d.used]) + sum(_checksum_np(x) for x in refs)
        got &= _MASK64
        if got != d.checksum:
            names = sorted({p[0] for p in d.pieces})
            raise ChecksumMismatch(
                f"stream {self.name!r}: bucket {d.index} of version {d.version} (sequence {d.seq}) has checksum {got}, "
                f"the publisher sent {d.checksum}; it holds {', '.join(map(repr, names[:8]))}"
                f"{' ...' if len(names) > 8 else ''}"
            )

    def _streams(self, stream: Any) -> Tuple[Any, Any]:
        """(torch stream or None, what to signal on)."""
        if not self._head.device_staging:
            return None, None
        s = _torch_stream(stream, self._device)
        return s, s

    def _begin(self, timeout: Optional[float], stream: Any) -> Tuple[Optional[float], Any, Any]:
        if self._broken is not None and not self._closed:
            raise ProtocolError(f"stream reader {self.name!r} met a malformed bucket ({self._broken}): close it, and "
                                "open a new reader once the publisher is fixed")
        timeout = seconds(timeout, "timeout", "wait for ever")  # (a negative or NaN one read as 0)
        deadline = None if timeout is None else time.monotonic() + timeout
        s, sig = self._streams(stream)
        if s is not None:
            if self._last_stream is not None and self._last_stream != s:
                # The last version's copies and releases ran there. A release on s ahead of them would let the
                # publisher refill buckets still being read, and their later release would lower the slot's value.
                s.wait_stream(self._last_stream)
            self._last_stream = s
        self._drain(deadline, sig)
        return deadline, s, sig

    def receive(self, into: Mapping[str, Any], stream: Any = None, timeout: Optional[float] = None) -> int:
        """Receives the next version into the tensors of ``into`` (name to tensor, contiguous, of the dtype and
        shape sent) and returns its number once every bucket has arrived and been applied. Device staging: torch
        tensors, copied on ``stream`` (None: torch's current stream) and returned before the copies ran: use the
        tensors on that stream or synchronize it. Host staging: NumPy arrays or torch tensors. Reference pieces are
        copied the same way, straight from the publisher's memory (its pool joined and the block held the first
        time, kept while later versions name it). Names sent that ``into`` lacks are skipped (listed in
        :attr:`skipped`).

        Raises Timeout, PeerDied (the publisher died, or a reference piece's pool is gone: ``into`` may hold part of
        the new version, never reported as received), Closed, ChecksumMismatch (naming the bucket), InvalidState
        (the publisher abandoned the version, evicted this reader, or freed a tensor it sent by reference before
        this reader copied it), ProtocolError (a malformed bucket, or one naming a block this reader cannot use),
        InvalidArgument (dtype, shape or kind of a tensor), TypeError (not an array). After an error in the middle
        of a version the next call skips what is left of it."""
        if not isinstance(into, Mapping):
            raise InvalidArgument(f"receive takes a mapping of names to tensors, not a {type(into).__name__}")
        deadline, s, sig = self._begin(timeout, stream)
        dsts: Dict[str, Any] = {}
        self.skipped = []
        with contextlib.closing(self._buckets(deadline, s, sig, "; the tensors given may hold part of it")) as buckets:
            for d, slot in buckets:
                if self._head.device_staging:
                    copies = self._plan(d, slot, into, dsts)
                    if copies:  # before the bucket is given back (_buckets signals after them, on the same stream)
                        torch = _torch()
                        with torch.cuda.stream(s):
                            copies.run(torch, non_blocking=True)
                    continue
                for piece in d.pieces:
                    key, dtype, shape, pos, n, off = piece[:_STAGED]
                    dst = self._lookup(key, into, dsts, dtype, shape)
                    if dst is not None and n:
                        self._copy_out(self._src(d, piece, slot, False)[off : off + n], dst, pos, n)
        return self._version

    def _lookup(self, key: str, into: Mapping[str, Any], dsts: Dict[str, Any], dtype: str, shape: List[int]) -> Any:
        """The checked destination of ``key`` in ``into`` (None, and listed in :attr:`skipped`, when absent)."""
        dst = dsts.get(key)
        if dst is None:
            if key not in into:
                if key not in self.skipped:
                    self.skipped.append(key)
                return None
            dst = dsts[key] = self._destination(key, into[key], dtype, shape)
        return dst

    def _plan(self, d: _Desc, slot: int, into: Mapping[str, Any], dsts: Dict[str, Any]) -> _Copies:
        """Device staging: the bucket's copies (into the destinations' bytes, from staging or the publisher's blocks),
        from the plan of the last bucket laid out the same way (in the same slot, where it has staged bytes) when
        ``into`` still holds the same tensors at the same addresses."""
        # A bucket of reference pieces only reads nothing from its slot, so its plan serves it in any slot: where a
        # version's bucket count is not a multiple of the ring's, a bucket lands in another slot every version (with
        # 115 buckets in a ring of 16, every plan was made again, ~45 us a piece: 16 GiB took 81-142 ms instead of
        # 15-16 on an H200, bench/results/experiments/byref-timeline-*-340-128-16-*). Whether it has staged bytes is
        # read from the pieces themselves (once per layout), not from the descriptor's `used`, which a publisher could
        # write as 0 beside staged pieces.
        cache_key = (id(d.pieces), slot if d.staged else -1)
        plan = self._plans.get(cache_key)
        if plan is not None and plan[0] is d.pieces:
            _, names, objs, ptrs, copies, skipped, blocks = plan
            # The same tensor objects at the same addresses: one torch call a tensor (with its shape, strides and
            # dtype, four: a few us a tensor every version). That sees what moves a tensor's bytes: a new tensor
            # under a name, its storage replaced (t.data = ..., set_: the plan's views keep the old storage alive,
            # so the new one lies elsewhere) or grown (resize_). It does not see a tensor reshaped in place at the
            # same address (t_(), as_strided_, a resize_ that shrinks it, t.data = a view of its own bytes): the
            # bytes then land in its memory as planned, never outside the storage the plan's views hold. Weights
            # are loaded into, not reshaped; docs/torch.md says to pass a new tensor instead.
            same = all(into.get(k) is o and o.data_ptr() == p for k, o, p in zip(names, objs, ptrs))
            if same and not any(k in into for k in skipped):
                self.skipped.extend(k for k in skipped if k not in self.skipped)
                self._used.update(blocks)  # the publisher's blocks its reference pieces copy from, still held
                return copies
        outs, ins, names, objs, skipped, blocks = [], [], [], [], [], set()
        for piece in d.pieces:
            key, dtype, shape, pos, n, off = piece[:_STAGED]
            dst = self._lookup(key, into, dsts, dtype, shape)
            if dst is None:
                skipped.append(key)
                continue
            if key not in names:
                names.append(key)
                objs.append(into[key])
            if n:
                outs.append(dst[1][pos : pos + n])
                ins.append(self._src(d, piece, slot, True)[off : off + n])
                if len(piece) == _REFERENCE:
                    blocks.add(self._block_key(d, piece[6]))
        if len(self._plans) >= 256:
            self._plans.clear()
        copies = _Copies(_torch(), outs, ins)
        self._plans[cache_key] = (d.pieces, names, objs, [o.data_ptr() for o in objs], copies, skipped, blocks)
        return copies

    def _buckets(self, deadline: Optional[float], s: Any, sig: Any, abandoned: str) -> Iterator[Tuple[_Desc, int]]:
        """The buckets of the next version, each with its ring slot, checked (abandoned versions raise
        InvalidState, `abandoned` ends the message; checksums) and given back to the publisher once the caller
        moves past it (or stops), or at once for a bucket of no staged bytes that is not the version's last. Sets
        :attr:`version` after the last one."""
        self._walks += 1
        walk = self._walks
        while True:
            if walk != self._walks:  # a later receive skipped the rest of this one's version
                raise InvalidState(f"stream {self.name!r}: a later receive took over from this iterator; it has ended")
            d = self._next_bucket(deadline)
            if not self._in_version:
                self._used = set()
                self._sent = {}
            self._in_version = True
            slot = d.seq % self._head.buckets
            self._map_ahead(d)
            # Only a descriptor, read now: its reference pieces are copied from the publisher's blocks, which stay
            # as they are until every reader consumed the version's last bucket (finish() waits for that one, and
            # it goes back after all of this reader's copies of the version, on their stream)
            early = d.used == 0 and not d.staged and not d.flags & (_D_LAST | _D_ABORT)
            self._handed_all = False
            try:
                if d.flags & _D_ABORT:
                    raise InvalidState(f"stream {self.name!r}: the publisher abandoned version {d.version}{abandoned}")
                self._follow(d)
                if early:
                    self._release(d.seq, sig, True)
                self._verify(d, slot, s)
                yield d, slot
                self._handed_all = True
            finally:
                # An iterator let go (closed, collected) after a later call drained the rest of its version: that
                # call gave this bucket back and read past it, and a release now would take the reader back to it.
                current = d.seq == self._next
                if current and d.flags & _D_LAST and self._handed_all and not self._head.device_staging:
                    # The copies out of the version's last bucket are done (host): a reader evicted while it made them
                    # may have read a slot or blocks the publisher rewrote since, so the version is not reported.
                    # (Earlier buckets: the next bucket's read checks.)
                    self._check_evicted()
                if current and not early:
                    self._release(d.seq, sig)
                if current and d.flags & (_D_LAST | _D_ABORT):
                    self._in_version = False
                # A loop left after the version's last piece (receive_iter's caller broke out there) received it
                if current and d.flags & _D_LAST and self._handed_all:
                    self._received(d)
            if d.flags & _D_LAST:
                return

    def _follow(self, d: _Desc) -> None:
        """ProtocolError unless bucket ``d`` continues its version: a tensor's pieces keep the dtype and shape of its
        first, each starts where the one before ended, and none is left short at the version's last bucket. (Each
        piece was checked against its own shape alone: a later piece claiming another shape, or a version that left
        a tensor half sent, was applied whole, with stale bytes in it.)"""
        sent = self._sent
        for piece in d.pieces:
            key, dtype, shape, pos, n = piece[:5]
            had = sent.get(key)
            if had is None:
                had = sent[key] = [dtype, shape, 0, math.prod(shape) * dtype_of(dtype).itemsize]
            elif had[0] != dtype or had[1] != shape:
                raise ProtocolError(f"stream {self.name!r}: a piece of {key!r} is {dtype}{shape}; its first was "
                                    f"{had[0]}{had[1]}")
            if pos != had[2]:
                raise ProtocolError(f"stream {self.name!r}: a piece of {key!r} starts at byte {pos}, not {had[2]} "
                                    "where its last ended")
            had[2] += n
        if d.flags & _D_LAST:
            short = [k for k, v in sent.items() if v[2] != v[3]]
            if short:
                raise ProtocolError(f"stream {self.name!r}: version {d.version} ended with {short[0]!r} sent in part")

    def _received(self, d: _Desc) -> None:
        """The version of last bucket `d` is in: :attr:`version`; the publisher's blocks it did not name are let go
        (their holds, and plans using them)."""
        self._version = d.version
        assert self._held is not None
        if self._held.retain(self._used):
            self._plans.clear()
            self._mapped.clear()

    def _destination(self, key: str, t: Any, dtype: str, shape: List[int]) -> Any:
        info = describe(t, f"into[{key!r}]")
        if info.dtype.name != dtype or list(info.shape) != list(shape):
            raise InvalidArgument(f"into[{key!r}] is {info.dtype.name}{list(info.shape)}; the publisher sent {dtype}{shape}")
        if not _contiguous(info):
            raise InvalidArgument(f"into[{key!r}] is not contiguous")
        if _is_torch(t):
            if t.is_cuda or self._head.device_staging:
                return ("torch", _torch_bytes(t))
            return ("numpy", _torch_bytes(t).numpy())
        if isinstance(t, np.ndarray) and not self._head.device_staging:
            if not t.flags.writeable:
                raise InvalidArgument(f"into[{key!r}] is read-only")
            return ("numpy", _numpy_bytes(t))
        raise InvalidArgument(
            f"into[{key!r}] is a {type(t).__name__}: receive copies into torch tensors (device staging) or NumPy "
            "arrays and torch tensors (host staging); use receive_iter for other frameworks"
        )

    def _copy_out(self, src: np.ndarray, dst: Tuple[str, Any], pos: int, n: int) -> None:
        """One piece's ``n`` bytes ``src`` (out of host staging, or a publisher's host block) into bytes ``pos`` on
        of a destination (device staging copies go together: receive)."""
        how, out = dst
        if src.nbytes != n:  # (the pieces are checked against their sources: a short one would broadcast)
            raise ProtocolError(f"stream {self.name!r}: a piece's {n} bytes lie past the end of its source")
        if how == "numpy":
            out[pos : pos + n] = src
            return
        with warnings.catch_warnings():  # into a torch tensor: a synchronous copy
            warnings.simplefilter("ignore")  # the source is mapped read-only; torch only reads it
            t = _torch().from_numpy(src)
        out[pos : pos + n].copy_(t)

    def receive_iter(self, stream: Any = None, timeout: Optional[float] = None) -> Iterator[StreamItem]:
        """Yields the next version piece by piece, as :class:`StreamItem` ``(name, view)`` over the staging bucket,
        or over the publisher's own memory for a reference piece (read-only; torch tensors for device staging, NumPy
        arrays for host staging): copy each before asking for the next, on ``stream`` (device staging; None: torch's
        current stream), since the bucket goes back to the publisher when the iterator moves past it (and after the
        last one the publisher may change its tensors). Ends after the version's last bucket (:attr:`version` is then
        that version, as it is once the last piece was handed out and the loop left). Raises what :meth:`receive` raises. Leaving the loop early skips the rest of the version at
        the next call."""
        deadline, s, sig = self._begin(timeout, stream)
        with contextlib.closing(self._buckets(deadline, s, sig, "")) as buckets:
            for d, slot in buckets:
                for i, piece in enumerate(d.pieces):
                    item = self._item(d, slot, piece)
                    if i == len(d.pieces) - 1:
                        self._handed_all = True  # a break after this piece still leaves the bucket read whole
                    yield item

    def _item(self, d: _Desc, slot: int, piece: List[Any]) -> StreamItem:
        key, dtype, shape, pos, n, off = piece[:_STAGED]
        dt = dtype_of(dtype)
        full = tuple(shape)
        count = n // dt.itemsize
        start = pos // dt.itemsize
        dims = full if (start == 0 and count == math.prod(full)) else (count,)
        if n == 0:  # an empty tensor: nothing in the bucket; a fresh empty array of its shape
            if self._head.device_staging:
                torch = _torch()
                view: Any = torch.empty(full, dtype=getattr(torch, dt.name), device=f"cuda:{self._device}")
            else:
                view = np.empty(full, dtype=dt.numpy) if dt.numpy is not None else None
                if view is not None:
                    view.flags.writeable = False  # like every other view of a bucket
            return StreamItem(key, view, start, 0, full, dtype)
        base = self._views[slot] if len(piece) == _STAGED else self._ref_block(d, piece[6]).view
        typed = make_array(base, dt, dims, off)
        if self._head.device_staging:
            typed = _torch().from_dlpack(typed.__dlpack__())
        return StreamItem(key, typed, start, count, full, dtype)

    def close(self) -> None:
        """Leaves (idempotent): frees this reader's slot (the publisher stops waiting for it at once). Device
        staging: first waits for the stream of the last receive, whose copies read the staging buckets and the
        publisher's blocks."""
        if self._closed:
            return
        self._closed = True
        if self._last_stream is not None:
            self._last_stream.synchronize()  # copies still queued read the staging and the publisher's blocks
            self._last_stream = None
        self._plans.clear()
        self._stage_torch = []
        self._stage_np = []
        self._views = []
        if self._held is not None:
            self._held.close()
        for sem in (self._slot_sem, self._filled):
            if sem is not None:
                sem.close()
        if self._pool is not None:
            self._pool.close()
        self._seg.close()
        self._mem = None  # (an array of the control segment keeps it mapped)
        self._mapped.clear()

    def __enter__(self) -> "StreamReader":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"<gpuipc.StreamReader {self.name!r} slot={getattr(self, '_slot', None)} version={getattr(self, '_version', 0)}>"


def stream_reader(
    name: str, *, device: Optional[int] = None, wait: Optional[float] = None, trust_pools: bool = False
) -> StreamReader:
    """Joins stream ``name`` as a reader: maps its staging buckets once and claims a reader slot. The reader is
    admitted at the publisher's next version (:meth:`StreamPublisher.start`); a :meth:`StreamReader.receive`
    before that waits for it. wait: seconds to wait for the stream to be created, and for a free slot. device: the
    GPU that maps device staging (None: the publisher's). trust_pools: copy from blocks of every pool the
    publisher's buckets name that this process may join; by default only of those the stream's owner could read
    itself, judged from its uid and primary gid (docs/torch.md#whose-pools). Raises NotFound, Timeout,
    QuotaExceeded (every slot is taken), PeerDied (the stream's pool is gone), PermissionDenied (also from receive,
    for a pool the stream's owner could not read)."""
    return StreamReader(name, device=device, wait=wait, trust_pools=trust_pools)
