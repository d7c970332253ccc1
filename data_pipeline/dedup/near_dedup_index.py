"""The persistent near-dedup index: signatures of the documents a run kept, for later runs.

Why: DeepSeek deduplicated across all Common Crawl dumps, not per dump. A run writes the MinHash
signatures, LSH band hashes and ids of its surviving documents; later runs list such indexes in
``near_dedup.against_indexes`` and drop documents that near-duplicate an indexed one. Texts are not
kept, so such pairs are verified with the signature estimate.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from data_contract.errors import ConfigError
from data_pipeline.dedup.lsh_bands import lsh_shape
from data_pipeline.io.shards import building_dir

if TYPE_CHECKING:
    from data_pipeline.dedup.near_dedup_config import NearDedupConfig

INDEX_DIR = "near_dedup_index"
_COMPATIBLE = ("num_perm", "ngram", "seed", "scheme")


@dataclass
class NearDedupIndex:
    signatures: np.ndarray  # uint32 [n, num_perm]
    bands: np.ndarray  # uint64 [n, bands]
    ids: list[str]


def index_meta(cfg: NearDedupConfig, bands: int, rows: int) -> dict:
    return {**{k: getattr(cfg, k) for k in _COMPATIBLE}, "bands": bands, "rows": rows}


def write_index(path: Path, index: NearDedupIndex, meta: dict) -> None:
    with building_dir(path) as tmp:
        np.save(tmp / "signatures.npy", index.signatures)
        np.save(tmp / "bands.npy", index.bands)
        pq.write_table(pa.table({"id": pa.array(index.ids, pa.string())}), tmp / "ids.parquet")
        (tmp / "meta.json").write_text(json.dumps({**meta, "documents": len(index.ids)}, indent=2) + "\n")


def load_index(path: Path, meta: dict) -> NearDedupIndex:
    """Memory-maps an index; its MinHash settings must match this run's, or nothing would collide."""
    meta_file = Path(path) / "meta.json"
    if not meta_file.is_file():
        raise ConfigError(f"near_dedup.against_indexes: {path} is not a near-dedup index (no meta.json)")
    saved = json.loads(meta_file.read_text())
    wrong = [k for k in (*_COMPATIBLE, "bands", "rows") if saved.get(k) != meta[k]]
    if wrong:
        raise ConfigError(
            f"near_dedup.against_indexes: {path} was built with "
            + ", ".join(f"near_dedup.{k}={saved.get(k)}" for k in wrong)
            + "; use the same settings"
        )
    ids = pq.read_table(Path(path) / "ids.parquet").column("id").to_pylist()
    return NearDedupIndex(
        np.load(Path(path) / "signatures.npy", mmap_mode="r"),
        np.load(Path(path) / "bands.npy", mmap_mode="r"),
        ids,
    )


def load_indexes(cfg: NearDedupConfig) -> list[NearDedupIndex]:
    """The indexes ``near_dedup.against_indexes`` names, checked against this run's settings."""
    meta = index_meta(cfg, *lsh_shape(cfg))
    return [load_index(p, meta) for p in cfg.against_indexes]


def index_key_offsets(indexes: list[NearDedupIndex]) -> list[int]:
    """The first key of each index: index documents get negative keys, so they sort before (and
    are kept over) this run's documents, whose keys are ``shard << 32 | row``."""
    total = sum(len(ix.ids) for ix in indexes)
    offsets, start = [], -total
    for ix in indexes:
        offsets.append(start)
        start += len(ix.ids)
    return offsets


def index_row(offsets: list[int], key: int) -> tuple[int, int]:
    """(which index, which row of it) holds the document with negative ``key``."""
    j = max(j for j, o in enumerate(offsets) if o <= key)
    return j, int(key - offsets[j])
