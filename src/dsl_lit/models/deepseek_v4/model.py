"""DeepSeek-V4's decoder in plain PyTorch: blocks of V4 attention and DeepSeekMoE (top-k or hash
routed, clamped SwiGLU experts) between manifold-constrained hyper-connections (DeepSeek-V4, sec. 2).

The residual is ``hc_mult`` streams [batch, seq, n, d_model]: the embedding is copied into them,
each sub-block reads a learned mix of them and writes back through its :class:`HyperConnection`
(``post * f(pre-mix) + comb^T @ streams``), and :class:`HyperHead` collapses them before the final
norm. The model keeps the house's names for what every family has (``tok_embeddings``,
``layers.<i>.attention``, ``layers.<i>.feed_forward``, ``attention_norm``, ``ffn_norm``, ``norm``,
``output``), so the transforms and checkpoints that address those work unchanged; V4's own modules
carry DeepSeek's release names (``attention.wq_a``, ``attention.compressor.ape``, ...). The parity
reference is transformers 5.24's ``DeepseekV4ForCausalLM`` (``tests/unit/models/test_deepseek_v4_model.py``).
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


class V4Transformer(Transformer):
    """``forward(input_ids[batch, seq]) -> logits[batch, seq, vocab]``, the interface of
    :class:`Transformer` (whose head, losses and counts it inherits); built here rather than by
    ``Transformer.__init__`` because its blocks take streams, token ids and per-kind rotaries. No
    MTP modules yet."""

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
        self.layers = nn.ModuleDict({
            str(i): V4Block(cfg, i, self.rotaries["main" if cfg.attention_kind(i) == "sliding" else "compress"])
            for i in range(cfg.n_layers)})
        self.hc_head = HyperHead(cfg.d_model, cfg.hc_mult, cfg.hc_eps, cfg.norm_eps)
        self.norm: Fp32RMSNorm | None = Fp32RMSNorm(cfg.d_model, cfg.norm_eps)
        self.output: nn.Linear | None = nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)
        self.mtp = nn.ModuleDict()
        if cfg.tie_embeddings:
            self.output.weight = self.tok_embeddings.weight
        self.init_weights()

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
        for left-padded batches, ``cache``: each layer keeps its rotated keys and its compressors'
        per-token projections."""
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
