"""Post-training data files (SFT conversations, DPO pairs, GRPO prompts): JSONL read line by line, a
line that is not JSON or not a row counted and set aside with its number and why, as the data
pipeline sets bad records aside, never a traceback."""

from __future__ import annotations

import json
import logging
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

Row = TypeVar("Row")
Message = dict[str, str]
log = logging.getLogger(__name__)


def as_messages(value: Any, role: str) -> list[Message] | None:
    """A prompt or reply as messages: a string is one ``role`` turn; a non-empty list must hold
    ``{"role": str, "content": str}`` messages (None: neither)."""
    if isinstance(value, str):
        return [{"role": role, "content": value}]
    if isinstance(value, list) and value and all(
            isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str) for m in value):
        return [{"role": m["role"], "content": m["content"]} for m in value]
    return None


def read_jsonl(path: str | Path, parse: Callable[[Any], Row | str]) -> tuple[list[Row], int]:
    """(rows, lines set aside): each line's record through ``parse``, which returns its row or, as a
    string, why the line is set aside; one warning names the first three such lines."""
    rows: list[Row] = []
    set_aside: list[str] = []
    with Path(path).open(encoding="utf-8", errors="replace") as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                parsed = parse(json.loads(line))
            except json.JSONDecodeError:
                parsed = "not JSON"
            if isinstance(parsed, str):
                set_aside.append(f"{n} ({parsed})")
            else:
                rows.append(parsed)
    if set_aside:
        log.warning("%s: %d line(s) set aside: %s%s", path, len(set_aside), "; ".join(set_aside[:3]),
                    "; ..." if len(set_aside) > 3 else "")
    return rows, len(set_aside)
