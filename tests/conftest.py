"""Shared test helpers: composing the real Hydra configs of the recipes."""

from __future__ import annotations

import atexit
import json
import os
import shutil
import tempfile
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir
from omegaconf import DictConfig

import dsl_lit.training.build  # noqa: F401  (registers the ${project_root:} resolver)

ROOT = Path(__file__).resolve().parents[1]
CONF = ROOT / "conf"
# Context-extension stages pack their data with the previous stage's tokenizer (the token ids its
# weights were trained on), which a fresh checkout has not built yet: composition tests drop it.
AFTER_A_STAGE = {"experiment=cpu_context_512": "data.tokenizer_dir=null",
                 "experiment=cpu_context_2048": "data.tokenizer_dir=null"}


def with_stage_inputs(overrides: list[str]) -> list[str]:
    return overrides + [AFTER_A_STAGE[o] for o in overrides if o in AFTER_A_STAGE]

os.environ.setdefault("WANDB_MODE", "offline")
os.environ.setdefault("WANDB_SILENT", "true")
if os.environ.get("PYTEST_XDIST_WORKER_COUNT"):
    # pytest -n N: N workers share the cores, so each one's in-process torch ops use its share (the
    # recipes they start in subprocesses keep torch's default)
    import torch

    torch.set_num_threads(max(1, (os.cpu_count() or 1) // int(os.environ["PYTEST_XDIST_WORKER_COUNT"])))
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# Every recipe the tests run (subprocesses inherit this) builds its tokenizer and shards afresh in a
# session cache, so a regression in tokenizer training or packing cannot hide behind the
# repository's warm .cache/ (set DSL_LIT_CACHE_ROOT yourself to reuse one between sessions).
if "DSL_LIT_CACHE_ROOT" not in os.environ:
    os.environ["DSL_LIT_CACHE_ROOT"] = tempfile.mkdtemp(prefix="dsl_lit_test_cache_")
    atexit.register(shutil.rmtree, os.environ["DSL_LIT_CACHE_ROOT"], ignore_errors=True)


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
