"""DeepSeek-V4's attention, in plain PyTorch: a sliding window over the recent tokens plus, in
compressed layers, keys compressed from whole windows of the past (DeepSeek-V4, sec. 2.3).

Three layer kinds share one module:

- ``sliding``: each query attends to the last ``sliding_window`` tokens only;
- ``csa`` (compressed sparse attention): every ``rate`` (4) tokens are compressed into one key from
  overlapping windows of ``2 * rate`` tokens; a lightning indexer scores the compressed keys per
  query and the query attends to its top ``index_topk`` of them besides its window;
- ``hca`` (heavily compressed attention): every ``rate`` (128) tokens compressed into one key, from
  non-overlapping windows; every query sees all compressed keys of windows it has passed.

Common to all: one key/value head shared by every query head and read as both key and value
(shared-KV MQA); RoPE on the trailing ``rope_dim`` channels of each head, pairs rotated in place,
and undone on the output (the value carries the rotation, so the output's rotation is taken back
at the query's position, which keeps what a key contributes a function of relative distance); a
learned per-head attention sink (a logit that takes softmax mass and contributes nothing); and a
grouped low-rank output projection (heads in ``o_groups`` groups, each projected to ``o_lora_rank``,
then mixed to ``d_model``).

The full-sequence forward (training) is here; the parity reference is transformers 5.24's
``DeepseekV4Attention`` with ``cache=None`` (``tests/unit/models/test_deepseek_v4_attention.py``).
Parameter names are DeepSeek's release names (``wq_a``, ``wkv``, ``wo_a``, ``attn_sink``,
``compressor.wkv``, ``indexer.wq_b``, ...).
"""

from __future__ import annotations

from typing import Literal

import torch
import torch.nn.functional as F
from torch import nn

from dsl_lit.config.model import ModelConfig
from dsl_lit.config.model_parts.v4_attention import V4AttentionShape
from dsl_lit.models.common.kv_cache import KVCache
from dsl_lit.models.common.layers import rope_frequencies
from dsl_lit.models.common.split_heads import HeadMean, local_part
from dsl_lit.models.deepseek_v4.windows import Windows, passed

LayerKind = Literal["sliding", "csa", "hca"]


class Fp32RMSNorm(nn.Module):
    """RMSNorm whose weight stays fp32 and multiplies in fp32 before one cast (V4's norms)."""

    def __init__(self, dim: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim, dtype=torch.float32))

    def reset_parameters(self) -> None:
        nn.init.ones_(self.weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return (self.weight * h).to(x.dtype)


def rms_normalised(x: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm without a weight, statistics in fp32 (V4's per-head query norm)."""
    return x * torch.rsqrt(x.float().square().mean(-1, keepdim=True) + eps).to(x.dtype)


class PairRotary(nn.Module):
    """RoPE angles for positions given at each call: ``(cos, sin)`` of shape ``[..., rope_dim / 2]``,
    one per rotated pair, in the activations' dtype."""

    def __init__(self, rope_dim: int, theta: float, scaling: dict | None = None) -> None:
        super().__init__()
        self.rope_dim, self.theta, self.scaling = rope_dim, theta, dict(scaling) if scaling else None
        self.register_buffer("inv_freq", self._inv_freq(), persistent=False)

    def _inv_freq(self) -> torch.Tensor:
        # V4 scales no attention logit with YaRN's mscale: only the frequencies are stretched
        return rope_frequencies(self.rope_dim, self.theta, self.scaling)[0]

    def reset_parameters(self) -> None:
        self.inv_freq.copy_(self._inv_freq().to(self.inv_freq.device))

    def forward(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        angles = positions[..., None].float() * self.inv_freq.float()
        return angles.cos().to(dtype), angles.sin().to(dtype)


def rotate_tail(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate the trailing ``2 * cos.shape[-1]`` channels of ``x`` [batch, seq, heads, dim] in
    adjacent pairs, in place (no de-interleaving: the value is rotated too and read by the output
    projection), in fp32; ``cos``/``sin`` [batch, seq, pairs] (or [seq, pairs])."""
    cos = cos.repeat_interleave(2, dim=-1).unsqueeze(-2)
    sin = sin.repeat_interleave(2, dim=-1).unsqueeze(-2)
    width = cos.shape[-1]
    plain, rope = x[..., :-width], x[..., -width:]
    partner = torch.stack((-rope[..., 1::2], rope[..., 0::2]), dim=-1).flatten(-2)
    rotated = (rope.float() * cos + partner.float() * sin).to(x.dtype)
    return torch.cat([plain, rotated], dim=-1)


class WindowCompressor(nn.Module):
    """Compressed keys from windows of ``rate`` tokens: a gated (softmax over the window's slots,
    per channel) sum of the tokens' projections, normalised and rotated at the window's first
    position. ``overlap`` (CSA): each key pools its own window and the previous one (``2 * rate``
    slots; each token projects two halves, one per window it serves)."""

    def __init__(self, d_model: int, head_dim: int, rate: int, overlap: bool, rotary: PairRotary,
                 norm_eps: float = 1e-6) -> None:
        super().__init__()
        self.head_dim, self.rate, self.overlap, self.rotary = head_dim, rate, overlap, rotary
        width = 2 * head_dim if overlap else head_dim
        self.wkv = nn.Linear(d_model, width, bias=False)
        self.wgate = nn.Linear(d_model, width, bias=False)
        self.ape = nn.Parameter(torch.zeros(rate, width, dtype=torch.float32))
        """A learned bias of each slot of the window (absolute position in it) on the gate."""
        self.norm = Fp32RMSNorm(head_dim, norm_eps)

    def reset_parameters(self) -> None:
        nn.init.zeros_(self.ape)

    def project(self, hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Each token's share of its windows: (kv, gate logits) [batch, seq, width] (a KV cache keeps
        these, so a decoding step pools windows without projecting the past again)."""
        return self.wkv(hidden), self.wgate(hidden)

    def pool(self, kv: torch.Tensor, gate: torch.Tensor, windows: Windows | None = None) -> torch.Tensor:
        """The keys [batch, windows, head_dim] of the complete ``windows`` (None: one document per
        row, the first token at position 0) of tokens whose projections (:meth:`project`) are ``kv``,
        ``gate`` [batch, seq, width]: each window's tokens gathered, all windows of the batch at once."""
        batch, seq, _ = kv.shape
        m, d = self.rate, self.head_dim
        windows = Windows.of_rows(m, seq, device=kv.device) if windows is None else windows
        count = windows.start.shape[1]
        if count == 0:
            return kv.new_zeros(batch, 0, d)
        slots = (windows.start.unsqueeze(-1) + torch.arange(m, device=kv.device)).expand(batch, -1, -1)
        slots = slots.clamp_max(seq - 1)  # a padding window's (document -1: never seen) may reach past the row

        def gathered(x: torch.Tensor, at: torch.Tensor) -> torch.Tensor:  # [batch, windows, m, width]
            index = at.flatten(1).unsqueeze(-1).expand(-1, -1, x.shape[-1])
            return x.gather(1, index).view(batch, count, m, -1)

        own_kv, own_gate = gathered(kv, slots), gathered(gate, slots) + self.ape
        if self.overlap:  # slots: the previous window's first halves, then this window's second halves
            earlier = gathered(kv, (slots - m).clamp_min(0)), gathered(gate, (slots - m).clamp_min(0)) + self.ape
            first = (windows.index == 0).expand(batch, -1)[..., None, None]  # no previous window in its document
            own_kv = torch.cat([earlier[0][..., :d].masked_fill(first, 0.0), own_kv[..., d:]], dim=2)
            own_gate = torch.cat([earlier[1][..., :d].masked_fill(first, float("-inf")), own_gate[..., d:]], dim=2)
        weights = own_gate.softmax(dim=2, dtype=torch.float32).to(own_kv.dtype)
        keys = self.norm((own_kv * weights).sum(dim=2))
        cos, sin = self.rotary(windows.index * m, keys.dtype)
        return rotate_tail(keys.unsqueeze(2), cos, sin).squeeze(2)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        """``hidden`` [batch, seq, d_model] -> the keys of its complete windows [batch, windows, head_dim]."""
        return self.pool(*self.project(hidden))


def visible_windows(positions: torch.Tensor, windows: int, rate: int) -> torch.Tensor:
    """[batch, seq, windows]: whether a query at ``positions`` has seen all of a window's tokens
    (one document per row, from position 0)."""
    return passed(positions, torch.arange(windows, device=positions.device), rate)


class LightningIndexer(nn.Module):
    """CSA's top-k selection of compressed keys per query: its own small compressor (``index_head_dim``),
    ``index_n_heads`` query heads from the attention's query latent, scores
    ``sum_h w_h(x) * relu(q_h . k)``, and the ``index_topk`` best windows a query has passed."""

    def __init__(self, d_model: int, q_lora_rank: int, n_heads: int, head_dim: int, topk: int, rate: int,
                 rotary: PairRotary, norm_eps: float = 1e-6) -> None:
        super().__init__()
        self.n_heads, self.head_dim, self.topk, self.rate, self.rotary = n_heads, head_dim, topk, rate, rotary
        self.compressor = WindowCompressor(d_model, head_dim, rate, overlap=True, rotary=rotary, norm_eps=norm_eps)
        self.wq_b = nn.Linear(q_lora_rank, n_heads * head_dim, bias=False)
        self.weights_proj = nn.Linear(d_model, n_heads, bias=False)

    def scores(self, hidden: torch.Tensor, q_latent: torch.Tensor, positions: torch.Tensor,
               keys: torch.Tensor | None = None) -> torch.Tensor:
        """[batch, seq, windows] fp32 index scores of every complete window (visible or not);
        ``keys`` [batch, windows, head_dim]: the indexer's compressed keys (None: from ``hidden``)."""
        batch, seq, _ = hidden.shape
        keys = self.compressor(hidden) if keys is None else keys
        q = self.wq_b(q_latent).view(batch, seq, self.n_heads, self.head_dim)
        q = rotate_tail(q, *self.rotary(positions, q.dtype))
        scores = torch.relu(q.float() @ keys.float().transpose(-1, -2).unsqueeze(1)) * self.head_dim**-0.5
        weights = self.weights_proj(hidden).float() * self.n_heads**-0.5  # [batch, seq, heads]
        return (scores * weights.unsqueeze(-1)).sum(dim=2)

    def select(self, scores: torch.Tensor, visible: torch.Tensor) -> torch.Tensor:
        """[batch, seq, windows] bool: the ``topk`` ``visible`` windows [batch, seq, windows] of
        highest score per query (all of them when it sees fewer). Windows tied at the k-th score (the
        ReLU's exact zeros, when every index head scores a window below zero) are chosen as
        ``torch.topk`` chooses, by where they lie in the row (as transformers does): a packed
        document may pick another of its tied windows than it picks alone."""
        windows = scores.shape[-1]
        visible = visible.expand_as(scores)
        if windows == 0:
            return visible
        chosen = scores.masked_fill(~visible, float("-inf")).topk(min(self.topk, windows), dim=-1).indices
        picked = torch.zeros_like(visible).scatter_(-1, chosen, True)
        return picked & visible

    def forward(self, hidden: torch.Tensor, q_latent: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """[batch, seq, windows] bool: the windows each query selects."""
        scores = self.scores(hidden, q_latent, positions)
        return self.select(scores, visible_windows(positions, scores.shape[-1], self.rate))


def indexer_kl(target: torch.Tensor, index_scores: torch.Tensor, selected: torch.Tensor) -> torch.Tensor:
    """DeepSeek-V3.2's sparse-stage indexer loss: KL(p || softmax(I)) over the ``selected`` keys
    [batch, seq, keys], ``p`` the main attention's distribution over them (``target``, normalised per
    query); the mean over the queries that selected any key."""
    return counted_mean(*indexer_kl_per_query(target, index_scores, selected))


def indexer_kl_per_query(target: torch.Tensor, index_scores: torch.Tensor,
                         selected: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(each query's KL [batch, seq], whether it counts: it selected any key) of :func:`indexer_kl`,
    kept per query so that context parallelism can average over whole rows."""
    log_q = index_scores.masked_fill(~selected, float("-inf")).log_softmax(-1)
    kl = torch.where(target > 0, target * (target.clamp_min(1e-30).log() - log_q), 0.0).sum(-1)
    return kl, selected.any(-1).to(kl.dtype)


def counted_mean(values: torch.Tensor, counted: torch.Tensor) -> torch.Tensor:
    """Mean of ``values`` over the entries ``counted`` (1.0) marks (0 when none)."""
    return (values * counted).sum() / counted.sum().clamp_min(1)


class V4Attention(V4AttentionShape, HeadMean, nn.Module):
    """One V4 attention layer (``kind``: ``sliding``, ``csa`` or ``hca``): ``forward(hidden
    [batch, seq, d_model], positions [batch, seq]) -> [batch, seq, d_model]``. Its class answers the
    shape questions (:class:`~dsl_lit.config.model_parts.v4_attention.V4AttentionShape`). Under
    tensor parallelism a rank computes its own heads and whole groups of the output projection
    (``deepseek_v4/parallelize.py``): the sinks and ``wo_a`` arrive split (:func:`local_part`), the
    indexer is replicated and its target sums the ranks' heads."""

    @classmethod
    def of_config(cls, cfg: ModelConfig, layer_id: int, rotary: PairRotary) -> V4Attention:
        """Layer ``layer_id`` of ``cfg`` (its kind from ``cfg.attention_kind``), rotating with ``rotary``."""
        kind = cfg.attention_kind(layer_id)
        rate = {"sliding": 0, "csa": cfg.csa_rate, "hca": cfg.hca_rate}[kind]
        return cls(kind=kind, d_model=cfg.d_model, n_heads=cfg.n_heads, head_dim=cfg.attention_head_dim,
                   rope_dim=cfg.qk_rope_head_dim, q_lora_rank=cfg.q_lora_rank, o_groups=cfg.o_groups,
                   o_lora_rank=cfg.o_lora_rank, sliding_window=cfg.sliding_window, rotary=rotary, compress_rate=rate,
                   index_n_heads=cfg.index_n_heads, index_head_dim=cfg.index_head_dim, index_topk=cfg.index_topk,
                   norm_eps=cfg.norm_eps, index_training=cfg.index_training, layer_id=layer_id)

    def __init__(self, *, kind: LayerKind, d_model: int, n_heads: int, head_dim: int, rope_dim: int,
                 q_lora_rank: int, o_groups: int, o_lora_rank: int, sliding_window: int, rotary: PairRotary,
                 compress_rate: int = 0, index_n_heads: int = 0, index_head_dim: int = 0, index_topk: int = 0,
                 norm_eps: float = 1e-6, index_training: str = "off", layer_id: int = 0) -> None:
        super().__init__()
        self.layer_id = layer_id
        """Where its entries sit in a :class:`~dsl_lit.models.common.kv_cache.KVCache`."""
        self.kind, self.n_heads, self.head_dim, self.rope_dim = kind, n_heads, head_dim, rope_dim
        self.sliding_window, self.o_groups, self.norm_eps = sliding_window, o_groups, norm_eps
        self.rotary = rotary
        self.wq_a = nn.Linear(d_model, q_lora_rank, bias=False)
        self.q_norm = Fp32RMSNorm(q_lora_rank, norm_eps)
        self.wq_b = nn.Linear(q_lora_rank, n_heads * head_dim, bias=False)
        self.wkv = nn.Linear(d_model, head_dim, bias=False)
        self.kv_norm = Fp32RMSNorm(head_dim, norm_eps)
        self.wo_a = nn.Linear(n_heads * head_dim // o_groups, o_groups * o_lora_rank, bias=False)
        """Per group of heads, its own [o_lora_rank, heads_per_group * head_dim] block (stacked)."""
        self.wo_b = nn.Linear(o_groups * o_lora_rank, d_model, bias=False)
        self.attn_sink = nn.Parameter(torch.zeros(n_heads, dtype=torch.float32))
        self.compressor = (WindowCompressor(d_model, head_dim, compress_rate, overlap=kind == "csa",
                                            rotary=rotary, norm_eps=norm_eps) if kind != "sliding" else None)
        self.indexer = (LightningIndexer(d_model, q_lora_rank, index_n_heads, index_head_dim, index_topk,
                                         compress_rate, rotary, norm_eps) if kind == "csa" else None)
        self.compress_rate = compress_rate
        self.index_training = index_training
        """``sparse``: a training forward leaves the CSA indexer's KL (:func:`indexer_kl`) in
        ``index_loss``, its inputs detached; ``off``: none (the indexer keeps its weights)."""
        self.index_loss: torch.Tensor | None = None
        self.index_recall: torch.Tensor | None = None
        """Share of the attention mass over every visible compressed key that the selected ones hold."""

    def reset_parameters(self) -> None:
        nn.init.zeros_(self.attn_sink)

    def _indexer_objective(self, index_scores: torch.Tensor, visible: torch.Tensor, compressed_logits: torch.Tensor,
                           selected: torch.Tensor, shard: KVCache | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """(KL of the indexer to the attention over the selected compressed keys, recall), as
        DeepSeek-V3.2's sparse stage trains its indexer: the target is the main attention's
        distribution over the selected keys (per head, then the mean over heads), the recall's over
        the ``visible`` ones [batch, seq, windows]; ``index_scores``
        were computed from detached inputs (:meth:`forward`), so this loss trains the indexer only
        and the language-model loss never reaches it (top-k selection has no gradient either).
        ``shard``: context parallelism (a training forward has no KV cache): the per-query terms are
        gathered and every rank takes the means over whole rows (the gather's backward sums each
        rank's share back), as DeepSeek-V3.2's indexer does (``models/common/dsa.py``)."""
        with torch.no_grad():
            visible = visible.expand_as(index_scores)
            logits = compressed_logits.float().transpose(1, 2)  # [batch, seq, heads, windows]
            dense = self.mean_over_heads(logits.masked_fill(~visible.unsqueeze(2), float("-inf")).softmax(-1).nan_to_num(0.0), 2)
            recall, has_visible = (dense * selected).sum(-1), visible.any(-1).to(dense.dtype)
            target = self.mean_over_heads(logits.masked_fill(~selected.unsqueeze(2), float("-inf")).softmax(-1).nan_to_num(0.0), 2)
        kl, counted = indexer_kl_per_query(target, index_scores, selected)
        if shard is not None:
            kl, counted, recall, has_visible = shard.update(self.layer_id, kl, counted, recall, has_visible)
        return counted_mean(kl, counted), counted_mean(recall, has_visible)

    def forward(self, hidden: torch.Tensor, positions: torch.Tensor, key_valid: torch.Tensor | None = None,
                cache: KVCache | None = None) -> torch.Tensor:
        """``key_valid`` [batch, keys]: the real tokens of a left-padded batch (None: all), or
        [batch, seq, seq]: packed documents (``posttrain/chat/rows.py: document_mask``; ``positions``
        restart at each), where the sliding window and the compressed windows follow each document as
        if it were alone; ``cache``: this call continues the cached positions (it keeps each token's
        rotated key and its compressors' projections, so a step pools windows without projecting the past)."""
        batch, seq, _ = hidden.shape
        packed = key_valid is not None and key_valid.dim() == 3
        if packed and cache is not None:
            raise ValueError("DeepSeek-V4's attention follows packed documents (a per-query key_valid) in a "
                             "full-sequence forward only; continue a KV cache with a [batch, keys] padding mask")
        cos, sin = self.rotary(positions, hidden.dtype)
        q_latent = self.q_norm(self.wq_a(hidden))
        q = rms_normalised(self.wq_b(q_latent).view(batch, seq, -1, self.head_dim), self.norm_eps)  # (this rank's heads)
        q = rotate_tail(q, cos, sin)
        kv = rotate_tail(self.kv_norm(self.wkv(hidden)).view(batch, seq, 1, self.head_dim), cos, sin).squeeze(2)
        projections: list[torch.Tensor] = []
        if self.compressor is not None:
            projections += self.compressor.project(hidden)
        if self.indexer is not None:
            # the indexer reads detached inputs: only its own KL trains it (and its scores serve both
            # the selection and that KL, computed once)
            projections += self.indexer.compressor.project(hidden.detach())
        if cache is not None:
            kv, *projections = cache.update(self.layer_id, kv, *projections)
        keys_len = kv.shape[1]
        if cache is None and (key_valid is None or packed):
            key_positions = positions
        elif key_valid is None:
            key_positions = torch.arange(keys_len, device=hidden.device).unsqueeze(0)
        else:
            key_positions = key_valid[:, :keys_len].long().cumsum(-1) - 1
        offsets = positions.unsqueeze(-1) - key_positions.unsqueeze(-2)  # query - key position
        visible = (offsets >= 0) & (offsets < self.sliding_window)  # [batch, seq, keys]
        if key_valid is not None:
            visible = visible & (key_valid if packed else key_valid[:, None, :keys_len])
        seen = index_scores = reachable = None
        if self.compressor is not None:
            windows = Windows.of_keys(key_valid, keys_len, self.compress_rate, hidden.device)
            reachable = windows.visible(positions)  # its own document's windows a query has passed
            keys = self.compressor.pool(projections[0], projections[1], windows)
            if self.indexer is not None:
                index_keys = self.indexer.compressor.pool(projections[2], projections[3], windows)
                index_scores = self.indexer.scores(hidden.detach(), q_latent.detach(), positions, index_keys)
                seen = self.indexer.select(index_scores, reachable)
            else:
                seen = reachable.expand(batch, -1, -1)
            kv, visible = torch.cat([kv, keys], dim=1), torch.cat([visible.expand(batch, -1, -1), seen], dim=-1)
        logits = (q.transpose(1, 2) @ kv.unsqueeze(1).transpose(-1, -2)) * self.head_dim**-0.5
        self.index_loss = self.index_recall = None
        if self.training and self.indexer is not None and self.index_training == "sparse":
            self.index_loss, self.index_recall = self._indexer_objective(index_scores, reachable,
                                                                         logits[..., keys_len:], seen, cache)
        logits = logits.masked_fill(~visible.unsqueeze(1), float("-inf"))
        sink = local_part(self.attn_sink).view(1, -1, 1, 1).expand(batch, -1, seq, 1)
        logits = torch.cat([logits, sink], dim=-1)  # the fp32 sink makes the softmax fp32 in any dtype
        logits = logits - logits.max(dim=-1, keepdim=True).values
        probs = F.softmax(logits, dim=-1, dtype=logits.dtype)[..., :-1]  # the sink takes mass, gives nothing
        out = (probs.to(kv.dtype) @ kv.unsqueeze(1)).transpose(1, 2)  # [batch, seq, heads, head_dim]
        out = rotate_tail(out, cos, -sin)
        grouped = out.reshape(batch, seq, -1, self.wo_a.in_features)  # [.., groups, heads of a group x head_dim]
        blocks = local_part(self.wo_a.weight).view(grouped.shape[2], -1, grouped.shape[-1])  # [groups, o_lora_rank, in]
        projected = torch.einsum("bsgi,goi->bsgo", grouped, blocks)
        return self.wo_b(projected.flatten(2))
