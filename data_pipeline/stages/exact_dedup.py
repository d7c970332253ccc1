"""Stage ``exact_dedup``: documents whose text is byte-identical to an earlier one are removed.

Why three steps: hashing is per shard; finding the first occurrence of each hash needs all shards,
so the 128-bit hashes are split into ``partitions`` hash ranges resolved independently (memory per
unit ~ 24 bytes x documents / partitions); applying is per shard again. Idempotent: the output has
no two equal texts, so a second pass removes nothing.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import Any

import numpy as np
import pyarrow.parquet as pq

from data_contract.errors import ConfigError
from data_pipeline.context import Context
from data_pipeline.dedup.apply import mark_duplicates
from data_pipeline.dedup.doc_keys import column_of_keys, make_keys, shard_of
from data_pipeline.io.shards import shard_file, write_npy
from data_pipeline.stage import Stage, Step

HASH_DTYPE = np.dtype([("h0", "<u8"), ("h1", "<u8"), ("key", "<i8")])
DUP_DTYPE = np.dtype([("key", "<i8"), ("first", "<i8")])


@dataclass
class ExactDedupConfig:
    partitions: int = 16  # hash-range partitions resolved in parallel (units of the resolve step)

    def validate(self) -> ExactDedupConfig:
        if not 1 <= self.partitions <= 4096:
            raise ConfigError(f"exact_dedup.partitions={self.partitions} must lie in [1, 4096]")
        return self


def text_digests(texts: list[str]) -> np.ndarray:
    """uint64 [n, 2]: BLAKE2b-128 of each UTF-8 text (collisions: ~n^2 / 2^129)."""
    raw = b"".join(hashlib.blake2b(t.encode("utf-8"), digest_size=16).digest() for t in texts)
    return np.frombuffer(raw, dtype="<u8").reshape(len(texts), 2)


def hash_unit(ctx: Context, unit: int) -> dict[str, Any]:
    texts = pq.read_table(ctx.docs_dir / shard_file(unit), columns=["text"]).column("text").to_pylist()
    digests = text_digests(texts)
    records = np.empty(len(texts), dtype=HASH_DTYPE)
    records["h0"], records["h1"], records["key"] = digests[:, 0], digests[:, 1], make_keys(unit, len(texts))
    partition = records["h0"] % np.uint64(ctx.config.partitions)
    order = np.argsort(partition, kind="stable")
    offsets = np.searchsorted(partition[order], np.arange(ctx.config.partitions + 1))
    write_npy(records[order], ctx.step_dir / f"hashes-{unit:05d}.npy")
    write_npy(offsets.astype(np.int64), ctx.step_dir / f"offsets-{unit:05d}.npy")
    return {"documents": len(texts)}


def resolve_unit(ctx: Context, unit: int) -> dict[str, Any]:
    """Partition ``unit`` of every shard: each hash's smallest key is kept, the others are duplicates."""
    hash_dir = ctx.dirs["exact_dedup.hash"]
    parts = []
    for shard in range(ctx.num_shards):
        offsets = np.load(hash_dir / f"offsets-{shard:05d}.npy")
        records = np.load(hash_dir / f"hashes-{shard:05d}.npy", mmap_mode="r")
        parts.append(np.asarray(records[offsets[unit] : offsets[unit + 1]]))
    records = np.concatenate(parts) if parts else np.empty(0, dtype=HASH_DTYPE)
    records = records[np.lexsort((records["key"], records["h1"], records["h0"]))]
    same = np.zeros(records.size, dtype=bool)
    same[1:] = (records["h0"][1:] == records["h0"][:-1]) & (records["h1"][1:] == records["h1"][:-1])
    group_first = np.maximum.accumulate(np.where(same, 0, np.arange(records.size)))
    dups = np.empty(int(same.sum()), dtype=DUP_DTYPE)
    dups["key"], dups["first"] = records["key"][same], records["key"][group_first[same]]
    write_npy(dups, ctx.step_dir / f"dups-{unit:05d}.npy")
    return {"duplicates": int(dups.size)}


def apply_unit(ctx: Context, unit: int) -> dict[str, Any]:
    resolve_dir = ctx.dirs["exact_dedup.resolve"]
    found = []
    for p in range(ctx.config.partitions):
        dups = np.load(resolve_dir / f"dups-{p:05d}.npy")
        found.append(dups[shard_of(dups["key"]) == unit])
    dups = np.concatenate(found)
    originals = column_of_keys(ctx.docs_dir, dups["first"])
    return mark_duplicates(ctx, unit, dups["key"], ["exact_duplicate"] * dups.size, originals)


class ExactDedup(Stage):
    name = "exact_dedup"
    Config = ExactDedupConfig

    def steps(self) -> list[Step]:
        return [
            self.step(hash_unit, "hash"),
            self.step(resolve_unit, "resolve", units=self.config.partitions),
            self.step(apply_unit, writes_documents=True),
        ]
