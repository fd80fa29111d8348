"""Bucketed streaming, host kind (NumPy): stream_publisher / stream_reader with several reader processes, tensors
split across buckets, receive_iter, checksums (a corrupted bucket), an abandoned version, a SIGKILLed publisher
mid-version (PeerDied, never a torn version, never a hang), a SIGKILLed or stalled reader (the publisher goes on);
reference pieces from host pool blocks (mixed with staged ones, no handle opened in steady state, finish() and
wait_consumed ordering, eviction, a SIGKILLed reader, checksums), and a control block of another format."""

from __future__ import annotations

import gc
import multiprocessing
import os
import signal
import sys
import threading
import time

import numpy as np
import pytest

import gpuipc
import helpers


def _kill_when(ready: str, pid: int) -> threading.Thread:
    """A thread that SIGKILLs `pid` once the name `ready` exists."""

    def run() -> None:
        helpers.wait_for_name(ready, timeout=60)
        time.sleep(0.2)  # let the other side block on what the victim holds
        os.kill(pid, signal.SIGKILL)

    t = threading.Thread(target=run, daemon=True)
    t.start()
    return t


def _zeros() -> dict:
    return {k: np.zeros_like(x) for k, x in helpers.stream_state(0).items()}


def _same(a: dict, b: dict) -> bool:
    return all(np.array_equal(a[k], b[k]) for k in b)


def test_round_trip_several_reader_processes(name, start):
    # 64 KiB buckets, a ring of 2: "a" (200 KB) is split over 4 buckets, and the publisher waits for the readers
    with gpuipc.stream_publisher(name, 64 << 10, 2, readers=4, kind="host") as pub:
        futs = [start(helpers.stream_reader_follow, name, 3) for _ in range(3)]
        assert pub.wait_readers(3, timeout=60) == 3
        for v in (1, 2, 3):
            assert pub.publish(helpers.stream_state(v)) == v
        assert pub.version == 3
        for f in futs:
            assert f.result(timeout=60) == [(1, True), (2, True), (3, True)]


def test_receive_iter_and_lifecycle(name):
    # buckets=8: the version fits in the ring, so one process can publish and then read
    with gpuipc.stream_publisher(name, 64 << 10, 8, kind="host") as pub, gpuipc.stream_reader(name) as rd:
        assert pub.wait_readers(1, timeout=10) == 1
        assert pub.start() == 1
        state = helpers.stream_state(1)
        pub.update([("a", state["a"]), ("b", state["b"])])
        pub.update({"h": state["h"], "z": state["z"], "s": state["s"]})
        assert pub.finish() == 1
        got = _zeros()
        pieces = []
        for item in rd.receive_iter(timeout=10):
            key, view = item
            assert not view.flags.writeable and view.dtype == got[key].dtype
            got[key].reshape(-1)[item.start : item.start + item.count] = view.reshape(-1)
            pieces.append((key, item.complete))
        assert rd.version == 1 and _same(got, state)
        assert [p for p in pieces if p[0] == "a"] == [("a", False)] * 4  # split over 4 buckets
        assert ("b", True) in pieces and ("z", True) in pieces
        # receive: names the caller lacks are skipped; a strided source travels contiguous
        src = np.arange(200, dtype=np.float64).reshape(10, 20)[:, ::2]
        assert pub.publish({"t": src, "b": state["b"]}) == 2
        into = {"t": np.zeros((10, 10))}
        assert rd.receive(into, timeout=10) == 2
        assert np.array_equal(into["t"], src) and rd.skipped == ["b"]
        # negative strides too (refused before: describe() came before the contiguous copy)
        rev = np.arange(100, dtype=np.float32)[::-1]
        assert pub.publish({"r": rev}) == 3
        into = {"r": np.zeros(100, dtype=np.float32)}
        assert rd.receive(into, timeout=10) == 3 and np.array_equal(into["r"], rev)


def test_an_iterator_let_go_after_a_later_receive_does_not_take_the_reader_back(name):
    """A receive_iter left in the middle of a version, then a receive (which skips the rest of that version): the
    iterator's end, when it was collected, gave its bucket back again and set the reader to read after it, so the
    next receive met a ring slot of another bucket and the reader stopped for good (ProtocolError)."""
    a = np.arange(2048, dtype=np.float32)  # 8 KiB: two buckets of 4 KiB
    with gpuipc.stream_publisher(name, 4096, 8, kind="host") as pub, gpuipc.stream_reader(name) as rd:
        assert pub.wait_readers(1, timeout=10) == 1
        pub.publish({"a": a})
        it = rd.receive_iter(timeout=10)
        next(it)  # the first bucket of version 1, held
        pub.publish({"a": a + 1})
        into = {"a": np.zeros_like(a)}
        assert rd.receive(into, timeout=10) == 2 and np.array_equal(into["a"], a + 1)
        with pytest.raises(gpuipc.InvalidState, match="a later receive took over"):
            next(it)
        del it
        gc.collect()
        pub.publish({"a": a + 2})
        assert rd.receive(into, timeout=10) == 3 and np.array_equal(into["a"], a + 2)


def test_a_loop_left_after_the_last_piece_has_received_the_version(name):
    """A caller that breaks out of receive_iter once it has the version's last piece (it knows the names it wants)
    read the whole version, but :attr:`version` stayed at the one before (the generator was closed at its yield, and
    the version was set after it); a break before the last piece still leaves it unreceived."""
    a = np.arange(2048, dtype=np.float32)  # 8 KiB: two buckets of 4 KiB
    with gpuipc.stream_publisher(name, 4096, 8, kind="host") as pub, gpuipc.stream_reader(name) as rd:
        assert pub.wait_readers(1, timeout=10) == 1
        assert pub.publish({"a": a, "b": a[:10]}) == 1
        for item in rd.receive_iter(timeout=10):
            if item.name == "b":
                break
        assert rd.version == 1
        assert pub.publish({"a": a + 1, "b": a[:10]}) == 2
        for item in rd.receive_iter(timeout=10):
            break  # the first piece of two buckets' worth: the version is not in
        assert rd.version == 1
        assert pub.publish({"a": a + 2}) == 3
        into = {"a": np.zeros_like(a)}
        assert rd.receive(into, timeout=10) == 3 and np.array_equal(into["a"], a + 2)


def test_checksum_mismatch_names_the_bucket(name):
    with gpuipc.stream_publisher(name, 4096, 8, kind="host", checksum=True) as pub, gpuipc.stream_reader(name) as rd:
        pub.wait_readers(1, timeout=10)
        a = np.arange(1500, dtype=np.float32)  # 6000 bytes: buckets 0 and 1
        into = {"a": np.zeros_like(a)}
        assert pub.publish({"a": a}) == 1
        first = pub._blocks[1 % pub.buckets]  # bucket sequence 1 lives in ring slot 1
        first.numpy()[8] ^= 0xFF  # corrupt the staging bucket after the publisher's checksum
        with pytest.raises(gpuipc.ChecksumMismatch, match=r"bucket 0 of version 1"):
            rd.receive(into, timeout=10)
        assert rd.version == 0
        # the next receive skips the rest of version 1 and gets version 2 whole
        assert pub.publish({"a": a * 2}) == 2
        assert rd.receive(into, timeout=10) == 2 and np.array_equal(into["a"], a * 2)


def test_abandoned_version_and_errors(name):
    with gpuipc.stream_publisher(name, 4096, 8, kind="host") as pub, gpuipc.stream_reader(name) as rd:
        pub.wait_readers(1, timeout=10)
        a = np.arange(100, dtype=np.float32)
        into = {"a": np.zeros_like(a)}
        with pytest.raises(gpuipc.InvalidArgument, match="twice"):
            pub.publish([("a", a), ("a", a)])  # abandoned: readers are told
        with pytest.raises(gpuipc.InvalidState, match="abandoned version 1"):
            rd.receive(into, timeout=10)
        assert pub.publish({"a": a + 1}) == 2
        assert rd.receive(into, timeout=10) == 2 and np.array_equal(into["a"], a + 1)
        pub.publish({"a": np.zeros(3, dtype=np.float32)})
        with pytest.raises(gpuipc.InvalidArgument, match="float32\\[3\\]"):
            rd.receive(into, timeout=10)
        with pytest.raises(gpuipc.Timeout):
            rd.receive(into, timeout=0.1)
        with pytest.raises(gpuipc.InvalidState, match="start"):
            pub.update({"a": a})
        with pytest.raises(gpuipc.AlreadyExists, match="unlink_stream"):
            gpuipc.stream_publisher(name, 4096, 2, kind="host")
    with pytest.raises(gpuipc.NotFound):
        gpuipc.stream_reader(name)


def test_a_tensor_refused_by_update_can_be_passed_again_in_its_version(name):
    """start/update/finish: a tensor that update() refuses (not an array, strided foreign memory) is not recorded as
    sent, so the corrected one can follow in the same version. Before, it was refused as sent "twice"."""
    with gpuipc.stream_publisher(name, 1 << 16, 2, kind="host") as pub, gpuipc.stream_reader(name) as rd:
        pub.wait_readers(1, timeout=10)
        pub.start()
        with pytest.raises(TypeError, match="tensor 'w'"):
            pub.update({"w": [1.0, 2.0]})
        pub.update({"w": np.array([1.0, 2.0])})
        assert pub.finish() == 1
        into = {"w": np.zeros(2)}
        assert rd.receive(into, timeout=10) == 1 and into["w"].tolist() == [1.0, 2.0]


def test_wait_readers_refuses_more_readers_than_slots(name):
    with gpuipc.stream_publisher(name, 4096, 2, readers=2, kind="host") as pub:
        with pytest.raises(gpuipc.InvalidArgument, match="slots for 2 readers"):
            pub.wait_readers(3, timeout=5)  # refused at once (without a timeout it would have waited for ever)


def test_reader_slots_are_bounded_and_reused(name):
    with gpuipc.stream_publisher(name, 4096, 4, readers=1, kind="host") as pub:
        rd = gpuipc.stream_reader(name)
        with pytest.raises(gpuipc.QuotaExceeded, match="reader slots"):
            gpuipc.stream_reader(name, wait=0.1)
        rd.close()
        assert pub.readers == 0  # the closed reader's slot is freed
        with gpuipc.stream_reader(name, wait=5) as rd2:
            assert rd2.slot == 0 and pub.publish({"x": np.ones(4)}) == 1
            into = {"x": np.zeros(4)}
            assert rd2.receive(into, timeout=10) == 1 and into["x"].sum() == 4


def test_start_looks_at_free_reader_slots_only_after_a_reader_joined(name, monkeypatch):
    """A reader slot is a name its reader creates, so looking at a free one is a broker round trip. start() looks at
    the free slots when NAME.joins moved (a reader raises it once its slot exists), and at least once a second (a
    reader that could not raise it is admitted then)."""
    from gpuipc._stream_reader import StreamReader

    probes = []
    real_open = gpuipc.Semaphore.open.__func__

    def counting_open(cls, n, **kw):
        if ".reader." in n:
            probes.append(n)
        return real_open(cls, n, **kw)

    monkeypatch.setattr(gpuipc.Semaphore, "open", classmethod(counting_open))

    def version(pub, v):
        probes.clear()
        assert pub.publish({"x": np.full(4, float(v))}) == v
        return len(probes)

    with gpuipc.stream_publisher(name, 4096, 8, readers=8, kind="host") as pub:
        assert version(pub, 1) == 8  # the first looks at every slot
        assert version(pub, 2) == 0
        with gpuipc.stream_reader(name, wait=5) as rd:
            assert version(pub, 3) == 8  # NAME.joins moved: every slot not known is looked at (the reader's found)
            assert version(pub, 4) == 0
            into = {"x": np.zeros(4)}
            assert rd.receive(into, timeout=10) == 3 and rd.receive(into, timeout=10) == 4
            monkeypatch.setattr(StreamReader, "_announce", lambda self: None)  # a reader that does not raise it
            with gpuipc.stream_reader(name, wait=5) as quiet:
                t = time.monotonic()
                assert version(pub, 5) == 0
                with pytest.raises(gpuipc.Timeout):
                    quiet.receive(into, timeout=0.2)  # not admitted at version 5
                time.sleep(max(0.0, 1.05 - (time.monotonic() - t)))
                assert version(pub, 6) == 7  # a second went by: every slot but rd's looked at (quiet's found)
                assert quiet.receive(into, timeout=10) == 6 and into["x"][0] == 6.0


def test_slow_reader_is_evicted(name):
    with gpuipc.stream_publisher(name, 4096, 2, kind="host", reader_timeout=0.3) as pub, \
            gpuipc.stream_reader(name) as rd:
        pub.wait_readers(1, timeout=10)
        t0 = time.monotonic()
        assert pub.publish({"a": np.zeros(5000, dtype=np.float32)}) == 1  # 5 buckets: the reader never reads
        assert time.monotonic() - t0 < 10
        with pytest.raises(gpuipc.InvalidState, match="evicted"):
            rd.receive({"a": np.zeros(5000, dtype=np.float32)}, timeout=5)


def test_publisher_killed_mid_version(name):
    ctx = multiprocessing.get_context("spawn")
    p = ctx.Process(target=helpers.stream_publisher_dies_mid_version, args=(name, name + "-ready"))
    p.start()
    try:
        with gpuipc.stream_reader(name, wait=30) as rd:
            into = _zeros()
            assert rd.receive(into, timeout=60) == 1 and _same(into, helpers.stream_state(1))
            killer = _kill_when(name + "-ready", p.pid)
            t0 = time.monotonic()
            with pytest.raises(gpuipc.PeerDied):
                rd.receive(into, timeout=60)
            assert time.monotonic() - t0 < 30
            killer.join(10)
            assert rd.version == 1  # version 2 is never reported
            assert into["a"][0] == 2 and into["b"][0, 0] == 1  # documented: partly written
            with pytest.raises(gpuipc.PeerDied):
                rd.receive(into, timeout=5)
    finally:
        p.kill()
        p.join()
    gpuipc.unlink_stream(name)
    with pytest.raises(gpuipc.NotFound):
        gpuipc.unlink_stream(name)


def test_reader_killed_publisher_goes_on(name, start):
    ctx = multiprocessing.get_context("spawn")
    with gpuipc.stream_publisher(name, 64 << 10, 2, kind="host") as pub:
        good = start(helpers.stream_reader_follow, name, 2)
        p = ctx.Process(target=helpers.stream_reader_stalls, args=(name, name + "-ready"))
        p.start()
        try:
            assert pub.wait_readers(2, timeout=60) == 2
            assert pub.publish(helpers.stream_state(1)) == 1
            killer = _kill_when(name + "-ready", p.pid)
            t0 = time.monotonic()
            assert pub.publish(helpers.stream_state(2)) == 2  # blocks on the staller until it is killed
            assert time.monotonic() - t0 < 30
            killer.join(10)
        finally:
            p.kill()
            p.join()
        assert good.result(timeout=60) == [(1, True), (2, True)]
        deadline = time.monotonic() + 10
        while pub.readers and time.monotonic() < deadline:
            time.sleep(0.01)
        assert pub.readers == 0
        assert pub.publish(helpers.stream_state(3)) == 3  # no reader left: nothing to wait for


def test_publisher_follows_torch_tensors_changed_between_versions(name):
    """The publisher remembers the torch tensors it sent, and trusts that only while each is the same tensor at
    the same address: values written in place, a storage replaced in place (``.data =``), a new tensor under a
    name, and a tensor that is gone all travel right; what it remembered of a dead tensor is dropped."""
    torch = pytest.importorskip("torch", reason="torch is not installed here")
    state = {"w": torch.arange(40000, dtype=torch.float32), "b": torch.ones(7, dtype=torch.bfloat16)}
    with gpuipc.stream_publisher(name, 64 << 10, 8, kind="host") as pub, gpuipc.stream_reader(name) as rd:
        assert pub.wait_readers(1, timeout=10) == 1
        into = {k: torch.zeros_like(v) for k, v in state.items()}
        for v in (1, 2, 3, 4):
            if v == 2:
                state["w"].add_(1)  # in place: same tensor, same address
            elif v == 3:
                state["w"].data = torch.full((40000,), -5.0)  # same object, another storage
                state["b"] = torch.full((7,), 3.0, dtype=torch.bfloat16)  # a new tensor under the name
            elif v == 4:
                state["w"] = state["w"] * 2
            assert pub.publish(state) == v
            assert rd.receive(into, timeout=10) == v
            assert all(torch.equal(into[k], state[k]) for k in state), v
        gone = torch.ones(3)
        pub.publish({"gone": gone})
        assert "gone" in pub._seen
        del gone
        gc.collect()
        assert "gone" not in pub._seen


def test_update_reads_its_torch_tensors_before_it_returns(name):
    """A torch source's copy into the staging bucket was enqueued only when the bucket was sent (or at finish()), so
    a buffer reused for the next name (the way a model larger than a spare copy is streamed) was read once, with its
    last contents, for every name."""
    torch = pytest.importorskip("torch", reason="torch is not installed here")
    buf = torch.empty(1000, dtype=torch.float32)
    with gpuipc.stream_publisher(name, 64 << 10, 8, kind="host") as pub, gpuipc.stream_reader(name) as rd:
        assert pub.wait_readers(1, timeout=10) == 1
        assert pub.start() == 1
        for i, key in enumerate(("a", "b", "c")):
            buf.fill_(float(i + 1))
            pub.update({key: buf})
        assert pub.finish() == 1
        into = {k: torch.zeros(1000) for k in ("a", "b", "c")}
        assert rd.receive(into, timeout=10) == 1
        assert [into[k][0].item() for k in ("a", "b", "c")] == [1.0, 2.0, 3.0]
        assert all(torch.equal(into[k], torch.full((1000,), float(i + 1))) for i, k in enumerate(("a", "b", "c")))


# Reference pieces: tensors that live in gpuipc pool memory go by reference (readers copy from the publisher's block)
def _ref_sources(pool: "gpuipc.Pool", v: int) -> tuple:
    """A block of `pool` holding "w" and "i" of helpers.ref_layout(v) (views of it), and the dict to publish."""
    block = pool.allocate(64 << 10)
    want = helpers.ref_layout(v)
    w = block.numpy("float32", (8000,))
    i = block.numpy("int64", (4, 4), offset=32768)
    w[...], i[...] = want["w"], want["i"]
    return block, {"w": w, "i": i, "p": want["p"], "z": want["z"]}


def _descriptor(pub: "gpuipc.StreamPublisher", seq: int):
    from gpuipc._stream_format import _read_desc

    return _read_desc(pub._mem, pub.buckets, pub._nreaders, seq % pub.buckets)


def _wait_live_blocks(pool: "gpuipc.Pool", n: int) -> int:
    deadline = time.monotonic() + 10
    while pool.stats()["live_blocks"] != n and time.monotonic() < deadline:
        time.sleep(0.01)
    return pool.stats()["live_blocks"]


@pytest.mark.parametrize("checksum", [False, True])
def test_reference_pieces_mixed_and_steady_state(name, start, checksum):
    """Host pool views travel as reference pieces beside staged ones; the reader joins the source pool and resolves
    its block once (version 1), opens nothing in later versions while the block stays, resolves the new block when
    the publisher replaces it, and lets the old one go (its hold, so the publisher's free takes effect)."""
    with gpuipc.Pool.create(name + ".src", kind="host", chunk_bytes=1 << 20, max_bytes=4 << 20) as pool, \
            gpuipc.stream_publisher(name, 4096, 2, kind="host", checksum=checksum) as pub:
        fut = start(helpers.stream_receive_counting, name, helpers.ref_layout(0), 5)
        assert pub.wait_readers(1, timeout=60) == 1
        block, state = _ref_sources(pool, 1)
        for v in (1, 2, 3, 4, 5):
            if v == 4:  # the publisher's blocks change: the old one is freed, the new one lives elsewhere
                old = block
                block, state = _ref_sources(pool, 4)
                old.free()
                assert pool.stats()["live_blocks"] == 2  # the reader holds the freed block
            elif v > 1:
                state["w"][...], state["i"][...] = helpers.ref_layout(v)["w"], helpers.ref_layout(v)["i"]
                state["p"] = helpers.ref_layout(v)["p"]
            assert pub.publish(state) == v  # host staging: returns once the reader copied the references
            d = _descriptor(pub, pub._seq)
            shapes = {p[0]: len(p) for p in d.pieces}
            assert shapes == {"w": 7, "i": 7, "p": 6, "z": 6}  # references, staged, an empty tensor (0 bytes)
            assert len(d.blocks) == 1 and d.blocks[0] == [pool.name, bytes(block.ref).hex()]
            assert d.used == 256 and d.staged  # only "p" took staging bytes
            if v == 4:  # the reader, still there, let the freed block go once version 4 no longer named it
                assert _wait_live_blocks(pool, 1) == 1
        got = fut.result(timeout=60)
        assert [v for v, _, _ in got] == [1, 2, 3, 4, 5]
        for v, arrays, _ in got:
            want = helpers.ref_layout(v)
            assert all(arrays[k].dtype == want[k].dtype and arrays[k].shape == want[k].shape for k in want)
            assert all(np.array_equal(arrays[k], want[k]) for k in want), v
        calls = [c for _, _, c in got]
        # joins the source pool, maps the chunk its block lies in, holds the block
        assert calls[0] == {"Pool.open": 1, "Pool.map_chunks": 1, "Pool.views_of": 1}, calls
        assert calls[1] == calls[2] == {}, calls  # steady state: no handle opened or resolved
        assert calls[3] == {"Pool.map_chunks": 1, "Pool.views_of": 1}, calls  # the new block, in the pool joined
        assert calls[4] == {}, calls


def test_repeat_versions_skip_describing_and_finding_blocks(name, start, monkeypatch):
    """The same arrays again (same objects, shapes, strides and dtypes): the publisher neither describes them nor
    looks their blocks up; a new array under a name, and one reshaped in place, are looked at again. The reader gets
    every version right (values written in place between versions)."""
    import gpuipc.streaming as streaming

    calls: dict = {"describe": [], "shared_block": []}

    def counted(what, orig):
        def call(*args, **kwargs):
            calls[what].append(args[1] if what == "describe" else args[0].shape)
            return orig(*args, **kwargs)

        return call

    with gpuipc.Pool.create(name + ".src", kind="host", chunk_bytes=1 << 20, max_bytes=4 << 20) as pool, \
            gpuipc.stream_publisher(name, 4096, 2, kind="host") as pub:
        fut = start(helpers.stream_receive_counting, name, helpers.ref_layout(0), 3)
        assert pub.wait_readers(1, timeout=60) == 1
        _, state = _ref_sources(pool, 1)
        assert pub.publish(state) == 1
        monkeypatch.setattr(streaming, "describe", counted("describe", streaming.describe))
        monkeypatch.setattr(streaming, "shared_block", counted("shared_block", streaming.shared_block))
        for v in (2, 3):
            want = helpers.ref_layout(v)
            state["w"][...], state["i"][...] = want["w"], want["i"]
            if v == 2:
                state["p"][...] = want["p"]  # every object as in version 1
            else:
                state["p"] = want["p"]  # a new array under the name
            calls["describe"].clear(), calls["shared_block"].clear()
            assert pub.publish(state) == v  # returns once the reader copied the references
            assert calls == ({"describe": [], "shared_block": []} if v == 2 else
                             {"describe": ["tensor 'p'"], "shared_block": [(5,)]}), v
        got = fut.result(timeout=60)
        assert [v for v, _, _ in got] == [1, 2, 3]
        for v, arrays, _ in got:
            want = helpers.ref_layout(v)
            assert all(np.array_equal(arrays[k], want[k]) for k in want), v
        state["i"].shape = (2, 8)  # in place: the same object, another shape
        calls["describe"].clear()
        assert pub.publish(state) == 4
        assert calls["describe"] == ["tensor 'i'"]
        assert [p[2] for p in _descriptor(pub, pub._seq).pieces if p[0] == "i"] == [[2, 8]]


def test_by_reference_true_false_and_auto(name):
    with gpuipc.Pool.create(name + ".src", kind="host", chunk_bytes=1 << 20, max_bytes=4 << 20) as pool:
        _, state = _ref_sources(pool, 1)
        with pytest.raises(gpuipc.InvalidArgument, match="by_reference"):
            gpuipc.stream_publisher(name, 4096, 2, kind="host", by_reference="yes")
        with gpuipc.stream_publisher(name, 1 << 20, 2, kind="host", by_reference=True) as pub:
            assert pub.bucket_bytes == 256  # nothing is staged
            with pytest.raises(gpuipc.InvalidArgument, match=r"tensor 'p' .*not in gpuipc pool memory"):
                pub.publish(state)
            with pytest.raises(gpuipc.InvalidArgument, match=r"tensor 'ws' .*strided"):
                pub.publish({"w": state["w"], "ws": state["w"][::2]})
            assert pub.publish({"w": state["w"], "i": state["i"], "z": state["z"]}) == 3
            assert [len(p) for p in _descriptor(pub, pub._seq).pieces] == [7, 7, 6]
        with gpuipc.stream_publisher(name, 1 << 20, 2, kind="host", by_reference=False) as pub:
            assert pub.publish(state) == 1
            d = _descriptor(pub, pub._seq)
            assert [len(p) for p in d.pieces] == [6, 6, 6, 6] and d.blocks == []


def test_many_reference_pieces_take_descriptor_only_buckets(name, start):
    """3000 references with long names do not fit one 128 KiB descriptor: the version takes several buckets of
    descriptors only (no staging bytes), through a ring of two, and arrives whole."""
    n = 3000
    with gpuipc.Pool.create(name + ".src", kind="host", chunk_bytes=1 << 20, max_bytes=4 << 20) as pool, \
            gpuipc.stream_publisher(name, 4096, 2, kind="host") as pub:
        block = pool.allocate(n * 64)
        state = {f"model.layers.{k}.self_attn.q_proj.weight.shard_{'x' * 40}": block.numpy("int64", (8,), offset=64 * k)
                 for k in range(n)}
        for k, a in enumerate(state.values()):
            a[...] = k
        fut = start(helpers.stream_receive_counting, name, state, 1)
        assert pub.wait_readers(1, timeout=60) == 1
        assert pub.publish(state) == 1
        assert pub._seq >= 2
        for seq in range(pub._seq - 1, pub._seq + 1):  # the two buckets still in the ring
            d = _descriptor(pub, seq)
            assert d.used == 0 and d.pieces and all(len(p) == 7 for p in d.pieces) and len(d.blocks) == 1
            assert not d.staged
        [(v, arrays, calls)] = fut.result(timeout=60)
        assert v == 1 and all(np.array_equal(arrays[k], state[k]) for k in state)
        assert calls == {"Pool.open": 1, "Pool.map_chunks": 1, "Pool.views_of": 1}  # one block, resolved once


def test_a_readers_first_version_maps_the_publishers_chunks_in_one_call(name, start):
    """Blocks of a version lying in three chunks of the publisher's pool: the reader's first receive joins the pool
    and maps the three chunks with one Pool.map_chunks (one broker round trip) before it resolves the blocks; the
    next version, naming the same blocks, opens and maps nothing."""
    with gpuipc.Pool.create(name + ".src", kind="host", chunk_bytes=1 << 16, max_bytes=3 << 16) as pool, \
            gpuipc.stream_publisher(name, 1 << 20, 2, kind="host", by_reference=True) as pub:
        blocks = [pool.allocate(1 << 16) for _ in range(3)]  # a chunk each
        assert sorted(b.ref.chunk for b in blocks) == [0, 1, 2]
        state = {f"t{k}": b.numpy("int64") for k, b in enumerate(blocks)}
        fut = start(helpers.stream_receive_counting, name, state, 2)
        assert pub.wait_readers(1, timeout=60) == 1
        for v in (1, 2):
            for k, a in enumerate(state.values()):
                a[...] = 10 * v + k
            assert pub.publish(state) == v
        got = fut.result(timeout=60)
        assert [v for v, _, _ in got] == [1, 2]
        for v, arrays, _ in got:
            assert all(np.all(arrays[f"t{k}"] == 10 * v + k) for k in range(3)), v
        calls = [c for _, _, c in got]
        assert calls[0] == {"Pool.open": 1, "Pool.map_chunks": 1, "Pool.views_of": 3}, calls
        assert calls[1] == {}, calls


def test_references_are_sent_in_buckets_of_bucket_bytes(name, start):
    """by_reference=True: a bucket goes out once its reference pieces name bucket_bytes (64 KiB here), before the
    publisher has walked the rest of the dict; 12 arrays of 16 KiB take three buckets through a ring of two, and
    arrive whole over two versions."""
    with gpuipc.Pool.create(name + ".src", kind="host", chunk_bytes=1 << 20, max_bytes=4 << 20) as pool, \
            gpuipc.stream_publisher(name, 64 << 10, 2, kind="host", by_reference=True) as pub:
        block = pool.allocate(12 * 16384)
        state = {f"t{k:02}": block.numpy("float32", (4096,), offset=16384 * k) for k in range(12)}
        fut = start(helpers.stream_receive_counting, name, state, 2)
        assert pub.wait_readers(1, timeout=60) == 1
        for v in (1, 2):
            for k, a in enumerate(state.values()):
                a[...] = 100 * v + k
            first = pub._seq + 1
            assert pub.start() == v
            pub.update(list(state.items())[:6])
            assert pub._filled.value == first  # the first 4 (64 KiB) are out already
            pub.update(list(state.items())[6:])
            assert pub.finish() == v
            assert pub._seq == first + 2
            for i in (1, 2):  # the two buckets still in the ring: 4 pieces each
                d = _descriptor(pub, first + i)
                assert d.used == 0 and [p[0] for p in d.pieces] == [f"t{k:02}" for k in range(4 * i, 4 * i + 4)]
        got = fut.result(timeout=60)
        assert [v for v, _, _ in got] == [1, 2]
        for v, arrays, _ in got:
            assert all(np.all(arrays[k] == 100 * v + i) for i, k in enumerate(state)), v


def test_descriptor_only_buckets_go_back_once_read(name, start):
    """A bucket with no staged bytes that is not the last of its version goes back to the publisher once the reader
    has read it, before its copies: three buckets of one reference each pass a ring of two while the reader still
    holds the first piece (until update() has returned: no deadlock, no eviction). The last bucket is still waited
    for: finish() returns after the reader's copies, and the reader has the version's values, not those written
    right after finish()."""
    with gpuipc.Pool.create(name + ".src", kind="host", chunk_bytes=1 << 20, max_bytes=4 << 20) as pool, \
            gpuipc.stream_publisher(name, 4096, 2, kind="host", by_reference=True, reader_timeout=20) as pub:
        block = pool.allocate(3 * 16384)
        state = {k: block.numpy("float32", (4096,), offset=16384 * i) for i, k in enumerate("abc")}
        for i, a in enumerate(state.values()):
            a[...] = i + 1
        hold = 0.3
        fut = start(helpers.stream_receive_slowly, name, hold, name + "-go")
        assert pub.wait_readers(1, timeout=60) == 1
        assert pub.start() == 1
        t0 = time.monotonic()
        pub.update(state)  # bucket 3 waits for the reader to give bucket 1 back: it does, holding its piece
        assert time.monotonic() - t0 < 10 and pub._seq == 3
        with gpuipc.Segment.create(name + "-go", 4096):
            t1 = time.monotonic()
            assert pub.finish() == 1
            assert time.monotonic() - t1 >= 2 * hold  # the reader's copies of the three pieces, `hold` each
            for a in state.values():
                a[...] = -1
            r = fut.result(timeout=60)  # not evicted: an evicted reader raises InvalidState
        assert {k: float(v[0]) for k, v in r["got"].items()} == {"a": 1.0, "b": 2.0, "c": 3.0}
        assert all(np.all(r["got"][k] == r["got"][k][0]) for k in "abc")


def test_a_reader_evicted_while_it_copies_the_last_bucket_does_not_report_the_version(name, start):
    """Eviction was checked before each bucket's read only: a reader that took longer than reader_timeout over the
    version's last bucket, while the publisher's next version overwrote that ring slot under it, ended the loop
    normally and reported the version with the next one's bytes in it."""
    with gpuipc.stream_publisher(name, 4096, 2, kind="host", reader_timeout=0.3) as pub:
        fut = start(helpers.stream_receive_slow_last, name, "c", 1.5)
        assert pub.wait_readers(1, timeout=60) == 1
        assert pub.publish({k: np.full(1024, 1.0, np.float32) for k in "abc"}) == 1  # a bucket each, a ring of 2
        time.sleep(0.3)
        assert pub.publish({k: np.full(1024, 2.0, np.float32) for k in "abc"}) == 2  # evicts the reader, then
        r = fut.result(timeout=60)  # rewrites the slot of version 1's last bucket
        assert r[0] == "raised" and r[1] == "InvalidState" and "evicted" in r[2], r


def test_source_changed_after_wait_consumed_is_not_seen(name, start):
    """finish() (host staging) returns only after the reader has copied the references out of the last bucket, so
    the publisher may write its tensors once publish() returns; wait_consumed() then returns at once."""
    with gpuipc.Pool.create(name + ".src", kind="host", chunk_bytes=1 << 20, max_bytes=4 << 20) as pool, \
            gpuipc.stream_publisher(name, 4096, 2, kind="host") as pub:
        _, state = _ref_sources(pool, 1)
        hold = 0.4
        fut = start(helpers.stream_receive_slowly, name, hold)
        assert pub.wait_readers(1, timeout=60) == 1
        t0 = time.monotonic()
        assert pub.publish(state) == 1
        assert time.monotonic() - t0 >= 3 * hold  # it waited for the reader's copies (4 pieces, `hold` each)
        assert pub.wait_consumed(timeout=0) == 1  # already consumed: no waiting at all
        state["w"][...] = -1.0  # the next version's values, written in place
        state["i"][...] = -1
        r = fut.result(timeout=60)
        assert np.array_equal(r["got"]["w"], helpers.ref_layout(1)["w"])
        assert np.array_equal(r["got"]["i"], helpers.ref_layout(1)["i"])
        assert r["items"]["w"] == ("float32", (8000,), True, False)  # whole, read-only, over the publisher's block
        assert r["items"]["i"] == ("int64", (4, 4), True, False)


def test_wait_consumed_timeout_and_eviction(name):
    with gpuipc.Pool.create(name + ".src", kind="host", chunk_bytes=1 << 20, max_bytes=4 << 20) as pool:
        _, state = _ref_sources(pool, 1)
        with gpuipc.stream_publisher(name, 4096, 8, kind="host") as pub, gpuipc.stream_reader(name) as rd:
            assert pub.wait_consumed(timeout=0) == 0  # nothing committed yet
            pub.wait_readers(1, timeout=10)
            assert pub.publish({"p": state["p"]}) == 1  # staged only: finish() does not wait
            with pytest.raises(gpuipc.Timeout, match="slot 0"):
                pub.wait_consumed(timeout=0.2)
            assert rd.receive({"p": np.zeros(5)}, timeout=10) == 1
            assert pub.wait_consumed(timeout=5) == 1
        # a reader that stays alive but does not read is evicted after reader_timeout, by finish()'s wait too
        with gpuipc.stream_publisher(name, 4096, 8, kind="host", reader_timeout=0.3) as pub, \
                gpuipc.stream_reader(name) as rd:
            pub.wait_readers(1, timeout=10)
            t0 = time.monotonic()
            assert pub.publish(state) == 1
            assert 0.25 < time.monotonic() - t0 < 10
            assert pub.wait_consumed(timeout=1) == 1  # the evicted reader is not waited for
            with pytest.raises(gpuipc.InvalidState, match="evicted"):
                rd.receive(helpers.ref_layout(0), timeout=5)


def test_reader_close_lets_the_publishers_blocks_go(name):
    with gpuipc.Pool.create(name + ".src", kind="host", chunk_bytes=1 << 20, max_bytes=4 << 20) as pool, \
            gpuipc.stream_publisher(name, 4096, 2, kind="host") as pub:
        block, state = _ref_sources(pool, 1)
        rd = gpuipc.stream_reader(name)
        pub.wait_readers(1, timeout=10)
        into = {k: np.zeros_like(x) for k, x in helpers.ref_layout(0).items()}
        got = []
        t = threading.Thread(target=lambda: got.append(rd.receive(into, timeout=10)))
        t.start()
        assert pub.publish(state) == 1  # returns once the reader (a thread here) copied the references
        t.join(10)
        assert got == [1] and np.array_equal(into["w"], state["w"])
        block.free()
        assert pool.stats()["live_blocks"] == 1  # the reader still holds it, and would copy from it
        rd.close()
        assert pool.stats()["live_blocks"] == 0


def test_a_readers_close_unmaps_the_stream(name):
    with gpuipc.stream_publisher(name, 4096, 2, kind="host"):
        before = helpers.mapped(name)
        rd = gpuipc.stream_reader(name)
        assert len(helpers.mapped(name)) > len(before)
        rd.close()  # the control segment's array kept it mapped until the reader was collected
        assert helpers.mapped(name) == before


def test_killed_reader_does_not_hold_finish(name):
    ctx = multiprocessing.get_context("spawn")
    with gpuipc.Pool.create(name + ".src", kind="host", chunk_bytes=1 << 20, max_bytes=4 << 20) as pool, \
            gpuipc.stream_publisher(name, 4096, 2, kind="host") as pub:
        _, state = _ref_sources(pool, 1)
        p = ctx.Process(target=helpers.stream_reader_holds_first, args=(name, name + "-ready"))
        p.start()
        try:
            assert pub.wait_readers(1, timeout=60) == 1
            killer = _kill_when(name + "-ready", p.pid)
            t0 = time.monotonic()
            assert pub.publish(state) == 1  # finish() waits for the reader until it is killed
            assert time.monotonic() - t0 < 30
            killer.join(10)
        finally:
            p.kill()
            p.join()
        assert pub.wait_consumed(timeout=5) == 1
        assert pub.readers == 0


def test_checksum_covers_reference_pieces(name, start):
    """A tensor sent by reference that changes after its bucket was sent (a publisher breaking the rule) fails the
    reader's checksum, which sums the bytes it is about to copy; the next version arrives whole."""
    with gpuipc.Pool.create(name + ".src", kind="host", chunk_bytes=1 << 20, max_bytes=4 << 20) as pool, \
            gpuipc.stream_publisher(name, 4096, 2, kind="host", checksum=True) as pub:
        _, state = _ref_sources(pool, 1)
        layout = {"w": state["w"], "pad": np.zeros(2000, dtype=np.float32)}
        fut = start(helpers.stream_receive_after, name, name + "-go", layout)
        assert pub.wait_readers(1, timeout=60) == 1
        pub.start()
        pub.update({"w": state["w"], "pad": layout["pad"]})  # "pad" fills bucket 1 (sent), and goes on in bucket 2
        state["w"][0] += 1  # after bucket 1 and its checksum were sent
        with gpuipc.Segment.create(name + "-go", 4096):
            assert pub.finish() == 1  # waits until the reader skipped the rest of version 1
            assert pub.publish(layout) == 2
            first, (v, arrays) = fut.result(timeout=60)
        assert first[0] == "ChecksumMismatch" and "version 1" in first[1] and "'w'" in first[1]
        assert v == 2 and np.array_equal(arrays["w"], state["w"])


def test_format_mismatch_is_refused(name):
    from gpuipc._stream_format import FORMAT

    with gpuipc.stream_publisher(name, 4096, 2, kind="host") as pub:
        for other in (1, FORMAT + 1):
            pub._mem[8:12] = np.frombuffer(np.uint32(other).tobytes(), dtype=np.uint8)
            with pytest.raises(gpuipc.InvalidArgument, match=f"format {other}; this gpuipc reads format {FORMAT} only"):
                gpuipc.stream_reader(name)


def test_the_weights_bench_finds_by_reference():
    """bench/suites/_weights_versions.py measures the by-reference path only where stream_publisher takes
    by_reference (else it reports it missing): it must find it in this gpuipc."""
    suites = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "bench", "suites")
    if not os.path.exists(os.path.join(suites, "_weights_versions.py")):
        pytest.skip("no bench/suites here (an installed package without the repository)")
    sys.path.insert(0, suites)
    try:
        import _weights_versions
    finally:
        sys.path.remove(suites)
    assert _weights_versions._has_by_reference(gpuipc)


def test_pieces_outside_their_tensor_or_source_are_refused():
    """A reader checks every piece of a descriptor it decodes: within its tensor, within the staging bucket or the
    block its table names, the table index real (a publisher's bytes are never trusted)."""
    from gpuipc._stream_format import _check_pieces

    ref = gpuipc.BlockRef(pool=1, generation=1, offset=0, size=4096, chunk=0, index=0)
    blocks = [["p", bytes(ref).hex()]]
    good = [["a", "float32", [4], 0, 16, 0], ["b", "int64", [2, 2], 0, 32, 4000 - 32, 0]]
    _check_pieces(good, blocks, 1024)  # as a publisher writes them
    bad = [
        [["a", "float32", [4], 0, 17, 0]],  # more bytes than its tensor has
        [["a", "float32", [4], -4, 16, 0]],  # a negative position
        [["a", "float32", [4], 0, 16, 1020]],  # past the staging bucket
        [["b", "int64", [2, 2], 0, 32, 4080, 0]],  # past its block
        [["b", "int64", [2, 2], 0, 32, 0, 1]],  # a block not in the table
        [["b", "int64", [2, 2], 0, 32, 0, -1]],  # not even with a negative index
        [["b", "int64", [2, 2], 0, 32, 0, True]],
        [["a", "no-such-type", [4], 0, 16, 0]],
    ]
    for pieces in bad:
        with pytest.raises(gpuipc.ProtocolError):
            _check_pieces(pieces, blocks, 1024)
    with pytest.raises(gpuipc.ProtocolError):
        _check_pieces(good, [["p", "zz"]], 1024)


def test_bad_timeouts_are_refused(name):
    """NaN, negative or non-numeric timeouts raise InvalidArgument: wait_readers(timeout=nan) waited for ever,
    reader_timeout=nan was taken and broke the second publish, and receive read a negative timeout as 0."""
    with pytest.raises(gpuipc.InvalidArgument, match="reader_timeout"):
        gpuipc.stream_publisher(name, 4096, 1, kind="host", reader_timeout=float("nan"))
    with gpuipc.stream_publisher(name, 4096, 1, readers=1, kind="host") as pub:
        for bad in (float("nan"), -1, "1"):
            with pytest.raises(gpuipc.InvalidArgument, match="timeout"):
                pub.wait_readers(1, timeout=bad)
        with gpuipc.stream_reader(name) as rd:
            for bad in (float("nan"), -1):
                with pytest.raises(gpuipc.InvalidArgument, match="timeout"):
                    rd.receive({"x": np.zeros(1)}, timeout=bad)


def test_stream_publisher_sizes(name):
    """NumPy ints are ints; a ring over 1 TiB is refused naming bucket_bytes (it was reported as the pool's
    chunk_bytes); bools are no counts."""
    with gpuipc.stream_publisher(name, np.int64(4096), np.int32(2), readers=np.uint8(1), kind="host") as pub:
        assert pub.publish({"x": np.ones(4)}) == 1
    with pytest.raises(gpuipc.InvalidArgument, match="buckets of"):
        gpuipc.stream_publisher(name, 1 << 40, 2, kind="host")
    with pytest.raises(gpuipc.InvalidArgument, match="buckets must be 1..1024, not True"):
        gpuipc.stream_publisher(name, 4096, True, kind="host")


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to setuid a child to another uid")
def test_only_those_who_may_read_a_stream_make_its_reader_slots(name, spawn):
    """A reader's slot is a semaphore it makes under the stream's name, and the publisher waits for every reader it
    finds there: another user who may not read the stream made one, and the publisher waited for it for ever."""
    from gpuipc._stream_format import _slot_name

    with gpuipc.stream_publisher(name, 4096, 2, readers=1, kind="host", mode=0o600) as pub:
        pub.init()
        cls, msg = spawn(helpers.create_semaphore_as_other_user, _slot_name(name, 0))
        assert cls == "PermissionDenied" and "may not read" in msg, (cls, msg)
    shown = name + "s"
    with gpuipc.stream_publisher(shown, 4096, 2, readers=1, kind="host", mode=0o644) as pub:
        pub.init()
        assert spawn(helpers.create_semaphore_as_other_user, _slot_name(shown, 0)) == ("ok", "")
