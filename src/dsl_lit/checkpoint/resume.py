"""Which checkpoint a run resumes from, decided at start-up before any data, model or process group,
so a wrong ``checkpoint.resume_from``, a checkpoint of another model or a run directory of broken
checkpoints fails in a second with an error naming the option, not after data preparation (and a
run directory of broken checkpoints never trains from step 0 again without a word).

Only cheap checks happen here (``meta.json``, file sizes, safetensors headers); the checksums are
verified when the checkpoint is loaded, where the ranks share the hashing and a checkpoint that
fails falls back to the previous one (:class:`~dsl_lit.checkpoint.directory.DirectoryCheckpointIO`).
"""

from __future__ import annotations

from pathlib import Path

from dsl_lit.checkpoint.config_drift import check_config_drift
from dsl_lit.checkpoint.directory import latest_checkpoint, no_usable_checkpoint, step_dirs
from dsl_lit.checkpoint.files import checkpoint_problem
from dsl_lit.config import CheckpointConfig, ConfigError, TrainConfig


def resume_checkpoint(checkpoint: CheckpointConfig, checkpoints: Path) -> Path | None:
    """The step directory to resume from: ``checkpoint.resume_from`` if set (ConfigError naming it
    unless it is a complete checkpoint), else with ``checkpoint.resume`` the latest usable one under
    ``checkpoints`` (this run's), else None (train from step 0). ConfigError when every step
    directory there is unusable: ``checkpoint.resume=false`` is how to start afresh on purpose."""
    if checkpoint.resume_from:
        return _named(checkpoint.resume_from)
    if not checkpoint.resume:
        return None
    latest = latest_checkpoint(checkpoints)
    broken = step_dirs(checkpoints)
    if latest is None and broken:
        raise no_usable_checkpoint(checkpoints, [f"{path.name}: {checkpoint_problem(path)}" for _, path in broken])
    return latest


def _named(value: str) -> Path:
    path = Path(value)
    if not path.exists():
        raise ConfigError(f"checkpoint.resume_from={value}: no such directory; name a <run dir>/checkpoints/step-<N> "
                          "directory, or leave it null to resume this run's latest checkpoint")
    problem = checkpoint_problem(path) if path.is_dir() else "it is a file"
    if problem is not None:
        raise ConfigError(f"checkpoint.resume_from={value} is not a usable checkpoint ({problem}); name a complete "
                          "<run dir>/checkpoints/step-<N> directory")
    return path


def check_resume(cfg: TrainConfig) -> Path | None:
    """At start-up, before any data, model or process group: the checkpoint this run will resume
    from (:func:`resume_checkpoint`, this run's ``<run dir>/checkpoints``), checked against the
    run's config (:func:`~dsl_lit.checkpoint.config_drift.check_config_drift`: ConfigError for a
    changed model or tokenizer, one warning listing every other change)."""
    path = resume_checkpoint(cfg.checkpoint, Path(cfg.run_dir) / "checkpoints")
    if path is not None:
        check_config_drift(path, cfg.raw, cfg.model)
    return path
