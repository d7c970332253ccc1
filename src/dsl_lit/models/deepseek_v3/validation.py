"""The fields the DeepSeek-V3 family (and DeepSeek-V2, which shares its blocks) uses beyond the
shared ones: MLA's dimensions, DeepSeekMoE's experts and node-limited routing, MTP depth."""

from __future__ import annotations

from data_contract.errors import ConfigError
from dsl_lit.config.model import EXPERT_BACKENDS, SCORE_FUNCS, ModelConfig


def validate(cfg: ModelConfig, prefix: str) -> None:
    """ConfigError naming ``<prefix>.<field>`` for values MLA + DeepSeekMoE cannot be built with."""
    positive = ["kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim"]
    if cfg.q_lora_rank is not None:
        positive.append("q_lora_rank")
    if cfg.n_dense_layers > 0:
        positive.append("ffn_hidden")
    if cfg.n_routed_experts:
        positive += ["n_activated_experts", "moe_ffn_hidden", "n_expert_groups", "n_limited_groups"]
    for name in positive:
        value = getattr(cfg, name)
        if not isinstance(value, int) or value <= 0:
            raise ConfigError(f"{prefix}.{name}={value!r} must be a positive integer")
    for name in ("n_dense_layers", "n_routed_experts", "n_shared_experts", "mtp_depth"):
        value = getattr(cfg, name)
        if not isinstance(value, int) or value < 0:
            raise ConfigError(f"{prefix}.{name}={value!r} must be a non-negative integer")
    if cfg.qk_rope_head_dim % 2:
        raise ConfigError(f"{prefix}.qk_rope_head_dim={cfg.qk_rope_head_dim} must be even for rotary embeddings")
    if cfg.n_dense_layers > cfg.n_layers:
        raise ConfigError(f"{prefix}.n_dense_layers={cfg.n_dense_layers} exceeds n_layers={cfg.n_layers}")
    if cfg.n_routed_experts == 0 and cfg.n_dense_layers < cfg.n_layers:
        raise ConfigError(
            f"{prefix}.n_routed_experts=0 but layers {cfg.n_dense_layers}.. are MoE; set "
            f"{prefix}.n_dense_layers={cfg.n_layers} for a dense model or add routed experts"
        )
    if cfg.n_routed_experts:
        _validate_routing(cfg, prefix)
    if cfg.seq_balance_alpha < 0 or cfg.batch_balance_alpha < 0 or cfg.route_scale <= 0:
        raise ConfigError(f"{prefix}: balance alphas must be >= 0 and route_scale > 0")


V3_SCORE_FUNCS = ("sigmoid", "softmax")
"""What DeepSeek-V2/V3 checkpoints route with (their Hugging Face layouts know no other)."""


def _validate_routing(cfg: ModelConfig, prefix: str) -> None:
    e, k, g, kg = cfg.n_routed_experts, cfg.n_activated_experts, cfg.n_expert_groups, cfg.n_limited_groups
    if e % g:
        raise ConfigError(f"{prefix}.n_expert_groups={g} does not divide n_routed_experts={e}")
    if kg > g:
        raise ConfigError(f"{prefix}.n_limited_groups={kg} exceeds n_expert_groups={g}")
    if k > kg * (e // g):
        raise ConfigError(
            f"{prefix}.n_activated_experts={k} exceeds the {kg * (e // g)} experts in the "
            f"n_limited_groups={kg} groups a token may use; raise n_limited_groups"
        )
    if cfg.score_func not in SCORE_FUNCS:
        raise ConfigError(f"{prefix}.score_func={cfg.score_func!r} is unknown; choose one of {SCORE_FUNCS}")
    if cfg.score_func not in V3_SCORE_FUNCS:
        raise ConfigError(f"{prefix}.score_func={cfg.score_func!r} is DeepSeek-V4's routing (model=deepseek_v4_tiny); "
                          f"the {cfg.family} family routes with one of {V3_SCORE_FUNCS}")
    if cfg.expert_backend not in EXPERT_BACKENDS:
        raise ConfigError(
            f"{prefix}.expert_backend={cfg.expert_backend!r} is unknown; choose one of {EXPERT_BACKENDS}"
        )
