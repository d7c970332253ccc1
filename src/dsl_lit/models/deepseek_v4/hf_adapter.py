"""DeepSeek-V4 checkpoints in the layout DeepSeek releases them (the hub's ``deepseek-ai/DeepSeek-V4-*``
files, which transformers 5.24 renames on load with its ``deepseek_v4`` conversion mapping).

Names, ours -> released (no ``model.`` prefix):

* ``tok_embeddings`` -> ``embed``, ``output`` -> ``head``, ``norm`` -> ``norm``,
  ``hc_head.{fn,base,scale}`` -> ``hc_head_{fn,base,scale}``;
* per block ``layers.<i>.``: ``attention.`` -> ``attn.`` (inside, DeepSeek's own names already:
  ``wq_a``, ``q_norm``, ``wkv``, ``attn_sink``, ``compressor.ape``, ``indexer.compressor.wkv``, ...),
  ``attention_norm`` -> ``attn_norm``, ``ffn_norm`` -> ``ffn_norm``, ``attention_hc.{fn,base,scale}``
  -> ``hc_attn_{fn,base,scale}``, ``ffn_hc.*`` -> ``hc_ffn_*``, ``feed_forward.`` -> ``ffn.`` with
  ``gate.expert_bias`` -> ``gate.bias`` (hash layers: ``gate.tid2eid``, no bias) and the stacked
  experts ``experts.w1/w2/w3`` [E, out, in] written one per expert (``ffn.experts.<e>.w1.weight``);
* per MTP module ``mtp.<k>.`` (DeepSeek's ``MTPBlock``, which is a block: its names are a layer's,
  under ``mtp.<k>.`` rather than ``layers.<i>.``): ``block.`` -> nothing (``mtp.<k>.block.attention.wq_a``
  -> ``mtp.<k>.attn.wq_a``, ``mtp.<k>.block.attention_hc.fn`` -> ``mtp.<k>.hc_attn_fn``, ...), its own
  ``enorm``, ``hnorm``, ``e_proj``, ``h_proj``, ``norm`` alike and ``hc_head.{fn,base,scale}`` ->
  ``hc_head_{fn,base,scale}``. The embedding and head are the main model's (a copy some releases keep
  as ``mtp.<k>.head.weight`` or ``mtp.<k>.emb.tok_emb.weight`` is dropped on reading, none written).

Checkpoints that transformers' own ``save_pretrained`` wrote (its module names: ``model.`` prefix,
``embed_tokens``, ``hc_head.hc_*``, ``attn.norm``) read too (:meth:`DeepseekV4Adapter.release_name`).

The quantised release (``save_pretrained(fp8=True)``, :mod:`dsl_lit.hf.quantised`): the projections
in :data:`FP8_WEIGHTS` (the MTP layers' too, their ``e_proj`` and ``h_proj`` with them) stored with
their scales as ``<module>.scale`` (transformers' spelling, ``<module>.weight_scale_inv``, reads too),
every scale a ``float8_e8m0fnu`` power of two (``quantization_config.scale_fmt`` "ue8m0"); the routed
experts FP4 (``expert_dtype`` "fp4", :mod:`dsl_lit.hf.fp4_rows`), the rest e4m3 in 128x128 blocks.

config.json is transformers' ``DeepseekV4Config`` (``layer_types``, ``mlp_layer_types``,
``compress_rates``, nested ``rope_parameters``), ``num_nextn_predict_layers`` the MTP modules
(``mtp_depth``; transformers builds none and skips ``mtp.*`` on load). Reading keeps the MTP layers
config.json declares and the files hold (:meth:`DeepseekV4Adapter.config_for_checkpoint`: the files
transformers' ``save_pretrained`` writes hold none); a model built with fewer leaves the rest out,
with a log line. An MTP layer whose keys are compressed (a nonzero ``compress_ratios`` entry past the
layers', in DeepSeek's own config.json) is refused: every release's MTP layer attends through its
sliding window only.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Collection, Iterable, Mapping
from typing import Any

import torch

from data_contract.errors import ConfigError
from dsl_lit.config.model import ModelConfig
from dsl_lit.config.model_parts.v4_attention import ATTENTION_KINDS
from dsl_lit.models.common.hf_adapter import (
    SCALE_SUFFIX,
    HFAdapter,
    HFSource,
    StateDict,
    check_rope_theta_writable,
    keep_present_mtp,
    renamed_from_hf,
    renamed_sources,
    renamed_to_hf,
    require,
    token_ids_from_hf,
    token_ids_to_hf,
)

log = logging.getLogger(__name__)

LAYER_TYPES = dict(zip(ATTENTION_KINDS, ("sliding_attention", "compressed_sparse_attention",
                                          "heavily_compressed_attention"), strict=True))
"""Our attention kind -> transformers' ``layer_types`` value."""
_KIND = {hf: ours for ours, hf in LAYER_TYPES.items()}
_TOP = {"tok_embeddings.weight": "embed.weight", "output.weight": "head.weight", "norm.weight": "norm.weight",
        **{f"hc_head.{p}": f"hc_head_{p}" for p in ("fn", "base", "scale")}}
_TOP_INV = {hf: ours for ours, hf in _TOP.items()}
_BLOCK_PREFIXES = (("attention.", "attn."), ("feed_forward.", "ffn."))
_BLOCK_PREFIXES_INV = tuple((hf, ours) for ours, hf in _BLOCK_PREFIXES)
_BLOCK = {"attention_norm.weight": "attn_norm.weight", "ffn_norm.weight": "ffn_norm.weight",
          "feed_forward.gate.expert_bias": "ffn.gate.bias",
          **{f"attention_hc.{p}": f"hc_attn_{p}" for p in ("fn", "base", "scale")},
          **{f"ffn_hc.{p}": f"hc_ffn_{p}" for p in ("fn", "base", "scale")}}
_BLOCK_INV = {hf: ours for ours, hf in _BLOCK.items()}
_MTP_OWN = {**{f"{w}.weight": f"{w}.weight" for w in ("enorm", "hnorm", "e_proj", "h_proj", "norm")},
            **{f"hc_head.{p}": f"hc_head_{p}" for p in ("fn", "base", "scale")}}
"""An MTP module's own tensors (after ``mtp.<k>.``), ours -> released; its block's are a layer's."""
_MTP_OWN_INV = {hf: ours for ours, hf in _MTP_OWN.items()}
_MTP_SHARED = ("embed.weight", "emb.tok_emb.weight", "head.weight")
"""Copies of the shared embedding and head some releases keep in an MTP layer (``mtp.<k>.``): dropped."""
_STACK = re.compile(r"(layers\.\d+|mtp\.\d+\.block)\.feed_forward\.experts\.(w[123])")
_HF_EXPERT = re.compile(r"((?:layers|mtp)\.\d+)\.ffn\.experts\.(\d+)\.(w[123])\.weight")
_OUR_BLOCK = re.compile(r"(layers\.\d+|mtp\.\d+\.block)\.(.+)")
_HF_BLOCK = re.compile(r"((?:layers|mtp)\.\d+)\.(.+)")
_MTP = re.compile(r"mtp\.(\d+)\.(.+)")
_SAVED_BY_TRANSFORMERS = tuple((re.compile(p), r) for p, r in (
    (r"^model\.", ""), (r"^embed_tokens\.", "embed."), (r"^hc_head\.hc_(fn|base|scale)$", r"hc_head_\1"),
    (r"^(layers\.\d+\.attn\.)norm\.weight$", r"\1kv_norm.weight")))
"""transformers' ``save_pretrained`` names -> the release's (applied in order; measured on
transformers 5.24: these four are every difference, the rest, ``head.weight`` included, agree)."""
_RELEASED_SCALE = re.compile(r"^(.+)\.scale$")
"""A quantised weight's scales as the release names them (``layers.0.attn.wq_a.scale``: DeepSeek's
inference code's ``Linear.scale``); read as ``<weight>_scale_inv`` (transformers renames them alike).
The mHC parameters end in ``_scale``, never ``.scale``."""
FP32_SUFFIXES = ("attn_sink", ".ape", "gate.bias", "norm.weight", *(f"hc_{w}_{p}" for w in ("attn", "ffn", "head")
                                                                     for p in ("fn", "base", "scale")))
"""Released names kept in fp32 whatever dtype the rest is written in (transformers'
``_keep_in_fp32_modules_strict`` for V4: norms, sinks, window biases, mHC, the balancing bias)."""
FP8_WEIGHTS = re.compile(r"(?:(?:layers|mtp)\.\d+\.(?:attn\.(?:wq_a|wq_b|wkv|wo_a|wo_b|indexer\.wq_b)"
                         r"|ffn\.(?:shared_experts|experts\.\d+)\.w[123])|mtp\.\d+\.[eh]_proj)\.weight")
"""Released names stored quantised, a ``.scale`` beside each: the attention's projections, the
indexer's query projection and every expert, in the MTP layers as in the others, and the MTP
layers' ``e_proj`` and ``h_proj`` (DeepSeek's ``MTPBlock`` builds them as every other ``Linear``, in
the release's FP8); the compressors' ``wkv`` and ``wgate``, the indexer's ``weights_proj``
(transformers' V4 lists them as shipping in BF16), the router, embedding and head stay in the
model's dtype."""
FP4_WEIGHTS = re.compile(r"(?:layers|mtp)\.\d+\.ffn\.experts\.\d+\.w[123]\.weight")
"""Of those, the routed experts are FP4 (``expert_dtype`` "fp4": e2m1 pairs in int8, 1x32 scale
groups); the rest FP8 in 128x128 blocks. Every scale is a ``float8_e8m0fnu`` power of two."""


class DeepseekV4Adapter(HFAdapter):
    family = "deepseek_v4"
    model_type = "deepseek_v4"
    architecture = "DeepseekV4ForCausalLM"
    fp32_suffixes = FP32_SUFFIXES
    fp8_weights = FP8_WEIGHTS
    fp4_weights = FP4_WEIGHTS
    scale_fmt = "ue8m0"

    # -- config -----------------------------------------------------------------------------------
    def config_from_hf(self, hf: Mapping[str, Any]) -> ModelConfig:
        n_layers = int(require(hf, "num_hidden_layers"))
        head_dim = int(require(hf, "head_dim"))
        if int(hf.get("num_key_value_heads", 1)) != 1:
            raise ConfigError(f"config.json num_key_value_heads={hf['num_key_value_heads']!r}: DeepSeek-V4's "
                              "attention has one shared key/value head")
        layer_types = hf.get("layer_types") or []
        unknown = [t for t in layer_types if t not in _KIND]
        if unknown or len(layer_types) != n_layers:
            raise ConfigError(f"config.json layer_types must list one of {sorted(_KIND)} per layer ({n_layers}); "
                              f"got {layer_types!r}")
        mlp_types = list(hf.get("mlp_layer_types") or [])
        n_hash = sum(1 for t in mlp_types if t == "hash_moe")
        if mlp_types != ["hash_moe"] * n_hash + ["moe"] * (n_layers - n_hash):
            raise ConfigError(f"config.json mlp_layer_types must be hash_moe layers first, then moe; got {mlp_types!r}")
        rates = hf.get("compress_rates") or {}
        mtp_depth = int(hf.get("num_nextn_predict_layers") or 0)
        ratios = hf.get("compress_ratios")  # DeepSeek's own config.json lists the MTP layers' after the others'
        if isinstance(ratios, list) and any(ratios[n_layers : n_layers + mtp_depth]):
            raise ConfigError(f"config.json compress_ratios={ratios[n_layers:]!r} for the MTP layers: ours attend "
                              "through the sliding window only, as DeepSeek releases them (a ratio of 0)")
        rope = hf.get("rope_parameters") or {}
        main, compress = rope.get("main") or {}, rope.get("compress") or {}
        partial = float(hf.get("partial_rotary_factor") or main.get("partial_rotary_factor") or 0.125)
        return ModelConfig(
            name="hf", family=self.family,
            vocab_size=int(require(hf, "vocab_size")), n_layers=n_layers, d_model=int(require(hf, "hidden_size")),
            n_heads=int(require(hf, "num_attention_heads")), max_seq_len=int(hf.get("max_position_embeddings", 4096)),
            rope_theta=float(main.get("rope_theta", hf.get("rope_theta", 10000.0))),
            norm_eps=float(hf.get("rms_norm_eps", 1e-6)), init_std=float(hf.get("initializer_range", 0.02)),
            tie_embeddings=bool(hf.get("tie_word_embeddings", False)),
            attention_head_dim=head_dim, q_lora_rank=int(require(hf, "q_lora_rank")),
            qk_rope_head_dim=int(round(head_dim * partial)),
            rope_scaling=self._yarn_from_hf(compress),
            n_routed_experts=int(require(hf, "n_routed_experts")), n_shared_experts=int(hf.get("n_shared_experts", 1)),
            n_activated_experts=int(require(hf, "num_experts_per_tok")),
            moe_ffn_hidden=int(require(hf, "moe_intermediate_size")),
            score_func=hf.get("scoring_func", "sqrtsoftplus"), route_scale=float(hf.get("routed_scaling_factor", 1.0)),
            norm_topk_prob=bool(hf.get("norm_topk_prob", True)),
            attention_kinds=[_KIND[t] for t in layer_types],
            csa_rate=int(rates.get("compressed_sparse_attention", 4)),
            hca_rate=int(rates.get("heavily_compressed_attention", 128)),
            compress_rope_theta=float(compress.get("rope_theta", hf.get("compress_rope_theta", 160000.0))),
            sliding_window=int(require(hf, "sliding_window")), o_groups=int(require(hf, "o_groups")),
            o_lora_rank=int(require(hf, "o_lora_rank")), index_n_heads=int(require(hf, "index_n_heads")),
            index_head_dim=int(require(hf, "index_head_dim")), index_topk=int(require(hf, "index_topk")),
            n_hash_layers=n_hash, swiglu_limit=float(hf.get("swiglu_limit") or 0.0),
            hc_mult=int(hf.get("hc_mult", 4)), hc_sinkhorn_iters=int(hf.get("hc_sinkhorn_iters", 20)),
            hc_eps=float(hf.get("hc_eps", 1e-6)), mtp_depth=mtp_depth, extra=token_ids_from_hf(hf),
        )

    @staticmethod
    def _yarn_from_hf(compress: Mapping[str, Any]) -> dict[str, Any] | None:
        if compress.get("rope_type", "default") != "yarn":
            return None
        scaling = {"factor": compress["factor"],
                   "original_max_seq_len": compress["original_max_position_embeddings"]}
        for key in ("beta_fast", "beta_slow"):
            if compress.get(key) is not None:
                scaling[key] = compress[key]
        return scaling

    def config_to_hf(self, cfg: ModelConfig) -> dict[str, Any]:
        check_rope_theta_writable(cfg)
        partial = cfg.qk_rope_head_dim / cfg.attention_head_dim
        compress: dict[str, Any] = {"rope_type": "default", "rope_theta": cfg.compress_rope_theta,
                                    "partial_rotary_factor": partial}
        if cfg.rope_scaling:
            compress.update(rope_type="yarn", factor=cfg.rope_scaling["factor"], attention_factor=1.0,
                            original_max_position_embeddings=cfg.rope_scaling["original_max_seq_len"],
                            **{k: cfg.rope_scaling[k] for k in ("beta_fast", "beta_slow") if k in cfg.rope_scaling})
        out = {
            "architectures": [self.architecture], "model_type": self.model_type,
            "vocab_size": cfg.vocab_size, "hidden_size": cfg.d_model, "num_hidden_layers": cfg.n_layers,
            "num_attention_heads": cfg.n_heads, "num_key_value_heads": 1, "head_dim": cfg.attention_head_dim,
            "q_lora_rank": cfg.q_lora_rank, "partial_rotary_factor": partial,
            "moe_intermediate_size": cfg.moe_ffn_hidden, "n_routed_experts": cfg.n_routed_experts,
            "n_shared_experts": cfg.n_shared_experts, "num_experts_per_tok": cfg.n_activated_experts,
            "scoring_func": cfg.score_func, "norm_topk_prob": cfg.norm_topk_prob,
            "routed_scaling_factor": cfg.route_scale, "max_position_embeddings": cfg.max_seq_len,
            "rope_theta": cfg.rope_theta, "compress_rope_theta": cfg.compress_rope_theta,
            "rope_parameters": {"main": {"rope_type": "default", "rope_theta": cfg.rope_theta,
                                         "partial_rotary_factor": partial}, "compress": compress},
            "layer_types": [LAYER_TYPES[cfg.attention_kind(i)] for i in range(cfg.n_layers)],
            "compress_rates": {"compressed_sparse_attention": cfg.csa_rate, "heavily_compressed_attention": cfg.hca_rate},
            "mlp_layer_types": ["hash_moe"] * cfg.n_hash_layers + ["moe"] * (cfg.n_layers - cfg.n_hash_layers),
            "hc_mult": cfg.hc_mult, "hc_sinkhorn_iters": cfg.hc_sinkhorn_iters, "hc_eps": cfg.hc_eps,
            "swiglu_limit": cfg.swiglu_limit, "sliding_window": cfg.sliding_window, "o_groups": cfg.o_groups,
            "o_lora_rank": cfg.o_lora_rank, "index_n_heads": cfg.index_n_heads, "index_head_dim": cfg.index_head_dim,
            "index_topk": cfg.index_topk, "num_nextn_predict_layers": cfg.mtp_modules, "hidden_act": "silu",
            "rms_norm_eps": cfg.norm_eps, "initializer_range": cfg.init_std,
            "tie_word_embeddings": cfg.tie_embeddings, "attention_bias": False, "use_cache": True,
        }
        out.update(token_ids_to_hf(cfg))
        return out

    # -- weights ----------------------------------------------------------------------------------
    def release_name(self, stored: str) -> str:
        """transformers' ``save_pretrained`` of its ``DeepseekV4ForCausalLM`` writes the module names
        (``model.`` prefix, ``embed_tokens``, ``hc_head.hc_*``, the key/value norm as ``attn.norm``);
        the release's are read. Names already in the release layout pass unchanged, but for the
        release's scales (``<module>.scale``), read as ``<module>.weight_scale_inv`` like every
        layout's (transformers' ``save_pretrained`` writes them so already)."""
        for pattern, release in _SAVED_BY_TRANSFORMERS:
            stored = pattern.sub(release, stored)
        return _RELEASED_SCALE.sub(r"\1.weight" + SCALE_SUFFIX, stored)

    def scale_name(self, hf_name: str) -> str:
        """``layers.0.attn.wq_a.weight`` -> ``layers.0.attn.wq_a.scale``, as the release names them."""
        return hf_name.removesuffix(".weight") + ".scale"

    def config_for_checkpoint(self, cfg: ModelConfig, hf_names: Collection[str]) -> ModelConfig:
        """Drop MTP modules that config.json declares but the checkpoint has no weights for (what
        transformers' own ``save_pretrained`` writes: it keeps ``num_nextn_predict_layers``, not ``mtp.*``)."""
        return keep_present_mtp(cfg, {int(m[1]) for m in map(_MTP.fullmatch, hf_names) if m}, log)

    def from_hf(self, hf_state: StateDict, cfg: ModelConfig) -> StateDict:
        experts: dict[tuple[str, str], dict[int, torch.Tensor]] = {}
        plain: StateDict = {}
        beyond: list[str] = []
        for name, tensor in hf_state.items():
            mtp = _MTP.fullmatch(name)
            if mtp and int(mtp[1]) >= cfg.mtp_modules:
                beyond.append(name)
                continue
            if mtp and mtp[2] in _MTP_SHARED:
                continue
            expert = _HF_EXPERT.fullmatch(name)
            if expert:
                experts.setdefault((expert[1], expert[3]), {})[int(expert[2])] = tensor
            else:
                plain[name] = tensor
        if beyond:
            log.info("left out the checkpoint's %d tensors of MTP layers past model.mtp_depth=%d (mtp.*)",
                     len(beyond), cfg.mtp_modules)
        state = renamed_from_hf(plain, cfg, self._hf_to_ours, self.family)
        for (block, w), per_expert in experts.items():
            if sorted(per_expert) != list(range(cfg.n_routed_experts)):
                raise ConfigError(f"checkpoint {block} holds experts {sorted(per_expert)[:5]}... of {w}; "
                                  f"the model has {cfg.n_routed_experts}")
            state[f"{_our_block(block)}.feed_forward.experts.{w}"] = torch.stack([per_expert[e] for e in sorted(per_expert)])
        return state

    def to_hf(self, state: StateDict, cfg: ModelConfig) -> StateDict:
        flat: StateDict = {}
        for name, tensor in state.items():
            stack = _STACK.fullmatch(name)
            if stack:
                for e, weight in enumerate(tensor.unbind(0)):
                    flat[f"{_hf_block(stack[1])}.ffn.experts.{e}.{stack[2]}.weight"] = weight
            else:
                flat[name] = tensor
        return renamed_to_hf(flat, cfg, lambda n: n if _HF_EXPERT.fullmatch(n) else self._ours_to_hf(n))

    def hf_sources(self, names: Iterable[str], cfg: ModelConfig) -> dict[str, HFSource]:
        out: dict[str, HFSource] = {}
        renamed: list[str] = []
        for name in names:
            stack = _STACK.fullmatch(name)
            if stack:
                out[name] = HFSource(tuple(f"{_hf_block(stack[1])}.ffn.experts.{e}.{stack[2]}.weight"
                                           for e in range(cfg.n_routed_experts)), stacked=True)
            else:
                renamed.append(name)
        return out | renamed_sources(renamed, cfg, self._ours_to_hf)

    @staticmethod
    def _ours_to_hf(name: str) -> str | None:
        if name.endswith("inv_freq"):
            return None
        return _renamed(name, _TOP, _MTP_OWN, _OUR_BLOCK, _BLOCK, _BLOCK_PREFIXES, _hf_block)

    @staticmethod
    def _hf_to_ours(hf_name: str) -> str | None:
        return _renamed(hf_name, _TOP_INV, _MTP_OWN_INV, _HF_BLOCK, _BLOCK_INV, _BLOCK_PREFIXES_INV, _our_block)


def _renamed(name: str, top: dict[str, str], mtp_own: dict[str, str], block_re: re.Pattern[str],
             block: dict[str, str], prefixes: tuple[tuple[str, str], ...], block_name: Any) -> str | None:
    """One name in the other layout (either direction, by the tables given): a top-level tensor, an
    MTP layer's own tensor, or a block's; None for a name the layout does not store."""
    if name in top:
        return top[name]
    mtp = _MTP.fullmatch(name)
    if mtp and mtp[2] in mtp_own:
        return f"mtp.{mtp[1]}.{mtp_own[mtp[2]]}"
    found = block_re.fullmatch(name)
    rest = _in_block(found[2], block, prefixes) if found else None
    return f"{block_name(found[1])}.{rest}" if found and rest else None


def _hf_block(ours: str) -> str:
    """A block's name prefix, ours -> released: ``layers.<i>`` alike, ``mtp.<k>.block`` -> ``mtp.<k>``."""
    return ours.removesuffix(".block")


def _our_block(released: str) -> str:
    """A block's name prefix, released -> ours (the inverse of :func:`_hf_block`)."""
    return f"{released}.block" if released.startswith("mtp.") else released


def _in_block(rest: str, block: dict[str, str], prefixes: tuple[tuple[str, str], ...]) -> str | None:
    """``rest`` (a name inside a block) in the other layout, by one direction's tables (None: no
    counterpart). The stacked experts are not renamed here: they are split or stacked by the adapter."""
    if rest in block:
        return block[rest]
    for source, target in prefixes:
        if rest.startswith(source) and not rest.startswith(source + "experts."):
            return target + rest[len(source):]
    return None


V4_ADAPTER = DeepseekV4Adapter()
