"""DeepSeek-V4's decoder in plain PyTorch: blocks of V4 attention and DeepSeekMoE (top-k or hash
routed, clamped SwiGLU experts) between manifold-constrained hyper-connections (DeepSeek-V4, sec. 2),
and its multi-token-prediction modules.

The residual is ``hc_mult`` streams [batch, seq, n, d_model]: the embedding is copied into them,
each sub-block reads a learned mix of them and writes back through its :class:`HyperConnection`
(``post * f(pre-mix) + comb^T @ streams``), and :class:`HyperHead` collapses them before the final
norm. The model keeps the house's names for what every family has (``tok_embeddings``,
``layers.<i>.attention``, ``layers.<i>.feed_forward``, ``attention_norm``, ``ffn_norm``, ``norm``,
``output``), so the transforms and checkpoints that address those work unchanged; V4's own modules
carry DeepSeek's release names (``attention.wq_a``, ``attention.compressor.ape``, ...). The parity
reference is transformers 5.24's ``DeepseekV4ForCausalLM`` (``tests/unit/models/test_deepseek_v4_model.py``).

MTP (:class:`V4MTPModule`) is the ``MTPBlock`` of DeepSeek's V4 inference code (the release's
``inference/model.py``; transformers does not build it): a whole V4 block, sliding-window attention
and top-k routed experts, fed the previous depth's streams and the next token's embedding, with its
own stream collapse and norm before the shared head (``tests/unit/models/test_deepseek_v4_mtp.py``
restates it).
"""

from __future__ import annotations

import torch
from torch import nn

from dsl_lit.config.model import ModelConfig
from dsl_lit.models.common.hyper_connections import HyperConnection, HyperHead, expand_streams
from dsl_lit.models.common.kv_cache import KVCache
from dsl_lit.models.common.moe import HashRouter, MoE, TopKRouter
from dsl_lit.models.common.transformer import Transformer
from dsl_lit.models.deepseek_v4.attention import Fp32RMSNorm, PairRotary, V4Attention
from dsl_lit.models.deepseek_v4.windows import check_documents


class V4Block(nn.Module):
    """Attention then MoE, each between two mixes of the residual streams."""

    def __init__(self, cfg: ModelConfig, layer_id: int, rotary: PairRotary) -> None:
        super().__init__()
        self.layer_id = layer_id
        self.attention_norm = Fp32RMSNorm(cfg.d_model, cfg.norm_eps)
        self.attention = V4Attention.of_config(cfg, layer_id, rotary)
        self.ffn_norm = Fp32RMSNorm(cfg.d_model, cfg.norm_eps)
        self.feed_forward = MoE(cfg, HashRouter if layer_id < cfg.n_hash_layers else TopKRouter)
        self.attention_hc = HyperConnection(cfg.d_model, cfg.hc_mult, cfg.hc_sinkhorn_iters, cfg.hc_eps, cfg.norm_eps)
        self.ffn_hc = HyperConnection(cfg.d_model, cfg.hc_mult, cfg.hc_sinkhorn_iters, cfg.hc_eps, cfg.norm_eps)

    def forward(self, streams: torch.Tensor, positions: torch.Tensor, token_ids: torch.Tensor,
                key_valid: torch.Tensor | None = None, cache: KVCache | None = None) -> torch.Tensor:
        streams = self.attention_hc(streams, lambda x: self.attention(self.attention_norm(x), positions, key_valid, cache))
        return self.ffn_hc(streams, lambda x: self.feed_forward(self.ffn_norm(x), token_ids))


class V4MTPModule(nn.Module):
    """MTP depth k of DeepSeek-V4 (the release's ``MTPBlock``, layer ``n_layers + k - 1``): the
    previous depth's streams ``h`` [batch, seq, n, d_model] (depth 1: the last main layer's, before
    :class:`HyperHead`) and the embedding ``e`` of the token k ahead [batch, seq, d_model] make the
    block's input streams ``e_proj(enorm(e)) + h_proj(hnorm(h))`` (the embedding's projection added to
    each stream's); a :class:`V4Block` (sliding-window attention, top-k routed experts) runs on them,
    and the shared head reads ``norm(hc_head(streams))``, its own collapse and norm (:meth:`head_input`)."""

    def __init__(self, cfg: ModelConfig, layer_id: int, rotary: PairRotary) -> None:
        super().__init__()
        d = cfg.d_model
        self.enorm = Fp32RMSNorm(d, cfg.norm_eps)
        self.hnorm = Fp32RMSNorm(d, cfg.norm_eps)
        self.e_proj = nn.Linear(d, d, bias=False)
        self.h_proj = nn.Linear(d, d, bias=False)
        self.block = V4Block(cfg, layer_id, rotary)
        self.hc_head = HyperHead(d, cfg.hc_mult, cfg.hc_eps, cfg.norm_eps)
        self.norm = Fp32RMSNorm(d, cfg.norm_eps)

    def forward(self, streams: torch.Tensor, next_embeddings: torch.Tensor, positions: torch.Tensor,
                token_ids: torch.Tensor | None = None, key_valid: torch.Tensor | None = None,
                cache: KVCache | None = None) -> torch.Tensor:
        """``streams`` h^{k-1}[:, :T-k], ``next_embeddings`` emb(t[:, k:]), ``positions`` [batch, T-k]
        -> h^k [batch, T-k, n, d_model] (``token_ids`` t[:, k:]: read by a hash router only)."""
        h = self.e_proj(self.enorm(next_embeddings)).unsqueeze(-2) + self.h_proj(self.hnorm(streams))
        return self.block(h, positions, token_ids, key_valid, cache)

    def head_input(self, streams: torch.Tensor) -> torch.Tensor:
        """What the shared head reads of h^k: its streams collapsed, then normed."""
        return self.norm(self.hc_head(streams))


class V4Transformer(Transformer):
    """``forward(input_ids[batch, seq]) -> logits[batch, seq, vocab]``, the interface of
    :class:`Transformer` (whose head, losses, MTP logits and counts it inherits); built here rather
    than by ``Transformer.__init__`` because its blocks take streams, token ids and per-kind rotaries."""

    def __init__(self, cfg: ModelConfig) -> None:
        nn.Module.__init__(self)
        cfg.validate()
        self.config = cfg
        self.tok_embeddings: nn.Embedding | None = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.rope = None  # each kind of layer rotates with its own tables (below)
        # sliding layers rotate with rope_theta; compressed layers with compress_rope_theta (and YaRN)
        self.rotaries = nn.ModuleDict({
            "main": PairRotary(cfg.qk_rope_head_dim, cfg.rope_theta),
            "compress": PairRotary(cfg.qk_rope_head_dim, cfg.compress_rope_theta, cfg.rope_scaling),
        })
        self.layers = nn.ModuleDict({str(i): V4Block(cfg, i, self._rotary(i)) for i in range(cfg.n_layers)})
        self.hc_head = HyperHead(cfg.d_model, cfg.hc_mult, cfg.hc_eps, cfg.norm_eps)
        self.norm: Fp32RMSNorm | None = Fp32RMSNorm(cfg.d_model, cfg.norm_eps)
        self.output: nn.Linear | None = nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)
        # after every main module: the same seed draws the same main weights with or without MTP
        self.mtp = nn.ModuleDict({str(k): V4MTPModule(cfg, cfg.n_layers + k, self._rotary(cfg.n_layers + k))
                                  for k in range(cfg.mtp_modules)})
        if cfg.tie_embeddings:
            self.output.weight = self.tok_embeddings.weight
        self.init_weights()

    def _rotary(self, layer_id: int) -> PairRotary:
        """Sliding layers rotate with ``rope_theta``; compressed ones with ``compress_rope_theta`` (and YaRN)."""
        return self.rotaries["main" if self.config.attention_kind(layer_id) == "sliding" else "compress"]

    @torch.no_grad()
    def init_weights(self) -> None:
        """The house's init (normal(0, init_std) matrices, ones for norms), the hash routers' scores
        and tables, the mHC maps at ``init_std`` (transformers: normal(0, initializer_range))."""
        super().init_weights()
        for module in self.modules():
            if isinstance(module, HashRouter):
                nn.init.normal_(module.weight, mean=0.0, std=self.config.init_std)
            if isinstance(module, (HyperConnection, HyperHead)):
                module.reset_parameters(std=self.config.init_std)

    # -- the forward's pieces (Transformer.hidden_states runs them; a pipeline stage runs its share) --
    needs_token_ids = True  # the hash-routed layers choose experts from the token ids
    last_stage_modules = (*Transformer.last_stage_modules, "hc_head")

    def embed(self, tokens: torch.Tensor) -> torch.Tensor:
        """The embedding copied into the ``hc_mult`` residual streams [batch, seq, n, d_model]."""
        return expand_streams(self.tok_embeddings(tokens), self.config.hc_mult)

    def run_layers(self, streams: torch.Tensor, layer_ids: list[int], positions: torch.Tensor | None,
                   key_valid: torch.Tensor | None, token_ids: torch.Tensor | None,
                   cache: KVCache | None = None, offset: int = 0) -> torch.Tensor:
        """``positions`` [batch, seq] (default: from ``offset`` on), ``key_valid`` [batch, cached + seq]
        for left-padded batches or [batch, seq, seq] for packed documents (checked here, once for all
        layers), ``cache``: each layer keeps its rotated keys and its compressors' per-token projections."""
        if key_valid is not None and key_valid.dim() == 3:
            check_documents(key_valid)
        if positions is None:
            batch, seq = streams.shape[:2]
            positions = torch.arange(offset, offset + seq, device=streams.device).expand(batch, -1)
        for i in layer_ids:
            streams = self.layers[str(i)](streams, positions, token_ids, key_valid, cache)
        return streams

    def collapse(self, streams: torch.Tensor) -> torch.Tensor:
        return self.hc_head(streams)

    def residual_shape(self, rows: int, seq: int) -> tuple[int, ...]:
        return (rows, seq, self.config.hc_mult, self.config.d_model)

    # -- multi-token prediction (Transformer.mtp_logits chains the modules) ---------------------------
    def mtp_embeddings(self, tokens: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        """The token embeddings themselves (the residual is ``hc_mult`` copies of them)."""
        return self.tok_embeddings(tokens)

    def run_mtp(self, module: nn.Module, residual: torch.Tensor, next_embeddings: torch.Tensor,
                next_ids: torch.Tensor | None, positions: torch.Tensor | None, keys: KVCache | None,
                key_valid: torch.Tensor | None = None) -> torch.Tensor:
        """:class:`V4MTPModule` on the streams (``keys``: context parallelism's shard of the rows,
        through which its sliding-window attention gathers the ranks' keys, or the KV cache a draft
        continues: its block keeps its keys as a main layer does)."""
        if residual.dim() != 4:
            raise ValueError("DeepSeek-V4's MTP modules read the last layer's residual streams [batch, seq, hc_mult, "
                             f"d_model] (V4Transformer.residual), not a tensor of shape {tuple(residual.shape)}")
        if positions is None:
            batch, seq = residual.shape[:2]
            positions = torch.arange(seq, device=residual.device).expand(batch, -1)
        return module(residual, next_embeddings, positions, next_ids, key_valid, cache=keys)
