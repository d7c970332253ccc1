"""Stage ``remix``: reach target proportions of a metadata field by down- and up-sampling.

Why deterministic selection instead of coin flips: each document gets a rank hash of (seed, key).
For a group that must shrink or grow by a fraction, the documents with the smallest ranks are taken
until the target weight is met, so the realised proportions match the targets as closely as
document sizes allow, and the same run selects the same documents. Copies beyond the first keep
the original text with ids ``<id>#<k>``; dropped documents are removed as ``remix_downsampled``.
"""

from __future__ import annotations

import dataclasses as dc
import hashlib
from dataclasses import dataclass
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from data_contract.errors import ConfigError
from data_pipeline.context import Context
from data_pipeline.dedup.doc_keys import make_keys
from data_pipeline.document_step import Verdicts, write_split
from data_pipeline.io.shards import read_documents, shard_file, write_npy, write_table
from data_pipeline.stage import Stage, Step

NO_VALUE = "<none>"


@dataclass
class RemixConfig:
    field: str = "source"  # the column whose values are mixed
    targets: dict[str, float] = dc.field(default_factory=dict)  # value -> proportion (they sum to 1)
    unit: str = "documents"  # proportions of documents or of UTF-8 bytes
    total: int | None = None  # documents (or bytes) after remixing; null: as many as before
    seed: int = 0

    def validate(self) -> RemixConfig:
        if not self.targets:
            raise ConfigError(
                "remix.targets is empty: give proportions, e.g. remix.targets={web: 0.7, code: 0.3}"
            )
        if any(v < 0 for v in self.targets.values()) or abs(sum(self.targets.values()) - 1.0) > 1e-6:
            raise ConfigError(f"remix.targets={self.targets} must be non-negative and sum to 1")
        if self.unit not in ("documents", "bytes"):
            raise ConfigError(f"remix.unit={self.unit!r} must be documents or bytes")
        if self.total is not None and self.total <= 0:
            raise ConfigError(f"remix.total={self.total} must be positive, or null to keep the current size")
        return self


def weigh_unit(ctx: Context, unit: int) -> dict[str, Any]:
    cfg: RemixConfig = ctx.config
    table = pq.read_table(ctx.docs_dir / shard_file(unit))
    if cfg.field not in table.column_names:
        raise KeyError(f"remix.field={cfg.field!r} is not a column of the documents: {table.column_names}")
    groups = pc.fill_null(pc.cast(table.column(cfg.field), pa.string()), NO_VALUE)
    if cfg.unit == "bytes":
        weights = pc.fill_null(pc.binary_length(table.column("text")), 0).to_numpy().astype(np.int64)
    else:
        weights = np.ones(table.num_rows, dtype=np.int64)
    keys = make_keys(unit, table.num_rows)
    ranks = [
        int.from_bytes(hashlib.blake2b(f"{cfg.seed}:{k}".encode(), digest_size=8).digest(), "little") >> 1
        for k in keys.tolist()
    ]
    out = pa.table({"group": groups, "weight": weights, "rank": pa.array(ranks, pa.int64()), "key": keys})
    write_table(out, ctx.step_dir / f"weights-{unit:05d}.parquet")
    return {"documents": table.num_rows}


def plan_unit(ctx: Context, unit: int) -> dict[str, Any]:
    """Copies per document for every shard, and the before/after report."""
    cfg: RemixConfig = ctx.config
    weigh_dir = ctx.dirs["remix.weigh"]
    table = pa.concat_tables(
        [pq.read_table(weigh_dir / f"weights-{s:05d}.parquet") for s in range(ctx.num_shards)]
    )
    groups = np.array(table.column("group").to_pylist(), dtype=object)
    weights, ranks, keys = (table.column(c).to_numpy() for c in ("weight", "rank", "key"))
    present = {g: int(weights[groups == g].sum()) for g in sorted(set(groups.tolist()))}
    missing = [g for g, p in cfg.targets.items() if p > 0 and present.get(g, 0) == 0]
    if missing:
        raise RuntimeError(f"remix.targets names {missing}, but no document has {cfg.field} = {missing}")
    total = cfg.total if cfg.total is not None else sum(present.get(g, 0) for g in cfg.targets)
    copies = np.zeros(groups.size, dtype=np.int64)
    for group, share in cfg.targets.items():
        members = np.flatnonzero(groups == group)
        if members.size == 0:
            continue
        target = share * total
        have = weights[members].sum()
        full = int(target // have)
        copies[members] = full
        rest = target - full * have
        order = members[np.argsort(ranks[members], kind="stable")]
        cumulative = np.concatenate([[0], np.cumsum(weights[order])])
        extra = int(np.argmin(np.abs(cumulative - rest)))  # the prefix closest to the remaining weight
        copies[order[:extra]] += 1
    after = {g: int((weights * copies)[groups == g].sum()) for g in present}
    after_total = max(sum(after.values()), 1)
    before_total = max(sum(present.values()), 1)
    report = {
        g: {
            "before": present[g],
            "before_share": round(present[g] / before_total, 6),
            "target_share": cfg.targets.get(g, 0.0),
            "after": after[g],
            "after_share": round(after[g] / after_total, 6),
        }
        for g in present
    }
    shard = keys >> 32
    for s in range(ctx.num_shards):
        write_npy(copies[shard == s], ctx.step_dir / f"copies-{s:05d}.npy")
    return {"unit": cfg.unit, "field": cfg.field, "total": int(total), "groups": report}


def apply_unit(ctx: Context, unit: int) -> dict[str, Any]:
    copies = np.load(ctx.dirs["remix.plan"] / f"copies-{unit:05d}.npy")
    docs = read_documents(ctx.docs_dir / shard_file(unit))
    reasons = [None if c > 0 else "remix_downsampled" for c in copies.tolist()]
    return write_split(ctx, unit, docs, Verdicts(reasons, copies=copies.tolist()))


class Remix(Stage):
    name = "remix"
    Config = RemixConfig
    needs_settings = "pick remix=<preset> or set remix.targets"

    def steps(self) -> list[Step]:
        return [
            self.step(weigh_unit, "weigh"),
            self.step(plan_unit, "plan", units=1),
            self.step(apply_unit, writes_documents=True),
        ]
