"""Options of ``recipes/evaluate.py``: which model to evaluate, on what, in which precision."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import ClassVar

from data_contract.errors import ConfigError
from dsl_lit.config.eval import EvalTasksConfig
from dsl_lit.config.train import WandbConfig

PRECISIONS = ("fp32", "bf16")
WEIGHTS = ("model", "ema")


@dataclass
class EvaluateConfig(EvalTasksConfig):
    """``recipes/evaluate.py``: ``checkpoint`` is one of our checkpoints (a step-<N> directory, or a
    run directory: its latest complete step) or a Hugging Face directory (config.json +
    safetensors). ``weights=ema`` evaluates the EMA our checkpoints keep with memory.ema_decay > 0.
    ``precision``: fp32, or bf16 autocast."""

    FIELD_PREFIX: ClassVar[str] = ""

    checkpoint: str | None = None
    weights: str = "model"
    device: str = "auto"
    precision: str = "fp32"
    wandb: WandbConfig = field(default_factory=lambda: WandbConfig(enabled=False))

    def validate(self) -> EvaluateConfig:
        super().validate()
        if not self.checkpoint:
            raise ConfigError("checkpoint= is required: one of our checkpoints (step-<N> or run directory) "
                              "or a Hugging Face model directory")
        if not self.tasks:
            raise ConfigError("tasks= is empty; e.g. tasks=[dsl_kjv_next_sentence,dsl_devil_perplexity,dsl_arithmetic]")
        if self.weights not in WEIGHTS:
            raise ConfigError(f"weights={self.weights!r} is unknown; choose one of {list(WEIGHTS)}")
        if self.precision not in PRECISIONS:
            raise ConfigError(f"precision={self.precision!r} is unknown; choose one of {list(PRECISIONS)}")
        if self.device not in ("auto", "cpu") and not self.device.startswith("cuda"):
            raise ConfigError(f"device={self.device!r} must be auto, cpu, cuda or cuda:<index>")
        self.wandb.validate()
        return self
