"""What a model scored on a task's held-out problems, problem by problem, as a run leaves it in its
run dir: post-training runs write it at their end (``PostTrainModule.final_evaluation``); the
reproduction reads it to compare two stages on the same problems (a paired bootstrap,
``dsl_lit.reproduce.claims``), which one accuracy per stage cannot do."""

from __future__ import annotations

import json
import os
from pathlib import Path

HELD_OUT_FILE = "held_out.json"


def write_outcomes(run_dir: str | os.PathLike, step: int, outcomes: list[float]) -> None:
    """``outcomes``: the reward per held-out problem (1.0: right), in the task's order; written atomically."""
    path = Path(run_dir) / HELD_OUT_FILE
    tmp = path.with_name(f".{HELD_OUT_FILE}.tmp")
    tmp.write_text(json.dumps({"step": step, "accuracy": sum(outcomes) / len(outcomes), "outcomes": outcomes}))
    os.replace(tmp, path)


def read_outcomes(run_dir: str | os.PathLike) -> list[float] | None:
    """The outcomes a run wrote, or None (no held-out evaluation, or a run from before they were kept)."""
    path = Path(run_dir) / HELD_OUT_FILE
    return [float(x) for x in json.loads(path.read_text())["outcomes"]] if path.is_file() else None
