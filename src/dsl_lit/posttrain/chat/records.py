"""Post-training data (SFT conversations, DPO pairs, GRPO prompts) as researchers bring it: a JSONL
file read line by line, or a directory that ``datasets``' ``save_to_disk`` wrote (a ``Dataset``, or
a ``DatasetDict`` whose ``train`` split is read). A line or row that is not JSON or not a row is
counted and set aside with its number and why, as the data pipeline sets bad records aside, never
a traceback."""

from __future__ import annotations

import json
import logging
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, TypeVar

from data_contract.errors import ConfigError

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


def read_records(path: str | Path, parse: Callable[[Any], Row | str]) -> tuple[list[Row], int]:
    """(rows, records set aside): each record through ``parse``, which returns its row or, as a
    string, why the record is set aside; one warning names the first three such lines (or rows)."""
    path = Path(path)
    records, unit = (_dataset_rows(path), "row(s)") if path.is_dir() else (_jsonl_records(path), "line(s)")
    rows: list[Row] = []
    set_aside: list[str] = []
    for n, record, why in records:
        parsed = why if why is not None else parse(record)
        if isinstance(parsed, str):
            set_aside.append(f"{n} ({parsed})")
        else:
            rows.append(parsed)
    if set_aside:
        log.warning("%s: %d %s set aside: %s%s", path, len(set_aside), unit, "; ".join(set_aside[:3]),
                    "; ..." if len(set_aside) > 3 else "")
    return rows, len(set_aside)


def _jsonl_records(path: Path) -> Iterator[tuple[int, Any, str | None]]:
    """(line number, its record, None) or (line number, None, why there is none) of the non-blank lines."""
    with path.open(encoding="utf-8", errors="replace") as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                yield n, json.loads(line), None
            except json.JSONDecodeError:
                yield n, None, "not JSON"


def _dataset_rows(path: Path) -> Iterator[tuple[int, Any, str | None]]:
    """(row number from 1, the row as a dict) of a ``save_to_disk`` directory's dataset."""
    try:
        import datasets
    except ImportError:
        raise ConfigError(f"{path} is a directory: reading a datasets directory needs the datasets package "
                          "(pip install datasets), or give a .jsonl file") from None
    try:
        loaded = datasets.load_from_disk(str(path))
    except FileNotFoundError:
        raise ConfigError(f"{path} is a directory that datasets' save_to_disk did not write (no dataset_info.json "
                          "or dataset_dict.json); give a .jsonl file or such a directory") from None
    if isinstance(loaded, datasets.DatasetDict):
        if "train" not in loaded:
            raise ConfigError(f"{path} holds the splits {sorted(loaded)} and no 'train' split; save the split to "
                              "train on as 'train' or as a Dataset of its own")
        loaded = loaded["train"]
    for n, row in enumerate(loaded, 1):  # a column a row lacks is None in Arrow's table: absent, as in JSON
        yield n, {k: v for k, v in row.items() if v is not None}, None
