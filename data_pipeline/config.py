"""The pipeline's configuration: the run's own fields plus each stage's settings, validated up front.

Why dataclasses behind the Hydra YAML: a typo or an out-of-range value fails at start-up with a
message naming the field (``near_dedup.threshold``) and the fix, not hours later in a worker. Each
stage's settings dataclass lives in the stage's own file (or in the room below that reads it too:
``dedup/near_dedup_config.py``); this module only assembles them, by the section names the
registered stages declare (``data_pipeline/registry.py``).
"""

from __future__ import annotations

import dataclasses
import dataclasses as dc
import importlib.util
import typing
from dataclasses import dataclass
from typing import Any

from data_contract.errors import ConfigError
from data_contract.schema import dataclass_from_dict
from data_pipeline.executors import ExecutorConfig
from data_pipeline.registry import ALWAYS, STAGES
from data_pipeline.stage import Phase, Stage
from data_pipeline.stages.ingest import InputConfig


def section_schemas() -> dict[str, type]:
    """Settings dataclass of every config section a registered stage reads."""
    schemas: dict[str, type] = {}
    for stage in STAGES.values():
        name = stage.section_name()
        if schemas.setdefault(name, stage.Config) is not stage.Config:
            raise TypeError(f"stages sharing the section {name!r} must share its dataclass")
    return schemas


@dataclass
class PipelineConfig:
    input: InputConfig
    output_dir: str
    stages: list[str] = dc.field(
        default_factory=lambda: ["normalize", "exact_dedup", "near_dedup", "quality_filter"]
    )
    num_proc: int = 1  # executor=local: worker processes on this machine (units of a step run in parallel)
    executor: ExecutorConfig = dc.field(default_factory=ExecutorConfig)  # where units run: local | ray
    step: str | None = None  # run only this step (see `plan`), for cluster schedulers
    task_index: int = 0  # with step: this task takes units task_index, task_index + task_count, ...
    task_count: int = 1
    sections: dict[str, Any] = dc.field(default_factory=dict)
    """Every registered stage's settings by section name (``near_dedup``, ``tokenizer``, ...); None
    for a section without usable defaults (``remix``) that was not given."""

    def stage_objects(self) -> list[Stage]:
        """The run's stages in the order of their phases (``Stage.phase``: ingest, the document
        stages as listed, finalize, then the stages that read ``kept/``), each made with its settings."""
        settings = {**self.sections, "input": self.input}  # the input's settings are a field of their own
        chosen = [*ALWAYS, *(STAGES[name] for name in self.stages)]
        made = [stage(settings.get(stage.section_name()), self.sections) for stage in chosen]
        return sorted(made, key=lambda stage: stage.phase)  # stable: as listed within a phase

    def validate(self) -> PipelineConfig:
        if not self.output_dir:
            raise ConfigError("output_dir is empty: pass output_dir=<dir>")
        unknown = [s for s in self.stages if s not in STAGES]
        if unknown:
            raise ConfigError(f"stages: unknown stage(s) {unknown}; known stages: {list(STAGES)}")
        if len(set(self.stages)) != len(self.stages):
            raise ConfigError(f"stages={self.stages} names a stage twice")
        phases = [STAGES[s].phase for s in self.stages]
        if phases != sorted(phases):
            last = " and ".join(name for name, stage in STAGES.items() if stage.phase == Phase.PUBLISHED)
            raise ConfigError(f"stages={self.stages}: {last} must come last")
        for position, name in enumerate(self.stages):
            stage = STAGES[name]
            for earlier in stage.comes_after:
                if earlier in self.stages[position:]:
                    raise ConfigError(f"stages: {earlier} must come before {name}")
            if stage.needs_settings and self.sections.get(stage.section_name()) is None:
                raise ConfigError(
                    f"stages includes {name} but its settings ({stage.section_name()}) are not set: "
                    f"{stage.needs_settings}"
                )
        if self.num_proc <= 0:
            raise ConfigError(f"num_proc={self.num_proc} must be a positive integer")
        if self.executor.kind == "ray":
            if self.num_proc != 1:
                raise ConfigError(
                    f"num_proc={self.num_proc} sets local processes; with executor=ray the cluster's CPUs "
                    "run the units (executor.num_cpus each): leave num_proc at 1"
                )
            if importlib.util.find_spec("ray") is None:
                raise ConfigError("executor=ray needs Ray installed: pip install 'dsl-lit[ray]'")
        if self.task_count <= 0 or not 0 <= self.task_index < self.task_count:
            raise ConfigError(f"task_index={self.task_index} must lie in [0, task_count={self.task_count})")
        if self.task_count > 1 and self.step is None:
            raise ConfigError(
                "task_count > 1 needs step=<name>: run each step as its own scheduler array, in the order "
                "`python -m data_pipeline ... +plan=true` prints (see data_pipeline/README.md)"
            )
        return self


def build(schema: type, values: dict[str, Any] | None, prefix: str) -> Any:
    """``values`` (nested plain dicts) -> ``schema``, recursing into dataclass-typed fields."""
    values = dict(values or {})
    hints = typing.get_type_hints(schema)
    for f in dataclasses.fields(schema):
        kind = hints[f.name]
        args = [a for a in typing.get_args(kind) if a is not type(None)]
        target = kind if dataclasses.is_dataclass(kind) else (args[0] if len(args) == 1 else None)
        if f.name in values and dataclasses.is_dataclass(target):
            if values[f.name] is None:
                continue
            if not isinstance(values[f.name], dict):
                raise ConfigError(f"{prefix}{f.name} must be a mapping, got {values[f.name]!r}")
            values[f.name] = build(target, values[f.name], f"{prefix}{f.name}.")
    return dataclass_from_dict(schema, values, prefix.rstrip(".") or "pipeline")


def load_config(values: dict[str, Any]) -> PipelineConfig:
    """Plain values (a resolved Hydra config) -> a validated ``PipelineConfig``."""
    schemas = section_schemas()
    own = {f.name for f in dataclasses.fields(PipelineConfig)} - {"sections"}
    unknown = sorted(k for k in values if k not in own and k not in schemas and k != "plan")
    if unknown:
        raise ConfigError(f"{unknown[0]} is not a known field; known fields: {sorted(own | set(schemas))}")
    sections: dict[str, Any] = {}
    for name, schema in schemas.items():
        given = values.get(name)
        needs_settings = any(s.needs_settings for s in STAGES.values() if s.section_name() == name)
        sections[name] = None if given is None and needs_settings else build(schema, given, f"{name}.")
    top = {k: v for k, v in values.items() if k in own}
    return build(PipelineConfig, {**top, "sections": sections}, "")
