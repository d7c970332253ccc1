"""Causal self-attention with grouped-query heads and three interchangeable kernels.

``sdpa`` (PyTorch's fused kernel, the default), ``flash_attn`` (the flash-attn package on CUDA; on
anything else it logs one warning and runs ``sdpa``), and ``eager`` (the explicit softmax formula,
the reference the other two are tested against).
"""

from __future__ import annotations

import importlib.util
import logging
import math

import torch
import torch.nn.functional as F
from torch import nn

from dsl_lit.config.model import ModelConfig
from dsl_lit.config.model_parts.attention import GroupedQueryShape
from dsl_lit.models.common.kv_cache import KVCache
from dsl_lit.models.common.layers import apply_rope

log = logging.getLogger(__name__)
_warned: set[str] = set()


def _warn_once(message: str) -> None:
    if message not in _warned:
        _warned.add(message)
        log.warning(message)


def flash_attn_available(device: torch.device) -> bool:
    return device.type == "cuda" and importlib.util.find_spec("flash_attn") is not None


def attention_mask(
    seq_q: int,
    seq_k: int,
    key_valid: torch.Tensor | None,
    device: torch.device,
    query_positions: torch.Tensor | None = None,
) -> torch.Tensor:
    """Boolean mask [batch or 1, 1, seq_q, seq_k]: the keys are positions ``0 .. seq_k - 1``, the
    queries the last ``seq_q`` of them (or ``query_positions`` [seq_q], e.g. the two chunks a
    context-parallel rank holds); each query sees keys at or before its position that are valid (not
    padding), and always itself, so that a padding query never has an empty softmax row (which would
    put NaN into later layers).

    ``key_valid`` is [batch, seq_k] (padding), or [batch, seq_q, seq_k] per query (packed
    documents: True where query and key belong to the same document)."""
    if query_positions is None:
        query_positions = torch.arange(seq_k - seq_q, seq_k, device=device)
    key_positions = torch.arange(seq_k, device=device)
    causal = key_positions[None, :] <= query_positions[:, None]
    if key_valid is None:
        return causal[None, None]
    itself = key_positions[None, :] == query_positions[:, None]
    allowed = key_valid[:, None] if key_valid.dim() == 3 else key_valid[:, None, None, :]
    return (causal & allowed) | itself


def query_positions(cache: KVCache | None) -> torch.Tensor | None:
    """Where the queries sit among the keys ``cache.update`` returned: None means the last positions
    (decoding); a context-parallel key source knows its rank's chunks."""
    return getattr(cache, "query_positions", None)


def causal_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    backend: str,
    scale: float | None = None,
    key_valid: torch.Tensor | None = None,
    query_positions: torch.Tensor | None = None,
    key_mask: torch.Tensor | None = None,
) -> torch.Tensor:
    """Causal attention over [batch, seq, heads, head_dim] tensors; k/v may have fewer heads (GQA)
    and more positions than q (cached decoding: q holds the last positions; context parallelism:
    q holds the positions ``query_positions``). ``key_valid`` [batch, seq_k] marks real tokens in
    left-padded batches. ``key_mask`` [batch, seq_q, seq_k] bool, when given, is the whole mask
    (causality included, every row with a key: sparse attention's selection) and replaces the others.

    Returns [batch, seq_q, heads, v_head_dim].
    """
    seq_q, seq_k = q.shape[1], k.shape[1]
    plain_causal = key_valid is None and query_positions is None and seq_q == seq_k and key_mask is None
    if backend == "flash_attn":
        if flash_attn_available(q.device) and q.dtype in (torch.float16, torch.bfloat16) and plain_causal:
            from flash_attn import flash_attn_func

            v_dim = v.shape[-1]
            if v_dim != q.shape[-1]:  # flash-attn wants one head dim: pad v (MLA), slice the output
                v = F.pad(v, (0, q.shape[-1] - v_dim))
            return flash_attn_func(q, k, v, causal=True, softmax_scale=scale)[..., :v_dim]
        _warn_once(
            "attn_backend=flash_attn requested but flash-attn needs the `gpu` extra, a CUDA device, "
            f"fp16/bf16 inputs and no padding mask (got device={q.device.type}, dtype={q.dtype}, "
            f"masked={not plain_causal}); falling back to sdpa"
        )
        backend = "sdpa"
    q, k, v = (t.transpose(1, 2) for t in (q, k, v))
    if key_mask is not None:
        mask = key_mask[:, None]
    else:
        mask = None if plain_causal else attention_mask(seq_q, seq_k, key_valid, q.device, query_positions)
    if backend == "sdpa":
        v_dim = v.shape[-1]
        if v_dim != q.shape[-1]:
            # MLA's v is narrower than q/k; SDPA's fused kernels need one head dim, and padding v
            # with zeros (sliced off below) beats the unfused math path by ~1.6x on CPU.
            v = F.pad(v, (0, q.shape[-1] - v_dim))
        out = F.scaled_dot_product_attention(
            q, k, v, attn_mask=mask, is_causal=plain_causal, scale=scale, enable_gqa=True
        )[..., :v_dim]
    elif backend == "eager":
        out = eager_causal_attention(q, k, v, scale, mask)
    else:
        raise ValueError(f"unknown attention backend {backend!r}")
    return out.transpose(1, 2)


def eager_causal_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float | None = None, mask: torch.Tensor | None = None
) -> torch.Tensor:
    """Reference: softmax(q k^T * scale + mask) v in fp32, on [batch, heads, seq, dim]."""
    groups = q.shape[1] // k.shape[1]
    k = k.repeat_interleave(groups, dim=1)
    v = v.repeat_interleave(groups, dim=1)
    scale = scale if scale is not None else 1.0 / math.sqrt(q.shape[-1])
    scores = (q.float() @ k.float().transpose(-2, -1)) * scale
    if mask is None:
        mask = attention_mask(q.shape[-2], k.shape[-2], None, q.device)
    scores = scores.masked_fill(~mask, float("-inf"))
    return (scores.softmax(dim=-1) @ v.float()).to(q.dtype)


class GroupedQueryAttention(GroupedQueryShape, nn.Module):
    """Multi-head attention with ``n_kv_heads`` shared key/value heads and RoPE on q and k; its shape
    answers are :class:`GroupedQueryShape`'s."""

    def __init__(self, cfg: ModelConfig, layer_id: int = 0) -> None:
        super().__init__()
        self.layer_id = layer_id
        self.n_heads = cfg.n_heads
        self.n_kv_heads = cfg.n_kv_heads
        self.head_dim = cfg.head_dim
        self.backend = cfg.attn_backend
        self.wq = nn.Linear(cfg.d_model, cfg.n_heads * self.head_dim, bias=False)
        self.wk = nn.Linear(cfg.d_model, cfg.n_kv_heads * self.head_dim, bias=False)
        self.wv = nn.Linear(cfg.d_model, cfg.n_kv_heads * self.head_dim, bias=False)
        self.wo = nn.Linear(cfg.n_heads * self.head_dim, cfg.d_model, bias=False)

    def forward(
        self,
        x: torch.Tensor,
        rope: tuple[torch.Tensor, torch.Tensor],
        cache: KVCache | None = None,
        key_valid: torch.Tensor | None = None,
    ) -> torch.Tensor:
        batch, seq, _ = x.shape
        # -1 for the head count lets a tensor-parallel plan shard heads without touching this code.
        q = self.wq(x).view(batch, seq, -1, self.head_dim)
        k = self.wk(x).view(batch, seq, -1, self.head_dim)
        v = self.wv(x).view(batch, seq, -1, self.head_dim)
        cos, sin = rope
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        if cache is not None:
            k, v = cache.update(self.layer_id, k, v)
        out = causal_attention(q, k, v, self.backend, key_valid=key_valid, query_positions=query_positions(cache))
        return self.wo(out.reshape(batch, seq, -1))
