"""Shard files: atomic writes, completion markers, and document shards as in-memory ``datasets``.

Why: a killed run must never leave a half-written file that a rerun mistakes for finished work.
Every output is written under a temporary name and renamed; a unit's marker is renamed into place
only after all its outputs, so "marker present" means "outputs complete". Temporary names are
chosen, not created with ``mkstemp``/``mkdtemp`` (which make them private, 0600/0700): the files and
directories are then created as usual, so they follow the umask like any other output.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import datasets
import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from data_contract.fs import publish_dir

REMOVED_SCHEMA = pa.schema(
    [
        ("id", pa.string()),
        ("stage", pa.string()),
        ("reason", pa.string()),
        ("duplicate_of", pa.string()),
        ("source", pa.string()),
        ("text", pa.string()),
    ]
)
"""Every removed document: which stage removed it and why; ``duplicate_of`` is the kept document's id."""


def shard_file(index: int) -> str:
    return f"shard-{index:05d}.parquet"


def removed_file(index: int) -> str:
    return f"removed-{index:05d}.parquet"


def temp_path(path: Path) -> Path:
    """An unused hidden name beside ``path`` for building it; nothing is created."""
    return path.parent / f".{path.name}.tmp-{os.getpid()}-{uuid.uuid4().hex[:12]}"


def _atomic(path: Path, write: Any) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = temp_path(path)
    try:
        write(str(tmp))
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def make_temp_dir(path: Path) -> Path:
    """A new directory beside ``path`` (mode from the umask) to build ``path`` in."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = temp_path(path)
    tmp.mkdir()
    return tmp


@contextlib.contextmanager
def building_dir(path: Path) -> Iterator[Path]:
    """A directory to fill that replaces ``path`` by rename when the block ends; on an exception it
    is removed and ``path`` stays as it was."""
    tmp = make_temp_dir(path)
    try:
        yield tmp
        publish_dir(tmp, path)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def write_table(table: pa.Table, path: Path) -> None:
    """Parquet, deterministic: fixed row groups and compression, no pandas metadata."""
    _atomic(path, lambda tmp: pq.write_table(table, tmp, compression="zstd", row_group_size=10_000))


def write_npy(array: np.ndarray, path: Path) -> None:
    def save(tmp: str) -> None:
        with open(tmp, "wb") as f:
            np.save(f, array)

    _atomic(path, save)


def write_json(obj: Any, path: Path) -> None:
    text = json.dumps(obj, indent=2, sort_keys=True, ensure_ascii=False) + "\n"
    _atomic(path, lambda tmp: Path(tmp).write_text(text, encoding="utf-8"))


def read_documents(path: Path, columns: list[str] | None = None) -> datasets.Dataset:
    """A document shard as an in-memory ``datasets.Dataset``: ``map`` results stay in memory, no cache files."""
    return datasets.Dataset(pq.read_table(path, columns=columns))


def table_of(dataset: datasets.Dataset) -> pa.Table:
    """The Arrow table behind a dataset, without its ``datasets`` schema metadata (bytes stay stable)."""
    table = dataset.data.table if not dataset._indices else dataset.flatten_indices().data.table
    return table.replace_schema_metadata(None)


def marker_path(step_dir: Path, unit: int) -> Path:
    return step_dir / "done" / f"{unit:05d}.json"


def read_marker(step_dir: Path, unit: int) -> dict[str, Any] | None:
    path = marker_path(step_dir, unit)
    return json.loads(path.read_text(encoding="utf-8")) if path.is_file() else None


def link_or_copy(src: Path, dst: Path) -> None:
    """Hard link (no extra disk) where the filesystem allows it, else a copy."""
    dst.parent.mkdir(parents=True, exist_ok=True)
    try:
        os.link(src, dst)
    except OSError:
        shutil.copyfile(src, dst)
