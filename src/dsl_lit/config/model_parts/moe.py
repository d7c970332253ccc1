"""The routed-experts parts: DeepSeekMoE (DeepSeek-V2/V3: dense first blocks, node-limited
routing) and DeepSeek-V4's (every block MoE, the first ones hash-routed, a clamped SwiGLU).

Each names its fields, checks them and says which layers route; the family passes in its rules
(the score functions its checkpoints know).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, ClassVar

from data_contract.errors import ConfigError
from dsl_lit.config.model_parts.part import require_ints

if TYPE_CHECKING:
    from dsl_lit.config.model import ModelConfig

SCORE_FUNCS = ("sigmoid", "softmax", "sqrtsoftplus")
EXPERT_BACKENDS = ("grouped_mm", "split", "loop")
MOE_FIELDS = ("n_dense_layers", "n_routed_experts", "n_shared_experts", "n_activated_experts", "moe_ffn_hidden",
              "n_expert_groups", "n_limited_groups", "score_func", "route_scale", "norm_topk_prob",
              "seq_balance_alpha", "batch_balance_alpha", "expert_backend")
"""DeepSeekMoE's fields."""


def _check_scores(cfg: ModelConfig, prefix: str, score_funcs: tuple[str, ...]) -> None:
    if cfg.score_func not in SCORE_FUNCS:
        raise ConfigError(f"{prefix}.score_func={cfg.score_func!r} is unknown; choose one of {SCORE_FUNCS}")
    if cfg.score_func not in score_funcs:
        v4 = " (sqrtsoftplus is DeepSeek-V4's routing: model=deepseek_v4_tiny)" if cfg.score_func == "sqrtsoftplus" else ""
        raise ConfigError(f"{prefix}.score_func={cfg.score_func!r}: the {cfg.family} family routes with "
                          f"{' or '.join(score_funcs)} scores{v4}")
    if cfg.expert_backend not in EXPERT_BACKENDS:
        raise ConfigError(f"{prefix}.expert_backend={cfg.expert_backend!r} is unknown; choose one of {EXPERT_BACKENDS}")


class RoutedExperts:
    """What every routed-experts part answers: which blocks route."""

    @staticmethod
    def routes(cfg: ModelConfig, layer_id: int) -> bool:
        """Whether block ``layer_id`` is MoE: at or after ``n_dense_layers`` (MTP blocks too, as in
        DeepSeek-V3; V4 has none dense), when there are routed experts."""
        return cfg.n_routed_experts > 0 and layer_id >= cfg.n_dense_layers


@dataclass(frozen=True)
class DeepSeekMoE(RoutedExperts):
    """Blocks from ``n_dense_layers`` on route each token to ``n_activated_experts`` of
    ``n_routed_experts`` (in ``n_limited_groups`` of ``n_expert_groups``), plus shared experts."""

    score_funcs: tuple[str, ...] = ("sigmoid", "softmax")
    """The score functions the family's checkpoints route with."""

    FIELDS: ClassVar[tuple[str, ...]] = MOE_FIELDS
    DESCRIPTION: ClassVar[str] = "routed experts (DeepSeekMoE)"

    def validate(self, cfg: ModelConfig, prefix: str) -> None:
        require_ints(cfg, prefix, (["ffn_hidden"] if cfg.n_dense_layers > 0 else []) + (
            ["n_activated_experts", "moe_ffn_hidden", "n_expert_groups", "n_limited_groups"] if cfg.n_routed_experts
            else []))
        require_ints(cfg, prefix, ("n_dense_layers", "n_routed_experts", "n_shared_experts"), minimum=0)
        if cfg.n_dense_layers > cfg.n_layers:
            raise ConfigError(f"{prefix}.n_dense_layers={cfg.n_dense_layers} exceeds n_layers={cfg.n_layers}")
        if cfg.n_routed_experts == 0 and cfg.n_dense_layers < cfg.n_layers:
            raise ConfigError(
                f"{prefix}.n_routed_experts=0 but layers {cfg.n_dense_layers}.. are MoE; set "
                f"{prefix}.n_dense_layers={cfg.n_layers} for a dense model or add routed experts"
            )
        if cfg.n_routed_experts:
            self._validate_routing(cfg, prefix)
        if cfg.seq_balance_alpha < 0 or cfg.batch_balance_alpha < 0 or cfg.route_scale <= 0:
            raise ConfigError(f"{prefix}: balance alphas must be >= 0 and route_scale > 0")

    def _validate_routing(self, cfg: ModelConfig, prefix: str) -> None:
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
        _check_scores(cfg, prefix, self.score_funcs)


@dataclass(frozen=True)
class HashRoutedMoE(RoutedExperts):
    """DeepSeek-V4's experts: every block MoE (no dense first blocks, no expert groups), the first
    ``n_hash_layers`` routed by a fixed token-id table, the SwiGLU clamped at ``swiglu_limit``."""

    score_funcs: tuple[str, ...] = SCORE_FUNCS

    FIELDS: ClassVar[tuple[str, ...]] = (
        *(f for f in MOE_FIELDS if f not in ("n_dense_layers", "n_expert_groups", "n_limited_groups")),
        "n_hash_layers", "swiglu_limit")
    DESCRIPTION: ClassVar[str] = "DeepSeek-V4's hash-routed experts"

    def validate(self, cfg: ModelConfig, prefix: str) -> None:
        require_ints(cfg, prefix, ("n_routed_experts", "n_activated_experts", "moe_ffn_hidden"))
        if cfg.n_activated_experts > cfg.n_routed_experts:
            raise ConfigError(f"{prefix}.n_activated_experts={cfg.n_activated_experts} exceeds "
                              f"n_routed_experts={cfg.n_routed_experts}")
        if not 0 <= cfg.n_hash_layers <= cfg.n_layers:
            raise ConfigError(f"{prefix}.n_hash_layers={cfg.n_hash_layers} must be between 0 and n_layers={cfg.n_layers}")
        if cfg.n_dense_layers:
            raise ConfigError(f"{prefix}.n_dense_layers={cfg.n_dense_layers}: every DeepSeek-V4 block is MoE; drop it")
        _check_scores(cfg, prefix, self.score_funcs)
        if cfg.swiglu_limit < 0:
            raise ConfigError(f"{prefix}.swiglu_limit must be >= 0 (0: no clamp)")
