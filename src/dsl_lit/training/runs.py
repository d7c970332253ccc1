"""Run-directory chores shared by every recipe: the resolved config, pre-launch data checks, cleanup."""

from __future__ import annotations

import functools
import inspect
import logging
import os
import sys
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

import yaml

from data_contract.errors import ConfigError
from data_contract.tokenizer_dir import validate_tokenizer_dir
from dsl_lit.config import TrainConfig
from dsl_lit.config.resolvers import register_resolvers

if TYPE_CHECKING:
    import lightning as L

F = TypeVar("F", bound=Callable[..., Any])
log = logging.getLogger(__name__)


def check_environment(hydra_cfg: Any) -> None:
    """What the config asks of this machine, checked before any data or process group: a GPU
    accelerator needs a visible GPU (torch is imported only to ask that)."""
    trainer = hydra_cfg.get("trainer") if hasattr(hydra_cfg, "get") else None
    accelerator = str(trainer.get("accelerator", "auto")) if trainer is not None else "auto"
    if accelerator not in ("gpu", "cuda"):
        return
    import torch

    if not torch.cuda.is_available():
        raise ConfigError(f"trainer.accelerator={accelerator} but this machine has no usable CUDA GPU; "
                          "use trainer.accelerator=cpu (or auto)")


def check_source_tree(recipe_file: str | None) -> None:
    """A recipe of one clone run with another clone's Python would import that clone's ``dsl_lit``
    (its editable install) with this clone's ``conf/``: refused. A copied recipe outside any clone
    (no ``src/dsl_lit`` beside its folder) runs with whatever ``dsl_lit`` is installed."""
    import dsl_lit

    if recipe_file is None:
        return
    root = Path(recipe_file).resolve().parents[1]
    ours = root / "src" / "dsl_lit"
    imported = Path(dsl_lit.__file__).resolve().parent
    if ours.is_dir() and ours.resolve() != imported:
        raise ConfigError(f"{recipe_file} belongs to the clone {root}, but this Python ({sys.executable}) imports "
                          f"dsl_lit from {imported}: run it with {root}/.venv/bin/python (make setup there)")


def wants_job_config(argv: list[str]) -> bool:
    """Whether the command line asks Hydra for the job's config (``--cfg job`` / ``-c job``)."""
    return any(a in ("--cfg", "-c") and b == "job" for a, b in zip(argv, argv[1:]))


def print_job_config(recipe_file: str, argv: list[str]) -> bool:
    """``--cfg job`` of a training recipe: its config validated and resolved as the run would see it
    (``resolved_config.yaml``'s view: the model field by field, parameter counts, the layout and the
    precision) instead of Hydra's composition, which shows the model as ``{name: ...}``. Returns
    False for a recipe whose config is not a training run's (Hydra then prints its own)."""
    from omegaconf import open_dict

    from dsl_lit.config.help import compose, recipe_config
    from dsl_lit.training.run_info import resolved_view

    conf, name, _ = recipe_config(Path(recipe_file))
    defaults = (yaml.safe_load((conf / f"{name}.yaml").read_text()) or {}).get("defaults") or []
    if not any(isinstance(entry, dict) and "model" in entry for entry in defaults):
        return False  # not a training run's config (composing it here would only make Hydra warn)
    composed = compose(conf, name, [a for a in argv if "=" in a and not a.startswith("-")])
    if not {"model", "trainer"} <= set(composed) or "sweep" in composed:  # (a sweep's points differ)
        return False
    with open_dict(composed):
        del composed["hydra"]  # Hydra's own node (its interpolations need a running app)
    cfg = TrainConfig.from_hydra(composed, post_training="task" in composed)
    sys.stdout.write(yaml.safe_dump(resolved_view(cfg), sort_keys=False))
    return True


def exits_on_config_error(main: F) -> F:
    """Decorate a recipe's ``main`` (under ``@hydra.main``): a bad config prints one line naming
    the field and the fix and exits with code 2, without Hydra's traceback (``HYDRA_FULL_ERROR=1``
    keeps it). A training recipe run with ``--cfg job`` prints its resolved config
    (:func:`print_job_config`) and exits before Hydra starts the app."""
    if main.__module__ == "__main__" and wants_job_config(sys.argv[1:]):
        register_resolvers()
        try:
            if print_job_config(inspect.getsourcefile(main), sys.argv[1:]):
                raise SystemExit(0)
        except ConfigError as error:
            print(f"error: {error}", file=sys.stderr)
            raise SystemExit(2) from None

    @functools.wraps(main)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        register_resolvers()  # before anything reads a ${project_root:} value
        try:
            check_source_tree(inspect.getsourcefile(main))
            if args:
                check_environment(args[0])
            return main(*args, **kwargs)
        except ConfigError as error:
            if os.environ.get("HYDRA_FULL_ERROR") == "1":
                traceback.print_exc()  # kept for debugging; the exit code stays that of a config error
            print(f"error: {error}", file=sys.stderr)
            raise SystemExit(2) from None

    return wrapper  # type: ignore[return-value]


def is_launcher_process() -> bool:
    """True in the process the user started (not in a rank Lightning or torchrun spawned for it)."""
    return int(os.environ.get("LOCAL_RANK", "0")) == 0 and int(os.environ.get("RANK", "0")) == 0


def save_resolved_config(cfg: TrainConfig, announce: bool = True) -> Path:
    """Write the fully resolved config beside Hydra's ``.hydra/`` (which keeps the unresolved one),
    once it is known to suit the checkpoint the run resumes (``check_resume``: every recipe calls
    this first, before any data or model), and log the run's start-up block. The model is written
    field by field with its parameter counts, layout and precision
    (:func:`~dsl_lit.training.run_info.resolved_view`)."""
    from dsl_lit.checkpoint.resume import check_resume  # (torch: not for recipes that only orchestrate)
    from dsl_lit.training.run_info import resolved_view, startup_lines  # imports build, which imports this

    check_resume(cfg)
    path = Path(cfg.run_dir) / "resolved_config.yaml"
    if is_launcher_process():
        view = resolved_view(cfg)
        for line in startup_lines(cfg, view["derived"]) if announce else ():
            log.info(line)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text("# The run's config, resolved: `model` field by field as validated (its preset filled in), "
                        "`derived` computed from the rest (not a setting).\n" + yaml.safe_dump(view, sort_keys=False))
    return path


def require_vocab(meta: dict[str, Any], model_vocab_size: int, tokenizer: str) -> None:
    """``ConfigError`` naming both sizes unless the model embeds every id of the tokenizer (``meta``:
    its meta.json, ``tokenizer``: where it comes from)."""
    vocab, padded = int(meta["vocab_size"]), int(meta["padded_vocab_size"])
    if vocab > model_vocab_size:
        raise ConfigError(
            f"the tokenizer ({tokenizer}) has {vocab} token ids but model.vocab_size={model_vocab_size}: set "
            f"+model.vocab_size={padded} (its padded vocabulary) or use the model's own tokenizer"
        )


def check_vocab(cfg: TrainConfig, datamodule: Any) -> None:
    """Prepare the data once in the launching process, then check the model can embed every token id
    (a given ``data.tokenizer_dir`` is checked first, before any corpus is packed with it)."""
    if not is_launcher_process():
        return
    if cfg.data.tokenizer_dir:
        require_vocab(validate_tokenizer_dir(cfg.data.tokenizer_dir, "data.tokenizer_dir"), cfg.model.vocab_size,
                      f"data.tokenizer_dir={cfg.data.tokenizer_dir}")
    datamodule.prepare_data()
    require_vocab(datamodule.tokenizer_meta, cfg.model.vocab_size, f"{datamodule.tokenizer_dir}, "
                  f"data.tokenizer_vocab_size={cfg.data.tokenizer_vocab_size}")


def finish_run(trainer: L.Trainer) -> None:
    """Close W&B runs so a Hydra multirun starts each job with a fresh run."""
    for logger in trainer.loggers:
        experiment = getattr(logger, "_experiment", None)
        if experiment is not None and hasattr(experiment, "finish"):
            experiment.finish()
