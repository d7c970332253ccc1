"""Model configuration: one dataclass for every DeepSeek family, plus named presets.

Presets carry the numbers from the papers (see DESIGN.md section 2); ``ModelConfig.from_name``
builds one and lets any field be overridden, which is what the Hydra ``model`` group does.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, Literal

from dsl_lit.config.errors import ConfigError

AttentionBackend = Literal["sdpa", "flash_attn", "eager"]
ATTENTION_BACKENDS = ("sdpa", "flash_attn", "eager")
FAMILIES = ("deepseek_llm", "deepseek_v3")
SCORE_FUNCS = ("sigmoid", "softmax")
EXPERT_BACKENDS = ("grouped_mm", "split", "loop")
YARN_KEYS = ("factor", "original_max_seq_len", "beta_fast", "beta_slow", "mscale", "mscale_all_dim")


@dataclass
class ModelConfig:
    """Architecture hyperparameters. ``family`` selects which blocks the decoder is built from.

    ``deepseek_llm`` uses grouped-query attention and a dense SwiGLU in every block. ``deepseek_v3``
    uses Multi-head Latent Attention, dense SwiGLU in the first ``n_dense_layers`` blocks and
    DeepSeekMoE after them, and optionally ``mtp_depth`` multi-token-prediction modules. Fields of
    the other family are ignored.
    """

    name: str = "custom"
    family: Literal["deepseek_llm", "deepseek_v3"] = "deepseek_llm"
    vocab_size: int = 102400
    n_layers: int = 30
    d_model: int = 4096
    n_heads: int = 32
    n_kv_heads: int = 32
    ffn_hidden: int = 11008
    max_seq_len: int = 4096
    rope_theta: float = 10000.0
    norm_eps: float = 1e-6
    init_std: float = 0.006
    tie_embeddings: bool = False
    attn_backend: AttentionBackend = "sdpa"
    # -- Multi-head Latent Attention (deepseek_v3) ---------------------------------------------------
    q_lora_rank: int | None = None
    """Rank of the low-rank query path; ``None`` projects queries directly (DeepSeek-V2-Lite)."""
    kv_lora_rank: int = 512
    qk_nope_head_dim: int = 128
    qk_rope_head_dim: int = 64
    """Decoupled RoPE dims: one rotary key of this size shared by all heads."""
    v_head_dim: int = 128
    rope_interleave: bool = True
    """DeepSeek's rotary layout pairs adjacent dims (x0, x1), (x2, x3), ... (HF ``rope_interleave``)."""
    rope_scaling: dict[str, Any] | None = None
    """YaRN context extension: keys ``factor``, ``original_max_seq_len``, ``beta_fast`` (32),
    ``beta_slow`` (1), ``mscale`` (1), ``mscale_all_dim`` (0)."""
    # -- DeepSeekMoE (deepseek_v3) -------------------------------------------------------------------
    n_dense_layers: int = 0
    """The first k blocks keep a dense FFN of ``ffn_hidden``; the rest are MoE."""
    n_routed_experts: int = 0
    n_shared_experts: int = 0
    n_activated_experts: int = 0
    """Routed experts per token (top-k)."""
    moe_ffn_hidden: int = 0
    """Hidden size of one expert (the shared expert block is ``n_shared_experts`` times wider)."""
    n_expert_groups: int = 1
    """Node-limited routing: experts split into this many groups ..."""
    n_limited_groups: int = 1
    """... and only this many groups (highest sum of their top-2 scores) are searched for the top-k."""
    score_func: Literal["sigmoid", "softmax"] = "sigmoid"
    route_scale: float = 1.0
    norm_topk_prob: bool = True
    seq_balance_alpha: float = 0.0
    """Weight of DeepSeek-V3's complementary sequence-wise balance loss (0.0001 in the paper)."""
    batch_balance_alpha: float = 0.0
    """Weight of the classic batch-wise auxiliary balance loss (off in V3; for comparisons)."""
    expert_backend: Literal["grouped_mm", "split", "loop"] = "grouped_mm"
    """How routed experts run: ``torch._grouped_mm`` on tokens sorted by expert, one matmul per
    expert on the sorted slices, or the naive per-expert masking loop (a reference only)."""
    # -- Multi-token prediction (deepseek_v3) --------------------------------------------------------
    mtp_depth: int = 0
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def head_dim(self) -> int:
        return self.d_model // self.n_heads

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def rope_dim(self) -> int:
        """Width of the rotary tables: the whole head (GQA) or the decoupled rope part (MLA)."""
        return self.qk_rope_head_dim if self.family == "deepseek_v3" else self.head_dim

    @property
    def is_moe(self) -> bool:
        return self.family == "deepseek_v3" and self.n_routed_experts > 0

    def is_moe_layer(self, layer_id: int) -> bool:
        """Blocks at or after ``n_dense_layers`` are MoE (MTP blocks too, as in DeepSeek-V3)."""
        return self.is_moe and layer_id >= self.n_dense_layers

    def validate(self, prefix: str = "model") -> ModelConfig:
        """Raise ConfigError naming ``model.<field>`` for values the model cannot be built with."""
        for name in ("vocab_size", "n_layers", "d_model", "n_heads", "n_kv_heads", "ffn_hidden", "max_seq_len"):
            value = getattr(self, name)
            if not isinstance(value, int) or value <= 0:
                raise ConfigError(f"{prefix}.{name}={value!r} must be a positive integer")
        if self.family not in FAMILIES:
            raise ConfigError(f"{prefix}.family={self.family!r} is unknown; choose one of {FAMILIES}")
        if self.family == "deepseek_v3":
            return self._validate_v3(prefix)
        if self.d_model % self.n_heads:
            raise ConfigError(
                f"{prefix}.n_heads={self.n_heads} does not divide {prefix}.d_model={self.d_model}; "
                "pick n_heads so that d_model / n_heads is an integer head dimension"
            )
        if self.n_heads % self.n_kv_heads:
            raise ConfigError(
                f"{prefix}.n_kv_heads={self.n_kv_heads} does not divide {prefix}.n_heads={self.n_heads}; "
                "grouped-query attention needs n_heads to be a multiple of n_kv_heads"
            )
        if self.head_dim % 2:
            raise ConfigError(f"{prefix}: head_dim={self.head_dim} must be even for rotary embeddings")
        self._validate_common(prefix)
        return self

    def _validate_common(self, prefix: str) -> None:
        if self.attn_backend not in ATTENTION_BACKENDS:
            raise ConfigError(
                f"{prefix}.attn_backend={self.attn_backend!r} is unknown; choose one of {ATTENTION_BACKENDS}"
            )
        if self.norm_eps <= 0 or self.init_std <= 0 or self.rope_theta <= 0:
            raise ConfigError(f"{prefix}.norm_eps, init_std and rope_theta must be > 0")
        if self.rope_scaling is not None:
            scaling = dict(self.rope_scaling)
            unknown = sorted(set(scaling) - set(YARN_KEYS))
            if unknown:
                raise ConfigError(f"{prefix}.rope_scaling.{unknown[0]} is unknown; YaRN keys are {YARN_KEYS}")
            for key in ("factor", "original_max_seq_len"):
                if not isinstance(scaling.get(key), (int, float)) or scaling[key] <= 0:
                    raise ConfigError(f"{prefix}.rope_scaling.{key}={scaling.get(key)!r} must be a positive number")

    def _validate_v3(self, prefix: str) -> ModelConfig:
        positive = ["kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim"]
        if self.q_lora_rank is not None:
            positive.append("q_lora_rank")
        if self.n_dense_layers > 0:
            positive.append("ffn_hidden")
        if self.n_routed_experts:
            positive += ["n_activated_experts", "moe_ffn_hidden", "n_expert_groups", "n_limited_groups"]
        for name in positive:
            value = getattr(self, name)
            if not isinstance(value, int) or value <= 0:
                raise ConfigError(f"{prefix}.{name}={value!r} must be a positive integer")
        for name in ("n_dense_layers", "n_routed_experts", "n_shared_experts", "mtp_depth"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 0:
                raise ConfigError(f"{prefix}.{name}={value!r} must be a non-negative integer")
        if self.qk_rope_head_dim % 2:
            raise ConfigError(f"{prefix}.qk_rope_head_dim={self.qk_rope_head_dim} must be even for rotary embeddings")
        if self.n_dense_layers > self.n_layers:
            raise ConfigError(f"{prefix}.n_dense_layers={self.n_dense_layers} exceeds n_layers={self.n_layers}")
        if self.n_routed_experts == 0 and self.n_dense_layers < self.n_layers:
            raise ConfigError(
                f"{prefix}.n_routed_experts=0 but layers {self.n_dense_layers}.. are MoE; set "
                f"{prefix}.n_dense_layers={self.n_layers} for a dense model or add routed experts"
            )
        if self.n_routed_experts:
            e, k, g, kg = self.n_routed_experts, self.n_activated_experts, self.n_expert_groups, self.n_limited_groups
            if e % g:
                raise ConfigError(f"{prefix}.n_expert_groups={g} does not divide n_routed_experts={e}")
            if kg > g:
                raise ConfigError(f"{prefix}.n_limited_groups={kg} exceeds n_expert_groups={g}")
            if k > kg * (e // g):
                raise ConfigError(
                    f"{prefix}.n_activated_experts={k} exceeds the {kg * (e // g)} experts in the "
                    f"n_limited_groups={kg} groups a token may use; raise n_limited_groups"
                )
            if self.score_func not in SCORE_FUNCS:
                raise ConfigError(f"{prefix}.score_func={self.score_func!r} is unknown; choose one of {SCORE_FUNCS}")
            if self.expert_backend not in EXPERT_BACKENDS:
                raise ConfigError(
                    f"{prefix}.expert_backend={self.expert_backend!r} is unknown; choose one of {EXPERT_BACKENDS}"
                )
        if self.seq_balance_alpha < 0 or self.batch_balance_alpha < 0 or self.route_scale <= 0:
            raise ConfigError(f"{prefix}: balance alphas must be >= 0 and route_scale > 0")
        self._validate_common(prefix)
        return self

    @classmethod
    def from_name(cls, name: str, **overrides: Any) -> ModelConfig:
        """Build a preset by name, with field overrides (unknown fields raise ConfigError)."""
        if name not in PRESETS:
            raise ConfigError(f"model.name={name!r} is not a known preset; choose one of {sorted(PRESETS)}")
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(overrides) - known)
        if unknown:
            raise ConfigError(f"model.{unknown[0]} is not a ModelConfig field; known fields: {sorted(known)}")
        values = {**PRESETS[name], **{k: v for k, v in overrides.items() if v is not None or k in _NULLABLE}}
        return cls(name=name, **values).validate()


_NULLABLE = ("q_lora_rank", "rope_scaling")
"""Fields where an explicit ``null`` override means "none" rather than "keep the preset"."""

PRESETS: dict[str, dict[str, Any]] = {
    # DeepSeek LLM (arXiv 2401.02954, Table 2): LLaMA-style pre-norm decoder, 102400 vocab.
    "deepseek_llm_7b": dict(
        family="deepseek_llm", vocab_size=102400, n_layers=30, d_model=4096, n_heads=32, n_kv_heads=32,
        ffn_hidden=11008, max_seq_len=4096,
    ),
    "deepseek_llm_67b": dict(
        family="deepseek_llm", vocab_size=102400, n_layers=95, d_model=8192, n_heads=64, n_kv_heads=8,
        ffn_hidden=22016, max_seq_len=4096,
    ),
    # A few million parameters: trains on two CPU cores in minutes. GQA so the grouped path is exercised.
    "deepseek_llm_tiny": dict(
        family="deepseek_llm", vocab_size=8192, n_layers=4, d_model=256, n_heads=8, n_kv_heads=4,
        ffn_hidden=688, max_seq_len=1024,
    ),
    # ~100M parameters: the benchmark's "small but real" size.
    "deepseek_llm_100m": dict(
        family="deepseek_llm", vocab_size=32768, n_layers=12, d_model=640, n_heads=10, n_kv_heads=10,
        ffn_hidden=1728, max_seq_len=2048,
    ),
}

_V3_COMMON: dict[str, Any] = dict(
    family="deepseek_v3", kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128,
)
PRESETS.update({
    # DeepSeek-V3 (arXiv 2412.19437, section 4.2): 671B total, 37B activated, MTP depth 1.
    "deepseek_v3_671b": dict(
        _V3_COMMON, vocab_size=129280, n_layers=61, d_model=7168, n_heads=128, n_kv_heads=128,
        q_lora_rank=1536, n_dense_layers=3, ffn_hidden=18432, n_routed_experts=256, n_shared_experts=1,
        n_activated_experts=8, moe_ffn_hidden=2048, n_expert_groups=8, n_limited_groups=4,
        score_func="sigmoid", route_scale=2.5, norm_topk_prob=True, seq_balance_alpha=0.0001, mtp_depth=1,
        max_seq_len=4096,
    ),
    # DeepSeek-V2-Lite (arXiv 2405.04434): 15.7B total, 2.4B activated; no query compression,
    # softmax routing over 64 experts + 2 shared, no group limit.
    "deepseek_v2_lite": dict(
        _V3_COMMON, vocab_size=102400, n_layers=27, d_model=2048, n_heads=16, n_kv_heads=16,
        q_lora_rank=None, n_dense_layers=1, ffn_hidden=10944, n_routed_experts=64, n_shared_experts=2,
        n_activated_experts=6, moe_ffn_hidden=1408, n_expert_groups=1, n_limited_groups=1,
        score_func="softmax", route_scale=1.0, norm_topk_prob=False, max_seq_len=4096,
    ),
    # A CPU-sized V3 with every mechanism switched on: low-rank queries, node-limited sigmoid
    # routing (4 groups, 2 kept), a shared expert, the balance loss and one MTP module.
    "deepseek_v3_tiny": dict(
        family="deepseek_v3", vocab_size=8192, n_layers=4, d_model=256, n_heads=8, n_kv_heads=8,
        q_lora_rank=128, kv_lora_rank=64, qk_nope_head_dim=32, qk_rope_head_dim=16, v_head_dim=32,
        n_dense_layers=1, ffn_hidden=688, n_routed_experts=16, n_shared_experts=1, n_activated_experts=4,
        moe_ffn_hidden=128, n_expert_groups=4, n_limited_groups=2, score_func="sigmoid", route_scale=2.5,
        norm_topk_prob=True, seq_balance_alpha=0.0001, mtp_depth=1, max_seq_len=1024,
    ),
})
