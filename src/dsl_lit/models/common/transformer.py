"""The decoder-only transformer shared by the DeepSeek families, in plain PyTorch.

A family's :class:`~dsl_lit.models.common.block.Composition` says which attention, which router
and whether MTP modules go in; ``dsl_lit.models.build_model`` picks it from the family registry.

Pre-norm blocks: h = x + attn(norm(x)); out = h + ffn(norm(h)). Layers live in a ``ModuleDict``
keyed by their index so that a pipeline stage can drop the layers it does not own and the names of
the kept ones (``layers.7.attention.wq.weight``) stay the same in every parallel layout, which is
what lets checkpoints reshard by name. Embedding, final norm and output head may likewise be
``None`` on a pipeline stage that does not hold them.
"""

from __future__ import annotations

from typing import Protocol

import torch
from torch import nn

from dsl_lit.config.model import ModelConfig
from dsl_lit.models.common.block import Composition, TransformerBlock
from dsl_lit.models.common.compute_copies import refresh_compute_copies
from dsl_lit.models.common.kv_cache import KVCache
from dsl_lit.models.common.layers import RMSNorm, RotaryEmbedding
from dsl_lit.models.common.moe import MoE, TopKRouter
from dsl_lit.models.common.mtp import MTPModule


class SequenceShard(Protocol):
    """One forward's share of the positions of whole rows (context parallelism; implemented by
    ``dsl_lit.parallel.context_parallel.ContextParallelKeys``). It stands where a :class:`KVCache`
    would: ``update`` returns the keys' sources for every position of the rows."""

    query_positions: torch.Tensor
    """[local seq]: the positions of the rows this forward holds."""
    length: int

    def shard(self, sequence: torch.Tensor) -> torch.Tensor:
        """This forward's positions of a whole-row tensor [batch, seq, ...]."""

    def shift(self, sequence: torch.Tensor, k: int, fill: int) -> torch.Tensor:
        """This forward's positions of ``sequence`` shifted left by ``k`` (``fill`` past the end)."""

    def whole(self, local: torch.Tensor) -> torch.Tensor:
        """The whole rows [batch, seq, ...] of a tensor given at this forward's positions."""

    def update(self, layer_id: int, *local: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """The whole rows of what keys and values are built from, given this forward's positions."""

    def advance(self, seq: int) -> None:
        """Called after a forward, as on a cache."""


class Transformer(nn.Module):
    """``forward(input_ids[batch, seq]) -> logits[batch, seq, vocab]``.

    Families with multi-token prediction add ``mtp`` modules (:meth:`mtp_logits`, used by the pretraining loss);
    MoE blocks leave a ``balance_loss`` that :meth:`balance_loss` collects.
    """

    def __init__(self, cfg: ModelConfig, composition: Composition) -> None:
        super().__init__()
        cfg.validate()
        self.config = cfg
        self.tok_embeddings: nn.Embedding | None = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.rope = RotaryEmbedding(cfg.rope_dim, cfg.max_seq_len, cfg.rope_theta, cfg.rope_scaling)
        self.layers = nn.ModuleDict({str(i): TransformerBlock(cfg, i, composition) for i in range(cfg.n_layers)})
        self.norm: RMSNorm | None = RMSNorm(cfg.d_model, cfg.norm_eps)
        self.output: nn.Linear | None = nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)
        self.mtp = nn.ModuleDict(
            {str(k): MTPModule(cfg, cfg.n_layers + k, composition) for k in range(cfg.mtp_modules)}
        )
        if cfg.tie_embeddings:
            self.output.weight = self.tok_embeddings.weight
        self.init_weights()

    @torch.no_grad()
    def init_weights(self) -> None:
        """Normal(0, init_std) for every matrix (expert stacks and router included), ones for norms,
        zeros for the expert bias (DeepSeek: std 0.006)."""
        std = self.config.init_std
        for module in self.modules():
            if isinstance(module, (nn.Linear, nn.Embedding)):
                nn.init.normal_(module.weight, mean=0.0, std=std)
            elif isinstance(module, TopKRouter):
                nn.init.normal_(module.weight, mean=0.0, std=std)
                module.expert_bias.zero_()
            elif hasattr(module, "w1") and isinstance(module.w1, nn.Parameter):  # GroupedExperts
                for weight in (module.w1, module.w2, module.w3):
                    nn.init.normal_(weight, mean=0.0, std=std)
            elif hasattr(module, "reset_parameters") and not isinstance(module, Transformer):
                module.reset_parameters()  # RMSNorm, RotaryEmbedding, ExpertLoad

    def hidden_states(
        self,
        tokens: torch.Tensor,
        positions: torch.Tensor | None = None,
        key_valid: torch.Tensor | None = None,
        cache: KVCache | None = None,
    ) -> torch.Tensor:
        """Run embedding (when this stage has it) and the blocks; returns the un-normed hidden
        state the head reads (:meth:`residual` through :meth:`collapse`).

        ``positions`` [batch, seq] and ``key_valid`` [batch, cached + seq] describe left-padded
        batches; ``cache`` makes the call incremental (positions continue from ``cache.length``).
        """
        return self.collapse(self.residual(tokens, positions, key_valid, cache))

    def residual(
        self,
        tokens: torch.Tensor,
        positions: torch.Tensor | None = None,
        key_valid: torch.Tensor | None = None,
        cache: KVCache | SequenceShard | None = None,
    ) -> torch.Tensor:
        """:meth:`hidden_states` before :meth:`collapse`: the last layer's residual, what the MTP
        modules read (:meth:`mtp_logits`; the hidden state itself here, DeepSeek-V4's ``hc_mult``
        streams there)."""
        refresh_compute_copies(self)
        h = self.embed(tokens) if self.tok_embeddings is not None else tokens
        offset = cache.length if cache is not None else 0
        h = self.run_layers(h, [int(name) for name in self.layers], positions, key_valid, tokens, cache, offset)
        if cache is not None:
            cache.advance(tokens.shape[1])
        return h

    # -- the forward cut at layer boundaries: what a pipeline stage runs of it ------------------------
    needs_token_ids: bool = False
    """Whether the layers read the token ids (DeepSeek-V4's hash-routed MoE): every pipeline stage
    then receives them with its inputs."""

    def embed(self, tokens: torch.Tensor) -> torch.Tensor:
        """The residual the first layer reads: the token embeddings."""
        return self.tok_embeddings(tokens)

    def run_layers(self, h: torch.Tensor, layer_ids: list[int], positions: torch.Tensor | None,
                   key_valid: torch.Tensor | None, token_ids: torch.Tensor | None,
                   cache: KVCache | SequenceShard | None = None, offset: int = 0) -> torch.Tensor:
        """Layers ``layer_ids`` over the residual ``h``; ``cache``: a KV cache to continue, or a
        context-parallel shard of whole rows' keys; ``offset``: the cache's length."""
        rope = self.rope(h.shape[1], offset, positions)
        for i in layer_ids:
            h = self.layers[str(i)](h, rope, cache, key_valid)
        return h

    def collapse(self, h: torch.Tensor) -> torch.Tensor:
        """The last layer's residual -> what the final norm (and the MTP modules) read: itself here."""
        return h

    def residual_shape(self, rows: int, seq: int) -> tuple[int, ...]:
        """The residual's shape between layers (what one pipeline stage sends the next)."""
        return (rows, seq, self.config.d_model)

    last_stage_modules: tuple[str, ...] = ("norm", "output", "mtp")
    """Modules only the last pipeline stage runs (after the last layer)."""

    def mtp_embeddings(self, tokens: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        """The token embeddings the MTP modules read, given the ids and the residual :meth:`embed`
        made of them (a pipeline's first stage sends them to the last): that residual here."""
        return residual

    def head(self, h: torch.Tensor) -> torch.Tensor:
        """Final norm and output projection (each only on the stage that holds it)."""
        if self.norm is not None:
            h = self.norm(h)
        return self.output(h) if self.output is not None else h

    def forward(
        self,
        tokens: torch.Tensor,
        positions: torch.Tensor | None = None,
        key_valid: torch.Tensor | None = None,
        cache: KVCache | None = None,
    ) -> torch.Tensor:
        return self.head(self.hidden_states(tokens, positions, key_valid, cache))

    def mtp_logits(self, residual: torch.Tensor, tokens: torch.Tensor, shard: SequenceShard | None = None) -> list[torch.Tensor]:
        """Logits of each MTP depth k = 1..D: [batch, seq - k, vocab], predicting labels[:, k:].

        ``residual`` is the main model's last residual (:meth:`residual`; here the un-normed
        output :meth:`hidden_states` returns, DeepSeek-V4's streams before their collapse) for
        ``tokens``; ``tokens`` may also be their embeddings [batch, seq, d_model] (a pipeline's
        last stage receives those from the first, where the embedding lives). Depth k runs its
        module (:meth:`run_mtp`) on depth k - 1's residual and the embeddings of the tokens k
        ahead; the shared head reads what the module hands it (``module.head_input``).

        With ``shard`` (context parallelism) ``residual`` holds only the positions
        ``shard.query_positions`` of the whole rows ``tokens`` (token ids [batch, seq], or the
        embeddings of this forward's positions [batch, local seq, d_model] on a pipeline's last
        stage): every depth keeps all positions (depth k at position i reads token i + k, taken
        from the whole row; the last k positions predict nothing and their labels are ignored),
        so each rank keeps its positions and the block's attention gathers keys through
        ``shard`` as the main layers do. Logits are then [batch, local seq, vocab] at this
        rank's positions, for ``shard.shift(labels, k, -100)``.
        """
        embeddings = tokens if tokens.is_floating_point() else None
        logits = []
        if shard is not None:
            positions = shard.query_positions.expand(residual.shape[0], -1)
            whole = shard.whole(embeddings) if embeddings is not None else None
            for k, module in enumerate(self.mtp.values(), start=1):
                ids = None if whole is not None else shard.shift(tokens, k, fill=0)
                shifted = shard.shift(whole, k, fill=0) if whole is not None else self.tok_embeddings(ids)
                residual = self.run_mtp(module, residual, shifted, ids, positions, shard)
                logits.append(self.output(module.head_input(residual)))
            return logits
        for k, module in enumerate(self.mtp.values(), start=1):
            ids = None if embeddings is not None else tokens[:, k:]
            shifted = embeddings[:, k:] if embeddings is not None else self.tok_embeddings(ids)
            residual = self.run_mtp(module, residual[:, :-1], shifted, ids, None, None)
            logits.append(self.output(module.head_input(residual)))
        return logits

    def run_mtp(self, module: nn.Module, residual: torch.Tensor, next_embeddings: torch.Tensor,
                next_ids: torch.Tensor | None, positions: torch.Tensor | None,
                keys: KVCache | SequenceShard | None, key_valid: torch.Tensor | None = None) -> torch.Tensor:
        """One MTP module: depth k - 1's ``residual`` [batch, seq, ...] and the embeddings (and ids,
        when this stage has them) of the tokens k ahead [batch, seq, d_model] -> depth k's residual.
        ``positions`` [batch, seq] (None: 0 .. seq - 1); ``keys``: where attention takes its keys
        from (context parallelism's whole rows, or the KV cache a draft continues,
        ``dsl_lit.inference.speculative``); ``key_valid`` [batch, keys]: a left-padded batch's real tokens."""
        return module(residual, next_embeddings, self.rope(residual.shape[1], 0, positions), keys, key_valid)

    def moe_layers(self) -> list[MoE]:
        return [m for m in self.modules() if isinstance(m, MoE)]

    def balance_loss(self) -> torch.Tensor | None:
        """Sum of the balance losses the MoE blocks left in the last training forward."""
        losses = [m.balance_loss for m in self.moe_layers() if m.balance_loss is not None]
        return torch.stack(losses).sum() if losses else None

    def index_losses(self) -> tuple[torch.Tensor, torch.Tensor] | None:
        """(sum over layers of the sparse-attention indexers' KL losses, mean of their top-k recalls)
        left by the last training forward (DeepSeek-V3.2 with ``index_training`` on), else None."""
        layers = [m for m in self.modules() if getattr(m, "index_loss", None) is not None]
        if not layers:
            return None
        return torch.stack([m.index_loss for m in layers]).sum(), torch.stack([m.index_recall for m in layers]).mean()

    def num_params(
        self, exclude_embeddings: bool = False, include_mtp: bool = False, activated: bool = False
    ) -> int:
        """Parameter count (shared tensors once). ``exclude_embeddings`` drops the input embedding;
        MTP modules are left out unless ``include_mtp`` (papers quote the main model);
        ``activated`` counts only the ``top_k`` routed experts a token uses."""
        seen: set[int] = set()
        total = 0
        cfg = self.config
        for name, p in self.named_parameters():
            if id(p) in seen or (exclude_embeddings and name.startswith("tok_embeddings")):
                continue
            if not include_mtp and name.startswith("mtp."):
                continue
            seen.add(id(p))
            numel = p.numel()
            if activated and ".experts.w" in name:
                numel = numel // cfg.n_routed_experts * cfg.n_activated_experts
            total += numel
        return total
