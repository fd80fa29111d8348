"""Range checks of integer arguments before they reach the extension, whose unsigned parameters refuse a negative
or too large int with a bare TypeError ("incompatible function arguments")."""

from __future__ import annotations

import math
import operator
from typing import Any, Optional

from .errors import InvalidArgument

#: The largest value an unsigned 32- and 64-bit parameter takes.
U32 = (1 << 32) - 1
U64 = (1 << 64) - 1


def in_range(value: Any, what: str, top: int) -> int:
    """``value`` as an int from 0 to ``top``: InvalidArgument naming ``what`` otherwise (TypeError for what is no
    integer at all, such as 1.5)."""
    if isinstance(value, bool):  # (an int to Python: mode=True would be mode 1)
        raise InvalidArgument(f"{what} must be an integer, not {value!r}")
    v = operator.index(value)
    if not 0 <= v <= top:
        raise InvalidArgument(f"{what} must be an integer from 0 to {top}, not {v}")
    return v


def seconds(value: Any, what: str, none: str) -> Optional[float]:
    """A number of seconds >= 0 (``math.inf`` allowed), or None (which means ``none``): InvalidArgument for a
    negative number, NaN or what is no number."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) and not hasattr(value, "__float__"):
        raise InvalidArgument(f"{what} must be None ({none}) or a number of seconds >= 0, not {value!r}")
    v = float(value)
    if math.isnan(v) or v < 0:
        raise InvalidArgument(f"{what} must be None ({none}) or a number of seconds >= 0, not {value!r}")
    return v


def as_bytes(value: Any, what: str) -> bytes:
    """A bytes-like ``value`` as bytes: InvalidArgument for an int, which ``bytes()`` would make that many zeros."""
    if isinstance(value, int):
        raise InvalidArgument(f"{what} must be bytes (or bytearray, memoryview), not an int: b'...'")
    return bytes(value)
