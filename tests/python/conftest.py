"""Fixtures of the Python tests: a private broker per test, children in spawned processes, a hang guard.

Every test gets its own runtime directory (GPUIPC_RUNTIME_DIR, set before its first gpuipc call; children
inherit it), so it talks to its own broker, which the fixture stops afterwards (SIGTERM to the pid in
broker.pid). The library reconnects to the next test's broker on its next request.
"""

from __future__ import annotations

import faulthandler
import gc
import multiprocessing
import os
import shutil
import sys
import tempfile
import uuid
from concurrent.futures import ProcessPoolExecutor
from typing import Any, Callable, Iterator

import pytest

#: No test may take longer than this (seconds): a hang dumps every thread's stack and ends the run.
TEST_TIMEOUT = 120


@pytest.fixture(autouse=True)
def runtime_dir(monkeypatch: pytest.MonkeyPatch) -> Iterator[str]:
    # Short path: the broker's Unix socket path must fit in 108 bytes. 0755: setuid'd children reach it too.
    d = tempfile.mkdtemp(prefix="gpi-", dir="/tmp")
    os.chmod(d, 0o755)
    monkeypatch.setenv("GPUIPC_RUNTIME_DIR", d)
    monkeypatch.setenv("GPUIPC_IDLE_TIMEOUT_MS", "600000")
    faulthandler.dump_traceback_later(TEST_TIMEOUT, exit=True)
    try:
        yield d
    finally:
        faulthandler.cancel_dump_traceback_later()
        gc.collect()  # drop this test's objects while their broker is still there
        from gpuipc._broker import stop_broker

        stop_broker(d)
        shutil.rmtree(d, ignore_errors=True)


@pytest.fixture(scope="session", autouse=True)
def no_stray_brokers() -> Iterator[None]:
    """Objects that outlive their test (held by a failed test's traceback) are destroyed at exit; their broker is
    gone by then, and the library would start a new one in the default runtime directory to say goodbye."""
    yield
    os.environ["GPUIPC_NO_AUTOSTART"] = "1"
    os.environ["GPUIPC_RUNTIME_DIR"] = "/nonexistent/gpuipc-tests-are-over"


@pytest.fixture
def name() -> str:
    """A fresh object name."""
    return "t" + uuid.uuid4().hex[:12]


@pytest.fixture
def spawn() -> Iterator[Callable[..., Any]]:
    """spawn(fn, *args, timeout=60): runs fn(*args) in a fresh spawned process and returns its result (its
    exception is re-raised here). Each call gets its own process."""
    pools = []

    def run(fn: Callable[..., Any], *args: Any, timeout: float = 60) -> Any:
        pool = ProcessPoolExecutor(max_workers=1, mp_context=multiprocessing.get_context("spawn"))
        pools.append(pool)
        return pool.submit(fn, *args).result(timeout=timeout)

    yield run
    for pool in pools:
        pool.shutdown(wait=True, cancel_futures=True)


@pytest.fixture
def start() -> Iterator[Callable[..., Any]]:
    """start(fn, *args): starts fn(*args) in a spawned process and returns a Future (for children that run
    while the test does something else)."""
    pools = []

    def run(fn: Callable[..., Any], *args: Any) -> Any:
        pool = ProcessPoolExecutor(max_workers=1, mp_context=multiprocessing.get_context("spawn"))
        pools.append(pool)
        return pool.submit(fn, *args)

    yield run
    for pool in pools:
        pool.shutdown(wait=True, cancel_futures=True)


def pytest_report_header(config: pytest.Config) -> str:
    import gpuipc

    return f"gpuipc {gpuipc.__version__} from {os.path.dirname(gpuipc.__file__)}; python {sys.version.split()[0]}"
