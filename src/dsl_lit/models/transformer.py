"""The decoder-only transformer shared by the DeepSeek families, in plain PyTorch.

Pre-norm blocks: h = x + attn(norm(x)); out = h + ffn(norm(h)). Layers live in a ``ModuleDict``
keyed by their index so that a pipeline stage can drop the layers it does not own and the names of
the kept ones (``layers.7.attention.wq.weight``) stay the same in every parallel layout, which is
what lets checkpoints reshard by name. Embedding, final norm and output head may likewise be
``None`` on a pipeline stage that does not hold them.
"""

from __future__ import annotations

import torch
from torch import nn

from dsl_lit.models.attention import GroupedQueryAttention
from dsl_lit.models.config import ModelConfig
from dsl_lit.models.layers import RMSNorm, RotaryEmbedding, SwiGLU


class TransformerBlock(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_id: int) -> None:
        super().__init__()
        self.layer_id = layer_id
        self.attention_norm = RMSNorm(cfg.d_model, cfg.norm_eps)
        self.attention = GroupedQueryAttention(cfg)
        self.ffn_norm = RMSNorm(cfg.d_model, cfg.norm_eps)
        self.feed_forward = SwiGLU(cfg.d_model, cfg.ffn_hidden)

    def forward(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        h = x + self.attention(self.attention_norm(x), rope)
        return h + self.feed_forward(self.ffn_norm(h))


class Transformer(nn.Module):
    """``forward(input_ids[batch, seq]) -> logits[batch, seq, vocab]``."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        cfg.validate()
        self.config = cfg
        self.tok_embeddings: nn.Embedding | None = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.rope = RotaryEmbedding(cfg.head_dim, cfg.max_seq_len, cfg.rope_theta)
        self.layers = nn.ModuleDict({str(i): TransformerBlock(cfg, i) for i in range(cfg.n_layers)})
        self.norm: RMSNorm | None = RMSNorm(cfg.d_model, cfg.norm_eps)
        self.output: nn.Linear | None = nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)
        if cfg.tie_embeddings:
            self.output.weight = self.tok_embeddings.weight
        self.init_weights()

    @torch.no_grad()
    def init_weights(self) -> None:
        """Normal(0, init_std) for every matrix, ones for norms (DeepSeek: std 0.006)."""
        std = self.config.init_std
        for module in self.modules():
            if isinstance(module, (nn.Linear, nn.Embedding)):
                nn.init.normal_(module.weight, mean=0.0, std=std)
                if getattr(module, "bias", None) is not None:
                    nn.init.zeros_(module.bias)
            elif isinstance(module, (RMSNorm, RotaryEmbedding)):
                module.reset_parameters()

    def hidden_states(self, tokens: torch.Tensor) -> torch.Tensor:
        """Run embedding (when this stage has it) and the blocks; returns the un-normed residual."""
        h = self.tok_embeddings(tokens) if self.tok_embeddings is not None else tokens
        rope = self.rope(h.shape[1])
        for layer in self.layers.values():
            h = layer(h, rope)
        return h

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.hidden_states(tokens)
        if self.norm is not None:
            h = self.norm(h)
        return self.output(h) if self.output is not None else h

    def num_params(self, exclude_embeddings: bool = False) -> int:
        """Parameter count (shared tensors once). ``exclude_embeddings`` drops the input embedding."""
        seen: set[int] = set()
        total = 0
        for name, p in self.named_parameters():
            if id(p) in seen or (exclude_embeddings and name.startswith("tok_embeddings")):
                continue
            seen.add(id(p))
            total += p.numel()
        return total
