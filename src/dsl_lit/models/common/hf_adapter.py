"""Translation between our models and Hugging Face checkpoints: the adapter base and shared helpers.

An adapter knows two things about one model family: how our ``ModelConfig`` maps to an HF
``config.json`` dict, and how our parameter names (FQNs) map to HF's. It does no file I/O: each
family folder holds its adapter(s) and names them in its ``FamilySpec`` (``hf_readers`` by HF
``model_type``, ``hf_adapter`` for writing); ``dsl_lit.hf.io`` finds them through
:mod:`dsl_lit.models.registry`. The helpers below are shared by the families.

State dicts are translated whole (not name by name) because some families need more than renames,
e.g. stacking per-expert HF weights into one grouped tensor. Renames keep the same tensor objects,
so a rename costs no memory. A process that holds only part of a big model (a pipeline stage, its
experts, tensor shards) reads its tensors one by one instead: :meth:`HFAdapter.hf_sources` says, for
each of our names, which HF tensors make it, without reading any.
"""

from __future__ import annotations

import logging
import math
import re
from abc import ABC, abstractmethod
from collections.abc import Callable, Collection, Iterable, Mapping
from dataclasses import dataclass
from typing import Any, ClassVar

import torch

from data_contract.errors import ConfigError
from dsl_lit.config.model import ModelConfig
from dsl_lit.utils.names import few  # noqa: F401 (importable from here too)

StateDict = dict[str, torch.Tensor]

# Token ids that HF keeps in config.json; we carry them in ModelConfig.extra so a round trip keeps them.
TOKEN_ID_KEYS = ("bos_token_id", "eos_token_id", "pad_token_id")
SCALE_SUFFIX = "_scale_inv"
"""``<weight name><SCALE_SUFFIX>`` names a quantised weight's block scales when the checkpoint is read
(DeepSeek-V3's and transformers' spelling; a layout stored otherwise maps to it in
:meth:`HFAdapter.release_name`)."""


@dataclass(frozen=True)
class HFSource:
    """The HF tensors one of our tensors is made of: a single tensor (renamed), one per routed
    expert stacked along a new first dim (``stacked``), or none (a tensor HF does not store, which
    loads as zeros: DeepSeek-V2's missing balancing bias)."""

    names: tuple[str, ...]
    stacked: bool = False


class HFAdapter(ABC):
    """Config and state-dict translation for one model family; see the module docstring."""

    family: ClassVar[str]
    """Our ``ModelConfig.family``."""
    model_type: ClassVar[str]
    """HF ``config.json`` ``model_type``."""
    architecture: ClassVar[str]
    """HF class written to ``architectures`` (must load with ``AutoModelForCausalLM``)."""
    fp32_suffixes: ClassVar[tuple[str, ...]] = ()
    """HF names ending with one of these are read and written in fp32 whatever dtype is asked for
    (transformers' ``_keep_in_fp32_modules_strict``), e.g. a router's score-correction bias."""
    fp8_weights: ClassVar[re.Pattern[str] | None] = None
    """HF names of the weights the quantised release of this layout stores with block scales
    (DeepSeek-V3's: the attention and MLP / expert projections), in FP8 unless :attr:`fp4_weights`
    names them; None: the layout has no quantised form."""
    fp4_weights: ClassVar[re.Pattern[str] | None] = None
    """Of those, the ones stored in FP4 (``expert_dtype`` "fp4": DeepSeek-V4's routed experts,
    :mod:`dsl_lit.hf.fp4_rows`); None: all FP8."""
    scale_fmt: ClassVar[str] = "float"
    """How the release stores block scales: "float" (fp32, DeepSeek-V3) or "ue8m0"
    (``float8_e8m0fnu`` powers of two, DeepSeek-V4)."""

    @abstractmethod
    def config_from_hf(self, hf: Mapping[str, Any]) -> ModelConfig:
        """Build our config from a ``config.json`` dict; ConfigError naming the HF field if we can't."""

    def config_for_checkpoint(self, cfg: ModelConfig, hf_names: Collection[str]) -> ModelConfig:
        """Adjust ``cfg`` (from :meth:`config_from_hf`) to the tensors the checkpoint really holds,
        e.g. drop optional modules that config.json declares but whose weights were not saved."""
        return cfg

    def release_name(self, stored: str) -> str:
        """The name the adapter reads (the layout DeepSeek releases) of a tensor stored as ``stored``:
        itself, unless the family's files also come in another spelling (transformers' own
        ``save_pretrained`` writes DeepSeek-V4 under its module names)."""
        return stored

    def keeps_fp32(self, hf_name: str) -> bool:
        return hf_name.endswith(self.fp32_suffixes) if self.fp32_suffixes else False

    def quantizes_fp8(self, hf_name: str) -> bool:
        """Whether the quantised release stores ``hf_name`` in block FP8 (with a scale tensor)."""
        quantised = self.fp8_weights is not None and self.fp8_weights.fullmatch(hf_name)
        return bool(quantised) and not self.quantizes_fp4(hf_name)

    def quantizes_fp4(self, hf_name: str) -> bool:
        """Whether the quantised release stores ``hf_name`` in FP4 (with a scale tensor)."""
        return bool(self.fp4_weights is not None and self.fp4_weights.fullmatch(hf_name))

    def scale_name(self, hf_name: str) -> str:
        """The name the release stores the scales of the quantised weight ``hf_name`` under."""
        return hf_name + SCALE_SUFFIX

    @abstractmethod
    def config_to_hf(self, cfg: ModelConfig) -> dict[str, Any]:
        """The architecture part of ``config.json`` (io adds dtype and bookkeeping keys)."""

    @abstractmethod
    def from_hf(self, hf_state: StateDict, cfg: ModelConfig) -> StateDict:
        """HF names -> ours. Raise ConfigError listing names that belong to no parameter of ours."""

    @abstractmethod
    def to_hf(self, state: StateDict, cfg: ModelConfig) -> StateDict:
        """Our names -> HF's, leaving out tensors HF does not store (e.g. a tied output head)."""

    @abstractmethod
    def hf_sources(self, names: Iterable[str], cfg: ModelConfig) -> dict[str, HFSource]:
        """For each of our tensor ``names``, the HF tensors :meth:`from_hf` would make it from,
        without reading any (a tied head names the embedding). ConfigError lists unknown names."""


def keep_present_mtp(cfg: ModelConfig, present: Collection[int], log: logging.Logger) -> ModelConfig:
    """``cfg`` with ``mtp_depth`` cut to the MTP modules 0, 1, ... whose weights the checkpoint holds
    (``present``: their indices), a warning on ``log`` when config.json declares more (transformers
    keeps ``num_nextn_predict_layers`` but saves no MTP layer)."""
    depth = 0
    while depth < cfg.mtp_depth and depth in present:
        depth += 1
    if depth < cfg.mtp_depth:
        log.warning("config.json declares num_nextn_predict_layers=%d but the checkpoint holds weights for %d "
                    "MTP layer(s); loading with mtp_depth=%d", cfg.mtp_depth, depth, depth)
        cfg.mtp_depth = depth
    return cfg


def require(hf: Mapping[str, Any], key: str) -> Any:
    if hf.get(key) is None:
        raise ConfigError(f"config.json is missing {key!r}, which the model cannot be built without")
    return hf[key]


def check_rope_theta_writable(cfg: ModelConfig) -> None:
    """JSON has no infinity or NaN: a config with such a ``rope_theta`` cannot be written."""
    if not math.isfinite(cfg.rope_theta):
        raise ConfigError(f"model.rope_theta={cfg.rope_theta!r} cannot be written to config.json")


# -- pieces shared by the families -----------------------------------------------------------------

# Top-level names, ours -> HF (every family so far).
TOP_NAMES = {
    "tok_embeddings.weight": "model.embed_tokens.weight",
    "norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
# The two norms of a block, ours (after ``layers.<i>.``) -> HF (after ``model.layers.<i>.``).
BLOCK_NORM_NAMES = {
    "attention_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
}
# One SwiGLU (``dsl_lit.models.common.layers.SwiGLU``, or one expert), ours -> HF's ``*_proj`` names.
SWIGLU_NAMES = {
    "w1.weight": "gate_proj.weight",
    "w3.weight": "up_proj.weight",
    "w2.weight": "down_proj.weight",
}


def token_ids_from_hf(hf: Mapping[str, Any]) -> dict[str, Any]:
    """The token ids of config.json, for ``ModelConfig.extra`` (so that a round trip keeps them)."""
    return {k: hf[k] for k in TOKEN_ID_KEYS if hf.get(k) is not None}


def token_ids_to_hf(cfg: ModelConfig) -> dict[str, Any]:
    return {k: cfg.extra[k] for k in TOKEN_ID_KEYS if cfg.extra.get(k) is not None}


def hf_rope(hf: Mapping[str, Any]) -> dict[str, Any]:
    """config.json's RoPE settings as one dict with ``rope_type`` and ``rope_theta``, read the way
    transformers >= 5 reads them: the legacy ``rope_scaling`` (``type`` or ``rope_type``) wins over
    ``rope_parameters``; ``rope_theta`` may sit in either dict or at the top level."""
    params = dict(hf.get("rope_scaling") or hf.get("rope_parameters") or {})
    params.setdefault("rope_type", params.pop("type", "default"))
    theta = params.get("rope_theta")
    if theta is None:
        theta = (hf.get("rope_parameters") or {}).get("rope_theta", hf.get("rope_theta", 10000.0))
    params["rope_theta"] = float(theta)
    return params


def supported_rope(hf: Mapping[str, Any], rope_types: tuple[str, ...], family: str) -> dict[str, Any]:
    """:func:`hf_rope`, or ConfigError naming the field when its type is not in ``rope_types`` or
    it rotates only part of the head."""
    rope = hf_rope(hf)
    source = "rope_scaling" if hf.get("rope_scaling") else "rope_parameters"  # where the user wrote it
    if rope["rope_type"] not in rope_types:
        raise ConfigError(
            f"config.json {source}.rope_type={rope['rope_type']!r} is not supported for the {family} "
            f"family; supported: {rope_types}"
        )
    if rope.get("partial_rotary_factor", 1.0) != 1.0:
        raise ConfigError(
            f"config.json {source}.partial_rotary_factor={rope['partial_rotary_factor']!r} is not "
            "supported; our RoPE rotates the whole rotary head dimension"
        )
    return rope


def reject_unsupported_common(hf: Mapping[str, Any], architecture: str) -> None:
    """ConfigError for config.json fields no family of ours supports: biases, a non-silu
    activation, or an architecture other than the causal LM ``architecture``."""
    where = "config.json"
    for key in ("attention_bias", "mlp_bias"):
        if hf.get(key):
            raise ConfigError(f"{where} {key}=true is not supported: our projections have no bias")
    act = hf.get("hidden_act", "silu")
    if act not in ("silu", "swish"):
        raise ConfigError(f"{where} hidden_act={act!r} is not supported; our SwiGLU uses silu")
    archs = hf.get("architectures") or []
    if archs and architecture not in archs:
        raise ConfigError(
            f"{where} architectures={archs!r}: only {architecture} checkpoints "
            "(causal LM with an lm_head) can be loaded"
        )


def renamed_from_hf(
    hf_state: StateDict,
    cfg: ModelConfig,
    rename: Callable[[str], str | None],
    family: str,
    ignored_suffixes: tuple[str, ...] = (),
) -> StateDict:
    """HF names -> ours through ``rename`` (None: no parameter of ours), handling a tied head.

    ConfigError lists every HF name that ``rename`` does not know.
    """
    out: StateDict = {}
    unknown: list[str] = []
    for hf_name, tensor in hf_state.items():
        if ignored_suffixes and hf_name.endswith(ignored_suffixes):
            continue
        if cfg.tie_embeddings and hf_name == "lm_head.weight":
            continue  # tied: the head is the embedding; a stored copy is redundant
        name = rename(hf_name)
        if name is None:
            unknown.append(hf_name)
        else:
            out[name] = tensor
    if unknown:
        raise ConfigError(
            f"checkpoint has {len(unknown)} weight(s) the {family} model has no parameter for: {few(unknown)}"
        )
    if cfg.tie_embeddings and "tok_embeddings.weight" in out:
        out["output.weight"] = out["tok_embeddings.weight"]
    return out


def renamed_sources(
    names: Iterable[str], cfg: ModelConfig, rename: Callable[[str], str | None]
) -> dict[str, HFSource]:
    """:meth:`HFAdapter.hf_sources` of renamed tensors: each from the HF tensor ``rename`` names;
    a tied output head from the embedding HF stores. ConfigError lists every unknown name."""
    out: dict[str, HFSource] = {}
    unknown: list[str] = []
    for name in names:
        hf_name = rename("tok_embeddings.weight" if cfg.tie_embeddings and name == "output.weight" else name)
        if hf_name is None:
            unknown.append(name)
        else:
            out[name] = HFSource((hf_name,))
    if unknown:
        raise ConfigError(f"model has parameter(s) with no Hugging Face name: {few(unknown)}")
    return out


def renamed_to_hf(state: StateDict, cfg: ModelConfig, rename: Callable[[str], str | None]) -> StateDict:
    """Our names -> HF's through ``rename``, leaving out a tied output head (HF re-ties it from
    ``tie_word_embeddings``). ConfigError lists every name ``rename`` does not know."""
    out: StateDict = {}
    unknown: list[str] = []
    for name, tensor in state.items():
        if cfg.tie_embeddings and name == "output.weight":
            continue
        hf_name = rename(name)
        if hf_name is None:
            unknown.append(name)
        else:
            out[hf_name] = tensor
    if unknown:
        raise ConfigError(f"model has parameter(s) with no Hugging Face name: {few(unknown)}")
    return out
