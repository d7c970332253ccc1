"""Multi-head Latent Attention (DeepSeek-V2/V3).

Keys and values are compressed into one latent vector per token (``kv_lora_rank`` numbers, RMS
normed) and expanded per head by ``wkv_b``; positional information rides on a separate small
rotary key (``qk_rope_head_dim``) shared by all heads, because RoPE would not commute with the
expansion. Queries optionally go through their own low-rank bottleneck (``q_lora_rank``; V2-Lite
has none). A KV cache therefore stores only the latent and the rotary key per token.

Names follow DeepSeek's reference code: wq / wq_a, q_norm, wq_b, wkv_a, kv_norm, wkv_b, wo.
"""


from __future__ import annotations

import torch
from torch import nn

from dsl_lit.config.model import ModelConfig
from dsl_lit.config.model_parts.attention import LatentAttentionShape
from dsl_lit.models.common.attention import causal_attention, query_positions
from dsl_lit.models.common.kv_cache import KVCache
from dsl_lit.models.common.layers import RMSNorm, apply_rope, yarn_softmax_scale

LATENT_NORM_EPS = 1e-6
"""DeepSeek's reference code (and transformers) norm the latents with eps 1e-6 whatever
``rms_norm_eps`` says; matching it keeps checkpoints exact."""


class MultiHeadLatentAttention(LatentAttentionShape, nn.Module):
    """MLA: ``forward(x, rope, cache, key_valid)`` as grouped-query attention's, latents cached; its
    shape answers are :class:`LatentAttentionShape`'s."""

    def __init__(self, cfg: ModelConfig, layer_id: int = 0) -> None:
        super().__init__()
        self.layer_id = layer_id
        self.n_heads = cfg.n_heads
        self.kv_lora_rank = cfg.kv_lora_rank
        self.qk_nope_head_dim = cfg.qk_nope_head_dim
        self.qk_rope_head_dim = cfg.qk_rope_head_dim
        self.qk_head_dim = cfg.qk_head_dim
        self.v_head_dim = cfg.v_head_dim
        self.interleaved = cfg.rope_interleave
        self.backend = cfg.attn_backend
        self.softmax_scale = self.qk_head_dim**-0.5 * yarn_softmax_scale(cfg.rope_scaling)
        q_out = cfg.n_heads * cfg.qk_head_dim
        if cfg.q_lora_rank is None:
            self.wq: nn.Linear | None = nn.Linear(cfg.d_model, q_out, bias=False)
            self.wq_a = self.q_norm = self.wq_b = None
        else:
            self.wq = None
            self.wq_a = nn.Linear(cfg.d_model, cfg.q_lora_rank, bias=False)
            self.q_norm = RMSNorm(cfg.q_lora_rank, LATENT_NORM_EPS)
            self.wq_b = nn.Linear(cfg.q_lora_rank, q_out, bias=False)
        self.wkv_a = nn.Linear(cfg.d_model, cfg.kv_lora_rank + cfg.qk_rope_head_dim, bias=False)
        self.kv_norm = RMSNorm(cfg.kv_lora_rank, LATENT_NORM_EPS)
        self.wkv_b = nn.Linear(cfg.kv_lora_rank, cfg.n_heads * (cfg.qk_nope_head_dim + cfg.v_head_dim), bias=False)
        self.wo = nn.Linear(cfg.n_heads * cfg.v_head_dim, cfg.d_model, bias=False)

    def forward(
        self,
        x: torch.Tensor,
        rope: tuple[torch.Tensor, torch.Tensor],
        cache: KVCache | None = None,
        key_valid: torch.Tensor | None = None,
    ) -> torch.Tensor:
        q, k, v, _, _ = self.heads(x, rope, cache)
        out = causal_attention(q, k, v, self.backend, scale=self.softmax_scale, key_valid=key_valid,
                               query_positions=query_positions(cache))
        return self.wo(out.reshape(*x.shape[:2], -1))

    def heads(
        self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor], cache: KVCache | None,
        cached_with: tuple[torch.Tensor, ...] = (),
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None, tuple[torch.Tensor, ...]]:
        """(q, k, v [batch, seq, heads, dim], the query latent or None, ``cached_with`` as cached):
        the queries, and the keys and values expanded from the latents (this call's, after the
        cached ones when decoding). ``cached_with``: more per-token tensors the cache keeps beside
        the latents (a sparse attention's indexer keys)."""
        batch, seq, _ = x.shape
        cos, sin = rope
        q_latent = self.q_norm(self.wq_a(x)) if self.wq is None else None
        q = self.wq(x) if self.wq is not None else self.wq_b(q_latent)
        q_nope, q_rope = q.view(batch, seq, -1, self.qk_head_dim).split([self.qk_nope_head_dim, self.qk_rope_head_dim], dim=-1)
        q_rope = apply_rope(q_rope, cos, sin, self.interleaved)

        latent, k_rope = self.wkv_a(x).split([self.kv_lora_rank, self.qk_rope_head_dim], dim=-1)
        latent = self.kv_norm(latent)
        k_rope = apply_rope(k_rope.unsqueeze(2), cos, sin, self.interleaved)  # one head, shared
        if cache is not None:
            latent, k_rope, *cached = cache.update(self.layer_id, latent, k_rope, *cached_with)
            cached_with = tuple(cached)

        kv = self.wkv_b(latent).view(batch, latent.shape[1], -1, self.qk_nope_head_dim + self.v_head_dim)
        k_nope, v = kv.split([self.qk_nope_head_dim, self.v_head_dim], dim=-1)
        k = torch.cat([k_nope, k_rope.expand(-1, -1, k_nope.shape[2], -1)], dim=-1)
        return torch.cat([q_nope, q_rope], dim=-1), k, v, q_latent, cached_with
