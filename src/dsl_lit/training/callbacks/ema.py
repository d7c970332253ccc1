"""An exponential moving average of the weights, kept in CPU memory (DeepSeek-V3 section 3.2.3:
"the EMA parameters are stored in CPU memory and are updated asynchronously after each training
step", an early estimate of the model after learning-rate decay at no GPU memory cost).

Each rank averages the parameters it holds (its tensor-parallel shards, its pipeline stages'
layers) into fp32 CPU tensors after every ``every_n_steps`` optimizer steps; device-to-CPU copies
are issued non-blocking, so on GPU they overlap the next step. With ``validate_with_ema`` the
validation loop runs on the EMA weights (swapped in, then back). Checkpoints store the EMA by
parameter name, sharded like the weights (DTensors where the parameters are), so it survives a
change of layout.
"""

from __future__ import annotations

from typing import Any

import lightning as L
import torch
from torch.distributed.tensor import DTensor


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

    def _start_from_weights(self, pl_module: L.LightningModule) -> None:
        self.ema = {n: _local(p).detach().to("cpu", torch.float32).clone() for n, p in self._params(pl_module).items()}

    def on_fit_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        """Shaped now, so a checkpoint being restored has tensors to read the saved EMA into."""
        self._module = pl_module
        self._start_from_weights(pl_module)

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        """After any restore: the saved EMA, else the (possibly just loaded) weights themselves."""
        if self._loaded is not None:
            self._assign(self._loaded)
            self._loaded = None
        else:
            self._start_from_weights(pl_module)

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

    # -- checkpoints: this rank's part, by parameter name ----------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """The EMA as the parameters are laid out (a DTensor view of each tensor-parallel shard), so
        the checkpoint writer stores every rank's part and another layout reads back its own."""
        if self._module is None or not self.ema:
            return {"decay": self.decay, "ema": {}}
        named = {}
        for name, p in self._params(self._module).items():
            local = self.ema[name].to(_local(p).device)
            named[name] = (
                DTensor.from_local(local, p.device_mesh, p.placements, run_check=False)
                if isinstance(p, DTensor) else local
            )
        return {"decay": self.decay, "ema": named}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self._loaded = state_dict.get("ema") or None

    def _assign(self, saved: dict[str, torch.Tensor]) -> None:
        missing = [name for name in self.ema if name not in saved]
        if missing:
            raise KeyError(f"the checkpoint's EMA lacks {', '.join(missing[:5])}")
        for name in self.ema:
            self.ema[name] = _local(saved[name]).detach().to("cpu", torch.float32).clone()
