"""Per-channel options from Python (host channels, CPU): pacing and pacing_ahead at create and open and as
settable properties, with GPUIPC_CHANNEL_PACING_US / GPUIPC_CHANNEL_PACING_AHEAD as the defaults; Channel.stat."""

from __future__ import annotations

import numpy as np
import pytest

import gpuipc


def _create(name, **kw):
    opts = dict(kind="host", slots=8, slot_bytes=256, header_bytes=64)
    opts.update(kw)
    return gpuipc.Channel.create(name, **opts)


def test_defaults_are_the_environment_variables(name, monkeypatch):
    monkeypatch.delenv("GPUIPC_CHANNEL_PACING_US", raising=False)
    monkeypatch.delenv("GPUIPC_CHANNEL_PACING_AHEAD", raising=False)
    with _create(name) as ch:
        assert ch.pacing == pytest.approx(200e-6)
        assert ch.pacing_ahead == 4  # half a ring of 8
        monkeypatch.setenv("GPUIPC_CHANNEL_PACING_US", "35")
        monkeypatch.setenv("GPUIPC_CHANNEL_PACING_AHEAD", "3")
        with gpuipc.Channel.open(name, "consumer") as other:
            assert other.pacing == pytest.approx(35e-6)
            assert other.pacing_ahead == 3
        assert ch.pacing == pytest.approx(200e-6), "read when a handle is made, not later"
    gpuipc.Channel.unlink(name)


def test_options_override_the_environment(name, monkeypatch):
    monkeypatch.setenv("GPUIPC_CHANNEL_PACING_US", "35")
    monkeypatch.setenv("GPUIPC_CHANNEL_PACING_AHEAD", "3")
    with _create(name, pacing=0, pacing_ahead=5) as ch:
        assert ch.pacing == 0
        assert ch.pacing_ahead == 5
        with gpuipc.Channel.open(name, "consumer", pacing=1e-3, pacing_ahead=100) as other:
            assert other.pacing == pytest.approx(1e-3)
            assert other.pacing_ahead == 8  # clamped to the ring
        with gpuipc.Channel.open(name, "consumer") as plain:
            assert plain.pacing == pytest.approx(35e-6)
    gpuipc.Channel.unlink(name)


def test_setters(name):
    with _create(name) as ch:
        ch.pacing = 70e-6
        assert ch.pacing == pytest.approx(70e-6)
        ch.pacing_ahead = 2
        assert ch.pacing_ahead == 2
        ch.pacing_ahead = 1000
        assert ch.pacing_ahead == 8
        with pytest.raises(gpuipc.InvalidArgument):
            ch.pacing = -1.0
        with pytest.raises(gpuipc.InvalidArgument):
            ch.pacing_ahead = 0
        assert ch.pacing == pytest.approx(70e-6), "a refused value changes nothing"
    with pytest.raises(gpuipc.InvalidArgument):
        gpuipc.Channel.open(name, "producer", pacing=-1)
    gpuipc.Channel.unlink(name)


def test_stat_and_stats_count_published_messages_and_bytes(name):
    with _create(name, slots=4) as ch:
        ch.send(np.zeros(10, dtype=np.uint8))
        ch.send(np.zeros(20, dtype=np.uint8))
        s = gpuipc.Channel.stat(name)
        assert (s.published, s.published_bytes, s.queued, s.free_slots) == (2, 30, 2, 2)
        assert (s.slots, s.slot_bytes, s.producers, s.consumers) == (4, 256, 1, 0)
        assert ch.stats.published_bytes == 30
    with pytest.raises(gpuipc.NotFound):
        gpuipc.Channel.stat(name + "-none")
    gpuipc.Channel.unlink(name)
