"""Starting weights of a post-training run: one of our training checkpoints or a Hugging Face
directory, loaded into our Transformer together with the model config that rebuilds it.

Our checkpoints are read by ``recipes/export_hf.py``'s ``load_checkpoint_model`` (the one reader of
training checkpoints: safetensors shards, any layout that wrote them); HF directories by
``dsl_lit.hf.from_pretrained`` (safetensors only, no remote code).
"""

from __future__ import annotations

import dataclasses
import importlib.util
from functools import cache
from pathlib import Path
from types import ModuleType
from typing import Any

import yaml

from dsl_lit.hf import from_pretrained
from dsl_lit.models import ModelConfig, Transformer

EXPORT_RECIPE = Path(__file__).resolve().parents[2] / "recipes" / "export_hf.py"
FAMILY_PRESETS = {"deepseek_llm": "deepseek_llm_tiny", "deepseek_v3": "deepseek_v3_tiny"}


@cache
def _export_recipe() -> ModuleType:
    spec = importlib.util.spec_from_file_location("dsl_lit_export_hf_recipe", EXPORT_RECIPE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def model_group(cfg: ModelConfig) -> dict[str, Any]:
    """The ``model`` config group that rebuilds ``cfg`` with ``ModelConfig.from_name``: a preset of
    the family with every field overridden (so a checkpoint of this run can be exported)."""
    values = dataclasses.asdict(cfg)
    values.pop("name")
    return {"name": FAMILY_PRESETS[cfg.family], **values}


def load_pretrained(path: str | Path) -> tuple[Transformer, dict[str, Any]]:
    """(model with the weights, its ``model`` config group) from ``path``: an HF directory
    (config.json), or our ``step-<N>`` checkpoint / run directory (its latest complete step)."""
    directory = Path(path)
    if (directory / "config.json").is_file():
        model, cfg = from_pretrained(directory, dtype="fp32")
        return model, model_group(cfg)
    recipe = _export_recipe()
    step = recipe.find_checkpoint(directory)
    model, _ = recipe.load_checkpoint_model(step)
    raw = yaml.safe_load((step / "config.yaml").read_text())
    return model.float(), dict(raw["model"])
