"""Range checks of integer arguments before they reach the extension, whose unsigned parameters refuse a negative
or too large int with a bare TypeError ("incompatible function arguments")."""

from __future__ import annotations

import operator
from typing import Any

from .errors import InvalidArgument

#: The largest value an unsigned 32- and 64-bit parameter takes.
U32 = (1 << 32) - 1
U64 = (1 << 64) - 1


def in_range(value: Any, what: str, top: int) -> int:
    """``value`` as an int from 0 to ``top``: InvalidArgument naming ``what`` otherwise (TypeError for what is no
    integer at all, such as 1.5)."""
    v = operator.index(value)
    if not 0 <= v <= top:
        raise InvalidArgument(f"{what} must be an integer from 0 to {top}, not {v}")
    return v
