"""Shared test helpers: composing the real Hydra configs of the recipes."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir
from omegaconf import DictConfig

import dsl_lit.training.build  # noqa: F401  (registers the ${project_root:} resolver)

ROOT = Path(__file__).resolve().parents[1]
CONF = ROOT / "conf"

os.environ.setdefault("WANDB_MODE", "offline")
os.environ.setdefault("WANDB_SILENT", "true")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


def compose_config(name: str = "pretrain", overrides: list[str] | None = None) -> DictConfig:
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        return compose(config_name=name, overrides=overrides or [], return_hydra_config=False)


@pytest.fixture
def compose_cfg():
    return compose_config


def edit_config_json(path: Path, **changes: object) -> None:
    """Overwrite keys of a saved Hugging Face ``config.json`` (tests of bad checkpoints)."""
    config = json.loads((path / "config.json").read_text())
    config.update(changes)
    (path / "config.json").write_text(json.dumps(config))
