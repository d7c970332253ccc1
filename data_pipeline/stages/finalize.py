"""Step ``finalize``: publish ``kept/`` (the last document step's shards) and ``removed/`` (all steps').

Why links into freshly published directories: kept and removed always come from the same complete
run, even when an older run with other settings left its work directories behind.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pyarrow.parquet as pq

from data_pipeline.context import Context
from data_pipeline.io.shards import building_dir, link_or_copy, removed_file, shard_file
from data_pipeline.stage import Phase, Stage, Step


def _publish(ctx: Context, name: str, files: list[tuple[Path, str]]) -> None:
    with building_dir(ctx.output_dir / name) as tmp:
        for src, dst in files:
            link_or_copy(src, tmp / dst)


def run_unit(ctx: Context, unit: int) -> dict[str, Any]:
    last_dir = ctx.document_steps[-1][2]
    kept = [(last_dir / shard_file(s), shard_file(s)) for s in range(ctx.num_shards)]
    removed = []
    for position, (name, _, step_dir) in enumerate(ctx.document_steps):
        for s in range(ctx.num_shards):
            src = step_dir / removed_file(s)
            if pq.read_metadata(src).num_rows:
                removed.append((src, f"{position:02d}-{name}-{s:05d}.parquet"))
    _publish(ctx, "kept", kept)
    _publish(ctx, "removed", removed)
    return {"kept_files": len(kept), "removed_files": len(removed)}


class Finalize(Stage):
    """Runs in every run after the document stages (not listed in ``stages``); it has no settings."""

    name = "finalize"
    Config = type(None)
    phase = Phase.FINALIZE
    always = True

    def settings(self) -> None:
        return None

    def steps(self) -> list[Step]:
        return [self.step(run_unit, units=1)]
