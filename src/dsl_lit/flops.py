"""Analytical training FLOPs, the denominator-free half of MFU, for any model family.

The counts are the model's own (:func:`decoder_flops`: its config's attention part, counted by
:mod:`dsl_lit.models.common.flops`); this module is the family-agnostic entry point the trainer,
the planner and the scaling laws use. Counting from the config, not with a FLOP counter, because
meta-device counters miscount routed experts and fused kernels. No torch: the scaling sweep's
resolver and ``make reproduce``'s start-up checks count FLOPs without loading it.
"""

from __future__ import annotations

from dsl_lit.config.model import ModelConfig
from dsl_lit.models.common.flops import DecoderFlops, ffn_params_per_token

__all__ = [
    "attention_params", "decoder_flops", "ffn_params_per_token", "matmul_params_per_token", "non_embedding_flops_per_token",
    "training_flops_per_token",
]


def decoder_flops(cfg: ModelConfig) -> DecoderFlops:
    """``cfg``'s counts, from its attention part (torch-free)."""
    return DecoderFlops(cfg.attention)


def non_embedding_flops_per_token(n_layers: int, d_model: int, seq_len: int) -> float:
    """DeepSeek LLM's model scale M = 72 n_layer d^2 + 12 n_layer d l_seq (fwd + bwd, no vocab head)."""
    return 72 * n_layers * d_model**2 + 12 * n_layers * d_model * seq_len


def attention_params(cfg: ModelConfig) -> int:
    """Projection weights of one attention block (GQA, or MLA with its low-rank paths)."""
    return decoder_flops(cfg).attention_params(cfg)


def matmul_params_per_token(cfg: ModelConfig) -> int:
    """Weights each token multiplies through: attention and FFN projections (activated experts
    only), the MTP modules' projection and blocks, and the output head once per prediction."""
    return decoder_flops(cfg).matmul_params_per_token(cfg)


def training_flops_per_token(cfg: ModelConfig, seq_len: int) -> float:
    """6 FLOPs per weight per token plus attention scores and values (see
    :meth:`dsl_lit.models.common.flops.DecoderFlops.training_flops_per_token`)."""
    return decoder_flops(cfg).training_flops_per_token(cfg, seq_len)
