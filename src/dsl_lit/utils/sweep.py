"""A Hydra multirun's jobs: what each one is called and which sweep it belongs to.

A job is named by the overrides its sweep varies (``optim.lr=1e-3``, not the job number ``0``) and
grouped by its sweep (the last two parts of the sweep directory, ``pretrain/2026-11-27_13-00-00``):
the W&B run of each job of ``recipes/pretrain.py -m optim.lr=1e-3,3e-3`` carries both, and the
sweep's summary table (:mod:`dsl_lit.report.sweep`) uses the same columns.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

MULTIRUN_FILE = "multirun.yaml"
"""What Hydra's sweeper writes in the sweep directory: the sweep's config, its command line's overrides included."""


@dataclass(frozen=True)
class SweepJob:
    name: str
    """The job's overrides of the keys its sweep varies, e.g. ``optim.lr=1e-3`` (all its overrides
    when the sweep's own are unknown; its number when it has none)."""
    group: str
    """The sweep: the last two parts of its directory (``<recipe>/<time>`` by default)."""
    num: int
    sweep_dir: Path


def override_keys(overrides: Iterable[str], swept_only: bool = False) -> dict[str, str]:
    """Hydra override strings -> {key: the override as written}; ``swept_only``: only those that
    sweep (``a=1,2``, ``range(...)``, ``choice(...)``, ``glob(...)``)."""
    from hydra.core.override_parser.overrides_parser import OverridesParser

    parsed = OverridesParser.create().parse_overrides(list(overrides))
    return {o.key_or_group: o.input_line or "" for o in parsed if o.is_sweep_override() or not swept_only}


def swept_keys(sweep_dir: Path, sweeper_params: dict[str, str] | None = None) -> set[str] | None:
    """The keys a sweep varies: its command line's sweep overrides (from ``multirun.yaml``) and the
    config's ``hydra.sweeper.params``; None when ``multirun.yaml`` is not there."""
    path = Path(sweep_dir) / MULTIRUN_FILE
    if not path.is_file():
        return None
    from omegaconf import OmegaConf

    arguments = list(OmegaConf.load(path).hydra.overrides.task or [])
    arguments += [f"{key}={value}" for key, value in (sweeper_params or {}).items()]
    return set(override_keys(arguments, swept_only=True))


def current_job() -> SweepJob | None:
    """The running Hydra job, when it is one job of a multirun (else None)."""
    try:
        from hydra.core.hydra_config import HydraConfig
        from hydra.types import RunMode
        from omegaconf import OmegaConf
    except ImportError:
        return None
    if not HydraConfig.initialized():
        return None
    hydra = HydraConfig.get()
    if hydra.mode != RunMode.MULTIRUN:
        return None
    sweep_dir = Path(str(hydra.sweep.dir))
    params = OmegaConf.to_container(hydra.sweeper.params) if hydra.sweeper.get("params") else None
    keys = swept_keys(sweep_dir, params)
    overrides = override_keys(hydra.overrides.task)
    name = ",".join(line for key, line in overrides.items() if keys is None or key in keys)
    return SweepJob(name=name or str(hydra.job.num), group="/".join(sweep_dir.parts[-2:]), num=int(hydra.job.num),
                    sweep_dir=sweep_dir)
