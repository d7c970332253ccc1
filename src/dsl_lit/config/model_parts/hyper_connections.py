"""DeepSeek-V4's manifold-constrained hyper-connections (mHC): ``hc_mult`` residual streams mixed by
a matrix Sinkhorn-projected onto the doubly-stochastic ones."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, ClassVar

from data_contract.errors import ConfigError
from dsl_lit.config.model_parts.part import require_ints

if TYPE_CHECKING:
    from dsl_lit.config.model import ModelConfig


@dataclass(frozen=True)
class HyperConnections:
    FIELDS: ClassVar[tuple[str, ...]] = ("hc_mult", "hc_sinkhorn_iters", "hc_eps")
    DESCRIPTION: ClassVar[str] = "DeepSeek-V4's hyper-connections (mHC)"

    def validate(self, cfg: ModelConfig, prefix: str) -> None:
        require_ints(cfg, prefix, ("hc_mult", "hc_sinkhorn_iters"))
        if cfg.hc_eps <= 0:
            raise ConfigError(f"{prefix}.hc_eps must be > 0")
