"""Plan the run as steps of independent units, run the units not yet done, and report.

Why units with markers and no scheduler of our own: every step is a list of units (a document
shard, an LSH band, a hash partition, or one global unit) whose outputs and completion marker
depend only on the inputs and the config. A rerun skips units with a marker, so a killed run
resumes where it stopped, and any scheduler can run the units of one step as an array of tasks
(``step=<name> task_index=i task_count=n``): see data_pipeline/README.md. Within one invocation an
executor (``data_pipeline.executors``: local processes, or Ray tasks) runs a step's missing units.
"""

from __future__ import annotations

import hashlib
import json
import logging
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import datasets

from data_contract.errors import ConfigError
from data_pipeline import peak_memory
from data_pipeline.config import PipelineConfig
from data_pipeline.context import Context
from data_pipeline.executors import Executor, make_executor
from data_pipeline.io.output_dir import MARKER, claim_output_dir
from data_pipeline.io.shards import marker_path, write_json
from data_pipeline.stage import Step

log = logging.getLogger(__name__)

PIPELINE_VERSION = 1  # bump when a step's output format changes: older work directories are not reused


@dataclass
class Planned:
    step: Step
    context: Context
    num_units: int


def plan(cfg: PipelineConfig, found: Any = None) -> list[Planned]:
    """Every step of the run with its directory ``work/<NN>-<name>-<fingerprint>`` and unit count;
    the stage that reads the input (``Stage.reads_input``) splits it into the units every step
    shares. ``found``: what that stage's ``find_input`` returned, if the caller has it."""
    output_dir = Path(cfg.output_dir)
    stages = cfg.stage_objects()
    reader = next(stage for stage in stages if stage.reads_input)
    found = reader.find_input()[0] if found is None else found
    owned = (output_dir / MARKER).is_file()  # only then may planning keep its input scans there
    source = reader.plan_input(found, output_dir if owned else None)
    units = source.units
    fingerprint = hashlib.sha256(json.dumps([PIPELINE_VERSION, *source.identity], sort_keys=True).encode()).hexdigest()
    planned: list[Planned] = []
    dirs: dict[str, Path] = {}
    document_steps: list[tuple[str, str, Path]] = []
    docs_dir: Path | None = None
    steps = [(stage, step) for stage in stages for step in stage.steps()]
    for position, (stage, step) in enumerate(steps):
        fingerprint = hashlib.sha256(
            json.dumps([fingerprint, step.name, step.settings], sort_keys=True, default=str).encode()
        ).hexdigest()
        step_dir = output_dir / "work" / f"{position:02d}-{step.name}-{fingerprint[:12]}"
        ctx = Context(
            config=stage.config,
            sections=cfg.sections,
            run_stages=cfg.stages,
            output_dir=output_dir,
            step_name=step.name,
            stage=step.stage,
            step_dir=step_dir,
            docs_dir=docs_dir,
            dirs=dict(dirs),
            document_steps=list(document_steps),
            num_shards=len(units),
            input_units=units,
            corpus=source.corpus,
        )
        planned.append(Planned(step, ctx, step.num_units(len(units))))
        dirs[step.name] = step_dir
        if step.writes_documents:
            docs_dir = step_dir
            document_steps.append((step.name, step.stage, step_dir))
    return planned


def run_unit(step: Step, ctx: Context, unit: int) -> dict[str, Any]:
    """Run one unit and write its marker last (module level: worker processes import it)."""
    datasets.disable_progress_bars()  # one bar per shard and step would bury the log
    peak_memory.reset_peak()
    start = time.perf_counter()
    stats = step.run_unit(ctx, unit) or {}
    stats["seconds"] = round(time.perf_counter() - start, 3)
    stats["peak_rss_mb"] = peak_memory.peak_mb()
    write_json(stats, marker_path(ctx.step_dir, unit))
    return stats


def missing_units(p: Planned) -> list[int]:
    return [u for u in range(p.num_units) if not marker_path(p.context.step_dir, u).is_file()]


def _run_step(p: Planned, cfg: PipelineConfig, executor: Executor) -> None:
    todo = [u for u in missing_units(p) if u % cfg.task_count == cfg.task_index]
    if not todo:
        return
    log.info("%s: %d of %d units to run", p.step.name, len(todo), p.num_units)
    p.context.step_dir.mkdir(parents=True, exist_ok=True)
    executor.run(run_unit, p.step, p.context, todo)


def claim_and_plan(cfg: PipelineConfig) -> list[Planned]:
    """Check ``step`` and the input, claim ``output_dir`` (refusing one that is not the pipeline's),
    then plan: the claimed directory keeps the input's line scans for every later invocation."""
    stages = cfg.stage_objects()
    names = [step.name for stage in stages for step in stage.steps()]
    if cfg.step is not None and cfg.step not in names:
        raise ConfigError(f"step={cfg.step!r} is not a step of this run; its steps are {names}")
    found, root = next(stage for stage in stages if stage.reads_input).find_input()
    claim_output_dir(cfg.output_dir, root)
    return plan(cfg, found)


def run(cfg: PipelineConfig, executor: Executor | None = None) -> dict[str, Any] | None:
    """Run the selected steps; returns the stats (also in output_dir/stats.json) once all are done.

    ``executor``: one the caller opened and closes (default: ``cfg.executor``'s, opened and closed
    here, before anything is written: a cluster that cannot be reached leaves no output_dir behind).
    """
    own = executor is None
    executor = make_executor(cfg.executor, cfg.num_proc) if executor is None else executor
    try:
        planned = claim_and_plan(cfg)
        for i, p in enumerate(planned):
            if cfg.step is not None and p.step.name != cfg.step:
                continue
            blocked = [q.step.name for q in planned[:i] if missing_units(q)]
            if blocked:
                raise RuntimeError(
                    f"step {p.step.name} needs {blocked[0]} complete first: run step={blocked[0]}"
                )
            _run_step(p, cfg, executor)
    finally:
        if own:
            executor.close()
    if any(missing_units(p) for p in planned):
        return None
    from data_pipeline.report import write_stats

    return write_stats(cfg, planned)
