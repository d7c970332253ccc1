"""Dynamic loss scaling for fp16 training, usable by every layout (pipeline schedules included).

fp16 has 5 exponent bits: small gradients underflow to zero unless the loss is multiplied by a
large factor before backward. The scale starts high (2^16), halves whenever a step's gradients
overflow (that step is skipped: no optimizer update) and doubles after ``growth_interval`` clean
steps, as ``torch.amp.GradScaler`` does. Ours is not tied to an optimizer: the objective is
multiplied by :attr:`scale` wherever backward starts (``manual_backward`` or the pipeline's loss
function), and the unscaling is folded into gradient clipping (one pass over the gradients,
after the data-parallel reduction, with the global norm), so ZeRO-1 shards and pipeline stages
need nothing special.
"""

from __future__ import annotations

import math
from typing import Any


class DynamicLossScaler:
    def __init__(
        self,
        enabled: bool = True,
        init_scale: float = 2.0**16,
        growth_factor: float = 2.0,
        backoff_factor: float = 0.5,
        growth_interval: int = 1000,
        min_scale: float = 1.0,
    ) -> None:
        self.enabled = enabled
        self.scale = float(init_scale) if enabled else 1.0
        self.growth_factor, self.backoff_factor = growth_factor, backoff_factor
        self.growth_interval, self.min_scale = growth_interval, min_scale
        self.good_steps = 0
        self.skipped_steps = 0

    def update(self, grad_norm: float) -> bool:
        """Record a step's (scaled-back) gradient norm; returns True if the step must be skipped
        (non-finite gradients): the scale backs off. Otherwise it grows after enough clean steps."""
        if math.isfinite(grad_norm):
            self.good_steps += 1
            if self.enabled and self.good_steps % self.growth_interval == 0:
                self.scale *= self.growth_factor
            return False
        self.skipped_steps += 1
        self.good_steps = 0
        if self.enabled:
            self.scale = max(self.min_scale, self.scale * self.backoff_factor)
        return True

    def state_dict(self) -> dict[str, Any]:
        return {"scale": self.scale, "good_steps": self.good_steps, "skipped_steps": self.skipped_steps}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.scale = float(state["scale"])
        self.good_steps = int(state["good_steps"])
        self.skipped_steps = int(state["skipped_steps"])
