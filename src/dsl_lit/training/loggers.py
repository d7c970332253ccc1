"""``metrics.csv`` in the run directory that survives resumes.

Lightning's CSVLogger deletes an existing metrics.csv when it starts, which would erase the first
half of a resumed run's curve. This one appends; rows at or after the step it resumes from (logged
by a run that was killed after its last checkpoint) are replaced by the resumed run's rows.
"""

from __future__ import annotations

import csv
from pathlib import Path
from typing import Any

from lightning.pytorch.loggers.logger import Logger
from lightning.pytorch.utilities import rank_zero_only


class RunCSVLogger(Logger):
    def __init__(self, run_dir: str | Path, filename: str = "metrics.csv") -> None:
        super().__init__()
        self.path = Path(run_dir) / filename
        self._rows: list[dict[str, Any]] = []
        self._first_save = True

    @property
    def name(self) -> str:
        return "csv"

    @property
    def version(self) -> str:
        return ""

    @property
    def save_dir(self) -> str:
        return str(self.path.parent)

    @rank_zero_only
    def log_hyperparams(self, params: Any, *args: Any, **kwargs: Any) -> None:
        """The run directory already holds resolved_config.yaml; nothing to add to a CSV."""

    @rank_zero_only
    def log_metrics(self, metrics: dict[str, float], step: int | None = None) -> None:
        row = {k: (v.item() if hasattr(v, "item") else v) for k, v in metrics.items()}
        row["step"] = step if step is not None else len(self._rows)
        self._rows.append(row)

    @rank_zero_only
    def save(self) -> None:
        if not self._rows:
            return
        existing: list[dict[str, Any]] = []
        if self.path.is_file():
            with self.path.open(newline="") as f:
                existing = list(csv.DictReader(f))
        if self._first_save:
            first_step = self._rows[0]["step"]
            existing = [r for r in existing if int(float(r["step"])) < first_step]
            self._first_save = False
        rows = existing + self._rows
        keys = sorted({k for r in rows for k in r})
        self.path.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.path.with_suffix(".csv.tmp")
        with tmp.open("w", newline="") as f:
            writer = csv.DictWriter(f, fieldnames=keys)
            writer.writeheader()
            writer.writerows(rows)
        tmp.replace(self.path)
        self._rows = []

    @rank_zero_only
    def finalize(self, status: str) -> None:
        self.save()
