"""Model configuration: one dataclass for every model family, made of parts.

``family`` names a family of :mod:`dsl_lit.config.families`: the parts its config is made of
(``config/model_parts/``: its attention, routed experts, multi-token prediction, hyper-connections),
its presets and its own rules. The values stay flat here, as in DeepSeek's and Hugging Face's
``config.json``; each part names the fields it reads and answers its own shape questions, and a field
no part of the family reads is refused when set. ``ModelConfig.from_name`` builds a preset and lets
any field be overridden, which is what the Hydra ``model`` group does. No torch, and nothing above
``dsl_lit.config``: the model code reads this, never the other way.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, Literal

from data_contract.errors import ConfigError
from dsl_lit.config.families import DEFAULT_FAMILY, family_card, owner, part_fields, presets
from dsl_lit.config.families.card import FamilyCard
from dsl_lit.config.model_parts.attention import AttentionShape
from dsl_lit.config.model_parts.moe import RoutedExperts
from dsl_lit.config.model_parts.mtp import MultiTokenPrediction

AttentionBackend = Literal["sdpa", "flash_attn", "eager"]
ATTENTION_BACKENDS = ("sdpa", "flash_attn", "eager")
EXECUTION_FIELDS = ("attn_backend", "expert_backend")
"""Kernels computing the same function: the run's own on resume and under ``init_from``."""
CONTEXT_FIELDS = ("max_seq_len", "rope_scaling", "index_topk", "index_training", *EXECUTION_FIELDS)
"""Fields that shape no weight: a stage sets them on top of ``init_from``'s model (context extension:
the positions; DeepSeek-V3.2: how many keys the indexer keeps and how it trains; the kernels)."""
YARN_KEYS = ("factor", "original_max_seq_len", "beta_fast", "beta_slow", "mscale", "mscale_all_dim")


@dataclass
class ModelConfig:
    """Architecture hyperparameters. ``family`` selects the parts the decoder is built from.

    The fields every model has come first; the rest belong to parts (grouped by the comments
    below; each part's ``FIELDS`` is the list): the attention (grouped-query ``n_kv_heads``, or
    the MLA fields, with the indexer's for DeepSeek Sparse Attention), DeepSeekMoE from
    ``n_dense_layers`` on, ``mtp_depth`` MTP modules, DeepSeek-V4's blocks. A field the family's parts
    do not read is refused when set (:meth:`refuse_unused`); :attr:`attention`, :attr:`moe`,
    :attr:`mtp`, :attr:`is_moe`, :attr:`mtp_modules`, :attr:`rope_dim` and :attr:`kv_heads` say what
    the model really has.
    """

    name: str = "custom"
    family: str = DEFAULT_FAMILY
    """A family id of ``dsl_lit.config.families`` (which blocks the decoder is built from)."""
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
    # -- Multi-head Latent Attention (families with latent attention) --------------------------------
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
    # -- DeepSeekMoE (families with a router) --------------------------------------------------------
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
    """... and only this many groups (ranked by the family's router) are searched for the top-k."""
    score_func: Literal["sigmoid", "softmax", "sqrtsoftplus"] = "sigmoid"
    route_scale: float = 1.0
    norm_topk_prob: bool = True
    seq_balance_alpha: float = 0.0
    """Weight of DeepSeek-V3's complementary sequence-wise balance loss (0.0001 in the paper)."""
    batch_balance_alpha: float = 0.0
    """Weight of the classic batch-wise auxiliary balance loss (off in V3; for comparisons)."""
    expert_backend: Literal["grouped_mm", "split", "loop"] = "grouped_mm"
    """How routed experts run: ``torch._grouped_mm`` on tokens sorted by expert, one matmul per
    expert on the sorted slices, or the naive per-expert masking loop (a reference only)."""
    # -- Multi-token prediction (families with MTP) ---------------------------------------------------
    mtp_depth: int = 0
    """MTP modules asked for; :attr:`mtp_modules` is what the family builds."""
    # -- DeepSeek Sparse Attention (families with a lightning indexer: DeepSeek-V3.2) ----------------
    index_n_heads: int = 64
    """The indexer's query heads (its key has one head)."""
    index_head_dim: int = 128
    """The indexer's head size; its first ``qk_rope_head_dim`` dims carry rotary position."""
    index_topk: int = 2048
    """Keys each query attends to: the ones of highest index score (all of them when fewer)."""
    index_training: Literal["off", "warmup", "sparse"] = "off"
    """How DeepSeek-V3.2 trains its indexer (``models/common/dsa.py``): ``off`` (sparse attention,
    no indexer loss: inference, or training the rest only); ``warmup`` (dense attention; only the
    indexer learns, by KL to the main attention over every causal key); ``sparse`` (top-k attention;
    the indexer learns by KL over the selected keys, its input detached from the language model)."""
    # -- DeepSeek-V4's blocks (families whose card reads them) ---------------------------------------
    attention_head_dim: int = 512
    """The width of every head of V4's shared-KV attention (one key/value head of this width, read
    as both key and value), not tied to ``d_model / n_heads``."""
    attention_kinds: list[str] | None = None
    """Per layer, ``sliding``, ``csa`` (compressed sparse) or ``hca`` (heavily compressed), the first
    ``n_layers`` used (as transformers truncates ``layer_types``, so ``model.n_layers=2`` on a preset
    keeps its first two kinds); None:
    transformers' default schedule (two ``hca`` layers, then ``hca`` and ``csa`` alternating);
    :meth:`attention_kind` reads it."""
    csa_rate: int = 4
    """Tokens per compressed key in ``csa`` layers (windows of twice this, overlapping)."""
    hca_rate: int = 128
    """Tokens per compressed key in ``hca`` layers."""
    compress_rope_theta: float = 160000.0
    """RoPE base of the compressed layers (``rope_scaling``, when set, applies to them only)."""
    sliding_window: int = 128
    """Recent tokens every query attends to in every V4 layer."""
    o_groups: int = 8
    """Head groups of the grouped low-rank output projection."""
    o_lora_rank: int = 1024
    """Each group's projection width before the mix back to ``d_model``."""
    n_hash_layers: int = 3
    """The first MoE layers route by a fixed token-id -> experts table instead of the router's top-k."""
    swiglu_limit: float = 0.0
    """Clamp of the experts' SwiGLU pre-activations (gate from above, up both ways); 0: none."""
    hc_mult: int = 4
    """Residual streams of the manifold-constrained hyper-connections (mHC)."""
    hc_sinkhorn_iters: int = 20
    """Sinkhorn-Knopp iterations projecting the stream mix onto doubly-stochastic matrices."""
    hc_eps: float = 1e-6
    """The floor of mHC's gates and of its Sinkhorn normalisation."""
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def head_dim(self) -> int:
        return self.d_model // self.n_heads

    def attention_kind(self, layer_id: int) -> str:
        """DeepSeek-V4's attention kind of layer ``layer_id`` (:data:`ATTENTION_KINDS`); from
        ``n_layers`` on (the MTP blocks) ``sliding``, as DeepSeek releases them (the MTP layer's
        entry of the release's ``compress_ratios`` is 0)."""
        if layer_id >= self.n_layers:
            return "sliding"
        if self.attention_kinds is not None:
            return self.attention_kinds[layer_id]
        return "hca" if layer_id < 2 or layer_id % 2 == 0 else "csa"

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    def _family(self) -> FamilyCard:
        """This config's family card (``dsl_lit.config.families``)."""
        return family_card(self.family)

    @property
    def attention(self) -> type[AttentionShape]:
        """Its attention part (``config/model_parts/attention.py``): the shape questions (FLOPs, KV and
        activation sizes) are asked of it."""
        return self._family().attention

    @property
    def moe(self) -> RoutedExperts | None:
        """Its routed-experts part; None: a dense model."""
        return self._family().moe

    @property
    def mtp(self) -> MultiTokenPrediction | None:
        """Its multi-token-prediction part; None: the family builds no MTP module."""
        return self._family().mtp

    @property
    def rope_dim(self) -> int:
        """Width of the rotary tables: the whole head (GQA) or the decoupled rope part (MLA)."""
        return self.attention.rope_dim(self)

    @property
    def kv_heads(self) -> int:
        """Key/value heads the attention computes (what tensor parallelism splits): ``n_kv_heads``
        for grouped-query attention, one per query head for MLA."""
        return self.attention.kv_heads(self)

    @property
    def is_moe(self) -> bool:
        return self.moe is not None and self.n_routed_experts > 0

    def is_moe_layer(self, layer_id: int) -> bool:
        """Whether block ``layer_id`` routes (its experts part says; MTP blocks too, as in DeepSeek-V3)."""
        return self.moe is not None and self.moe.routes(self, layer_id)

    @property
    def unsupported_parallel(self) -> dict[str, str]:
        """Parallel dimensions this family cannot run under, each with why (its card says)."""
        return dict(self._family().unsupported_parallel)

    @property
    def split_over_tp(self) -> tuple[str, ...]:
        """Fields tensor parallelism divides over its ranks (its card says)."""
        return tuple(self._family().split_over_tp)

    @property
    def packs_documents(self) -> bool:
        """Whether the attention follows documents packed into one row (SFT's ``sft.packing``)."""
        return self._family().packed_documents

    @property
    def sparse_attention(self) -> bool:
        """Whether the attention is DeepSeek Sparse Attention (a lightning indexer picks the keys)."""
        return self._family().sparse_attention

    @property
    def mtp_modules(self) -> int:
        """Multi-token-prediction modules the model builds: ``mtp_depth`` if the family has MTP."""
        return self.mtp.modules(self) if self.mtp is not None else 0

    def unused_fields(self) -> tuple[str, ...]:
        """The fields this config's family never reads (a value there changes nothing it builds):
        those no part of it reads, and the shared ones its card ignores."""
        card = self._family()
        return tuple(name for name in part_fields() if not card.reads(name)) + card.ignores

    def refuse_unused(self, fields: Any, prefix: str = "model") -> None:
        """ConfigError naming the first of ``fields`` (the ones the user set) that this family never
        reads: ``+model.n_routed_experts=32`` on a dense preset would otherwise train the same dense
        model without a word."""
        unused = self.unused_fields()
        for name in fields:
            if name not in unused:
                continue
            if name == "n_kv_heads" and self.attention.latent:
                raise ConfigError(f"{prefix}.{name} is not used by model.name={self.name} (family {self.family}: its "
                                  "latent attention (MLA) has one key/value head per query head); drop it")
            has = f"a use for {name}" if name in self._family().ignores else owner(name).DESCRIPTION
            raise ConfigError(
                f"{prefix}.{name} is not used by model.name={self.name} (family {self.family}, which has no "
                f"{has}); drop it, or pick a preset of a family that has it (e.g. model=deepseek_v3_tiny)")

    def validate(self, prefix: str = "model") -> ModelConfig:
        """Raise ConfigError naming ``model.<field>`` for values the model cannot be built with: the
        fields every model has, then the family's parts and rules."""
        for name in ("vocab_size", "n_layers", "d_model", "n_heads", "n_kv_heads", "ffn_hidden", "max_seq_len"):
            value = getattr(self, name)
            if not isinstance(value, int) or value <= 0:
                raise ConfigError(f"{prefix}.{name}={value!r} must be a positive integer")
        family_card(self.family, prefix).validate(self, prefix)
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

    @classmethod
    def from_name(cls, name: str, **overrides: Any) -> ModelConfig:
        """Build a preset by name (presets live in their family's folder), with field overrides
        (unknown fields raise ConfigError)."""
        known_presets = presets()
        if name not in known_presets:
            raise ConfigError(f"model.name={name!r} is not a known preset; choose one of {sorted(known_presets)}")
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(overrides) - known)
        if unknown:
            raise ConfigError(f"model.{unknown[0]} is not a ModelConfig field; known fields: {sorted(known)}")
        values = {**known_presets[name], **{k: v for k, v in overrides.items() if v is not None or k in _NULLABLE}}
        return cls(name=name, **values).validate()


_NULLABLE = ("q_lora_rank", "rope_scaling", "attention_kinds")
"""Fields where an explicit ``null`` override means "none" rather than "keep the preset"."""


def continued_config(checkpoint: ModelConfig, run: ModelConfig) -> ModelConfig | None:
    """The architecture a run of ``run``'s family starts from a ``checkpoint`` of another family
    with, when its card ``continues`` that family (DeepSeek-V3.2 from DeepSeek-V3: the checkpoint's
    shape, ``run``'s family and the fields of the modules it adds); None when it does not."""
    card = family_card(run.family)
    if not card.starts_from(checkpoint.family):
        return None
    values = {f.name: getattr(checkpoint, f.name) for f in dataclasses.fields(checkpoint)}
    values.update(name=card.base_preset, family=card.name, **{name: getattr(run, name) for name in card.added_fields})
    return ModelConfig(**values).validate()
