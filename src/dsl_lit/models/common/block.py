"""One pre-norm decoder block: h = x + attn(norm(x)); out = h + ffn(norm(h)).

The family's :class:`Composition` picks the parts: grouped-query attention or Multi-head Latent
Attention, and whether blocks from ``n_dense_layers`` on are DeepSeekMoE (with which router) or
every block keeps a dense SwiGLU. Attribute names are the same whatever is inside, so plans and
checkpoints address ``layers.<i>.attention`` and ``layers.<i>.feed_forward`` in every family.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch
from torch import nn

from dsl_lit.config.model import ModelConfig
from dsl_lit.config.model_parts.attention import AttentionShape
from dsl_lit.models.common.kv_cache import KVCache
from dsl_lit.models.common.layers import RMSNorm, SwiGLU
from dsl_lit.models.common.moe import MoE, TopKRouter


class AttentionKind(AttentionShape, Protocol):
    """An attention module class: it answers the shape questions (its part, ``dsl_lit/config/model_parts/``) and builds
    the module."""

    def __call__(self, cfg: ModelConfig, layer_id: int = 0) -> nn.Module:
        """Build the module."""


@dataclass(frozen=True)
class Composition:
    """Which modules a family's decoder is built from (the rest of the decoder is shared)."""

    attention: AttentionKind
    router: type[TopKRouter] | None = None
    """The MoE router of blocks from ``n_dense_layers`` on; None: a dense family (every block a
    SwiGLU, the MoE fields of the config ignored)."""


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
