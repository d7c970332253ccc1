"""DeepSeek-V3 (``DeepseekV3ForCausalLM``) checkpoints, in the layout DeepSeek-V2 shares
(``hf_layout``).

``model_type`` deepseek_v3 reads into our ``deepseek_v3`` family: sigmoid routing with the balancing
bias, which is kept in fp32 as transformers keeps it (``_keep_in_fp32_modules_strict``), and
optional MTP layers.

Routing decides the model type written. transformers' DeepSeek-V3 router is sigmoid only, so a
softmax-routed ``deepseek_v3``-family model (the DeepSeek-V2-Lite preset) is written as
``deepseek_v2`` (``v2_hf_adapter``) with plain top-k (``topk_method`` "greedy"), which needs it to
have no group limit: the two routers rank expert groups differently. Things neither layout can
express raise ConfigError.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Collection, Mapping
from typing import Any

from data_contract.errors import ConfigError
from dsl_lit.config.model import ModelConfig
from dsl_lit.models.common.hf_adapter import keep_present_mtp
from dsl_lit.models.deepseek_v3.hf_layout import HF_LAYER, MLAMoEAdapter
from dsl_lit.models.deepseek_v3.v2_hf_adapter import V2_ADAPTER

log = logging.getLogger(__name__)


class DeepSeekV3Adapter(MLAMoEAdapter):
    """``model_type`` "deepseek_v3": sigmoid routing with the balancing bias, optional MTP layers."""

    family = "deepseek_v3"
    model_type = "deepseek_v3"
    architecture = "DeepseekV3ForCausalLM"
    fp32_suffixes = (".e_score_correction_bias",)
    score_func = "sigmoid"
    topk_methods = ("noaux_tc",)
    expert_bias = True
    defaults = {
        "norm_topk_prob": True,
        "routed_scaling_factor": 2.5,
        "n_group": 8,
        "topk_group": 4,
        "first_k_dense_replace": 3,
        "num_nextn_predict_layers": 1,  # dropped by config_for_checkpoint when the weights lack it
    }

    def _groups_from_hf(self, hf: Mapping[str, Any], get: Callable[[str], Any]) -> tuple[int, int]:
        """DeepSeek-V3's node-limited routing always reads them."""
        return int(get("n_group") or 1), int(get("topk_group") or 1)

    def _mtp_depth_from_hf(self, get: Callable[[str], Any]) -> int:
        return int(get("num_nextn_predict_layers") or 0)

    def _topk_method(self, cfg: ModelConfig) -> str:
        return self.topk_methods[0]

    def _config_keys_to_hf(self, cfg: ModelConfig) -> dict[str, Any]:
        return {"rope_interleave": cfg.rope_interleave, "num_nextn_predict_layers": cfg.mtp_depth}

    def config_for_checkpoint(self, cfg: ModelConfig, hf_names: Collection[str]) -> ModelConfig:
        """Drop MTP modules that config.json declares but the checkpoint has no weights for
        (transformers keeps ``num_nextn_predict_layers`` but saves no MTP layer)."""
        present = {int(m[1]) - cfg.n_layers for m in map(HF_LAYER.fullmatch, hf_names) if m}
        return keep_present_mtp(cfg, present, log)

    def _writer(self, cfg: ModelConfig) -> MLAMoEAdapter:
        """The model type a ``deepseek_v3``-family model is written as: its routing decides (see the
        module docstring)."""
        if cfg.score_func != "softmax":
            return super()._writer(cfg)
        if cfg.is_moe and cfg.n_limited_groups < cfg.n_expert_groups:
            raise ConfigError(
                f"model.n_limited_groups={cfg.n_limited_groups!r} cannot be written as model_type "
                f"{V2_ADAPTER.model_type!r}, the Hugging Face layout for softmax routing: it ranks expert groups by "
                "their best expert, this family's router by the sum of the best two (the deepseek_v2 family "
                "routes as DeepSeek-V2 does)"
            )
        return V2_ADAPTER._writer(cfg)


V3_ADAPTER = DeepSeekV3Adapter()
