"""The Hugging Face checkpoint layout DeepSeek-V2 and DeepSeek-V3 share (MLA + DeepSeekMoE): the
name tables, the translation of config.json and of the weights, parameterised by each model type's
adapter (``hf_adapter`` for ``DeepseekV3ForCausalLM``, ``v2_hf_adapter`` for ``DeepseekV2ForCausalLM``).

Names and config only; ``dsl_lit.hf.io`` does the file I/O and finds the adapters through the
family registry (``dsl_lit.models.registry``). The layout is that of the Hugging Face hub
checkpoints, which is also what ``transformers`` writes:

* routed experts are stored one by one (``model.layers.<i>.mlp.experts.<e>.gate_proj.weight``,
  ``up_proj``, ``down_proj``); we stack them into ``feed_forward.experts.w1/w3/w2`` [E, out, in]
  (transformers 5 fuses them into ``gate_up_proj`` at load time, in memory only);
* the router's balancing bias is ``mlp.gate.e_score_correction_bias``, where the model type has one
  (:attr:`MLAMoEAdapter.expert_bias`);
* multi-token-prediction module k is the extra decoder layer ``n_layers + k`` with ``enorm``,
  ``hnorm``, ``eh_proj`` and ``shared_head.norm`` next to the usual block weights, plus copies of the
  shared embedding (``embed_tokens``) and head (``shared_head.head``) that we write and drop on load.
* the FP8 release (``quantization_config`` quant_method fp8, read and written by ``dsl_lit.hf``)
  stores the attention projections and every MLP / expert projection in FP8, each with a
  ``weight_scale_inv``; the embedding, norms, router, MTP ``eh_proj`` and heads stay bf16
  (:data:`FP8_WEIGHTS`, the set of ``nn.Linear`` modules transformers quantises in this model,
  whose ``lm_head`` it keeps in full precision and whose router is not an ``nn.Linear``).

Things the layout cannot express raise ConfigError.
"""

from __future__ import annotations

import re
from abc import abstractmethod
from collections.abc import Callable, Iterable, Mapping
from typing import Any, ClassVar

import torch

from data_contract.errors import ConfigError
from dsl_lit.config.model import ModelConfig
from dsl_lit.models.common.hf_adapter import (
    BLOCK_NORM_NAMES,
    SWIGLU_NAMES,
    TOP_NAMES,
    HFAdapter,
    HFSource,
    StateDict,
    check_rope_theta_writable,
    few,
    hf_rope,
    reject_unsupported_common,
    renamed_from_hf,
    renamed_sources,
    renamed_to_hf,
    require,
    supported_rope,
    token_ids_from_hf,
    token_ids_to_hf,
)

# Attention projections, ours -> HF (``attention.<ours>.weight`` -> ``self_attn.<hf>.weight``).
_ATTENTION = {
    "wq": "q_proj",  # only without a low-rank query (q_lora_rank None)
    "wq_a": "q_a_proj",
    "q_norm": "q_a_layernorm",
    "wq_b": "q_b_proj",
    "wkv_a": "kv_a_proj_with_mqa",
    "kv_norm": "kv_a_layernorm",
    "wkv_b": "kv_b_proj",
    "wo": "o_proj",
}
# DeepSeek-V3.2's lightning indexer (``models/common/dsa.py``), ours -> HF, inside the attention.
_INDEXER = ("wq_b.weight", "wk.weight", "k_norm.weight", "k_norm.bias", "weights_proj.weight")
_BIAS = "feed_forward.gate.expert_bias"
_HF_BIAS = "mlp.gate.e_score_correction_bias"
# Names inside one block, ours -> HF (after ``model.layers.<j>.``); per-expert names are separate.
_BLOCK = {
    **BLOCK_NORM_NAMES,
    **{f"attention.{ours}.weight": f"self_attn.{hf}.weight" for ours, hf in _ATTENTION.items()},
    **{f"attention.indexer.{name}": f"self_attn.indexer.{name}" for name in _INDEXER},
    **{f"feed_forward.{ours}": f"mlp.{hf}" for ours, hf in SWIGLU_NAMES.items()},  # dense layers
    **{
        f"feed_forward.shared_experts.{ours}": f"mlp.shared_experts.{hf}" for ours, hf in SWIGLU_NAMES.items()
    },
    "feed_forward.gate.weight": "mlp.gate.weight",
    _BIAS: _HF_BIAS,
}
# The MTP module's own weights, ours (after ``mtp.<k>.``) -> HF (after ``model.layers.<n_layers + k>.``).
_MTP = {
    "enorm.weight": "enorm.weight",
    "hnorm.weight": "hnorm.weight",
    "eh_proj.weight": "eh_proj.weight",
    "norm.weight": "shared_head.norm.weight",
}
# Copies of shared tensors the hub keeps in every MTP layer, HF name -> ours.
_MTP_SHARED = {"embed_tokens.weight": "tok_embeddings.weight", "shared_head.head.weight": "output.weight"}
# Stacked expert weights (ours, in a block) -> the per-expert SwiGLU name (``w1.weight`` ...).
_STACKS = {f"feed_forward.experts.{w}": f"{w}.weight" for w in ("w1", "w2", "w3")}
_SWIGLU_INV = {hf: ours for ours, hf in SWIGLU_NAMES.items()}

_OUR_BLOCK = re.compile(r"(?:layers\.(\d+)|mtp\.(\d+)\.block)\.(.+)")
_OUR_MTP = re.compile(r"mtp\.(\d+)\.(.+)")
_OUR_EXPERT = re.compile(r"feed_forward\.experts\.(\d+)\.(w[123]\.weight)")
HF_LAYER = re.compile(r"model\.layers\.(\d+)\.(.+)")
_HF_EXPERT = re.compile(r"mlp\.experts\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight")
FP8_WEIGHTS = re.compile(
    r"model\.layers\.\d+\.(?:self_attn\.(?:q_proj|q_a_proj|q_b_proj|kv_a_proj_with_mqa|kv_b_proj|o_proj)"
    r"|mlp\.(?:(?:shared_experts|experts\.\d+)\.)?(?:gate_proj|up_proj|down_proj))\.weight"
)
"""HF names of the weights DeepSeek-V3's FP8 release stores in FP8 (main and MTP layers alike)."""

_HF_YARN_KEYS = {  # HF rope_parameters key -> our rope_scaling key
    "factor": "factor",
    "original_max_position_embeddings": "original_max_seq_len",
    "beta_fast": "beta_fast",
    "beta_slow": "beta_slow",
    "mscale": "mscale",
    "mscale_all_dim": "mscale_all_dim",
}


class MLAMoEAdapter(HFAdapter):
    """The layout's translation; a subclass is one model type and says what it has and how it routes."""

    fp8_weights = FP8_WEIGHTS

    score_func: ClassVar[str]
    """The router scoring this model type has (config.json ``scoring_func``)."""
    topk_methods: ClassVar[tuple[str, ...]]
    """``topk_method`` values of this model type's hub configs; the first is the default."""
    expert_bias: ClassVar[bool]
    """Whether the model type stores the router's balancing bias; without one it loads as zeros
    (the scores alone select) and only a zero bias can be written."""
    defaults: ClassVar[dict[str, Any]]
    """transformers' defaults for keys a config.json may leave out (where V2 and V3 differ)."""

    # -- config -----------------------------------------------------------------------------------

    def config_from_hf(self, hf: Mapping[str, Any]) -> ModelConfig:
        self._reject_unsupported(hf)
        n_layers = int(require(hf, "num_hidden_layers"))
        n_experts = int(hf.get("n_routed_experts") or 0)
        max_seq_len = int(hf.get("max_position_embeddings", 4096))
        rope = hf_rope(hf)
        q_lora_rank = hf.get("q_lora_rank")

        def get(key: str) -> Any:
            return hf[key] if key in hf else self.defaults.get(key)

        groups, limited = self._groups_from_hf(hf, get)

        return ModelConfig(
            name="hf",
            family=self.family,
            vocab_size=int(require(hf, "vocab_size")),
            n_layers=n_layers,
            d_model=int(require(hf, "hidden_size")),
            n_heads=int(require(hf, "num_attention_heads")),
            n_kv_heads=int(require(hf, "num_attention_heads")),  # MLA: every head has its own key
            ffn_hidden=int(require(hf, "intermediate_size")),
            max_seq_len=max_seq_len,
            rope_theta=rope["rope_theta"],
            norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
            init_std=float(hf.get("initializer_range", 0.02)),
            tie_embeddings=bool(hf.get("tie_word_embeddings", False)),
            q_lora_rank=None if q_lora_rank is None else int(q_lora_rank),
            kv_lora_rank=int(require(hf, "kv_lora_rank")),
            qk_nope_head_dim=int(require(hf, "qk_nope_head_dim")),
            qk_rope_head_dim=int(require(hf, "qk_rope_head_dim")),
            v_head_dim=int(require(hf, "v_head_dim")),
            rope_interleave=bool(hf.get("rope_interleave", True)),
            rope_scaling=self._yarn_from_hf(rope, max_seq_len),
            n_dense_layers=min(int(get("first_k_dense_replace") or 0), n_layers) if n_experts else n_layers,
            n_routed_experts=n_experts,
            n_shared_experts=int(hf.get("n_shared_experts") or 0),
            n_activated_experts=int(require(hf, "num_experts_per_tok")) if n_experts else 0,
            moe_ffn_hidden=int(require(hf, "moe_intermediate_size")) if n_experts else 0,
            n_expert_groups=groups,
            n_limited_groups=limited,
            score_func=self.score_func,  # type: ignore[arg-type]
            route_scale=float(get("routed_scaling_factor")),
            norm_topk_prob=bool(get("norm_topk_prob")),
            mtp_depth=self._mtp_depth_from_hf(get),
            extra=token_ids_from_hf(hf),
        )

    @abstractmethod
    def _groups_from_hf(self, hf: Mapping[str, Any], get: Callable[[str], Any]) -> tuple[int, int]:
        """(n_expert_groups, n_limited_groups) read from ``hf`` (``get`` falls back on :attr:`defaults`)."""

    @abstractmethod
    def _mtp_depth_from_hf(self, get: Callable[[str], Any]) -> int:
        """The number of MTP modules config.json declares (``get`` falls back on :attr:`defaults`)."""

    @abstractmethod
    def _topk_method(self, cfg: ModelConfig) -> str:
        """The ``topk_method`` written for ``cfg``."""

    @abstractmethod
    def _config_keys_to_hf(self, cfg: ModelConfig) -> dict[str, Any]:
        """The config.json keys only this model type writes."""

    def _reject_unsupported(self, hf: Mapping[str, Any]) -> None:
        """ConfigError naming the first config.json field our model cannot express."""
        where = f"config.json (model_type {self.model_type!r})"
        reject_unsupported_common(hf, self.architecture)
        score_func = hf.get("scoring_func") or self.score_func
        if score_func != self.score_func:
            raise ConfigError(
                f"{where} scoring_func={score_func!r} is not supported: this model type routes with "
                f"{self.score_func!r} scores"
            )
        topk_method = hf.get("topk_method") or self.topk_methods[0]
        if topk_method not in self.topk_methods:
            raise ConfigError(
                f"{where} topk_method={topk_method!r} is not supported; supported: {list(self.topk_methods)}"
            )
        if (hf.get("moe_layer_freq") or 1) != 1:
            raise ConfigError(
                f"{where} moe_layer_freq={hf['moe_layer_freq']!r} is not supported; every "
                "layer from first_k_dense_replace on must be MoE (moe_layer_freq=1)"
            )
        kv_heads = hf.get("num_key_value_heads")
        if kv_heads is not None and kv_heads != hf.get("num_attention_heads"):
            raise ConfigError(
                f"{where} num_key_value_heads={kv_heads!r} differs from num_attention_heads="
                f"{hf.get('num_attention_heads')!r}; Multi-head Latent Attention has one key per head"
            )
        if hf.get("use_mla") is False:
            raise ConfigError(f"{where} use_mla=false is not supported: the {self.family} family is MLA only")
        self._reject_conventions(hf, where)
        rope = supported_rope(hf, ("default", "yarn"), self.family)
        if rope["rope_type"] == "yarn":
            if rope.get("attention_factor") is not None:
                raise ConfigError(
                    f"{where} rope_parameters.attention_factor={rope['attention_factor']!r} is "
                    "not supported; we derive it from factor, mscale and mscale_all_dim"
                )
            if rope.get("truncate", True) is not True:
                raise ConfigError(f"{where} rope_parameters.truncate={rope['truncate']!r} is not supported")

    def _reject_conventions(self, hf: Mapping[str, Any], where: str) -> None:
        """ConfigError for a config.json field that breaks this model type's own conventions; none here."""

    @staticmethod
    def _yarn_from_hf(rope: Mapping[str, Any], max_seq_len: int) -> dict[str, Any] | None:
        if rope["rope_type"] != "yarn":
            return None
        # As transformers: the original length defaults to max_position_embeddings, the factor to
        # their ratio.
        original = rope.get("original_max_position_embeddings") or max_seq_len
        scaling: dict[str, Any] = {
            "factor": rope.get("factor") or max_seq_len / original,
            "original_max_seq_len": original,
        }
        for hf_key, ours in _HF_YARN_KEYS.items():
            if ours not in scaling and rope.get(hf_key) is not None:
                scaling[ours] = rope[hf_key]
        return scaling

    def config_to_hf(self, cfg: ModelConfig) -> dict[str, Any]:
        return self._writer(cfg)._config_to_hf(cfg)

    def _writer(self, cfg: ModelConfig) -> MLAMoEAdapter:
        """The adapter whose model type ``cfg`` is written as (ConfigError if none can express it)."""
        self._check_writable(cfg)
        return self

    def _check_writable(self, cfg: ModelConfig) -> None:
        check_rope_theta_writable(cfg)

    def _config_to_hf(self, cfg: ModelConfig) -> dict[str, Any]:
        rope_parameters: dict[str, Any] = {"rope_type": "default", "rope_theta": cfg.rope_theta}
        rope_scaling: dict[str, Any] | None = None
        if cfg.rope_scaling:
            yarn = {
                hf: cfg.rope_scaling[ours] for hf, ours in _HF_YARN_KEYS.items() if ours in cfg.rope_scaling
            }
            rope_parameters = {"rope_type": "yarn", "rope_theta": cfg.rope_theta, **yarn}
            rope_scaling = {"type": "yarn", **yarn}  # the hub's (transformers 4) form
        out: dict[str, Any] = {
            "architectures": [self.architecture],
            "model_type": self.model_type,
            "vocab_size": cfg.vocab_size,
            "hidden_size": cfg.d_model,
            "intermediate_size": cfg.ffn_hidden,
            "moe_intermediate_size": cfg.moe_ffn_hidden,
            "num_hidden_layers": cfg.n_layers,
            "num_attention_heads": cfg.n_heads,
            "num_key_value_heads": cfg.n_heads,
            "n_shared_experts": cfg.n_shared_experts,
            "n_routed_experts": cfg.n_routed_experts,
            "routed_scaling_factor": cfg.route_scale,
            "kv_lora_rank": cfg.kv_lora_rank,
            "q_lora_rank": cfg.q_lora_rank,
            "qk_rope_head_dim": cfg.qk_rope_head_dim,
            "v_head_dim": cfg.v_head_dim,
            "qk_nope_head_dim": cfg.qk_nope_head_dim,
            "n_group": cfg.n_expert_groups,
            "topk_group": cfg.n_limited_groups,
            "num_experts_per_tok": cfg.n_activated_experts,
            "first_k_dense_replace": cfg.n_dense_layers,
            "moe_layer_freq": 1,
            "norm_topk_prob": cfg.norm_topk_prob,
            "scoring_func": self.score_func,
            "topk_method": self._topk_method(cfg),
            "hidden_act": "silu",
            "max_position_embeddings": cfg.max_seq_len,
            "initializer_range": cfg.init_std,
            "rms_norm_eps": cfg.norm_eps,
            # transformers >= 5 reads rope_parameters (but lets a legacy rope_scaling win); the hub
            # configs and transformers 4 use rope_theta / rope_scaling.
            "rope_theta": cfg.rope_theta,
            "rope_scaling": rope_scaling,
            "rope_parameters": rope_parameters,
            "attention_bias": False,
            "attention_dropout": 0.0,
            "tie_word_embeddings": cfg.tie_embeddings,
            "use_cache": True,
        }
        out.update(self._config_keys_to_hf(cfg))
        out.update(token_ids_to_hf(cfg))
        return out

    # -- weights ----------------------------------------------------------------------------------

    def from_hf(self, hf_state: StateDict, cfg: ModelConfig) -> StateDict:
        kept = {n: t for n, t in hf_state.items() if not self._is_mtp_shared_copy(n, cfg)}
        flat = renamed_from_hf(
            kept, cfg, lambda n: self._hf_to_ours(n, cfg), self.family, (".rotary_emb.inv_freq",)
        )
        state = self._stack_experts(flat, cfg)
        if not self.expert_bias and cfg.is_moe and state:
            # No balancing bias stored: a zero bias selects by the scores alone.
            device = next(iter(state.values())).device
            for prefix in self._moe_blocks(cfg):
                state[prefix + _BIAS] = torch.zeros(cfg.n_routed_experts, dtype=torch.float32, device=device)
        return state

    def to_hf(self, state: StateDict, cfg: ModelConfig) -> StateDict:
        writer = self._writer(cfg)
        flat: StateDict = {}
        for name, tensor in state.items():
            block = _OUR_BLOCK.fullmatch(name)
            if block and block[3] in _STACKS:  # [E, out, in] -> one [out, in] per expert (views)
                prefix = name.removesuffix(block[3])
                for e, weight in enumerate(tensor.unbind(0)):
                    flat[f"{prefix}feed_forward.experts.{e}.{_STACKS[block[3]]}"] = weight
            elif block and block[3] == _BIAS and not writer.expert_bias:
                if tensor.any():
                    raise ConfigError(
                        f"{name} is non-zero, but model_type {writer.model_type!r} (softmax routing) has no "
                        "expert bias; a model trained with bias updates needs sigmoid routing (deepseek_v3)"
                    )
            else:
                flat[name] = tensor
        out = renamed_to_hf(flat, cfg, lambda n: self._ours_to_hf(n, cfg))
        for k in range(cfg.mtp_depth):  # the hub repeats the shared embedding and head in MTP layers
            for hf_name, ours in _MTP_SHARED.items():
                out[f"model.layers.{cfg.n_layers + k}.{hf_name}"] = state[ours]
        return out

    def hf_sources(self, names: Iterable[str], cfg: ModelConfig) -> dict[str, HFSource]:
        out: dict[str, HFSource] = {}
        renamed: list[str] = []
        for name in names:
            block = _OUR_BLOCK.fullmatch(name)
            if block and block[3] in _STACKS:  # one [out, in] HF tensor per expert
                prefix = name.removesuffix(block[3])
                experts = (f"{prefix}feed_forward.experts.{e}.{_STACKS[block[3]]}" for e in range(cfg.n_routed_experts))
                out[name] = HFSource(tuple(self._ours_to_hf(n, cfg) or n for n in experts), stacked=True)
            elif block and block[3] == _BIAS and not self.expert_bias:
                out[name] = HFSource(())  # no balancing bias stored: zeros (see from_hf)
            else:
                renamed.append(name)
        return out | renamed_sources(renamed, cfg, lambda n: self._ours_to_hf(n, cfg))

    def _ours_to_hf(self, name: str, cfg: ModelConfig) -> str | None:
        if name in TOP_NAMES:
            return TOP_NAMES[name]
        block = _OUR_BLOCK.fullmatch(name)
        if block:
            j = int(block[1]) if block[1] is not None else cfg.n_layers + int(block[2])
            rest = block[3]
            expert = _OUR_EXPERT.fullmatch(rest)
            if expert:
                return f"model.layers.{j}.mlp.experts.{expert[1]}.{SWIGLU_NAMES[expert[2]]}"
            return f"model.layers.{j}.{_BLOCK[rest]}" if rest in _BLOCK else None
        mtp = _OUR_MTP.fullmatch(name)
        if mtp and mtp[2] in _MTP:
            return f"model.layers.{cfg.n_layers + int(mtp[1])}.{_MTP[mtp[2]]}"
        return None

    def _hf_to_ours(self, hf_name: str, cfg: ModelConfig) -> str | None:
        if hf_name in _TOP_INV:
            return _TOP_INV[hf_name]
        layer = HF_LAYER.fullmatch(hf_name)
        if layer is None:
            return None
        j, rest = int(layer[1]), layer[2]
        if j < cfg.n_layers:
            prefix = f"layers.{j}."
        else:  # an MTP layer (or, past mtp_depth, one check_state_dict reports as unexpected)
            if rest in _MTP_INV:
                return f"mtp.{j - cfg.n_layers}.{_MTP_INV[rest]}"
            prefix = f"mtp.{j - cfg.n_layers}.block."
        expert = _HF_EXPERT.fullmatch(rest)
        if expert:
            return f"{prefix}feed_forward.experts.{expert[1]}.{_SWIGLU_INV[expert[2] + '.weight']}"
        inner = _BLOCK_INV.get(rest)
        if inner is None or (inner == _BIAS and not self.expert_bias):
            return None
        return prefix + inner

    @staticmethod
    def _is_mtp_shared_copy(hf_name: str, cfg: ModelConfig) -> bool:
        layer = HF_LAYER.fullmatch(hf_name)
        return bool(layer and int(layer[1]) >= cfg.n_layers and layer[2] in _MTP_SHARED)

    @staticmethod
    def _moe_blocks(cfg: ModelConfig) -> list[str]:
        """Our name prefixes of the MoE blocks, main layers and MTP blocks."""
        main = [f"layers.{i}." for i in range(cfg.n_layers) if cfg.is_moe_layer(i)]
        return main + [f"mtp.{k}.block." for k in range(cfg.mtp_depth) if cfg.is_moe_layer(cfg.n_layers + k)]

    @staticmethod
    def _stack_experts(flat: StateDict, cfg: ModelConfig) -> StateDict:
        """Per-expert ``...experts.<e>.w1.weight`` -> stacked ``...experts.w1`` [E, out, in]."""
        out: StateDict = {}
        groups: dict[str, dict[int, torch.Tensor]] = {}
        for name, tensor in flat.items():
            prefix, sep, rest = name.partition("feed_forward.experts.")
            expert = _OUR_EXPERT.fullmatch(sep + rest) if sep else None
            if expert is None:
                out[name] = tensor
            else:
                groups.setdefault(f"{prefix}feed_forward.experts.{expert[2].removesuffix('.weight')}", {})[
                    int(expert[1])
                ] = tensor
        missing: list[str] = []
        unexpected: list[str] = []
        for stacked, experts in groups.items():
            expected = range(cfg.n_routed_experts)
            missing += [f"{stacked}[{e}]" for e in expected if e not in experts]
            unexpected += [f"{stacked}[{e}]" for e in experts if e not in expected]
            if not missing and not unexpected:
                out[stacked] = torch.stack([experts[e] for e in expected])
        if missing or unexpected:
            problems = [f"missing {len(missing)} expert weight(s): {few(missing)}"] if missing else []
            if unexpected:
                problems.append(
                    f"{len(unexpected)} expert weight(s) beyond n_routed_experts={cfg.n_routed_experts}: "
                    f"{few(unexpected)}"
                )
            raise ConfigError("checkpoint experts do not match config.json: " + "; ".join(problems))
        return out


_TOP_INV = {hf: ours for ours, hf in TOP_NAMES.items()}
_BLOCK_INV = {hf: ours for ours, hf in _BLOCK.items()}
_MTP_INV = {hf: ours for ours, hf in _MTP.items()}
