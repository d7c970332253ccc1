"""The ``optim`` and ``schedule`` groups: the optimizer's hyperparameters (AdamW, or Muon with AdamW
for the embeddings, the head and 1-D parameters) and the learning-rate schedule's shape, as data
(``dsl_lit.optim`` builds the optimizer and the scheduler from them)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from data_contract.errors import ConfigError

MOMENT_DTYPE_NAMES = ("fp32", "bf16")
OPTIMIZER_NAMES = ("adamw", "muon")
"""``optim.name``s (``dsl_lit.optim.build.OPTIMIZERS`` builds them; a test ties the two)."""
MUON_LR_ADJUSTMENTS = ("match_rms_adamw", "original")
ScheduleName = Literal["multi_step", "cosine", "wsd", "constant", "deepseek_v3_tokens"]
_SCHEDULES = ("multi_step", "cosine", "wsd", "constant", "deepseek_v3_tokens")


@dataclass
class OptimConfig:
    """The ``optim`` config group: AdamW (DeepSeek LLM / V3: 0.9/0.95, wd 0.1, clip 1.0) or Muon."""

    name: str = "adamw"
    """``adamw`` (DeepSeek LLM, V2, V3) or ``muon`` (``conf/optim/muon.yaml``: Muon for the hidden
    matrices, these AdamW settings for the embeddings, the output head and 1-D parameters)."""
    lr: float = 4.2e-4
    """Peak learning rate, reached after ``schedule.warmup_steps`` and then scaled by the schedule
    (DeepSeek LLM 7B: 4.2e-4; V3: 2.2e-4)."""
    betas: tuple[float, float] = (0.9, 0.95)
    """AdamW's (beta1, beta2): decay rates of the first and second moment estimates."""
    weight_decay: float = 0.1
    """Decoupled weight decay, applied to matrices and embeddings only (not to norms or biases)."""
    eps: float = 1e-8
    """Added to the second moment's square root in AdamW's denominator."""
    grad_clip: float = 1.0
    """Clip the global gradient norm to this before each optimizer step (0: no clipping)."""
    foreach: bool | None = None
    """torch's multi-tensor (foreach) AdamW kernel; null: torch's choice (or ``fused`` where it applies)."""
    fused: bool | None = None
    """torch's fused AdamW kernel (CUDA and CPU; excludes ``foreach``). ``None``: fused wherever it
    applies (fp32 moments, ``foreach`` unset), as torchtitan's default: on CPU one step of the tiny
    V3's 8.8M parameters takes 18.5 ms fused vs 106 ms per-tensor (benchmarks/adamw_kernels.py)."""
    moments_dtype: str = "fp32"
    """``bf16`` keeps AdamW's two moments in bf16 (DeepSeek-V3 section 3.3.3: half their memory,
    no observable loss of accuracy); the update itself is computed in fp32."""

    momentum: float = 0.95
    """``muon``: the momentum of the matrices' update (Moonlight, Keller Jordan's Muon: 0.95)."""
    nesterov: bool = True
    """``muon``: orthogonalise the Nesterov look-ahead ``grad.lerp(momentum_buffer, momentum)``."""
    ns_steps: int = 5
    """``muon``: Newton-Schulz iterations (5: singular values within about 0.7-1.2 of 1)."""
    lr_adjust: str = "match_rms_adamw"
    """``muon``: a matrix's step relative to ``lr``: ``match_rms_adamw`` (Moonlight: x 0.2 sqrt(max(rows,
    cols)), AdamW's update RMS, so ``lr`` and ``weight_decay`` are AdamW's) or ``original`` (Keller
    Jordan's: x sqrt(max(1, rows / cols)), with an lr around 0.02)."""

    def validate(self) -> OptimConfig:
        if self.name not in OPTIMIZER_NAMES:
            raise ConfigError(f"optim.name={self.name!r} is not one of {list(OPTIMIZER_NAMES)} (optim=muon selects Muon)")
        if self.name == "muon":
            if not 0.0 <= self.momentum < 1.0:
                raise ConfigError(f"optim.momentum={self.momentum} must lie in [0, 1)")
            if not 1 <= self.ns_steps < 100:
                raise ConfigError(f"optim.ns_steps={self.ns_steps} must be between 1 and 99 (Muon uses 5)")
            if self.lr_adjust not in MUON_LR_ADJUSTMENTS:
                raise ConfigError(f"optim.lr_adjust={self.lr_adjust!r} is not one of {list(MUON_LR_ADJUSTMENTS)}")
            if self.fused:
                raise ConfigError("optim.fused=true with optim.name=muon: Muon's matrices have no fused kernel; "
                                  "set optim.fused=null")
        if not self.lr > 0:
            raise ConfigError(f"optim.lr={self.lr} must be > 0 (DeepSeek LLM 7B used 4.2e-4)")
        if len(self.betas) != 2 or not all(0.0 <= b < 1.0 for b in self.betas):
            raise ConfigError(f"optim.betas={list(self.betas)} must be two numbers in [0, 1)")
        if self.weight_decay < 0:
            raise ConfigError(f"optim.weight_decay={self.weight_decay} must be >= 0")
        if not self.eps > 0:
            raise ConfigError(f"optim.eps={self.eps} must be > 0")
        if self.grad_clip < 0:
            raise ConfigError(f"optim.grad_clip={self.grad_clip} must be >= 0 (0 disables clipping)")
        if self.moments_dtype not in MOMENT_DTYPE_NAMES:
            raise ConfigError(f"optim.moments_dtype={self.moments_dtype!r} must be one of {list(MOMENT_DTYPE_NAMES)}")
        if self.fused and self.foreach:
            raise ConfigError("optim.fused=true and optim.foreach=true exclude each other; set optim.foreach=null")
        if self.fused and self.moments_dtype != "fp32":
            raise ConfigError("optim.fused=true needs optim.moments_dtype=fp32 (the fused kernel keeps moments in "
                              "the parameters' dtype)")
        return self


@dataclass
class ScheduleConfig:
    """The ``schedule`` config group. ``total_steps`` defaults to ``trainer.max_steps``."""

    name: ScheduleName = "multi_step"
    """The shape after warmup: ``multi_step`` (DeepSeek LLM), ``cosine``, ``wsd`` (warmup-stable-decay),
    ``constant``, or ``deepseek_v3_tokens`` (V3's, counted in tokens)."""
    warmup_steps: int = 2000
    """Optimizer steps of linear warmup from ``optim.lr / warmup_steps`` to ``optim.lr``."""
    total_steps: int | None = None
    """The steps the schedule spans (null: ``trainer.max_steps``)."""
    milestones: tuple[float, ...] = (0.8, 0.9)
    """``multi_step``: fractions of ``total_steps`` at which the lr drops ..."""
    factors: tuple[float, ...] = (0.316, 0.1)
    """... to these multiples of the peak (DeepSeek LLM: x0.316 at 80%, x0.1 at 90%)."""
    min_ratio: float = 0.1
    """``cosine``, ``wsd``, ``deepseek_v3_tokens``: the final lr as a multiple of the peak."""
    decay_fraction: float = 0.2
    """``wsd``: the share of ``total_steps``, at the end, over which the lr decays linearly."""
    # -- deepseek_v3_tokens: counted in training tokens (DeepSeek-V3 section 4.2) --------------------------
    stable_tokens: float = 10e12
    """Peak lr after warmup until this many tokens (V3: 10T) ..."""
    decay_tokens: float = 4.3e12
    """... then a cosine to ``min_ratio`` x peak over this many (V3: 4.3T, to 2.2e-5) ..."""
    tail_tokens: float = 333e9
    """... ``min_ratio`` for this many more (V3: 333B) ..."""
    tail_ratio: float = 7.3e-6 / 2.2e-4
    """... then this ratio to the end (V3: 7.3e-6 for the last 167B)."""

    def validate(self) -> ScheduleConfig:
        if self.name not in _SCHEDULES:
            raise ConfigError(f"schedule.name={self.name!r} is unknown; choose one of {sorted(_SCHEDULES)}")
        if self.warmup_steps < 0:
            raise ConfigError(f"schedule.warmup_steps={self.warmup_steps} must be >= 0")
        if self.total_steps is not None and self.total_steps <= 0:
            raise ConfigError(f"schedule.total_steps={self.total_steps} must be > 0 (or null for trainer.max_steps)")
        if len(self.milestones) != len(self.factors) or list(self.milestones) != sorted(self.milestones):
            raise ConfigError("schedule.milestones must be increasing and as many as schedule.factors")
        if not 0.0 <= self.min_ratio <= 1.0:
            raise ConfigError(f"schedule.min_ratio={self.min_ratio} must lie in [0, 1]")
        for name in ("stable_tokens", "decay_tokens", "tail_tokens"):
            if getattr(self, name) < 0:
                raise ConfigError(f"schedule.{name}={getattr(self, name)} must be >= 0 (tokens)")
        if not 0.0 <= self.tail_ratio <= 1.0:
            raise ConfigError(f"schedule.tail_ratio={self.tail_ratio} must lie in [0, 1]")
        if not 0.0 <= self.decay_fraction <= 1.0:
            raise ConfigError(f"schedule.decay_fraction={self.decay_fraction} must lie in [0, 1]")
        return self

