"""Random number generator states in checkpoints, so a resumed run draws what it would have drawn.

Pretraining itself draws nothing at random after initialisation (the data order comes from the
sampler's seed), but sampling in post-training, dropout or noise in research variants do. Every
rank's Python, NumPy and torch (CPU and CUDA) generator states are gathered into the checkpoint;
a run resumed on the same world size gets its own rank's back, on another world size every rank
gets rank 0's (the layout changed, so per-rank streams cannot continue anyway).
"""

from __future__ import annotations

import logging
import random
from typing import Any

import lightning as L
import numpy as np
import torch
import torch.distributed as dist

log = logging.getLogger(__name__)


def rng_state() -> dict[str, Any]:
    """This process's generator states as plain lists and ints (loadable with ``weights_only``)."""
    kind, keys, pos, has_gauss, gauss = np.random.get_state()
    state = {
        "python": random.getstate(),
        "numpy": [kind, keys.tolist(), pos, has_gauss, gauss],
        "torch": torch.get_rng_state().tolist(),
    }
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = [s.tolist() for s in torch.cuda.get_rng_state_all()]
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    kind, keys, pos, has_gauss, gauss = state["numpy"]
    np.random.set_state((kind, np.asarray(keys, dtype=np.uint32), pos, has_gauss, gauss))
    torch.set_rng_state(torch.tensor(state["torch"], dtype=torch.uint8))
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all([torch.tensor(s, dtype=torch.uint8) for s in state["cuda"]])


class RNGStateCallback(L.Callback):
    """Saves every rank's generator states; restores them when training resumes."""

    def __init__(self) -> None:
        self._loaded: list[dict[str, Any]] | None = None

    def state_dict(self) -> dict[str, Any]:
        """Called on every rank while a checkpoint is written (a collective with several ranks)."""
        mine = rng_state()
        if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
            return {"ranks": [mine]}
        ranks: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(ranks, mine)
        return {"ranks": ranks}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self._loaded = list(state_dict.get("ranks") or []) or None

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        """Restored here, the last moment before the first step, so nothing in between draws from them."""
        if self._loaded is None:
            return
        if len(self._loaded) == trainer.world_size:
            set_rng_state(self._loaded[trainer.global_rank])
        else:
            log.info("resuming %d ranks' RNG states on %d ranks: every rank continues from rank 0's",
                     len(self._loaded), trainer.world_size)
            set_rng_state(self._loaded[0])
        self._loaded = None
