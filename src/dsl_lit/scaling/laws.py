"""DeepSeek LLM's scaling laws (arXiv 2401.02954, section 3) with the paper's coefficients.

The paper measures model scale not in parameters but in M, non-embedding FLOPs per token
(``72 n_layer d^2 + 12 n_layer d l_seq``: it counts attention's own compute and leaves out the
vocabulary), and compute as C = M D with D the training tokens. Its fits:

- batch size (tokens) B_opt = 0.2920 C^0.3271, learning rate lr_opt = 0.3118 C^-0.1250;
- allocation M_opt = 0.1715 C^0.5243, D_opt = 5.8316 C^0.4757.
"""

from __future__ import annotations

from dataclasses import dataclass

from dsl_lit.config.model import ModelConfig
from dsl_lit.flops import non_embedding_flops_per_token, training_flops_per_token

flops_per_token = training_flops_per_token
"""Training FLOPs per token of any of our configs (dense or MoE with activated experts only, GQA
or MLA, MTP modules, output head): re-exported from :mod:`dsl_lit.flops`, which MFU also uses."""


@dataclass(frozen=True)
class PowerLaw:
    """y = coefficient * x ** exponent."""

    coefficient: float
    exponent: float

    def __call__(self, x: float) -> float:
        return self.coefficient * x**self.exponent

    def to_dict(self) -> dict[str, float]:
        return {"coefficient": self.coefficient, "exponent": self.exponent}


PAPER_LR = PowerLaw(0.3118, -0.1250)
PAPER_BATCH = PowerLaw(0.2920, 0.3271)
"""Optimal batch size in tokens."""
PAPER_MODEL_SCALE = PowerLaw(0.1715, 0.5243)
PAPER_DATA_SCALE = PowerLaw(5.8316, 0.4757)


def model_scale(cfg: ModelConfig, seq_len: int) -> float:
    """M of any config, counted from its actual shapes: training FLOPs per token without the
    output head (one per prediction, MTP included). For a dense MHA model with a 8/3 d SwiGLU it
    is the paper's formula; GQA, MLA and MoE (activated experts) change the weights counted."""
    return training_flops_per_token(cfg, seq_len) - 6 * (1 + cfg.mtp_modules) * cfg.d_model * cfg.vocab_size


def optimal_hparams(compute_flops: float) -> tuple[float, float]:
    """(batch size in tokens, peak learning rate) for a budget C = M D in FLOPs."""
    _check_budget(compute_flops)
    return PAPER_BATCH(compute_flops), PAPER_LR(compute_flops)


def optimal_allocation(compute_flops: float) -> tuple[float, float]:
    """(model scale M in FLOPs per token, data scale D in tokens) for a budget C = M D."""
    _check_budget(compute_flops)
    return PAPER_MODEL_SCALE(compute_flops), PAPER_DATA_SCALE(compute_flops)


def _check_budget(compute_flops: float) -> None:
    if not compute_flops > 0:
        raise ValueError(f"compute budget C={compute_flops!r} FLOPs must be positive")


__all__ = [
    "PAPER_BATCH", "PAPER_DATA_SCALE", "PAPER_LR", "PAPER_MODEL_SCALE", "PowerLaw", "flops_per_token",
    "model_scale", "non_embedding_flops_per_token", "optimal_allocation", "optimal_hparams",
]
