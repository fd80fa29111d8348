"""The package itself: the shipped daemon, the exception hierarchy, stream arguments."""

from __future__ import annotations

import os
import re

import pytest

import gpuipc
from gpuipc._streams import stream_handle


def test_daemon_ships_inside_the_package():
    pkg = os.path.dirname(os.path.abspath(gpuipc.__file__))
    daemon = os.path.join(pkg, "gpuipcd")
    assert os.access(daemon, os.X_OK), "the wheel must carry an executable gpuipcd"
    if "GPUIPC_DAEMON" not in os.environ or os.environ["GPUIPC_DAEMON"] == daemon:
        assert os.path.realpath(gpuipc.daemon_path()) == os.path.realpath(daemon)


def test_the_package_names_the_commit_it_was_built_from():
    # what benchmark results of the module name (bench/suites/python_handoff.py, weights.py)
    assert re.fullmatch(r"[0-9a-f]{40}(-dirty)?|unknown", gpuipc.__commit__), gpuipc.__commit__


def test_broker_started_from_the_package(name, runtime_dir):
    with gpuipc.Segment.create(name, 1):
        pid = int(open(os.path.join(runtime_dir, "broker.pid")).read())
        exe = os.path.realpath(f"/proc/{pid}/exe")
        assert os.path.basename(exe) == "gpuipcd"


@pytest.mark.parametrize(
    "cls, builtin",
    [
        (gpuipc.InvalidArgument, ValueError),
        (gpuipc.NotFound, FileNotFoundError),
        (gpuipc.AlreadyExists, FileExistsError),
        (gpuipc.PermissionDenied, PermissionError),
        (gpuipc.Timeout, TimeoutError),
        (gpuipc.WouldBlock, gpuipc.Timeout),
        (gpuipc.Interrupted, InterruptedError),
        (gpuipc.InvalidState, RuntimeError),
        (gpuipc.SystemCallError, OSError),
    ],
)
def test_errors_derive_from_builtins(cls, builtin):
    assert issubclass(cls, gpuipc.Error) and issubclass(cls, builtin)


def test_every_error_class_is_exported():
    for cls in (gpuipc.QuotaExceeded, gpuipc.PeerDied, gpuipc.Closed, gpuipc.NoDriver, gpuipc.NoDevice,
                gpuipc.Unsupported, gpuipc.CudaError, gpuipc.ProtocolError):
        assert issubclass(cls, gpuipc.Error) and cls.__name__ in gpuipc.__all__
    e = gpuipc.PermissionDenied("no", code="PermissionDenied", call="open", errno=13)
    assert (str(e), e.code, e.call, e.errno, e.cu_result) == ("no", "PermissionDenied", "open", 13, 0)


@pytest.mark.parametrize("cls", [gpuipc.PermissionDenied, gpuipc.NotFound, gpuipc.SystemCallError, gpuipc.CudaError,
                                 gpuipc.Timeout, gpuipc.Error])
def test_an_error_pickles_with_its_attributes(cls):
    # multiprocessing sends a worker's exception back pickled: the OSError ones came back with errno None.
    import pickle

    e = cls("why", code="Code", call="open", errno=13, cu_result=2)
    back = pickle.loads(pickle.dumps(e))
    assert type(back) is cls
    assert (str(back), back.code, back.call, back.errno, back.cu_result) == ("why", "Code", "open", 13, 2)


def test_translated_error_carries_code_and_call(name):
    with pytest.raises(gpuipc.NotFound) as e:
        gpuipc.Segment.stat(name)
    assert e.value.code == "NotFound" and name in str(e.value)


class _Proto:
    def __cuda_stream__(self):
        return (0, 1234)


class _Torchish:
    cuda_stream = 99


class _Cupyish:
    ptr = 77


def test_stream_arguments():
    assert stream_handle(None) == 0
    assert stream_handle(5) == 5
    assert stream_handle(_Proto()) == 1234
    assert stream_handle(_Torchish()) == 99
    assert stream_handle(_Cupyish()) == 77
    with pytest.raises(TypeError):
        stream_handle("stream")
    with pytest.raises(TypeError):
        stream_handle(True)
    with pytest.raises(ValueError):
        stream_handle(-1)


class _TorchLike:
    """torch.cuda.Stream's shape: the protocol and an int attribute giving the same handle."""

    calls = 0

    def __init__(self, handle):
        self.cuda_stream = handle

    def __cuda_stream__(self):
        type(self).calls += 1
        return (0, self.cuda_stream)


class _Disagrees:
    """An attribute that is not the handle the protocol gives: the protocol is asked every time."""

    calls = 0
    cuda_stream = 5

    def __cuda_stream__(self):
        type(self).calls += 1
        return (0, 6)


def test_stream_handles_of_a_type_are_read_from_its_int_attribute_once_known():
    handles = [stream_handle(_TorchLike(h)) for h in (11, 12, 0, 13)]
    assert handles == [11, 12, 0, 13] and _TorchLike.calls == 1  # the protocol once, the attribute after
    late = _TorchLike(14)
    late.cuda_stream = None  # an instance whose attribute is no handle: the protocol again, and its error
    with pytest.raises(TypeError):
        stream_handle(late)
    assert [stream_handle(_Disagrees()) for _ in range(3)] == [6, 6, 6] and _Disagrees.calls == 3


def test_cupy_module_says_what_is_missing():
    try:
        import cupy  # noqa: F401
    except ImportError:
        pass
    else:
        pytest.skip("CuPy is installed here: tests/python/test_gpu_streaming.py covers gpuipc.cupy")
    import gpuipc.cupy as gcupy

    with pytest.raises(ImportError, match="CuPy"):
        gcupy.set_allocator(None)
