"""DeepSeek-V3.2 (``DeepseekV32ForCausalLM``) checkpoints: DeepSeek-V3's layout (``hf_layout``) plus
each layer's lightning indexer, ``model.layers.<i>.self_attn.indexer.{wq_b,wk,k_norm,weights_proj}``.

``model_type`` deepseek_v32 reads into our ``deepseek_v32`` family. config.json adds
``index_n_heads``, ``index_head_dim`` and ``index_topk``; its rotary layout is always interleaved
pairs (transformers' config has no ``rope_interleave``). In DeepSeek's FP8 release the indexer's
``wq_b`` and ``wk`` are FP8 with block scales like the other projections (DeepSeek's inference code
builds them as its default, FP8, ``Linear``), ``k_norm`` and ``weights_proj`` are not.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

from data_contract.errors import ConfigError
from dsl_lit.config.model import ModelConfig
from dsl_lit.models.common.hf_adapter import require
from dsl_lit.models.deepseek_v3.hf_adapter import DeepSeekV3Adapter
from dsl_lit.models.deepseek_v3.hf_layout import FP8_WEIGHTS, MLAMoEAdapter

FP8_WEIGHTS_V32 = re.compile(FP8_WEIGHTS.pattern + r"|model\.layers\.\d+\.self_attn\.indexer\.(?:wq_b|wk)\.weight")
"""DeepSeek-V3's FP8 weights plus the indexer's two projections."""


class DeepSeekV32Adapter(DeepSeekV3Adapter):
    """``model_type`` "deepseek_v32": DeepSeek-V3 with DeepSeek Sparse Attention's indexer."""

    family = "deepseek_v32"
    model_type = "deepseek_v32"
    architecture = "DeepseekV32ForCausalLM"
    fp8_weights = FP8_WEIGHTS_V32

    def config_from_hf(self, hf: Mapping[str, Any]) -> ModelConfig:
        cfg = super().config_from_hf(hf)
        cfg.index_n_heads = int(require(hf, "index_n_heads"))
        cfg.index_head_dim = int(require(hf, "index_head_dim"))
        cfg.index_topk = int(require(hf, "index_topk"))
        return cfg

    def _config_keys_to_hf(self, cfg: ModelConfig) -> dict[str, Any]:
        return {"num_nextn_predict_layers": cfg.mtp_depth, "index_n_heads": cfg.index_n_heads,
                "index_head_dim": cfg.index_head_dim, "index_topk": cfg.index_topk}

    def _reject_conventions(self, hf: Mapping[str, Any], where: str) -> None:
        if hf.get("rope_interleave") is False:
            raise ConfigError(f"{where} rope_interleave=false is not supported: DeepSeek-V3.2 rotates interleaved pairs")

    def _writer(self, cfg: ModelConfig) -> MLAMoEAdapter:
        self._check_writable(cfg)
        return self

    def _check_writable(self, cfg: ModelConfig) -> None:
        super()._check_writable(cfg)
        if not cfg.rope_interleave:
            raise ConfigError("model.rope_interleave=False cannot be written as model_type 'deepseek_v32': "
                              "it always rotates interleaved pairs")
        if cfg.score_func != self.score_func:
            raise ConfigError(f"model.score_func={cfg.score_func!r} cannot be written as model_type 'deepseek_v32': "
                              "it routes with sigmoid scores and the balancing bias")


V32_ADAPTER = DeepSeekV32Adapter()
