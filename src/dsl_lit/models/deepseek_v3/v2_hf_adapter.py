"""DeepSeek-V2 (``DeepseekV2ForCausalLM``) checkpoints, in the layout DeepSeek-V3 shares
(``hf_layout``).

``model_type`` deepseek_v2 reads into our ``deepseek_v2`` family, which routes as DeepSeek-V2 does
(``group_limited_greedy``: groups ranked by their best expert) and is written with it whenever its
group limit is on, with plain top-k (``greedy``) otherwise. The adapter also writes softmax-routed
``deepseek_v3``-family models without a group limit (``hf_adapter``). Things the layout cannot
express raise ConfigError.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from data_contract.errors import ConfigError
from dsl_lit.config.model import ModelConfig
from dsl_lit.models.common.hf_adapter import require
from dsl_lit.models.deepseek_v3.hf_layout import MLAMoEAdapter


class DeepSeekV2Adapter(MLAMoEAdapter):
    """``model_type`` "deepseek_v2" (DeepSeek-V2 / V2-Lite): softmax routing, plain top-k
    (``greedy``) or top-k inside the ``topk_group`` groups with the best experts
    (``group_limited_greedy``), no balancing bias, no MTP, RoPE always interleaved (no
    ``rope_interleave`` key), gates never renormalised. Read into, and written from, our
    ``deepseek_v2`` family; also writes softmax-routed ``deepseek_v3``-family models without a group
    limit."""

    family = "deepseek_v2"
    model_type = "deepseek_v2"
    architecture = "DeepseekV2ForCausalLM"
    score_func = "softmax"
    topk_methods = ("greedy", "group_limited_greedy")
    expert_bias = False
    defaults = {
        "norm_topk_prob": False,
        "routed_scaling_factor": 1.0,
        "n_group": None,
        "topk_group": None,
        "first_k_dense_replace": 0,
    }

    def _groups_from_hf(self, hf: Mapping[str, Any], get: Callable[[str], Any]) -> tuple[int, int]:
        """``greedy`` ignores n_group / topk_group (no group limit); ``group_limited_greedy`` needs both."""
        if (hf.get("topk_method") or self.topk_methods[0]) == "greedy":
            return 1, 1
        return int(require(hf, "n_group")), int(require(hf, "topk_group"))

    def _mtp_depth_from_hf(self, get: Callable[[str], Any]) -> int:
        return 0

    def _topk_method(self, cfg: ModelConfig) -> str:
        return "group_limited_greedy" if cfg.is_moe and cfg.n_limited_groups < cfg.n_expert_groups else "greedy"

    def _config_keys_to_hf(self, cfg: ModelConfig) -> dict[str, Any]:
        return {"mlp_bias": False}

    def _reject_conventions(self, hf: Mapping[str, Any], where: str) -> None:
        if hf.get("rope_interleave") is False:
            raise ConfigError(
                f"{where} rope_interleave=false is not supported: DeepSeek-V2 rotates interleaved pairs"
            )
        if hf.get("norm_topk_prob"):
            raise ConfigError(
                f"{where} norm_topk_prob=true is not supported: DeepSeek-V2's own code then skips "
                "routed_scaling_factor and transformers ignores norm_topk_prob, so its meaning is ambiguous"
            )

    def _check_writable(self, cfg: ModelConfig) -> None:
        super()._check_writable(cfg)
        checks = (
            ("mtp_depth", cfg.mtp_depth != 0, "it has no MTP layers"),
            ("rope_interleave", not cfg.rope_interleave, "it always rotates interleaved pairs"),
            ("norm_topk_prob", cfg.norm_topk_prob, "it does not renormalise the softmax gates"),
        )
        for name, bad, reason in checks:
            if bad:
                raise ConfigError(
                    f"model.{name}={getattr(cfg, name)!r} cannot be written as model_type {self.model_type!r}, "
                    f"the Hugging Face layout for {self.score_func} routing: {reason}"
                )


V2_ADAPTER = DeepSeekV2Adapter()
