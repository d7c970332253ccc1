"""The Lightning precision plugin of every recipe: autocast to bf16/fp16 (or nothing for fp32)
around forward, and an optimizer step that can be skipped.

Why not Lightning's ``MixedPrecision``: its fp16 mode brings a ``GradScaler`` bound to the
optimizer and to ``manual_backward``; our pipeline schedules run their own backward and ZeRO-1
owns the gradients, so loss scaling lives in :class:`~dsl_lit.precision.loss_scaler.DynamicLossScaler`
instead. A skipped step (overflow, or a non-finite gradient under any precision) still goes
through ``optimizer.step()`` so Lightning counts it (``global_step``, the lr schedule and the data
position stay in lock step); only the update itself is not applied.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Generator
from typing import Any

import torch
from lightning.pytorch.plugins.precision import Precision

DTYPES = {"fp32": None, "bf16": torch.bfloat16, "fp16": torch.float16}


class AutocastPrecision(Precision):
    def __init__(self, name: str, device_type: str) -> None:
        self.name = name
        self.precision = {"fp32": "32-true", "bf16": "bf16-mixed", "fp16": "16-mixed"}[name]
        self.dtype = DTYPES[name]
        self.device_type = device_type
        self.skip_next_step = False

    @contextlib.contextmanager
    def forward_context(self) -> Generator[None, None, None]:
        if self.dtype is None:
            yield
            return
        with torch.autocast(self.device_type, dtype=self.dtype):
            yield

    def optimizer_step(self, optimizer: Any, model: Any, closure: Callable[[], Any], **kwargs: Any) -> Any:
        if self.skip_next_step:
            self.skip_next_step = False
            return closure()
        return super().optimizer_step(optimizer, model, closure, **kwargs)
