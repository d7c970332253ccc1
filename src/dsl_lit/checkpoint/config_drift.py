"""What may change when a run resumes, checked at start-up against the checkpoint's ``config.yaml``.

The rule:

- **The model and its tokenizer cannot change.** Every field of the resolved ``ModelConfig`` that
  shapes the network or what its weights compute (sizes, layer counts, attention and MoE layout,
  rotary settings, norms, routing) and the tokenizer's settings (``data.tokenizer_vocab_size``,
  ``data.tokenizer_max_bytes``): a difference is a ``ConfigError`` naming the key, before any data,
  model or process group. Exempt are the model fields that only choose kernels or weigh losses
  (:data:`MUTABLE_MODEL_FIELDS`).
- **Everything else may change, and takes effect from the resumed step**, with one warning listing
  every changed key (``old -> new``). The optimizer's hyperparameters and the learning-rate
  schedule are the new config's from that step (:mod:`dsl_lit.checkpoint.hyperparameters`);
  ``schedule.total_steps: null`` follows ``trainer.max_steps``, so extending a run stretches its
  schedule. Bookkeeping keys (:data:`IGNORED`) are not compared.
"""

from __future__ import annotations

import dataclasses
import json
import logging
from pathlib import Path
from typing import Any

import yaml

from dsl_lit.checkpoint.files import CONFIG, META
from dsl_lit.checkpoint.reader import model_config
from dsl_lit.config import ConfigError, ModelConfig
from dsl_lit.config.model import EXECUTION_FIELDS

log = logging.getLogger(__name__)

MUTABLE_MODEL_FIELDS = frozenset({
    "name",  # a preset is a name for field values: the values are compared
    *EXECUTION_FIELDS,  # kernels computing the same function
    "init_std",  # used only to initialise
    "seq_balance_alpha", "batch_balance_alpha",  # loss weights
})
FIXED_KEYS = frozenset({"data.tokenizer_vocab_size", "data.tokenizer_max_bytes"})
"""Outside the model: what identifies the tokenizer the embeddings were trained with."""
IGNORED = frozenset({"run_name", "checkpoint.resume", "checkpoint.resume_from"})


def flatten(tree: Any, prefix: str = "") -> dict[str, Any]:
    """``{"optim": {"lr": 1}}`` -> ``{"optim.lr": 1}``; lists and tuples are values (as lists)."""
    if isinstance(tree, dict):
        out: dict[str, Any] = {}
        for key, value in tree.items():
            out.update(flatten(value, f"{prefix}.{key}" if prefix else str(key)))
        return out
    return {prefix: list(tree) if isinstance(tree, (list, tuple)) else tree}


def _model_changes(saved: ModelConfig, current: ModelConfig) -> dict[str, tuple[Any, Any]]:
    old, new = dataclasses.asdict(saved), dataclasses.asdict(current)
    return {f"model.{k}": (old[k], new[k]) for k in old if flatten(old[k]) != flatten(new[k])}


def config_changes(checkpoint: Path, raw: dict[str, Any], model: ModelConfig) -> dict[str, tuple[Any, Any]]:
    """Key -> (the checkpoint's value, this run's) for every setting that differs; the model
    compared field by field as resolved (a preset plus overrides), the rest as resolved YAML."""
    path = checkpoint / CONFIG
    saved = yaml.safe_load(path.read_text())
    if not isinstance(saved, dict):
        raise ConfigError(f"{path} is not a run config; the checkpoint cannot be checked against this run")
    changes = _model_changes(model_config(checkpoint), model)
    old = {k: v for k, v in flatten(saved).items() if not k.startswith("model.")}
    new = {k: v for k, v in flatten(raw).items() if not k.startswith("model.")}
    for key in sorted((old.keys() | new.keys()) - IGNORED):
        if old.get(key) != new.get(key):
            changes[key] = (old.get(key), new.get(key))
    return changes


def check_config_drift(checkpoint: Path, raw: dict[str, Any], model: ModelConfig) -> dict[str, tuple[Any, Any]]:
    """Apply the rule above for a run (resolved config ``raw``, ``model``) resuming ``checkpoint``:
    ConfigError naming every fixed key that differs, else one warning listing every change.
    Returns the changes."""
    changes = config_changes(checkpoint, raw, model)
    if "optim.name" in changes:  # absent: saved before the key existed, or the adamw group (its default)
        old, new = (name or "adamw" for name in changes.pop("optim.name"))
        if old != new:
            raise ConfigError(
                f"resuming {checkpoint}: optim.name={new!r} but the checkpoint was trained with {old!r}, whose state "
                f"({'momentum' if old == 'muon' else 'moments'}) the other optimizer cannot continue: resume with "
                f"optim={old}, or start a new run from these weights with init_from=<the run dir>"
            )
    fixed = {k: v for k, v in changes.items() if (k.startswith("model.") and
                                                  k.removeprefix("model.") not in MUTABLE_MODEL_FIELDS)
             or k in FIXED_KEYS}
    if fixed:
        shown = "; ".join(f"{k}={new!r} but the checkpoint has {old!r}" for k, (old, new) in fixed.items())
        raise ConfigError(
            f"resuming {checkpoint}: {shown}. The model's shape and its tokenizer cannot change when a run "
            f"resumes: set {next(iter(fixed))} back (and any other listed), or train another run (a new "
            "run_name or hydra.run.dir; post-training recipes start from a checkpoint with init_from=<dir>)"
        )
    if changes:
        step = json.loads((checkpoint / META).read_text()).get("global_step")
        shown = "; ".join(f"{k}: {old!r} -> {new!r}" for k, (old, new) in changes.items())
        log.warning(
            "resuming %s with changed settings, in effect from step %s (the optimizer's hyperparameters and the "
            "learning-rate schedule take the new values; weights, moments and data position are the "
            "checkpoint's): %s", checkpoint, step, shown,
        )
    return changes
