"""Document keys: ``shard << 32 | row`` within one step's input shards.

Why: dedup steps compare documents across shards by a single sortable int64 whose order is the
input order, so "keep the first occurrence" is "keep the smallest key", and a key says where to
find the document again.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pyarrow.parquet as pq

from data_pipeline.io.shards import shard_file

ROW_BITS = 32


def make_keys(shard: int, num_rows: int) -> np.ndarray:
    return (np.int64(shard) << ROW_BITS) + np.arange(num_rows, dtype=np.int64)


def shard_of(keys: np.ndarray) -> np.ndarray:
    return np.asarray(keys, dtype=np.int64) >> ROW_BITS


def row_of(keys: np.ndarray) -> np.ndarray:
    return np.asarray(keys, dtype=np.int64) & ((1 << ROW_BITS) - 1)


def column_of_keys(docs_dir: Path, keys: np.ndarray, column: str = "id") -> list[str]:
    """``column`` of the documents with these keys, reading each shard once and of it only the row
    groups that hold them (a few candidates cost a few row groups, not whole shards)."""
    keys = np.asarray(keys, dtype=np.int64)
    out: list[str] = [""] * keys.size
    shards = shard_of(keys)
    for shard in np.unique(shards):
        where = np.flatnonzero(shards == shard)
        rows = row_of(keys[where])
        parquet = pq.ParquetFile(docs_dir / shard_file(int(shard)))
        sizes = [parquet.metadata.row_group(g).num_rows for g in range(parquet.num_row_groups)]
        starts = np.concatenate([[0], np.cumsum(sizes)])
        group = np.searchsorted(starts, rows, side="right") - 1
        needed = np.unique(group)
        read_starts = np.zeros(starts.size - 1, dtype=np.int64)  # where each needed group lands
        read_starts[needed] = np.concatenate([[0], np.cumsum(np.asarray(sizes)[needed])[:-1]])
        values = parquet.read_row_groups(needed.tolist(), columns=[column]).column(column)
        taken = values.take(rows - starts[group] + read_starts[group]).to_pylist()
        for i, v in zip(where.tolist(), taken):
            out[i] = v
    return out
