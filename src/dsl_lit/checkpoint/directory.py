"""Checkpoints as directories: ``checkpoints/step-<N>/`` holding

- ``model.safetensors``: the weights (safetensors, so loading never unpickles code),
- ``trainer_state.pt``: optimizer, scheduler, loop and data positions (``torch.load(weights_only=True)``),
- ``config.yaml``: the resolved run config,
- ``meta.json``: written last; a directory is published by an atomic rename only once complete.

Lightning's ``ModelCheckpoint`` decides *when*; ``DirectoryCheckpointIO`` decides *how*.
"""

from __future__ import annotations

import json
import logging
import os
import re
import shutil
from pathlib import Path
from typing import Any

import torch
import yaml
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.plugins.io import CheckpointIO
from safetensors.torch import load_file, save_file

from dsl_lit.utils.fs import publish_dir

log = logging.getLogger(__name__)

STEP_DIR = re.compile(r"^step-(\d+)$")
_WEIGHTS = "model.safetensors"
_STATE = "trainer_state.pt"
_META = "meta.json"


def _unshared(state_dict: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """safetensors refuses tensors sharing storage (tied embeddings): keep one copy per storage."""
    seen: dict[tuple[int, int], str] = {}
    out: dict[str, torch.Tensor] = {}
    for name, tensor in state_dict.items():
        tensor = tensor.detach()
        key = (tensor.untyped_storage().data_ptr(), tensor.storage_offset())
        out[name] = tensor.clone().contiguous() if key in seen else tensor.contiguous()
        seen.setdefault(key, name)
    return out


class DirectoryCheckpointIO(CheckpointIO):
    def __init__(self, resolved_config: dict[str, Any] | None = None) -> None:
        self.resolved_config = resolved_config or {}

    def save_checkpoint(self, checkpoint: dict[str, Any], path: str | os.PathLike, storage_options: Any = None) -> None:
        final = Path(path)
        tmp = final.with_name(f".tmp-{final.name}")
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
        state = dict(checkpoint)
        save_file(_unshared(state.pop("state_dict")), str(tmp / _WEIGHTS))
        torch.save(state, tmp / _STATE)
        (tmp / "config.yaml").write_text(yaml.safe_dump(self.resolved_config, sort_keys=False))
        (tmp / _META).write_text(json.dumps({"global_step": checkpoint.get("global_step"), "complete": True}))
        publish_dir(tmp, final)

    def load_checkpoint(self, path: str | os.PathLike, map_location: Any = None, weights_only: bool | None = None) -> dict[str, Any]:
        path = Path(path)
        if not is_complete(path):
            raise FileNotFoundError(f"{path} is not a complete checkpoint directory (no {_META})")
        state = torch.load(path / _STATE, map_location=map_location or "cpu", weights_only=True)
        state["state_dict"] = load_file(str(path / _WEIGHTS), device="cpu")
        return state

    def remove_checkpoint(self, path: str | os.PathLike) -> None:
        shutil.rmtree(path, ignore_errors=True)


def is_complete(path: Path) -> bool:
    return (path / _META).is_file() and (path / _WEIGHTS).is_file() and (path / _STATE).is_file()


class StepCheckpoint(ModelCheckpoint):
    """``ModelCheckpoint`` writing ``step-<N>`` directories (no ``.ckpt`` suffix) every N steps."""

    FILE_EXTENSION = ""

    def __init__(self, dirpath: str | os.PathLike, every_n_steps: int) -> None:
        super().__init__(
            dirpath=dirpath, filename="step-{step}", auto_insert_metric_name=False,
            every_n_train_steps=every_n_steps, save_top_k=-1, save_last=False,
            save_on_train_epoch_end=False,
        )

    def on_train_end(self, trainer: Any, pl_module: Any) -> None:
        """Also save the final step, so a finished run always ends with a checkpoint of its weights."""
        if trainer.global_step and self._last_global_step_saved != trainer.global_step:
            self._save_topk_checkpoint(trainer, self._monitor_candidates(trainer))
        super().on_train_end(trainer, pl_module)


def latest_checkpoint(checkpoint_dir: str | os.PathLike) -> Path | None:
    """The complete ``step-<N>`` directory with the largest N; incomplete ones are skipped with a warning."""
    root = Path(checkpoint_dir)
    if not root.is_dir():
        return None
    candidates = []
    for child in root.iterdir():
        match = STEP_DIR.match(child.name)
        if not match:
            continue
        if is_complete(child):
            candidates.append((int(match.group(1)), child))
        else:
            log.warning("skipping incomplete checkpoint %s", child)
    return max(candidates)[1] if candidates else None
