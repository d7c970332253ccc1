"""Near-dedup clustering in partitions: verify candidate pairs and union them per partition, then merge.

Why partitions: one unit holding every candidate pair (and, with exact verification, the shingles
of every candidate) is what breaks first on a crawl. The ``buckets`` step files each pair under
``hash(smaller key) % cluster_partitions``, so a ``cluster`` unit reads only its partition's pairs
from every band, verifies them (reading the texts of its own candidates only) and runs union-find
on the verified ones. What it passes on is its forest: ``(document, smallest document of its
component)`` for every document that is not that smallest one. Each such document is a duplicate
in the end as well (its global component only grows, so its minimum only falls), so the one
``merge`` unit holds at most the duplicates' forests (each duplicate in up to a few partitions),
never the pairs and never all documents. Replacing each partition's verified edges by a star on
the partition component's minimum keeps every connection, so the merged components and their
minima, and thus the kept document of each cluster, are the same for any number of partitions.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from data_pipeline.context import Context
from data_pipeline.dedup.doc_keys import ROW_BITS, column_of_keys
from data_pipeline.dedup.lsh_bands import lsh_shape
from data_pipeline.dedup.minhash import jaccard_of_signatures, mix64, shingle_hashes
from data_pipeline.dedup.near_dedup_index import NearDedupIndex, index_key_offsets, index_row, load_indexes
from data_pipeline.dedup.union_find import connected_components
from data_pipeline.io.shards import read_marker, write_npy, write_table

if TYPE_CHECKING:
    from data_pipeline.dedup.near_dedup_config import NearDedupConfig

DUPLICATES_FILE = "duplicates.parquet"


def partition_of(keys: np.ndarray, partitions: int) -> np.ndarray:
    """int64 partition of each key: splitmix64 of the key modulo ``partitions`` (keys of one shard,
    consecutive integers, spread evenly)."""
    mixed = mix64(np.asarray(keys, dtype=np.int64).view(np.uint64).copy())
    return (mixed % np.uint64(partitions)).astype(np.int64)


def split_by_partition(pairs: np.ndarray, partitions: int) -> tuple[np.ndarray, np.ndarray]:
    """``pairs`` (smaller key first) grouped by the partition of their smaller key, and the
    ``partitions + 1`` offsets of the groups."""
    part = partition_of(pairs[:, 0], partitions)
    order = np.argsort(part, kind="stable")
    offsets = np.searchsorted(part[order], np.arange(partitions + 1))
    return pairs[order], offsets.astype(np.int64)


def _partition_pairs(ctx: Context, partition: int) -> np.ndarray:
    """This partition's candidate pairs from every band, each pair once."""
    bucket_dir = ctx.dirs["near_dedup.buckets"]
    parts = []
    for band in range(lsh_shape(ctx.config)[0]):
        offsets = np.load(bucket_dir / f"offsets-{band:05d}.npy")
        pairs = np.load(bucket_dir / f"pairs-{band:05d}.npy", mmap_mode="r")
        parts.append(np.asarray(pairs[offsets[partition] : offsets[partition + 1]]))
    pairs = np.concatenate(parts)
    return np.unique(pairs, axis=0) if pairs.size else np.zeros((0, 2), dtype=np.int64)


def _shingle_sets(ctx: Context, keys: np.ndarray) -> dict[int, np.ndarray]:
    """Unique shingle hashes of this run's documents ``keys`` (their texts read by row group)."""
    cfg: NearDedupConfig = ctx.config
    texts = column_of_keys(ctx.docs_dir, keys, column="text")
    out: dict[int, np.ndarray] = {}
    for start in range(0, keys.size, cfg.batch_size):
        batch = texts[start : start + cfg.batch_size]
        shingles, counts = shingle_hashes(batch, cfg.ngram)
        for key, part in zip(
            keys[start : start + cfg.batch_size].tolist(), np.split(shingles, np.cumsum(counts)[:-1])
        ):
            out[key] = np.unique(part)
    return out


def _signatures_of(ctx: Context, keys: np.ndarray, indexes: list[NearDedupIndex]) -> np.ndarray:
    sig_dir = ctx.dirs["near_dedup.signatures"]
    out = np.empty((keys.size, ctx.config.num_perm), dtype=np.uint32)
    offsets = index_key_offsets(indexes)
    maps: dict[int, np.ndarray] = {}
    for i, key in enumerate(keys.tolist()):  # candidates only: a small fraction of all documents
        if key >= 0:
            shard = key >> ROW_BITS
            if shard not in maps:
                maps[shard] = np.load(sig_dir / f"sig-{shard:05d}.npy", mmap_mode="r")
            out[i] = maps[shard][key & ((1 << ROW_BITS) - 1)]
        else:
            j, row = index_row(offsets, key)
            out[i] = indexes[j].signatures[row]
    return out


def _similarities(ctx: Context, pairs: np.ndarray, indexes: list[NearDedupIndex]) -> np.ndarray:
    """Jaccard of each candidate pair: exact on shingle sets, or the MinHash estimate (always for
    pairs with an indexed document, whose text was not kept)."""
    cfg: NearDedupConfig = ctx.config
    if cfg.verify == "none" or pairs.size == 0:
        return np.ones(pairs.shape[0])
    sims = np.empty(pairs.shape[0])
    exact = (pairs[:, 0] >= 0) if cfg.verify == "exact" else np.zeros(pairs.shape[0], dtype=bool)
    if exact.any():
        sets = _shingle_sets(ctx, np.unique(pairs[exact]))
        for i in np.flatnonzero(exact).tolist():
            a, b = sets[int(pairs[i, 0])], sets[int(pairs[i, 1])]
            sims[i] = np.intersect1d(a, b, assume_unique=True).size / max(np.union1d(a, b).size, 1)
    estimate = ~exact
    if estimate.any():
        keys, inverse = np.unique(pairs[estimate], return_inverse=True)
        sigs = _signatures_of(ctx, keys, indexes)[inverse.reshape(-1, 2)]
        sims[estimate] = jaccard_of_signatures(sigs[:, 0], sigs[:, 1])
    return sims


def components(edges: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(nodes, the smallest node of each one's component) of the graph ``edges``."""
    nodes, inverse = np.unique(edges, return_inverse=True)
    return nodes, nodes[connected_components(nodes.size, inverse.reshape(-1, 2))]


def cluster_unit(ctx: Context, partition: int) -> dict[str, Any]:
    """Verify one partition's candidate pairs; write the forest of its verified components."""
    pairs = _partition_pairs(ctx, partition)
    verified = pairs[_similarities(ctx, pairs, load_indexes(ctx.config)) >= ctx.config.threshold]
    nodes, roots = components(verified)
    forest = np.stack([nodes, roots], axis=1)[nodes != roots]
    write_npy(forest.astype(np.int64), ctx.step_dir / f"forest-{partition:05d}.npy")
    return {"candidate_pairs": int(pairs.shape[0]), "verified_pairs": int(verified.shape[0])}


def merge_unit(ctx: Context, unit: int) -> dict[str, Any]:
    """Every partition's forest merged: each duplicate with the first document of its cluster,
    sorted by key (``duplicates_of_shard`` reads one shard's rows by their row groups)."""
    cfg: NearDedupConfig = ctx.config
    cluster_dir = ctx.dirs["near_dedup.cluster"]
    partitions = cfg.cluster_partitions
    forests = [np.load(cluster_dir / f"forest-{p:05d}.npy") for p in range(partitions)]
    nodes, roots = components(np.concatenate(forests))
    is_dup = (roots != nodes) & (nodes >= 0)  # an indexed document is never removed (nor rewritten)
    dup_keys, root_keys = nodes[is_dup], roots[is_dup]
    original = np.empty(dup_keys.size, dtype=object)
    local = root_keys >= 0
    original[local] = column_of_keys(ctx.docs_dir, root_keys[local])
    indexes = load_indexes(cfg)
    offsets = index_key_offsets(indexes)
    for i in np.flatnonzero(~local).tolist():
        j, row = index_row(offsets, int(root_keys[i]))
        original[i] = indexes[j].ids[row]
    table = pa.table(
        {
            "key": pa.array(dup_keys, pa.int64()),
            "duplicate_of": pa.array(original.tolist(), pa.string()),
            "of_index": pa.array(~local, pa.bool_()),
        }
    )
    write_table(table, ctx.step_dir / DUPLICATES_FILE)
    markers = [read_marker(cluster_dir, p) for p in range(partitions)]
    bands, rows = lsh_shape(cfg)
    return {
        "bands": bands,
        "rows": rows,
        "cluster_partitions": partitions,
        "candidate_pairs": sum(m["candidate_pairs"] for m in markers),
        "verified_pairs": sum(m["verified_pairs"] for m in markers),
        "clusters": int(np.unique(roots).size),
        "duplicates": int(dup_keys.size),
        "duplicates_of_index": int((~local).sum()),
    }


def duplicates_of_shard(ctx: Context, shard: int) -> pa.Table:
    """The rows of ``merge``'s duplicates that lie in ``shard`` (only their row groups are read)."""
    low, high = shard << ROW_BITS, (shard + 1) << ROW_BITS
    path = ctx.dirs["near_dedup.merge"] / DUPLICATES_FILE
    return pq.read_table(path, filters=[("key", ">=", low), ("key", "<", high)])
