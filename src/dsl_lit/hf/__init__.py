"""Hugging Face checkpoint interop: load HF checkpoints into our models and export ours to HF.

``from_pretrained(path)`` reads a directory written by ``transformers`` (config.json + safetensors);
``save_pretrained(model, path)`` writes one that ``transformers.AutoModelForCausalLM`` loads without
``trust_remote_code``. The name and config translation of each family lives in its folder
(``dsl_lit.models.<family>.hf_adapter``); this package does the file I/O and finds the adapter
through the family registry: by ``model_type`` when reading, by ``ModelConfig.family`` when writing.
DeepSeek's quantised releases are read (dequantised) and written (``fp8=True``) as well: V3's block
FP8 (:mod:`dsl_lit.hf.fp8_blocks`), V4's with power-of-two scales and FP4 routed experts
(:mod:`dsl_lit.hf.fp4_rows`; which weight is in which: :mod:`dsl_lit.hf.quantised`);
:class:`dsl_lit.hf.reader.HFCheckpoint` reads a directory tensor by tensor, region by region, for
processes that hold part of a model.
"""

from dsl_lit.hf.io import adapter_for_family, adapter_for_model_type, from_pretrained, save_pretrained
from dsl_lit.models.common.hf_adapter import HFAdapter
from dsl_lit.models.deepseek_llm.hf_adapter import DeepSeekLLMAdapter
from dsl_lit.models.deepseek_v3.hf_adapter import DeepSeekV3Adapter
from dsl_lit.models.deepseek_v3.v2_hf_adapter import DeepSeekV2Adapter

__all__ = [
    "DeepSeekLLMAdapter",
    "DeepSeekV2Adapter",
    "DeepSeekV3Adapter",
    "HFAdapter",
    "adapter_for_family",
    "adapter_for_model_type",
    "from_pretrained",
    "save_pretrained",
]
