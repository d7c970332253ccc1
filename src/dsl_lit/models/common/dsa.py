"""DeepSeek Sparse Attention (DSA, DeepSeek-V3.2): MLA whose queries attend only to the keys a
lightning indexer selects.

The indexer is a small attention of its own (``index_n_heads`` heads of ``index_head_dim``, one key
head): its queries come from MLA's query latent (``q_norm(wq_a(x))``), its key from the hidden state
through ``wk`` and a LayerNorm, and a per-token, per-head weight (``weights_proj``) mixes the heads:

    I[t, s] = sum_h w[t, h] * ReLU(q[t, h] . k[s]) / sqrt(index_head_dim) / sqrt(index_n_heads)

Each query keeps the ``index_topk`` causal keys with the highest ``I`` and MLA attends to those
only. Rotary position: the first ``qk_rope_head_dim`` dims of the indexer's query and key, rotated
as halves (not interleaved pairs, unlike MLA's rotary part), as DeepSeek's and transformers' code do.
The indexer's keys are cached with MLA's latents for decoding.

How the sparse attention is computed here, and why: as MLA over all keys with a boolean mask that
keeps the selected ones (``causal_attention`` with ``key_mask``): exact, runs on every backend
(``eager`` is the reference; ``sdpa`` takes the mask on CPU and GPU), and gives the same numbers as
transformers' eager path. It costs dense attention's FLOPs: the saving DSA exists for (attention
O(L k) instead of O(L^2) at 128K tokens) needs a kernel that gathers the selected keys (FlashMLA's
sparse kernel on Hopper), which this CPU-built project does not ship. The selection itself
(the indexer's scores and top-k) runs without gradient: top-k is not differentiable, and the
language-model loss must not train the indexer; its own loss (DeepSeek-V3.2's KL to the main
attention) is computed from :meth:`SparseLatentAttention.indexer_scores`.
"""

from __future__ import annotations

import torch
from torch import nn

from dsl_lit.config.model import ModelConfig
from dsl_lit.config.model_parts.attention import SparseLatentAttentionShape
from dsl_lit.models.common.attention import attention_mask, causal_attention, query_positions
from dsl_lit.models.common.kv_cache import KVCache
from dsl_lit.models.common.layers import apply_rope
from dsl_lit.models.common.mla import MultiHeadLatentAttention
from dsl_lit.models.common.split_heads import HeadMean

INDEXER_NORM_EPS = 1e-6
"""The indexer's key LayerNorm eps in DeepSeek's and transformers' code."""


class LightningIndexer(nn.Module):
    """DSA's indexer: per-query scores over keys, from MLA's query latent and the hidden state.

    Names follow DeepSeek's code (and transformers' ``self_attn.indexer.*``): ``wq_b``, ``wk``,
    ``k_norm``, ``weights_proj``."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        if cfg.q_lora_rank is None:
            raise ValueError("the lightning indexer reads MLA's query latent: it needs q_lora_rank")
        self.n_heads = cfg.index_n_heads
        self.head_dim = cfg.index_head_dim
        self.rope_dim = cfg.qk_rope_head_dim
        self.wq_b = nn.Linear(cfg.q_lora_rank, cfg.index_n_heads * cfg.index_head_dim, bias=False)
        self.wk = nn.Linear(cfg.d_model, cfg.index_head_dim, bias=False)
        self.k_norm = nn.LayerNorm(cfg.index_head_dim, eps=INDEXER_NORM_EPS)
        self.weights_proj = nn.Linear(cfg.d_model, cfg.index_n_heads, bias=False)

    def keys(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """[batch, seq, 1, index_head_dim]: the one key head, its rotary part rotated."""
        k = self.k_norm(self.wk(x)).unsqueeze(2)
        return self._rotate(k, cos, sin)

    def _rotate(self, t: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        rot, rest = t.split([self.rope_dim, self.head_dim - self.rope_dim], dim=-1)
        return torch.cat([apply_rope(rot, cos, sin, interleaved=False), rest], dim=-1)

    def scores(self, x: torch.Tensor, q_latent: torch.Tensor, keys: torch.Tensor, cos: torch.Tensor,
               sin: torch.Tensor) -> torch.Tensor:
        """[batch, seq_q, seq_k] fp32 index scores of the queries of ``x`` against ``keys``
        [batch, seq_k, 1, index_head_dim] (no mask applied)."""
        batch, seq, _ = x.shape
        q = self._rotate(self.wq_b(q_latent).view(batch, seq, self.n_heads, self.head_dim), cos, sin)
        # the products in transformers' order (its top-k must pick the same keys from the same numbers)
        logits = torch.matmul(q.float(), keys.squeeze(2).float().transpose(-1, -2).unsqueeze(1)) * self.head_dim**-0.5
        weights = self.weights_proj(x.to(self.weights_proj.weight.dtype)).float() * self.n_heads**-0.5
        return torch.matmul(weights.unsqueeze(-2), logits.relu()).squeeze(-2)


class SparseLatentAttention(SparseLatentAttentionShape, HeadMean, MultiHeadLatentAttention):
    """MLA restricted to the keys the :class:`LightningIndexer` selects (DeepSeek-V3.2); its shape
    answers (FLOPs: the indexer plus top-k attention) are :class:`SparseLatentAttentionShape`'s.
    Under tensor parallelism the indexer is replicated (every rank selects the same keys and
    computes the same KL) and its target, the attention of all heads, sums the ranks' heads
    (:class:`~dsl_lit.models.common.split_heads.HeadMean`)."""

    def __init__(self, cfg: ModelConfig, layer_id: int = 0) -> None:
        super().__init__(cfg, layer_id)
        self.index_topk = cfg.index_topk
        self.index_training = cfg.index_training
        self.indexer = LightningIndexer(cfg)
        self.index_loss: torch.Tensor | None = None
        """The indexer's KL (mean over this forward's queries, with gradient for the indexer only),
        left by a training forward when ``index_training`` is on (:meth:`Transformer.index_loss`)."""
        self.index_recall: torch.Tensor | None = None
        """Share of the dense attention mass on the keys the indexer's top-k picks (detached)."""

    def forward(
        self,
        x: torch.Tensor,
        rope: tuple[torch.Tensor, torch.Tensor],
        cache: KVCache | None = None,
        key_valid: torch.Tensor | None = None,
    ) -> torch.Tensor:
        batch, seq, _ = x.shape
        cos, sin = rope
        q, k, v, q_latent, (index_keys,) = self.heads(x, rope, cache, (self.indexer.keys(x, cos, sin),))
        allowed = attention_mask(seq, k.shape[1], key_valid, x.device, query_positions(cache))[:, 0]
        selected = self.select(x, q_latent, index_keys, cos, sin, allowed)
        attended = allowed if self.index_training == "warmup" else selected  # the warm-up attends densely
        out = causal_attention(q, k, v, self.backend, scale=self.softmax_scale, key_mask=attended)
        self.index_loss = self.index_recall = None
        if self.training and self.index_training != "off":
            self.index_loss, self.index_recall = self._indexer_objective(x, q_latent, q, k, cos, sin, allowed, selected,
                                                                         attended, cache)
        return self.wo(out.reshape(batch, seq, -1))

    def _indexer_objective(self, x: torch.Tensor, q_latent: torch.Tensor, q: torch.Tensor, k: torch.Tensor,
                           cos: torch.Tensor, sin: torch.Tensor, allowed: torch.Tensor, selected: torch.Tensor,
                           attended: torch.Tensor, shard: KVCache | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """DeepSeek-V3.2's indexer loss, KL(p || softmax(I)) over the keys attended (every causal key in
        the warm-up, the selected ones in sparse training), ``p`` the main attention's distribution
        over them summed over heads and normalised; mean over queries. The indexer's inputs are
        detached, so this trains the indexer only and the language-model loss never reaches it.
        Also the top-k recall: the share of the dense attention mass on the selected keys."""
        with torch.no_grad():
            scores = torch.einsum("bshd,bthd->bsht", q.float(), k.float()) * self.softmax_scale
            dense = self.mean_over_heads(scores.masked_fill(~allowed[:, :, None], float("-inf")).softmax(-1), dim=2)
            recall = (dense * selected).sum(-1)  # [b, s] per query
            if attended is allowed:
                target = dense
            else:
                target = self.mean_over_heads(scores.masked_fill(~attended[:, :, None], float("-inf")).softmax(-1), dim=2)
        x, q_latent = x.detach(), q_latent.detach()
        keys = self.indexer.keys(x, cos, sin)
        if shard is not None:  # whole rows' keys (autograd reaches every rank's key projection)
            (keys,) = shard.update(self.layer_id, keys)
        index = self.indexer.scores(x, q_latent, keys, cos, sin)
        log_q = index.masked_fill(~attended, float("-inf")).log_softmax(-1)
        kl = torch.where(target > 0, target * (target.clamp_min(1e-30).log() - log_q), 0.0).sum(-1)
        if shard is not None:  # the means over whole rows' queries on every rank (gradient: the gather's
            kl, recall = shard.update(self.layer_id, kl, recall)  # backward sums each rank's share back)
            if self.drop_last:  # an MTP block's positions past the row's end, which one process never runs
                kl, recall = kl[:, : -self.drop_last], recall[:, : -self.drop_last]
        return kl.mean(), recall.mean()

    drop_last: int = 0
    """Under context parallelism, an MTP block of depth k runs every position of its rows, the last k
    shifted past the row's end: set to k (``apply_context_parallel``), they are left out of the
    indexer's KL and recall as one process, which runs the block over the first seq - k, leaves them."""

    @torch.no_grad()
    def select(self, x: torch.Tensor, q_latent: torch.Tensor, index_keys: torch.Tensor, cos: torch.Tensor,
               sin: torch.Tensor, allowed: torch.Tensor) -> torch.Tensor:
        """[batch, seq_q, seq_k] bool: the ``index_topk`` allowed keys of highest index score per query
        (all allowed keys when there are fewer). ``allowed`` [batch or 1, seq_q, seq_k] is the causal
        and padding mask; every row keeps at least one key (it always allows the query itself)."""
        scores = self.indexer.scores(x, q_latent, index_keys, cos, sin).masked_fill(~allowed, float("-inf"))
        top = scores.topk(min(self.index_topk, scores.shape[-1]), dim=-1).indices
        chosen = torch.zeros_like(scores, dtype=torch.bool).scatter_(-1, top, True)
        return chosen & allowed
