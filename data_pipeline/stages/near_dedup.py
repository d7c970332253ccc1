"""Stage ``near_dedup``: MinHash signatures, LSH buckets, verified union-find clusters, removal.

Steps and their units: ``signatures`` per shard (numpy MinHash, bounded by ``batch_size``),
``buckets`` per LSH band (documents sharing a band hash become candidate pairs, each with the
band's first document, filed by partition), ``cluster`` per partition (its candidate pairs verified
by exact Jaccard of shingle sets, or by the signature estimate, then union-find), ``merge`` once
(the partitions' components joined: see ``near_dedup_cluster``), ``apply`` per shard. Every
cluster keeps its first document (earlier runs' indexed documents come before all of this run's).
Its settings (``NearDedupConfig``) live in ``dedup/near_dedup_config.py``, beside the machinery
that reads them.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pyarrow.parquet as pq

from data_pipeline.context import Context
from data_pipeline.dedup.apply import mark_duplicates
from data_pipeline.dedup.doc_keys import make_keys, row_of
from data_pipeline.dedup.lsh_bands import lsh_shape
from data_pipeline.dedup.minhash import EMPTY, MinHasher, band_hashes
from data_pipeline.dedup.near_dedup_cluster import (
    cluster_unit,
    duplicates_of_shard,
    merge_unit,
    split_by_partition,
)
from data_pipeline.dedup.near_dedup_config import NearDedupConfig
from data_pipeline.dedup.near_dedup_index import (
    INDEX_DIR,
    NearDedupIndex,
    index_key_offsets,
    index_meta,
    load_indexes,
    write_index,
)
from data_pipeline.io.shards import shard_file, write_npy
from data_pipeline.stage import Stage, Step


def _hasher(cfg: NearDedupConfig) -> MinHasher:
    return MinHasher(num_perm=cfg.num_perm, ngram=cfg.ngram, seed=cfg.seed, scheme=cfg.scheme)


def signatures_unit(ctx: Context, unit: int) -> dict[str, Any]:
    cfg: NearDedupConfig = ctx.config
    bands, rows = lsh_shape(cfg)
    hasher = _hasher(cfg)
    texts = pq.read_table(ctx.docs_dir / shard_file(unit), columns=["text"]).column("text").to_pylist()
    sigs = np.full((len(texts), cfg.num_perm), EMPTY, dtype=np.uint32)
    for start in range(0, len(texts), cfg.batch_size):
        sigs[start : start + cfg.batch_size] = hasher.signatures(texts[start : start + cfg.batch_size])
    has = sigs[:, 0] != EMPTY if len(texts) else np.zeros(0, dtype=bool)
    write_npy(sigs, ctx.step_dir / f"sig-{unit:05d}.npy")
    write_npy(band_hashes(sigs, bands, rows), ctx.step_dir / f"bands-{unit:05d}.npy")
    write_npy(has, ctx.step_dir / f"has-{unit:05d}.npy")
    return {"documents": len(texts), "without_shingles": int((~has).sum())}


def buckets_unit(ctx: Context, band: int) -> dict[str, Any]:
    """Candidate pairs of one band: (first key, other key) for every group sharing the band hash,
    grouped by the cluster partition of the first key."""
    sig_dir = ctx.dirs["near_dedup.signatures"]
    hashes, keys = [], []
    for shard in range(ctx.num_shards):
        has = np.load(sig_dir / f"has-{shard:05d}.npy")
        column = np.load(sig_dir / f"bands-{shard:05d}.npy", mmap_mode="r")[:, band]
        hashes.append(np.asarray(column)[has])
        keys.append(make_keys(shard, has.size)[has])
    indexes = load_indexes(ctx.config)
    for ix, offset in zip(indexes, index_key_offsets(indexes)):
        hashes.append(np.asarray(ix.bands[:, band]))
        keys.append(offset + np.arange(len(ix.ids), dtype=np.int64))
    h, k = np.concatenate(hashes), np.concatenate(keys)
    order = np.lexsort((k, h))
    h, k = h[order], k[order]
    same = np.zeros(h.size, dtype=bool)
    same[1:] = h[1:] == h[:-1]
    first = k[np.maximum.accumulate(np.where(same, 0, np.arange(h.size)))]
    pairs = np.stack([first[same], k[same]], axis=1) if h.size else np.zeros((0, 2), dtype=np.int64)
    pairs = pairs[pairs[:, 1] >= 0].astype(np.int64)  # two indexed documents: deduplicated by their run
    pairs, offsets = split_by_partition(pairs, ctx.config.cluster_partitions)
    write_npy(pairs, ctx.step_dir / f"pairs-{band:05d}.npy")
    write_npy(offsets, ctx.step_dir / f"offsets-{band:05d}.npy")
    return {"pairs": int(pairs.shape[0])}


def apply_unit(ctx: Context, unit: int) -> dict[str, Any]:
    dups = duplicates_of_shard(ctx, unit)
    reasons = [
        "near_duplicate_of_index" if x else "near_duplicate" for x in dups.column("of_index").to_pylist()
    ]
    keys = dups.column("key").to_numpy()
    return mark_duplicates(ctx, unit, keys, reasons, dups.column("duplicate_of").to_pylist())


def save_index_unit(ctx: Context, unit: int) -> dict[str, Any]:
    """Signatures of the documents this run kept, published as ``output_dir/near_dedup_index``."""
    cfg: NearDedupConfig = ctx.config
    sig_dir = ctx.dirs["near_dedup.signatures"]
    sigs, bands, ids = [], [], []
    for shard in range(ctx.num_shards):  # ctx.docs_dir: the shards near_dedup kept, in input order
        has = np.load(sig_dir / f"has-{shard:05d}.npy")
        keep = np.ones(has.size, dtype=bool)
        keep[row_of(duplicates_of_shard(ctx, shard).column("key").to_numpy())] = False
        kept_ids = pq.read_table(ctx.docs_dir / shard_file(shard), columns=["id"]).column("id").to_pylist()
        ids += [i for i, h in zip(kept_ids, has[keep].tolist()) if h]
        keep &= has
        sigs.append(np.load(sig_dir / f"sig-{shard:05d}.npy")[keep])
        bands.append(np.load(sig_dir / f"bands-{shard:05d}.npy")[keep])
    index = NearDedupIndex(np.concatenate(sigs), np.concatenate(bands), ids)
    write_index(ctx.output_dir / INDEX_DIR, index, index_meta(cfg, *lsh_shape(cfg)))
    return {"documents": len(ids)}


class NearDedup(Stage):
    name = "near_dedup"
    Config = NearDedupConfig

    def steps(self) -> list[Step]:
        steps = [
            self.step(signatures_unit, "signatures"),
            self.step(buckets_unit, "buckets", units=lsh_shape(self.config)[0]),
            self.step(cluster_unit, "cluster", units=self.config.cluster_partitions),
            self.step(merge_unit, "merge", units=1),
            self.step(apply_unit, writes_documents=True),
        ]
        if self.config.save_index:
            steps.append(self.step(save_index_unit, "save_index", units=1))
        return steps
