"""One pre-norm decoder block: h = x + attn(norm(x)); out = h + ffn(norm(h)).

The family picks the parts: grouped-query attention or Multi-head Latent Attention, a dense
SwiGLU or DeepSeekMoE. Attribute names are the same for both, so plans and checkpoints address
``layers.<i>.attention`` and ``layers.<i>.feed_forward`` whatever is inside.
"""

from __future__ import annotations

import torch
from torch import nn

from dsl_lit.config.model import ModelConfig
from dsl_lit.models.attention import GroupedQueryAttention
from dsl_lit.models.kv_cache import KVCache
from dsl_lit.models.layers import RMSNorm, SwiGLU
from dsl_lit.models.mla import MultiHeadLatentAttention
from dsl_lit.models.moe import MoE


class TransformerBlock(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_id: int) -> None:
        super().__init__()
        self.layer_id = layer_id
        self.attention_norm = RMSNorm(cfg.d_model, cfg.norm_eps)
        attention = MultiHeadLatentAttention if cfg.family == "deepseek_v3" else GroupedQueryAttention
        self.attention = attention(cfg, layer_id)
        self.ffn_norm = RMSNorm(cfg.d_model, cfg.norm_eps)
        self.feed_forward: nn.Module = MoE(cfg) if cfg.is_moe_layer(layer_id) else SwiGLU(cfg.d_model, cfg.ffn_hidden)

    def forward(
        self,
        x: torch.Tensor,
        rope: tuple[torch.Tensor, torch.Tensor],
        cache: KVCache | None = None,
        key_valid: torch.Tensor | None = None,
    ) -> torch.Tensor:
        h = x + self.attention(self.attention_norm(x), rope, cache, key_valid)
        return h + self.feed_forward(self.ffn_norm(h))
