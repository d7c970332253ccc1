"""The per-step health checks (was the gradient finite?) read on the host in batches, not every step.

Deciding on the host whether a step's gradients were finite (``float(grad_norm)``) stalls the CPU
every step until the GPU has finished the backward, so it cannot queue the next step's kernels:
the GPU idles between steps. Where the optimizer can skip a step on the device (torch's fused
AdamW reads a ``found_inf`` tensor and leaves weights, moments and step counts untouched), the
module queues each step's flags here and reads them all with one host sync every
``trainer.log_every_n_steps`` steps (when Lightning syncs for its logs anyway), at the last step and
before a checkpoint is written: the same skips, counts, warnings and stops, read a few steps later.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass
class StepOutcome:
    step: int
    finite: bool
    loss: float


@dataclass
class PendingStepChecks:
    pending: list[tuple[int, torch.Tensor, torch.Tensor]] = field(default_factory=list)

    def add(self, step: int, finite: torch.Tensor, loss: torch.Tensor) -> None:
        """Queue step ``step``'s flag (a 0-d bool device tensor) and loss, without reading them."""
        self.pending.append((step, finite.detach(), loss.detach().float()))

    def drain(self) -> list[StepOutcome]:
        """Every queued step's outcome, oldest first, read with one host sync; the queue empties."""
        if not self.pending:
            return []
        steps = [step for step, _, _ in self.pending]
        values = torch.stack([torch.stack([finite.float(), loss]) for _, finite, loss in self.pending]).cpu()
        self.pending.clear()
        return [StepOutcome(step, bool(row[0]), float(row[1])) for step, row in zip(steps, values)]
