"""DeepSeek LLM checkpoints on the Hugging Face hub: the plain Llama layout (``LlamaForCausalLM``).

Names and config only; ``dsl_lit.hf.io`` does the file I/O.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

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


class DeepSeekLLMAdapter(HFAdapter):
    """DeepSeek LLM 7B/67B, released in the plain Llama layout (``LlamaForCausalLM``)."""

    family = "deepseek_llm"
    model_type = "llama"
    architecture = "LlamaForCausalLM"

    _TOP = TOP_NAMES
    # Names inside one block, ours (after ``layers.<i>.``) -> HF (after ``model.layers.<i>.``).
    _BLOCK = {
        **BLOCK_NORM_NAMES,
        "attention.wq.weight": "self_attn.q_proj.weight",
        "attention.wk.weight": "self_attn.k_proj.weight",
        "attention.wv.weight": "self_attn.v_proj.weight",
        "attention.wo.weight": "self_attn.o_proj.weight",
        **{f"feed_forward.{ours}": f"mlp.{hf}" for ours, hf in SWIGLU_NAMES.items()},
    }
    _TOP_INV = {v: k for k, v in _TOP.items()}
    _BLOCK_INV = {v: k for k, v in _BLOCK.items()}
    # Old transformers versions saved RoPE's inverse frequencies; we recompute them from rope_theta.
    _IGNORED_HF_SUFFIXES = (".rotary_emb.inv_freq",)

    # -- config -----------------------------------------------------------------------------------

    def config_from_hf(self, hf: Mapping[str, Any]) -> ModelConfig:
        self._reject_unsupported(hf)
        d_model = int(require(hf, "hidden_size"))
        n_heads = int(require(hf, "num_attention_heads"))
        head_dim = hf.get("head_dim")
        if head_dim is not None and n_heads and head_dim * n_heads != d_model:
            raise ConfigError(
                f"config.json head_dim={head_dim} differs from hidden_size / num_attention_heads = "
                f"{d_model}/{n_heads}; our attention derives head_dim from d_model and cannot represent it"
            )
        return ModelConfig(
            name="hf",
            family=self.family,
            vocab_size=int(require(hf, "vocab_size")),
            n_layers=int(require(hf, "num_hidden_layers")),
            d_model=d_model,
            n_heads=n_heads,
            n_kv_heads=int(hf.get("num_key_value_heads") or n_heads),
            ffn_hidden=int(require(hf, "intermediate_size")),
            max_seq_len=int(hf.get("max_position_embeddings", 4096)),
            rope_theta=hf_rope(hf)["rope_theta"],
            norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
            init_std=float(hf.get("initializer_range", 0.02)),
            tie_embeddings=bool(hf.get("tie_word_embeddings", False)),
            extra=token_ids_from_hf(hf),
        )

    @staticmethod
    def _reject_unsupported(hf: Mapping[str, Any]) -> None:
        """ConfigError naming the first HF field whose value this family's model cannot express."""
        supported_rope(hf, ("default",), DeepSeekLLMAdapter.family)
        reject_unsupported_common(hf, DeepSeekLLMAdapter.architecture)

    def config_to_hf(self, cfg: ModelConfig) -> dict[str, Any]:
        check_rope_theta_writable(cfg)
        out: dict[str, Any] = {
            "architectures": [self.architecture],
            "model_type": self.model_type,
            "vocab_size": cfg.vocab_size,
            "hidden_size": cfg.d_model,
            "intermediate_size": cfg.ffn_hidden,
            "num_hidden_layers": cfg.n_layers,
            "num_attention_heads": cfg.n_heads,
            "num_key_value_heads": cfg.n_kv_heads,
            "head_dim": cfg.head_dim,
            "hidden_act": "silu",
            "max_position_embeddings": cfg.max_seq_len,
            "initializer_range": cfg.init_std,
            "rms_norm_eps": cfg.norm_eps,
            # transformers >= 5 reads rope_parameters; older versions read rope_theta/rope_scaling.
            "rope_theta": cfg.rope_theta,
            "rope_scaling": None,
            "rope_parameters": {"rope_type": "default", "rope_theta": cfg.rope_theta},
            "attention_bias": False,
            "mlp_bias": False,
            "attention_dropout": 0.0,
            "pretraining_tp": 1,
            "tie_word_embeddings": cfg.tie_embeddings,
            "use_cache": True,
        }
        out.update(token_ids_to_hf(cfg))
        return out

    # -- weights ----------------------------------------------------------------------------------

    def from_hf(self, hf_state: StateDict, cfg: ModelConfig) -> StateDict:
        return renamed_from_hf(hf_state, cfg, self._hf_to_ours, self.family, self._IGNORED_HF_SUFFIXES)

    def to_hf(self, state: StateDict, cfg: ModelConfig) -> StateDict:
        return renamed_to_hf(state, cfg, self._ours_to_hf)

    def hf_sources(self, names: Iterable[str], cfg: ModelConfig) -> dict[str, HFSource]:
        return renamed_sources(names, cfg, self._ours_to_hf)

    def _hf_to_ours(self, hf_name: str) -> str | None:
        if hf_name in self._TOP_INV:
            return self._TOP_INV[hf_name]
        parts = hf_name.split(".", 3)  # model, layers, <i>, rest
        if len(parts) == 4 and parts[:2] == ["model", "layers"] and parts[2].isdigit():
            rest = self._BLOCK_INV.get(parts[3])
            return None if rest is None else f"layers.{parts[2]}.{rest}"
        return None

    def _ours_to_hf(self, name: str) -> str | None:
        if name in self._TOP:
            return self._TOP[name]
        parts = name.split(".", 2)  # layers, <i>, rest
        if len(parts) == 3 and parts[0] == "layers" and parts[1].isdigit():
            rest = self._BLOCK.get(parts[2])
            return None if rest is None else f"model.layers.{parts[1]}.{rest}"
        return None

