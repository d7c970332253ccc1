"""Analytical training FLOPs, the denominator-free half of MFU.

Counting from the config, not with a FLOP counter, because meta-device counters miscount routed
experts and fused kernels (DESIGN.md section 5).
"""

from __future__ import annotations

from dsl_lit.config.model import ModelConfig


def non_embedding_flops_per_token(n_layers: int, d_model: int, seq_len: int) -> float:
    """DeepSeek LLM's model scale M = 72 n_layer d^2 + 12 n_layer d l_seq (fwd + bwd, no vocab head)."""
    return 72 * n_layers * d_model**2 + 12 * n_layers * d_model * seq_len


def attention_params(cfg: ModelConfig) -> int:
    """Projection weights of one attention block (GQA, or MLA with its low-rank paths)."""
    if cfg.family != "deepseek_v3":
        return cfg.d_model * cfg.head_dim * (2 * cfg.n_heads + 2 * cfg.n_kv_heads)
    h = cfg.n_heads
    if cfg.q_lora_rank is None:
        q = cfg.d_model * h * cfg.qk_head_dim
    else:
        q = cfg.d_model * cfg.q_lora_rank + cfg.q_lora_rank * h * cfg.qk_head_dim
    kv = cfg.d_model * (cfg.kv_lora_rank + cfg.qk_rope_head_dim) + cfg.kv_lora_rank * h * (
        cfg.qk_nope_head_dim + cfg.v_head_dim
    )
    return q + kv + h * cfg.v_head_dim * cfg.d_model


def ffn_params_per_token(cfg: ModelConfig, layer_id: int) -> int:
    """FFN weights one token goes through: the dense SwiGLU, or router + shared + top-k experts."""
    if not cfg.is_moe_layer(layer_id):
        return 3 * cfg.d_model * cfg.ffn_hidden
    experts = cfg.n_activated_experts + cfg.n_shared_experts
    return cfg.d_model * cfg.n_routed_experts + 3 * cfg.d_model * cfg.moe_ffn_hidden * experts


def matmul_params_per_token(cfg: ModelConfig) -> int:
    """Weights each token multiplies through: attention and FFN projections (activated experts
    only), the MTP modules' projection and blocks, and the output head once per prediction."""
    blocks = [*range(cfg.n_layers)]
    mtp = cfg.mtp_depth if cfg.family == "deepseek_v3" else 0
    blocks += [cfg.n_layers + k for k in range(mtp)]
    per_block = sum(attention_params(cfg) + ffn_params_per_token(cfg, i) for i in blocks)
    return per_block + mtp * 2 * cfg.d_model**2 + (1 + mtp) * cfg.d_model * cfg.vocab_size


def training_flops_per_token(cfg: ModelConfig, seq_len: int) -> float:
    """6 FLOPs per weight per token (forward 2, backward 4) plus attention scores and values
    (6 n_blocks n_heads (qk_dim + v_dim) seq_len, without halving for causality, as PaLM and
    DeepSeek count; for GQA qk_dim = v_dim = head_dim, i.e. 12 n_layer n_heads head_dim seq_len)."""
    if cfg.family == "deepseek_v3":
        blocks, qk, v = cfg.n_layers + cfg.mtp_depth, cfg.qk_head_dim, cfg.v_head_dim
    else:
        blocks, qk, v = cfg.n_layers, cfg.head_dim, cfg.head_dim
    attention_scores = 6 * blocks * cfg.n_heads * (qk + v) * seq_len
    return 6 * matmul_params_per_token(cfg) + attention_scores
