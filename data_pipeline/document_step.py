"""The common shape of every document-level step: read a shard, judge each row, split kept/removed.

Why one helper: normalisation, filters and the apply half of each dedup differ only in how they
judge a document. Writing the kept shard, the removed records (with stage, reason, duplicate_of)
and the per-reason counts in one place keeps the "every document ends in exactly one of kept or
removed" accounting identical everywhere.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import datasets
import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from data_pipeline.context import Context
from data_pipeline.io.shards import REMOVED_SCHEMA, removed_file, shard_file, table_of, write_table


@dataclass
class Verdicts:
    """Per row: ``None`` keeps it, a string removes it for that reason (``duplicate_of`` for dedup)."""

    reasons: list[str | None]
    duplicate_of: list[str | None] | None = None
    copies: list[int] | None = None  # remix: how often each kept row is written (copies get "#<k>" ids)


def _with_copies(kept: pa.Table, copies: np.ndarray) -> pa.Table:
    """Each row repeated ``copies[i]`` times; the k-th extra copy's id gets the suffix ``#<k>``."""
    rows = np.repeat(np.arange(kept.num_rows), copies)
    copy = np.arange(rows.size) - np.repeat(np.cumsum(copies) - copies, copies)
    out = kept.take(pa.array(rows))
    ids = [i if c == 0 else f"{i}#{c}" for i, c in zip(out.column("id").to_pylist(), copy.tolist())]
    out = out.set_column(out.schema.get_field_index("id"), "id", pa.array(ids, pa.string()))
    return out.append_column("remix_copy", pa.array(copy, pa.int32()))


def map_documents(
    docs: datasets.Dataset,
    fn: Callable[[dict[str, list[Any]]], dict[str, list[Any]]],
    adds: dict[str, pa.DataType],
) -> datasets.Dataset:
    """``docs.map(fn, batched=True)`` in memory. ``map`` never calls ``fn`` on an empty shard (a stage
    before may have removed every document), so there the columns ``fn`` adds are added empty,
    with their types: every shard of a step has the same columns. Elsewhere the types are given to
    ``map`` too: it writes batches of 1000 rows, and a column whose first batch holds only None
    (a filter that kept those documents) would otherwise refuse a later batch's values."""
    if docs.num_rows:
        added = datasets.Features.from_arrow_schema(pa.schema(list(adds.items())))
        features = datasets.Features({**docs.features, **added})
        return docs.map(fn, batched=True, load_from_cache_file=False, features=features)
    table = table_of(docs)
    for name, kind in adds.items():
        table = table.append_column(pa.field(name, kind), pa.array([], kind))
    return datasets.Dataset(table)


def text_bytes(table: pa.Table) -> int:
    """UTF-8 bytes of the ``text`` column (nulls count 0)."""
    if table.num_rows == 0:
        return 0
    return int(pc.sum(pc.binary_length(table.column("text"))).as_py() or 0)


def write_split(
    ctx: Context, unit: int, dataset: datasets.Dataset, verdicts: Verdicts, bytes_in: int | None = None
) -> dict[str, Any]:
    """Write ``shard-<unit>`` (kept rows) and ``removed-<unit>`` to the step dir; return the unit's counts.

    ``bytes_in``: the text bytes before this step edited them (default: as ``dataset`` has them).
    """
    table = table_of(dataset)
    reasons = verdicts.reasons
    if len(reasons) != table.num_rows:
        raise RuntimeError(f"{ctx.step_name}: {len(reasons)} verdicts for {table.num_rows} documents")
    keep = np.array([r is None for r in reasons], dtype=bool)
    kept = table.filter(pa.array(keep))
    gone = table.filter(pa.array(~keep))
    dup = verdicts.duplicate_of or [None] * len(reasons)
    removed = pa.Table.from_pydict(
        {
            "id": gone.column("id"),
            "stage": pa.array([ctx.stage] * gone.num_rows, pa.string()),
            "reason": pa.array([r for r in reasons if r is not None], pa.string()),
            "duplicate_of": pa.array([d for d, k in zip(dup, keep) if not k], pa.string()),
            "source": gone.column("source")
            if "source" in gone.column_names
            else pa.nulls(gone.num_rows, pa.string()),
            "text": gone.column("text"),
        },
        schema=REMOVED_SCHEMA,
    )
    if verdicts.copies is not None:
        kept = _with_copies(kept, np.asarray(verdicts.copies, dtype=np.int64)[keep])
    write_table(kept, ctx.step_dir / shard_file(unit))
    write_table(removed, ctx.step_dir / removed_file(unit))
    return {
        "docs_in": table.num_rows,
        "docs_out": kept.num_rows,
        "bytes_in": text_bytes(table) if bytes_in is None else bytes_in,
        "bytes_out": text_bytes(kept),
        "removed": dict(sorted(Counter(r for r in reasons if r is not None).items())),
    }
