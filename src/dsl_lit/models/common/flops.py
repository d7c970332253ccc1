"""Analytical matmul weights per token and training FLOPs of a decoder, from its config.

Counted from the config, not with a FLOP counter, because meta-device counters miscount routed
experts and fused kernels. The attention's share comes from the family's attention class itself
(``matmul_params``, ``score_flops``), so a family's FLOPs, its pipeline stage costs and the MFU the
trainer logs all follow its composition; no second copy of its shapes exists.
"""

from __future__ import annotations

from dataclasses import dataclass

from dsl_lit.config.model import ModelConfig
from dsl_lit.config.model_parts.attention import AttentionShape


def ffn_params_per_token(cfg: ModelConfig, layer_id: int) -> int:
    """FFN weights one token goes through: the dense SwiGLU, or router + shared + top-k experts."""
    if not cfg.is_moe_layer(layer_id):
        return 3 * cfg.d_model * cfg.ffn_hidden
    experts = cfg.n_activated_experts + cfg.n_shared_experts
    return cfg.d_model * cfg.n_routed_experts + 3 * cfg.d_model * cfg.moe_ffn_hidden * experts


@dataclass(frozen=True)
class DecoderFlops:
    """Per-token counts of a decoder whose blocks use ``attention``; MTP modules and MoE layers as
    the config says (``cfg.mtp_modules``, ``cfg.is_moe_layer``)."""

    attention: AttentionShape

    def attention_params(self, cfg: ModelConfig) -> int:
        """Projection weights of one attention block."""
        return self.attention.matmul_params(cfg)

    def block_params_per_token(self, cfg: ModelConfig, layer_id: int) -> int:
        """Activated matmul weights of block ``layer_id`` (``>= n_layers``: an MTP module's block).
        Pipeline stages are balanced on these."""
        return self.attention_params(cfg) + ffn_params_per_token(cfg, layer_id)

    def last_stage_params_per_token(self, cfg: ModelConfig) -> int:
        """What only the last pipeline stage multiplies through: the output head, and per MTP module
        its block, its projection ``eh_proj`` and the shared head again."""
        head = cfg.d_model * cfg.vocab_size
        mtp = sum(
            self.block_params_per_token(cfg, cfg.n_layers + k) + 2 * cfg.d_model**2 + head
            for k in range(cfg.mtp_modules)
        )
        return head + mtp

    def matmul_params_per_token(self, cfg: ModelConfig) -> int:
        """Weights each token multiplies through: every block (activated experts only), the MTP
        modules and the output head once per prediction."""
        blocks = sum(self.block_params_per_token(cfg, i) for i in range(cfg.n_layers))
        return blocks + self.last_stage_params_per_token(cfg)

    def training_flops_per_token(self, cfg: ModelConfig, seq_len: int) -> float:
        """6 FLOPs per weight per token (forward 2, backward 4) plus attention scores and values
        (6 n_blocks n_heads (qk_dim + v_dim) seq_len, without halving for causality, as PaLM and
        DeepSeek count; for GQA qk_dim = v_dim = head_dim, i.e. 12 n_layer n_heads head_dim seq_len)."""
        blocks = cfg.n_layers + cfg.mtp_modules
        attention_scores = 3 * blocks * self.attention.score_flops(cfg, seq_len)  # forward 1, backward 2
        return 6 * self.matmul_params_per_token(cfg) + attention_scores
