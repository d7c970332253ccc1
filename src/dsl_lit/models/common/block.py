"""One pre-norm decoder block: h = x + attn(norm(x)); out = h + ffn(norm(h)).

The family's :class:`Composition` picks the parts: grouped-query attention or Multi-head Latent
Attention, and whether blocks from ``n_dense_layers`` on are DeepSeekMoE (with which router) or
every block keeps a dense SwiGLU. Attribute names are the same whatever is inside, so plans and
checkpoints address ``layers.<i>.attention`` and ``layers.<i>.feed_forward`` in every family.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar, Protocol

import torch
from torch import nn

from dsl_lit.config.model import ModelConfig
from dsl_lit.models.common.kv_cache import KVCache
from dsl_lit.models.common.layers import RMSNorm, SwiGLU
from dsl_lit.models.common.moe import MoE, TopKRouter


class AttentionShape(Protocol):
    """What the rest of the code asks an attention kind about its shapes, instead of branching on
    which kind it is (FLOPs, pipeline stage costs, the cluster planner's memory and time). Both
    :class:`GroupedQueryAttention` and :class:`MultiHeadLatentAttention` answer, as static methods of
    the module class; a new attention kind answers them too."""

    latent: ClassVar[bool]

    def __call__(self, cfg: ModelConfig, layer_id: int = 0) -> nn.Module:
        """Build the module."""

    @staticmethod
    def matmul_params(cfg: ModelConfig) -> int:
        """Weights of its projections."""

    @staticmethod
    def score_dims(cfg: ModelConfig) -> tuple[int, int]:
        """Per-head widths of q/k and of v."""

    @staticmethod
    def norm_params(cfg: ModelConfig) -> int:
        """Norm weights inside it."""

    @staticmethod
    def up_projection_params(cfg: ModelConfig) -> float:
        """Weights DeepSeek-V3's recompute recipe recomputes in backward."""

    @staticmethod
    def activation_elements(cfg: ModelConfig, mode: str, h: float, d: float, tp: int) -> float:
        """Elements per token kept for backward (``mode``: selective | none)."""

    @staticmethod
    def recipe_kept_elements(cfg: ModelConfig, h: float, tp: int) -> tuple[float, float]:
        """(kept, output) elements per token under DeepSeek-V3's recompute recipe."""

    @staticmethod
    def fp8_cast_elements(cfg: ModelConfig, h: float, d: float, tp: int) -> tuple[float, float]:
        """(linear inputs cast to FP8, linear outputs whose gradient is cast) per token."""


@dataclass(frozen=True)
class Composition:
    """Which modules a family's decoder is built from (the rest of the decoder is shared)."""

    attention: AttentionShape
    router: type[TopKRouter] | None = None
    """The MoE router of blocks from ``n_dense_layers`` on; None: a dense family (every block a
    SwiGLU, the MoE fields of the config ignored)."""
    mtp: bool = False
    """Whether the family builds ``mtp_depth`` multi-token-prediction modules (else it ignores the field)."""


class TransformerBlock(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_id: int, composition: Composition) -> None:
        super().__init__()
        self.layer_id = layer_id
        self.attention_norm = RMSNorm(cfg.d_model, cfg.norm_eps)
        self.attention = composition.attention(cfg, layer_id)
        self.ffn_norm = RMSNorm(cfg.d_model, cfg.norm_eps)
        moe = composition.router is not None and cfg.is_moe_layer(layer_id)
        self.feed_forward: nn.Module = MoE(cfg, composition.router) if moe else SwiGLU(cfg.d_model, cfg.ffn_hidden)

    def forward(
        self,
        x: torch.Tensor,
        rope: tuple[torch.Tensor, torch.Tensor],
        cache: KVCache | None = None,
        key_valid: torch.Tensor | None = None,
    ) -> torch.Tensor:
        h = x + self.attention(self.attention_norm(x), rope, cache, key_valid)
        return h + self.feed_forward(self.ffn_norm(h))
