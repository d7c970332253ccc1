"""Analytical training FLOPs, the denominator-free half of MFU.

Counting from the config, not with a FLOP counter, because meta-device counters miscount routed
experts and fused kernels (DESIGN.md section 5).
"""

from __future__ import annotations

from dsl_lit.models.config import ModelConfig


def non_embedding_flops_per_token(n_layers: int, d_model: int, seq_len: int) -> float:
    """DeepSeek LLM's model scale M = 72 n_layer d^2 + 12 n_layer d l_seq (fwd + bwd, no vocab head)."""
    return 72 * n_layers * d_model**2 + 12 * n_layers * d_model * seq_len


def matmul_params_per_token(cfg: ModelConfig) -> int:
    """Weights each token multiplies through: attention and FFN projections plus the output head."""
    head_dim = cfg.head_dim
    attention = cfg.d_model * head_dim * (2 * cfg.n_heads + 2 * cfg.n_kv_heads)
    ffn = 3 * cfg.d_model * cfg.ffn_hidden
    return cfg.n_layers * (attention + ffn) + cfg.d_model * cfg.vocab_size


def training_flops_per_token(cfg: ModelConfig, seq_len: int) -> float:
    """6 FLOPs per weight per token (forward 2, backward 4) plus attention scores and values
    (12 n_layer n_heads head_dim seq_len, without halving for causality, as PaLM and DeepSeek count)."""
    attention_scores = 12 * cfg.n_layers * cfg.n_heads * cfg.head_dim * seq_len
    return 6 * matmul_params_per_token(cfg) + attention_scores
