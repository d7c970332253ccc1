"""Starting weights of a post-training run: one of our training checkpoints or a Hugging Face
directory, loaded into our Transformer together with the model config that rebuilds it.

Our checkpoints are read by ``dsl_lit.checkpoint.reader`` (the one reader of training checkpoints:
safetensors shards, any layout that wrote them); HF directories by ``dsl_lit.hf.from_pretrained``
(safetensors only, no remote code).
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import yaml

from dsl_lit.checkpoint.reader import find_checkpoint, load_checkpoint_model
from dsl_lit.hf import from_pretrained
from dsl_lit.models import ModelConfig, Transformer, spec_of


def model_group(cfg: ModelConfig) -> dict[str, Any]:
    """The ``model`` config group that rebuilds ``cfg`` with ``ModelConfig.from_name``: a preset of
    the family with every field overridden (so a checkpoint of this run can be exported)."""
    values = dataclasses.asdict(cfg)
    values.pop("name")
    return {"name": spec_of(cfg).base_preset, **values}


def load_pretrained(path: str | Path) -> tuple[Transformer, dict[str, Any]]:
    """(model with the weights, its ``model`` config group) from ``path``: an HF directory
    (config.json), or our ``step-<N>`` checkpoint / run directory (its latest complete step)."""
    directory = Path(path)
    if (directory / "config.json").is_file():
        model, cfg = from_pretrained(directory, dtype="fp32")
        return model, model_group(cfg)
    step = find_checkpoint(directory)
    model, _ = load_checkpoint_model(step)
    raw = yaml.safe_load((step / "config.yaml").read_text())
    return model.float(), dict(raw["model"])
