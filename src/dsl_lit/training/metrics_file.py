"""A run's ``metrics.csv`` as one series per column.

The file is sparse: each row holds what was logged at one step (training scalars every
``log_every_n_steps``, validation and downstream evaluation when they ran), so a column's series
is its non-empty cells. A step logged twice (a resumed run re-logs the steps after its last
checkpoint, and the CSV logger keeps the newer rows) keeps the last value.
"""

from __future__ import annotations

import csv
import math
from dataclasses import dataclass
from pathlib import Path

import numpy as np

METRICS_FILE = "metrics.csv"


@dataclass
class Series:
    steps: np.ndarray
    values: np.ndarray


def _cells(path: str | Path):
    """(column, step, value) for every numeric cell of a metrics.csv (``path`` or its run dir)."""
    path = Path(path)
    if path.is_dir():
        path = path / METRICS_FILE
    if not path.is_file():
        raise FileNotFoundError(f"{path} missing: a run directory holds metrics.csv when logger.csv=true")
    with path.open(newline="", encoding="utf-8", errors="replace") as f:  # garbage bytes: rows skipped below
        for row in csv.DictReader(f):
            try:
                step = int(float(row.get("step") or "nan"))
            except (ValueError, OverflowError):  # no step, or not a number: not a metrics row
                continue
            for key, cell in row.items():
                if key in ("step", "epoch") or key is None or cell in (None, ""):
                    continue
                try:
                    yield key, step, float(cell)
                except ValueError:
                    continue


def read_metrics(path: str | Path) -> dict[str, Series]:
    """Column -> its (step, value) pairs in step order; non-numeric and non-finite cells are skipped
    (:func:`non_finite_steps` counts the latter)."""
    points: dict[str, dict[int, float]] = {}
    for key, step, value in _cells(path):
        if math.isfinite(value):
            points.setdefault(key, {})[step] = value
    return {key: Series(np.array(sorted(p)), np.array([p[s] for s in sorted(p)])) for key, p in points.items()}


def non_finite_steps(path: str | Path) -> dict[str, tuple[int, int]]:
    """Column -> (steps with a NaN or inf value, steps with a value) for the columns that have any:
    what a figure cannot show, so a report says it (a run whose every loss is NaN drew nothing
    and said nothing)."""
    counts: dict[str, list[int]] = {}
    for key, _, value in _cells(path):
        count = counts.setdefault(key, [0, 0])
        count[0] += not math.isfinite(value)
        count[1] += 1
    return {key: (bad, total) for key, (bad, total) in counts.items() if bad}


def columns_with_prefix(series: dict[str, Series], prefix: str) -> list[str]:
    return sorted(key for key in series if key.startswith(prefix))
