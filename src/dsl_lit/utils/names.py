"""Naming a few of many things in an error message."""

from __future__ import annotations

from collections.abc import Iterable


def few(names: Iterable[str], limit: int = 5) -> str:
    """``'a', 'b', ... (and 7 more)``: error messages list a few names, not thousands."""
    names = sorted(names)
    shown = ", ".join(repr(n) for n in names[:limit])
    return shown + (f" ... (and {len(names) - limit} more)" if len(names) > limit else "")
