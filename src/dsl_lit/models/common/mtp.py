"""Multi-token prediction (DeepSeek-V3 section 2.2).

Module k (k = 1..D) predicts the token k+1 positions ahead. At position i it combines the
previous depth's hidden state h_i^{k-1} with the embedding of token t_{i+k}:
``h' = eh_proj([enorm(emb(t_{i+k})); hnorm(h_i^{k-1})])``, runs one transformer block, and the
*shared* output head reads ``norm(h)``. The sequence shortens by one per depth. The embedding and
head are the main model's; the modules are only used for the training loss (or speculative
decoding), so the main model runs without them.
"""

from __future__ import annotations

import torch
from torch import nn

from dsl_lit.config.model import ModelConfig
from dsl_lit.models.common.block import Composition, TransformerBlock
from dsl_lit.models.common.kv_cache import KVCache
from dsl_lit.models.common.layers import RMSNorm


class MTPModule(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_id: int, composition: Composition) -> None:
        super().__init__()
        self.enorm = RMSNorm(cfg.d_model, cfg.norm_eps)
        self.hnorm = RMSNorm(cfg.d_model, cfg.norm_eps)
        self.eh_proj = nn.Linear(2 * cfg.d_model, cfg.d_model, bias=False)
        self.block = TransformerBlock(cfg, layer_id, composition)
        self.norm = RMSNorm(cfg.d_model, cfg.norm_eps)

    def forward(
        self, hidden: torch.Tensor, next_embeddings: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor],
        keys: KVCache | None = None, key_valid: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """``hidden`` h^{k-1}[:, :T-k] and ``next_embeddings`` emb(t[:, k:]) -> h^k (un-normed).
        ``keys``: where attention takes its keys from (context parallelism's whole rows, or a
        drafting KV cache); ``key_valid`` [batch, keys]: the real tokens of a left-padded batch."""
        h = self.eh_proj(torch.cat([self.enorm(next_embeddings), self.hnorm(hidden)], dim=-1))
        return self.block(h, rope, keys, key_valid)

    def head_input(self, hidden: torch.Tensor) -> torch.Tensor:
        """What the shared head reads of h^k: ``norm(h)``."""
        return self.norm(hidden)
