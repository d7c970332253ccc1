"""The ``precision`` config group."""

from __future__ import annotations

from dataclasses import dataclass

from data_contract.errors import ConfigError
from dsl_lit.config.fp8_recipes import FP8_RECIPES

NAMES = ("fp32", "bf16", "fp16", "auto")


@dataclass
class PrecisionConfig:
    """``precision`` group.

    - ``fp32``;
    - ``bf16``: bf16 compute (autocast), fp32 master weights and fp32 gradient accumulation across
      micro-batches, as DeepSeek LLM trains;
    - ``fp16``: fp16 compute with dynamic loss scaling (overflowing steps are skipped, the scale is
      logged as ``train/loss_scale``);
    - ``auto``: bf16 where this machine has native bf16 arithmetic (AMX or AVX512-BF16 CPUs, GPUs
      from compute capability 8.0), else fp32 (:mod:`dsl_lit.precision.auto`; the decision and its
      reason are logged).

    The router, norms, embeddings and the loss stay fp32 under autocast (the models keep them so).
    ``fp8`` additionally runs the eligible linear layers' GEMMs in FP8 (on top of bf16).
    """

    name: str = "fp32"
    loss_scale_init: float = 2.0**16
    loss_scale_growth_interval: int = 1000
    fp8: str | None = None
    expert_weight_copies: bool = True
    """Under bf16/fp16 autocast, keep a compute-dtype copy of the routed experts' fp32 weights
    between forwards, recast only after they change (an optimizer step, a load): one cast per step
    instead of one per micro-batch, recompute replay and generated token. Costs 2 bytes per routed
    expert parameter; the gradients are bit for bit those of casting every time."""

    def validate(self) -> PrecisionConfig:
        if self.name not in NAMES:
            raise ConfigError(f"precision.name={self.name!r} is unknown; choose one of {list(NAMES)}")
        if not self.loss_scale_init > 0:
            raise ConfigError(f"precision.loss_scale_init={self.loss_scale_init} must be > 0")
        if self.loss_scale_growth_interval < 1:
            raise ConfigError(f"precision.loss_scale_growth_interval={self.loss_scale_growth_interval} must be >= 1")
        if self.fp8 is not None and self.fp8 not in FP8_RECIPES:  # the table's rows (config/fp8_recipes.py)
            raise ConfigError(f"precision.fp8={self.fp8!r} is unknown; choose one of {list(FP8_RECIPES)} or null")
        if self.fp8 is not None and self.name == "auto":
            raise ConfigError(f"precision.fp8={self.fp8} needs bf16 on every machine; set precision.name=bf16, not auto")
        if self.fp8 is not None and self.name == "fp32":
            raise ConfigError(
                f"precision.fp8={self.fp8} runs FP8 GEMMs inside bf16 training (DeepSeek-V3); set precision.name=bf16"
            )
        return self
