"""The publisher's side of a stream's reader slots (streaming.py describes the format): which readers claimed a
slot, the admit word of each, and the drop of a reader that died, closed or was evicted."""

from __future__ import annotations

import time
from typing import Any, Dict, Iterator, List, Optional, Tuple

import numpy as np

from ._stream_format import _EVICTED, _ReaderSlot, _admit_offset, _slot_name
from .errors import Closed, Error, NotFound, PeerDied, Timeout
from .semaphore import Semaphore


#: At least this often admit() looks at every free reader slot, whatever NAME.joins says (seconds).
_FULL_SCAN_S = 1.0


class _ReaderSlots:
    """Reader slot ``i``: the timeline ``NAME.reader.<i>`` its reader created, and its admit word in the control
    block (``mem``, set once the publisher made it)."""

    def __init__(self, name: str, buckets: int, readers: int, device: int, reader_timeout: Optional[float]) -> None:
        self.name = name
        self._nbuckets = buckets
        self._device = device
        self._reader_timeout = reader_timeout
        self.mem: Optional[np.ndarray] = None
        self._readers: List[Optional[_ReaderSlot]] = [None] * readers
        self._evicted: Dict[int, Semaphore] = {}
        #: NAME.joins, which a reader raises once it has claimed a slot (_join_name); None until the publisher made it
        self.joins: Optional[Semaphore] = None
        self._joins_seen = -1  # its value before the last scan that looked at every free slot
        self._full_scan_at = 0.0  # when that scan was

    def close(self) -> None:
        """Closes every reader's timeline (the names stay: the publisher removes them)."""
        if self.joins is not None:
            self.joins.close()
            self.joins = None
        for slot in self._readers:
            if slot is not None:
                slot.sem.close()
        self._readers = [None] * len(self._readers)
        for sem in self._evicted.values():
            sem.close()
        self._evicted.clear()
        self.mem = None

    def _admit_word(self, i: int) -> np.ndarray:
        assert self.mem is not None
        off = _admit_offset(self._nbuckets) + 8 * i
        return self.mem[off : off + 8].view("<u8")

    def drop(self, i: int) -> None:
        """Frees reader slot i (its reader died, closed, or was evicted and has gone): the same code for all."""
        slot = self._readers[i]
        self._readers[i] = None
        sem = slot.sem if slot is not None else self._evicted.pop(i, None)
        self._admit_word(i)[0] = 0
        if sem is not None:
            sem.close()
        try:
            Semaphore.unlink(_slot_name(self.name, i))
        except Error:
            pass

    def scan(self, free: bool = True) -> int:
        """Finds readers that claimed a slot, and frees the slots of readers that are gone. Returns how many slots
        are claimed now (admitted or waiting for the next version). ``free``: also look at every free slot, one
        broker round trip each (a reader's slot is a name it creates); else only at the slots known."""
        for i in range(len(self._readers)):
            ev = self._evicted.get(i)
            if ev is not None:
                if ev.status != "ok":
                    self.drop(i)
                continue
            slot = self._readers[i]
            if slot is not None:
                if slot.sem.status != "ok":
                    self.drop(i)
                continue
            if not free:
                continue
            try:
                sem = Semaphore.open(_slot_name(self.name, i), role="waiter", device=self._device)
            except NotFound:
                continue
            self._readers[i] = _ReaderSlot(sem)
            if sem.status != "ok":
                self.drop(i)
        return sum(1 for r in self._readers if r is not None)

    def admit(self, first: int) -> None:
        """Readers that joined since the last version read from bucket ``first`` on. The free slots are looked at
        only when NAME.joins moved since the last time they were (each costs a broker round trip: 0.35-0.64 ms for
        three at every version on the H200s of bench/results/experiments/byref-timeline-919ec64-*-start-*), and at
        least once a second (a reader that could not raise it: no write permission, or an older gpuipc)."""
        joins = self.joins.value if self.joins is not None else None
        now = time.monotonic()
        free = joins is None or joins != self._joins_seen or now - self._full_scan_at >= _FULL_SCAN_S
        self.scan(free)
        if free:
            # The value read before the scan: a reader that raises it after claimed its slot after the scan began,
            # so the next admit() looks again.
            self._joins_seen = joins if joins is not None else -1
            self._full_scan_at = now
        for i, slot in enumerate(self._readers):
            if slot is not None and slot.first == 0:
                slot.first = first
                self._admit_word(i)[0] = first

    def wait_for_slot(self, seq: int) -> None:
        """Before bucket ``seq`` overwrites ring slot seq % buckets: every admitted reader has consumed bucket
        seq - buckets. A dead or closed reader is dropped; one slower than reader_timeout is evicted."""
        self.wait_consumed(seq - self._nbuckets)

    def _waited(self, need: int) -> Iterator[Tuple[int, _ReaderSlot]]:
        """The admitted readers that read bucket ``need``."""
        for i, slot in enumerate(self._readers):
            if slot is not None and slot.first != 0 and need >= slot.first:
                yield i, slot

    def wait_consumed(self, need: int, timeout: Optional[float] = None) -> None:
        """On the host, until every admitted reader has consumed bucket ``need`` (signalled its slot after its
        copies out of it). A dead or closed reader is dropped; one that takes longer than reader_timeout is evicted.
        Raises Timeout, naming the slot, when ``timeout`` (seconds for the whole call) passes first."""
        if need <= 0:
            return
        deadline = None if timeout is None else time.monotonic() + timeout
        for i, slot in list(self._waited(need)):
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            bound = self._reader_timeout
            evicts = bound is not None and (left is None or bound <= left)
            try:
                slot.sem.wait_host(need, bound if evicts else left)
            except (PeerDied, Closed):
                self.drop(i)
            except Timeout:
                if not evicts:
                    raise Timeout(f"stream {self.name!r}: the reader in slot {i} has not consumed bucket {need} "
                                  f"within {timeout:g} s") from None
                self._readers[i] = None
                self._evicted[i] = slot.sem
                self._admit_word(i)[0] = _EVICTED

    def wait_on_stream(self, need: int, stream: Any) -> None:
        """Stream-ordered: work enqueued on ``stream`` after this runs once every admitted reader has consumed
        bucket ``need``. A reader already dead or closed is dropped; one that dies or closes later releases the
        stream (the broker's poison of its slot, or its close)."""
        if need <= 0:
            return
        for i, slot in list(self._waited(need)):
            try:
                slot.sem.wait(need, stream)
            except (PeerDied, Closed):
                self.drop(i)
