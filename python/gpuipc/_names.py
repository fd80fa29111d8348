"""Removing every name an object made of several (a stream, a set of shared tensors) after its owner died without
closing it: streaming.unlink_stream and tensors.unlink_tensors."""

from __future__ import annotations

from typing import Callable, Iterable, Tuple

from .errors import NotFound


def unlink_names(unlinks: Iterable[Tuple[Callable[[str], None], str]], missing: str) -> None:
    """Calls each ``unlink(name)``, a name already gone skipped. Raises NotFound(``missing``) when none existed."""
    found = False
    for unlink, name in unlinks:
        try:
            unlink(name)
            found = True
        except NotFound:
            pass
    if not found:
        raise NotFound(missing)
