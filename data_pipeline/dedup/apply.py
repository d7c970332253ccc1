"""The apply half of both dedups: remove a shard's duplicates, naming the document each duplicates.

Why shared: exact and near dedup end the same way, with (key, original id) pairs for one shard.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from data_pipeline.context import Context
from data_pipeline.dedup.doc_keys import make_keys
from data_pipeline.document_step import Verdicts, write_split
from data_pipeline.io.shards import read_documents, shard_file


def mark_duplicates(
    ctx: Context, unit: int, keys: np.ndarray, reasons_of: list[str], originals: list[str]
) -> dict[str, Any]:
    """Remove the rows with ``keys`` from shard ``unit``; row ``keys[i]`` duplicates ``originals[i]``."""
    docs = read_documents(ctx.docs_dir / shard_file(unit))
    reasons: list[str | None] = [None] * docs.num_rows
    duplicate_of: list[str | None] = [None] * docs.num_rows
    rows = (np.asarray(keys, dtype=np.int64) - make_keys(unit, 1)[0]).tolist()
    for row, reason, original in zip(rows, reasons_of, originals):
        reasons[row], duplicate_of[row] = reason, original
    return write_split(ctx, unit, docs, Verdicts(reasons, duplicate_of))
