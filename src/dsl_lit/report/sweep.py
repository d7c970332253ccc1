"""The summary of a Hydra multirun: one row per job (the overrides its sweep varies, steps, final
training loss, final validation loss, median tokens/s) from each job's ``metrics.csv``.

:class:`SweepSummary` is the Hydra callback the training recipes register (``conf/hydra/callbacks/
sweep_summary.yaml``): after each job it rewrites ``sweep_summary.md`` and ``sweep_summary.csv`` in
the sweep directory (so a sweep stopped by a failing job keeps the table of those that finished),
and at the end of the multirun it prints the table::

    | job | optim.lr | steps | loss   | val loss | tokens/s |
    |-----|----------|-------|--------|----------|----------|
    | 0   | 1e-3     | 40    | 6.1020 | 6.2031   | 3,412    |
    | 1   | 3e-3     | 40    | 5.7712 | 5.8840   | 3,398    |
    best val loss: job 1 (optim.lr=3e-3)
"""

from __future__ import annotations

import csv
import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
from hydra.experimental.callback import Callback

from dsl_lit.report.metrics import METRICS_FILE, read_metrics
from dsl_lit.utils.sweep import override_keys

log = logging.getLogger(__name__)
SUMMARY_FILE = "sweep_summary.md"
SUMMARY_CSV = "sweep_summary.csv"
COLUMNS = {"loss": "train/loss", "val loss": "val/loss"}
"""Column -> the metric whose last logged value it shows."""
THROUGHPUT = "perf/tokens_per_s"


@dataclass
class JobSummary:
    num: int
    run_dir: Path
    overrides: dict[str, str] = field(default_factory=dict)
    """key -> its override as written (``optim.lr=1e-3``)."""
    steps: int | None = None
    values: dict[str, float | None] = field(default_factory=dict)
    tokens_per_s: float | None = None
    note: str = ""


def _job_dirs(sweep_dir: Path) -> list[Path]:
    """Directories of the sweep's jobs: those holding Hydra's ``.hydra/overrides.yaml`` (outermost only)."""
    found: list[Path] = []
    for marker in sorted(sweep_dir.rglob(".hydra/overrides.yaml"), key=lambda p: len(p.parts)):
        job = marker.parent.parent
        if job != sweep_dir and not any(parent in found for parent in job.parents):
            found.append(job)
    return found


def summarize_job(job_dir: Path, num: int) -> JobSummary:
    import yaml

    overrides = yaml.safe_load((job_dir / ".hydra" / "overrides.yaml").read_text(encoding="utf-8")) or []
    hydra_file = job_dir / ".hydra" / "hydra.yaml"
    if hydra_file.is_file():
        num = int((yaml.safe_load(hydra_file.read_text(encoding="utf-8")) or {}).get("hydra", {}).get("job", {})
                  .get("num", num))
    job = JobSummary(num=num, run_dir=job_dir, overrides=override_keys(overrides))
    if not (job_dir / METRICS_FILE).is_file():
        job.note = f"no {METRICS_FILE} (failed, still running, or logger.csv=false)"
        return job
    series = read_metrics(job_dir)
    for column, metric in COLUMNS.items():
        job.values[column] = float(series[metric].values[-1]) if metric in series else None
    if "train/loss" in series:
        job.steps = int(series["train/loss"].steps[-1]) + 1
    if THROUGHPUT in series:
        job.tokens_per_s = float(np.median(series[THROUGHPUT].values))
    return job


def summarize(sweep_dir: str | Path) -> list[JobSummary]:
    """Every job of the sweep in ``sweep_dir``, in job order."""
    jobs = [summarize_job(path, i) for i, path in enumerate(_job_dirs(Path(sweep_dir)))]
    return sorted(jobs, key=lambda job: job.num)


def varied_keys(jobs: list[JobSummary]) -> list[str]:
    """The override keys whose values differ between the jobs (all of a lone job's)."""
    keys = list(dict.fromkeys(k for job in jobs for k in job.overrides))
    if len(jobs) < 2:
        return keys
    return [k for k in keys if len({job.overrides.get(k) for job in jobs}) > 1]


def _value(line: str | None) -> str:
    return line.split("=", 1)[1] if line and "=" in line else "-"


def rows(jobs: list[JobSummary]) -> tuple[list[str], list[list[str]]]:
    """(header, one row of cells per job)."""
    keys = varied_keys(jobs)
    header = ["job", *keys, "steps", *COLUMNS, "tokens/s"]
    table = []
    for job in jobs:
        cells = [str(job.num), *(_value(job.overrides.get(k)) for k in keys)]
        cells.append("-" if job.steps is None else str(job.steps))
        cells += ["-" if job.values.get(c) is None else f"{job.values[c]:.4f}" for c in COLUMNS]
        cells.append("-" if job.tokens_per_s is None else f"{job.tokens_per_s:,.0f}")
        table.append(cells)
    return header, table


def best(jobs: list[JobSummary]) -> str:
    """The line naming the job with the lowest final validation loss (else training loss)."""
    for column in ("val loss", "loss"):
        scored = [job for job in jobs if job.values.get(column) is not None]
        if scored:
            job = min(scored, key=lambda j: j.values[column])
            keys = varied_keys(jobs)
            named = ",".join(job.overrides[k] for k in keys if k in job.overrides)
            return f"best {column}: job {job.num}" + (f" ({named})" if named else "") + f", {job.values[column]:.4f}"
    return "no job logged a loss yet"


def markdown(jobs: list[JobSummary]) -> str:
    header, table = rows(jobs)
    widths = [max(len(h), *(len(r[i]) for r in table)) if table else len(h) for i, h in enumerate(header)]

    def line(cells: list[str]) -> str:
        return "| " + " | ".join(c.ljust(w) for c, w in zip(cells, widths)) + " |"

    out = [line(header), "|" + "|".join("-" * (w + 2) for w in widths) + "|"]
    out += [line(cells) for cells in table]
    out += [f"job {job.num}: {job.note}" for job in jobs if job.note]
    return "\n".join(out + [best(jobs)]) + "\n"


def write_summary(sweep_dir: str | Path) -> tuple[Path, str]:
    """Write ``sweep_summary.md`` and ``sweep_summary.csv`` in the sweep directory; (the .md, its text)."""
    sweep_dir = Path(sweep_dir)
    jobs = summarize(sweep_dir)
    text = markdown(jobs)
    path = sweep_dir / SUMMARY_FILE
    tmp = path.with_suffix(".md.tmp")
    tmp.write_text(text, encoding="utf-8")
    tmp.replace(path)
    keys = varied_keys(jobs)
    with (sweep_dir / SUMMARY_CSV).open("w", newline="", encoding="utf-8") as f:  # the numbers unrounded
        writer = csv.writer(f)
        writer.writerow(["job", *keys, "steps", *(metric for metric in COLUMNS.values()), THROUGHPUT, "run_dir", "note"])
        for job in jobs:
            writer.writerow([job.num, *(_value(job.overrides.get(k)) for k in keys), job.steps,
                             *(job.values.get(c) for c in COLUMNS), job.tokens_per_s, str(job.run_dir), job.note])
    return path, text


class SweepSummary(Callback):
    """Hydra callback: the sweep's table after each job (written) and at its end (written and printed)."""

    def on_job_end(self, config: Any, job_return: Any, **kwargs: Any) -> None:
        from hydra.core.hydra_config import HydraConfig
        from hydra.types import RunMode

        if HydraConfig.initialized() and HydraConfig.get().mode == RunMode.MULTIRUN:
            try:
                write_summary(str(HydraConfig.get().sweep.dir))
            except Exception as error:  # a summary never fails the job it follows
                log.warning("sweep summary not written: %s", error)

    def on_multirun_end(self, config: Any, **kwargs: Any) -> None:
        path, text = write_summary(str(config.hydra.sweep.dir))
        print(f"\nSweep summary ({path}):\n{text}", flush=True)
