"""What a unit of a step is given: the ``Context`` the runner plans for each step, and the type of
a step's unit function.

Why a module of its own: every stage's unit functions take a ``Context`` (``run_unit(ctx, unit)``),
the runner builds it and the executors ship it to worker processes or Ray tasks; none of them
should import the runner (or each other) for the type. It imports nothing of the pipeline, not
even for annotations: what a unit reads of the run-wide config (other stages' settings, the list of
stages) is copied into the context, so the modules below ``config`` never point up at it.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any


@dataclass
class Context:
    """What a unit needs to run; picklable, so worker processes receive it whole."""

    config: Any  # the settings of the stage this step belongs to
    sections: dict[str, Any]  # every stage's settings by section name (tokenize_pack reads ``tokenizer``)
    run_stages: list[str]  # the run's ``stages=[...]`` as configured (recorded in shards/meta.json)
    output_dir: Path
    step_name: str
    stage: str
    step_dir: Path
    docs_dir: Path | None  # the document shards this step reads (the latest document step's output)
    dirs: dict[str, Path] = field(default_factory=dict)  # every earlier step's directory, by name
    document_steps: list[tuple[str, str, Path]] = field(default_factory=list)  # (name, stage, dir)
    num_shards: int = 0
    input_units: list[dict[str, Any]] = field(default_factory=list)
    corpus: dict[str, str] = field(default_factory=dict)  # the input's path and content fingerprint


RunUnit = Callable[[Context, int], dict[str, Any]]
"""A step's ``run_unit(ctx, unit)``: computes one unit (a shard, a band, a partition, or the one
global unit) and returns its counts, which become the unit's marker and feed stats.json."""
