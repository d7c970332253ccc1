"""Reading our training checkpoints back as a plain ``Transformer`` on one process, whatever layout
wrote them: the model config from the checkpoint's ``config.yaml``, the weights (or their EMA)
assembled from the safetensors shards. Used by the HF export and by post-training's ``init_from``.
No Lightning import, so tools that only read checkpoints start fast.
"""

from __future__ import annotations

import json
import logging
import re
from pathlib import Path
from typing import Any

import torch
import yaml

from data_contract.errors import ConfigError, MissingInputError
from dsl_lit.checkpoint.files import (
    CONFIG,
    META,
    SHARDS,
    STATE,
    CorruptCheckpoint,
    checkpoint_problem,
    load_plain_state,
)
from dsl_lit.checkpoint.integrity import checksum_problem
from dsl_lit.checkpoint.sharded import read_full_tensors
from dsl_lit.hf.io import adapter_for_family, load_into_meta_model, resolve_dtype, tied_groups
from dsl_lit.models import ModelConfig, Transformer, build_model
from dsl_lit.models.common.hf_adapter import few

log = logging.getLogger(__name__)

WEIGHT_SOURCES = ("model", "ema")
PREFIX = "model."
"""The LightningModule holds the Transformer as ``self.model``: its state-dict keys carry this prefix."""
_FILES = (SHARDS, STATE, CONFIG, META)
_STEP_DIR = re.compile(r"step-\d+")

StateDict = dict[str, torch.Tensor]


# -- finding and reading the checkpoint ----------------------------------------------------------------


def find_checkpoint(path: str | Path) -> Path:
    """A ``step-<N>`` directory as it is, or the latest complete one of a run or checkpoints directory.

    FileNotFoundError says what is missing: a directory that is (or looks like) one checkpoint must
    hold shards/, trainer_state.pt, config.yaml and meta.json (written last, listing every file).
    """
    directory = Path(path)
    if not directory.exists():
        raise MissingInputError(f"checkpoint={path}: no such directory")
    if not directory.is_dir():
        raise MissingInputError(f"checkpoint={path} is a file; pass a checkpoints/step-<N> directory")
    if _STEP_DIR.fullmatch(directory.name) or any((directory / f).exists() for f in _FILES):
        problem = checkpoint_problem(directory)
        if problem is not None:
            raise MissingInputError(
                f"checkpoint={path} is not a complete checkpoint: {problem} (meta.json is written last, so "
                "this save was interrupted or is still running); pick another step"
            )
        problem = checksum_problem(directory)
        if problem is not None:
            raise MissingInputError(f"checkpoint={path} is corrupt: {problem}; pick another step")
        return directory
    # Imported here: it imports Lightning (seconds), which exporting one step directory does not need.
    from dsl_lit.checkpoint.directory import latest_checkpoint, step_dirs

    root = directory / "checkpoints" if (directory / "checkpoints").is_dir() else directory
    refuse_a_damaged_newest(path, root, step_dirs(root))
    latest = latest_checkpoint(root, verify=True)
    if latest is None:
        raise MissingInputError(
            f"checkpoint={path} is not a checkpoint directory (checkpoints/step-<N>/ holding "
            f"{', '.join(_FILES)}) and holds no complete one under {root}"
        )
    log.info("checkpoint=%s: using its latest complete checkpoint %s", path, latest)
    return latest


def refuse_a_damaged_newest(path: str | Path, root: Path, steps: list[tuple[int, Path]]) -> None:
    """A run's newest checkpoint that was written whole (its ``meta.json`` is there) and is damaged
    since is an error, not a fallback: a reader (``init_from``, the HF export, evaluation) of a
    finished run would otherwise silently take an older step (a reproduce stage trained on
    pretraining's step 12 when step 15 was corrupt). An interrupted save (no ``meta.json``) is still
    skipped for the latest complete step, as resuming does."""
    for _, child in steps:
        if not (child / "meta.json").exists():
            continue  # an interrupted save: latest_checkpoint skips it
        problem = checkpoint_problem(child) or checksum_problem(child)
        if problem is None:
            return
        older = next((c for _, c in steps if c != child and (c / "meta.json").exists()), None)
        raise MissingInputError(
            f"checkpoint={path}: its newest checkpoint {child.name} is corrupt ({problem}); an older step would "
            "silently stand in for it: restore it, or name a step explicitly"
            + (f" (checkpoint={older} or init_from={older})" if older else "")
        )


def model_config(checkpoint: Path) -> ModelConfig:
    """The run's ``ModelConfig`` from the checkpoint's resolved ``config.yaml`` (its ``model`` group)."""
    path = checkpoint / "config.yaml"
    raw = yaml.safe_load(path.read_text())
    model = raw.get("model") if isinstance(raw, dict) else None
    if not isinstance(model, dict) or "name" not in model:
        raise ConfigError(f"{path} has no model group with a preset name (model.name); is it a run config?")
    values = dict(model)
    cfg = ModelConfig.from_name(values.pop("name"), **values)  # ConfigError naming a bad field
    adapter_for_family(cfg.family)  # ConfigError for a family without a Hugging Face layout
    return cfg


def read_model_weights(checkpoint: Path) -> StateDict:
    """The Transformer's tensors, whole, from the checkpoint's shards, LightningModule prefix stripped."""
    state = read_full_tensors(checkpoint / SHARDS, prefix="state_dict/")
    ours = {k.removeprefix(PREFIX): v for k, v in state.items() if k.startswith(PREFIX)}
    other = [k for k in state if not k.startswith(PREFIX)]
    if not ours:
        raise ConfigError(
            f"{checkpoint / SHARDS} holds no 'state_dict/{PREFIX}*' tensors (found {few(state)}); "
            "it is not a checkpoint of our LightningModules"
        )
    if other:
        log.warning("ignoring %d tensor(s) outside the model: %s", len(other), few(other))
    return ours


def read_ema(checkpoint: Path) -> tuple[StateDict, float]:
    """The EMA that ``dsl_lit.training.callbacks.ema.EMACallback`` saved, and its decay."""
    try:
        state = load_plain_state(checkpoint)
    except CorruptCheckpoint as err:
        raise ConfigError(f"weights=ema: {checkpoint}: {err}") from None
    callbacks: dict[str, Any] = state.get("callbacks") or {}
    found = [(k, v) for k, v in callbacks.items() if "EMACallback" in str(k) and isinstance(v, dict)]
    ema = read_full_tensors(checkpoint / SHARDS, prefix=f"callbacks/{found[0][0]}/ema/") if found else {}
    if not ema:
        raise ConfigError(
            f"weights=ema: {checkpoint} holds no EMA of the weights (the run had memory.ema_decay=0); "
            "use weights=model, or train with memory.ema_decay > 0"
        )
    return ema, float(found[0][1].get("decay", float("nan")))


def with_ema(state: StateDict, ema: StateDict, model: Transformer, keep_dtype: bool) -> StateDict:
    """``state`` with every parameter the EMA has replaced by its average. Buffers (the router's
    balancing bias) and parameters without an average stay as trained; tied names follow the EMA.
    ``keep_dtype``: cast the fp32 averages to the dtype the checkpoint stores the weights in."""
    unknown = sorted(set(ema) - set(state))
    if unknown:
        raise ConfigError(f"weights=ema: the EMA has tensor(s) the model has no parameter for: {few(unknown)}")
    out = dict(state)
    for name, average in ema.items():
        if average.shape != state[name].shape:
            raise ConfigError(
                f"weights=ema: EMA of {name} has shape {tuple(average.shape)}, the model's is "
                f"{tuple(state[name].shape)}"
            )
        out[name] = average.to(state[name].dtype) if keep_dtype else average
    for names in tied_groups(model):  # named_parameters() lists a tied tensor under one name only
        source = next((n for n in names if n in ema), None)
        if source is not None:
            out.update(dict.fromkeys(names, out[source]))
    params = [n for n, _ in model.named_parameters()]
    kept = [n for n in params if n not in ema]
    log.info("weights=ema: %d of %d parameters averaged", len(params) - len(kept), len(params))
    if kept:
        log.warning("weights=ema: %d parameter(s) have no EMA and keep their trained value: %s", len(kept), few(kept))
    return out


def load_checkpoint_model(
    checkpoint: str | Path, weights: str = "model", dtype: Any = None
) -> tuple[Transformer, dict[str, Any]]:
    """Our Transformer with a training checkpoint's weights, plus facts about them for logging.

    Built on the meta device and given the loaded tensors (``assign``), so no weight is allocated
    twice. ``dtype`` None keeps the checkpoint's dtype (the EMA's fp32 averages are cast to it).
    """
    if weights not in WEIGHT_SOURCES:
        raise ConfigError(f"weights={weights!r} is unknown; choose one of {WEIGHT_SOURCES}")
    target = resolve_dtype(dtype)
    directory = find_checkpoint(checkpoint)
    cfg = model_config(directory)
    with torch.device("meta"):
        model = build_model(cfg)
    state = read_model_weights(directory)
    info: dict[str, Any] = {"checkpoint": str(directory), "weights": weights, "family": cfg.family}
    info["global_step"] = json.loads((directory / "meta.json").read_text()).get("global_step")
    if weights == "ema":
        ema, info["ema_decay"] = read_ema(directory)
        state = with_ema(state, ema, model, keep_dtype=target is None)
    if target is not None:
        state = {k: v.to(target) if v.is_floating_point() else v for k, v in state.items()}
    load_into_meta_model(model, state, torch.device("cpu"), what=f"loading {directory / SHARDS}")
    return model.eval(), info
