"""An exponential moving average of the weights, kept in CPU memory (DeepSeek-V3 section 3.2.3:
"the EMA parameters are stored in CPU memory and are updated asynchronously after each training
step", an early estimate of the model after learning-rate decay at no GPU memory cost).

Each rank averages the parameters it holds (its tensor-parallel shards, its pipeline stages'
layers) into fp32 CPU tensors after every ``every_n_steps`` optimizer steps; device-to-CPU copies
are issued non-blocking, so on GPU they overlap the next step. With ``validate_with_ema`` the
validation loop runs on the EMA weights (swapped in, then back). Checkpoints store the EMA by
parameter name as full tensors (gathered like the weights), so it survives a change of layout.
"""

from __future__ import annotations

from typing import Any

import lightning as L
import torch
from torch.distributed.tensor import DTensor, distribute_tensor


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


class EMACallback(L.Callback):
    def __init__(self, decay: float, every_n_steps: int = 1, validate_with_ema: bool = False) -> None:
        self.decay = decay
        self.every_n_steps = every_n_steps
        self.validate_with_ema = validate_with_ema
        self.ema: dict[str, torch.Tensor] = {}
        self._loaded: dict[str, torch.Tensor] | None = None
        self._stash: dict[str, torch.Tensor] = {}
        self._module: L.LightningModule | None = None

    def _params(self, pl_module: L.LightningModule) -> dict[str, torch.nn.Parameter]:
        return {n: p for n, p in pl_module.model.named_parameters() if p.requires_grad}

    def on_fit_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._module = pl_module
        params = self._params(pl_module)
        if self._loaded is not None:  # resumed: keep this rank's part of the saved full tensors
            for name, p in params.items():
                full = self._loaded[name]
                if isinstance(p, DTensor):
                    full = distribute_tensor(full.to(p.device), p.device_mesh, p.placements, src_data_rank=None)
                self.ema[name] = _local(full).detach().to("cpu", torch.float32).clone()
            self._loaded = None
        elif not self.ema:
            self.ema = {n: _local(p).detach().to("cpu", torch.float32).clone() for n, p in params.items()}

    @torch.no_grad()
    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, *args: Any) -> None:
        if trainer.global_step % self.every_n_steps:
            return
        copies = {n: _local(p).detach().to("cpu", non_blocking=True) for n, p in self._params(pl_module).items()}
        if any(p.is_cuda for p in pl_module.model.parameters()):
            torch.cuda.current_stream().synchronize()
        for name, value in copies.items():
            self.ema[name].lerp_(value.float(), 1.0 - self.decay)

    # -- validation on the EMA weights ----------------------------------------------------------
    @torch.no_grad()
    def on_validation_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if not (self.validate_with_ema and trainer.state.fn == "fit" and self.ema):
            return
        for name, p in self._params(pl_module).items():
            self._stash[name] = _local(p).detach().to("cpu", copy=True)
            _local(p).copy_(self.ema[name])

    @torch.no_grad()
    def on_validation_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        for name, p in self._params(pl_module).items():
            if name in self._stash:
                _local(p).copy_(self._stash.pop(name))

    # -- checkpoints: full tensors by name ------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """Called on every rank while a checkpoint is written: gather the full EMA (a collective)."""
        if self._module is None or not self.ema:
            return {"decay": self.decay, "ema": {}}
        named = {}
        for name, p in self._params(self._module).items():
            local = self.ema[name].to(_local(p).device)
            named[name] = (
                DTensor.from_local(local, p.device_mesh, p.placements, run_check=False)
                if isinstance(p, DTensor) else local
            )
        strategy = self._module.trainer.strategy
        full = strategy.full_state(named) if hasattr(strategy, "full_state") else named
        return {"decay": self.decay, "ema": {k: v.cpu() for k, v in full.items()}}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self._loaded = state_dict["ema"] or None
