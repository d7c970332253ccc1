"""Training: the LightningModule every objective derives from, pretraining's objective, and what
turns a validated config into a Lightning run (callbacks, loggers, the Trainer, ``init_from``).

The two modules load on first use (PEP 562): code that only reads a run's files
(``training.metrics_file``, ``training.resume_command``: the report, ``make reproduce``'s runner and
its start-up checks) does not pay Lightning's and torch's ~8 s of imports."""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from dsl_lit.training.causal_lm import CausalLMModule
    from dsl_lit.training.pretrain import PretrainModule

__all__ = ["CausalLMModule", "PretrainModule"]
_HOMES = {"CausalLMModule": "dsl_lit.training.causal_lm", "PretrainModule": "dsl_lit.training.pretrain"}


def __getattr__(name: str) -> Any:
    if name in _HOMES:
        return getattr(importlib.import_module(_HOMES[name]), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
