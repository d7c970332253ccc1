"""Run-directory chores shared by every recipe: the resolved config, pre-launch data checks, cleanup."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import lightning as L
import yaml

from dsl_lit.checkpoint.resume import check_resume
from dsl_lit.config import TrainConfig
from dsl_lit.config.errors import ConfigError


def is_launcher_process() -> bool:
    """True in the process the user started (not in a rank Lightning or torchrun spawned for it)."""
    return int(os.environ.get("LOCAL_RANK", "0")) == 0 and int(os.environ.get("RANK", "0")) == 0


def save_resolved_config(cfg: TrainConfig) -> Path:
    """Write the fully resolved config beside Hydra's ``.hydra/`` (which keeps the unresolved one),
    once it is known to suit the checkpoint the run resumes (``check_resume``: every recipe calls
    this first, before any data or model)."""
    check_resume(cfg)
    path = Path(cfg.run_dir) / "resolved_config.yaml"
    if is_launcher_process():
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(yaml.safe_dump(cfg.raw, sort_keys=False))
    return path


def check_vocab(cfg: TrainConfig, datamodule: Any) -> None:
    """Prepare the data once in the launching process, then check the model can embed every token id."""
    if not is_launcher_process():
        return
    datamodule.prepare_data()
    padded = int(datamodule.tokenizer_meta["padded_vocab_size"])
    if padded > cfg.model.vocab_size:
        raise ConfigError(
            f"the tokenizer's padded vocabulary ({padded}) exceeds model.vocab_size={cfg.model.vocab_size}; "
            f"set +model.vocab_size={padded} or a smaller data.tokenizer_vocab_size"
        )


def finish_run(trainer: L.Trainer) -> None:
    """Close W&B runs so a Hydra multirun starts each job with a fresh run."""
    for logger in trainer.loggers:
        experiment = getattr(logger, "_experiment", None)
        if experiment is not None and hasattr(experiment, "finish"):
            experiment.finish()
