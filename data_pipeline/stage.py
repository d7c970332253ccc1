"""What a pipeline stage is: an object carrying its own config that lists the steps it adds to a run.

Why objects, as in datatrove: a stage's settings (a dataclass with ``validate()``), the steps it runs
and what fingerprints them live in the stage's own file, so adding a stage is that file plus one
line in ``data_pipeline/registry.py``. The runner knows stages only through this interface.

A step is a list of independent units (a document shard, an LSH band, a hash partition, or one
global unit); ``run_unit(ctx, unit)`` computes one and returns its counts, which become the unit's
marker and feed stats.json.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from enum import IntEnum
from pathlib import Path
from typing import Any, ClassVar

from data_contract.errors import ConfigError
from data_pipeline.context import RunUnit


@dataclass(frozen=True)
class Step:
    name: str
    stage: str
    run_unit: RunUnit
    units: int | None = None  # None: one unit per document shard; else this many units
    writes_documents: bool = False  # the step's output shards are the next step's documents
    settings: Any = None  # what the outputs depend on besides the inputs (fingerprinted)

    def num_units(self, num_shards: int) -> int:
        return num_shards if self.units is None else self.units


class Phase(IntEnum):
    """Where a stage's steps fall in every run; within a phase, stages run in the order ``stages``
    lists them."""

    INGEST = 0  # the input read into document shards
    DOCUMENTS = 1  # document stages: dedup, filters, decontamination, remixing
    FINALIZE = 2  # kept/ and removed/ published
    PUBLISHED = 3  # stages that read the published kept/ (tokenizer training, packing)


@dataclass(frozen=True)
class InputPlan:
    """The input split into units (one per document shard), as the stage that reads it plans it."""

    units: list[dict[str, Any]]
    corpus: dict[str, str]  # the input's path and fingerprint (``data_contract.corpus``)
    identity: list[Any]  # what fingerprints every step: the input settings and its file listing


class Stage:
    """Base of every stage. Subclasses set ``name`` and ``Config`` and implement ``steps``.

    ``section``: the key of the stage's settings in the config (default: ``name``); stages may share
    one (``train_tokenizer`` and ``tokenize_pack`` read ``tokenizer``). ``phase``: where its steps
    run (:class:`Phase`). ``always``: it runs in every run without being listed in ``stages``
    (ingest, finalize). ``reads_input``: it turns ``input.path`` into the run's units
    (:meth:`find_input`, :meth:`plan_input`); the runner asks the stage with this role, by role.
    ``needs_settings``: the section has no usable defaults; the hint says how to set it.
    ``comes_after``: stages that, when also selected, must be listed before this one.

    A stage is made with its own settings and ``sections``, every stage's settings by section name
    (``PipelineConfig.sections``), for a stage whose outputs depend on another's settings
    (``tokenize_pack`` on ``tokenizer``).
    """

    name: ClassVar[str]
    Config: ClassVar[type]
    section: ClassVar[str | None] = None
    phase: ClassVar[Phase] = Phase.DOCUMENTS
    always: ClassVar[bool] = False
    reads_input: ClassVar[bool] = False
    needs_settings: ClassVar[str | None] = None
    comes_after: ClassVar[tuple[str, ...]] = ()

    def __init__(self, config: Any, sections: dict[str, Any]) -> None:
        self.config = config
        self.sections = sections

    @classmethod
    def section_name(cls) -> str:
        return cls.section or cls.name

    def settings(self) -> Any:
        """What this stage's outputs depend on besides its inputs: its settings, as plain values."""
        return asdict(self.config)

    def steps(self) -> list[Step]:
        raise NotImplementedError(f"stage {self.name} must list its steps")

    def find_input(self) -> tuple[Any, Path | None]:
        """(What ``input.path`` names, the directory an output claim is checked against: None for
        a single file); a ConfigError when there is nothing. Only a stage that ``reads_input``."""
        raise NotImplementedError(f"stage {self.name} does not read the input")

    def plan_input(self, found: Any, cache_dir: Path | None) -> InputPlan:
        """``found`` (:meth:`find_input`) split into units; ``cache_dir`` (the claimed output
        directory, or None) keeps the input's scans for the next invocation."""
        raise NotImplementedError(f"stage {self.name} does not read the input")

    def step(
        self,
        run_unit: RunUnit,
        part: str | None = None,
        units: int | None = None,
        writes_documents: bool = False,
    ) -> Step:
        """A step of this stage, named ``<stage>.<part>`` (or the stage's name), fingerprinted by
        the stage's settings."""
        name = f"{self.name}.{part}" if part else self.name
        return Step(name, self.name, run_unit, units, writes_documents, self.settings())


def check_fraction(prefix: str, name: str, value: float, low: float = 0.0, high: float = 1.0) -> None:
    """A config check shared by stage configs: ``prefix.name`` lies in ``[low, high]``."""
    if not low <= value <= high:
        raise ConfigError(f"{prefix}.{name}={value} must lie in [{low}, {high}]")
