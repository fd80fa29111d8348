"""The ``device=`` arguments: a GPU ordinal of this process, or a GPU's UUID, which names the same physical GPU in
every process whatever its CUDA_VISIBLE_DEVICES (docs/multigpu.md)."""

from __future__ import annotations

from typing import Optional, Union

from . import _gpuipc
from .errors import NoDevice

#: What a ``device=`` argument takes: an ordinal of this process, or "GPU-xxxxxxxx-xxxx-xxxx-xxxx-xxxxxxxxxxxx".
Device = Union[int, str]


def device_ordinal(uuid: str) -> int:
    """The ordinal, in this process, of the GPU with UUID ``uuid`` (``"GPU-..."`` as ``nvidia-smi -L``,
    ``SegmentInfo.device_uuid`` and ``gpuipc doctor`` print it), or -1 when this process does not see it
    (CUDA_VISIBLE_DEVICES). Raises InvalidArgument (malformed UUID), NoDriver."""
    return int(_gpuipc.device_ordinal(uuid))


def resolve(device: Optional[Device]) -> Optional[int]:
    """An ordinal of this process for ``device``: an int as it is, None as None, a UUID string by
    :func:`device_ordinal`. Raises NoDevice for a UUID this process does not see, InvalidArgument for a malformed
    one, TypeError for anything else."""
    if device is None or isinstance(device, int):
        return device
    if isinstance(device, str):
        ordinal = device_ordinal(device)
        if ordinal < 0:
            raise NoDevice(
                f"GPU {device} is not visible to this process (CUDA_VISIBLE_DEVICES); gpuipc doctor lists the GPUs "
                "it sees with their UUIDs"
            )
        return ordinal
    raise TypeError(f"device must be a GPU ordinal (int) or a GPU UUID (str), not {type(device).__name__}")
