"""Run-directory chores shared by every recipe: the resolved config, pre-launch data checks, cleanup."""

from __future__ import annotations

import functools
import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

import lightning as L
import yaml

from dsl_lit.config import TrainConfig
from dsl_lit.config.errors import ConfigError

F = TypeVar("F", bound=Callable[..., Any])


def check_environment(hydra_cfg: Any) -> None:
    """What the config asks of this machine, checked before any data or process group: a GPU
    accelerator needs a visible GPU."""
    import torch

    trainer = hydra_cfg.get("trainer") if hasattr(hydra_cfg, "get") else None
    accelerator = str(trainer.get("accelerator", "auto")) if trainer is not None else "auto"
    if accelerator in ("gpu", "cuda") and not torch.cuda.is_available():
        raise ConfigError(f"trainer.accelerator={accelerator} but this machine has no usable CUDA GPU; "
                          "use trainer.accelerator=cpu (or auto)")


def exits_on_config_error(main: F) -> F:
    """Decorate a recipe's ``main`` (under ``@hydra.main``): a bad config prints one line naming
    the field and the fix and exits with code 2, without Hydra's traceback (``HYDRA_FULL_ERROR=1``
    keeps it)."""

    @functools.wraps(main)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        try:
            if args:
                check_environment(args[0])
            return main(*args, **kwargs)
        except ConfigError as error:
            if os.environ.get("HYDRA_FULL_ERROR") == "1":
                raise
            print(f"error: {error}", file=sys.stderr)
            raise SystemExit(2) from None

    return wrapper  # type: ignore[return-value]


def is_launcher_process() -> bool:
    """True in the process the user started (not in a rank Lightning or torchrun spawned for it)."""
    return int(os.environ.get("LOCAL_RANK", "0")) == 0 and int(os.environ.get("RANK", "0")) == 0


def save_resolved_config(cfg: TrainConfig) -> Path:
    """Write the fully resolved config beside Hydra's ``.hydra/`` (which keeps the unresolved one)."""
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
