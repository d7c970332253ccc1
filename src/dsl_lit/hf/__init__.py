"""Hugging Face checkpoint interop: load HF checkpoints into our models and export ours to HF.

``from_pretrained(path)`` reads a directory written by ``transformers`` (config.json + safetensors);
``save_pretrained(model, path)`` writes one that ``transformers.AutoModelForCausalLM`` loads without
``trust_remote_code``. Per-family name and config translation lives in ``adapter`` (DeepSeek LLM,
in the Llama layout) and ``deepseek_v3`` (DeepSeek-V3 and V2, ``model_type`` deepseek_v3 / deepseek_v2).
"""

from dsl_lit.hf.adapter import (
    DeepSeekLLMAdapter,
    HFAdapter,
    adapter_for_family,
    adapter_for_model_type,
    register_adapter,
)
from dsl_lit.hf.deepseek_v3 import DeepSeekV2Adapter, DeepSeekV3Adapter
from dsl_lit.hf.io import from_pretrained, save_pretrained

__all__ = [
    "DeepSeekLLMAdapter",
    "DeepSeekV2Adapter",
    "DeepSeekV3Adapter",
    "HFAdapter",
    "adapter_for_family",
    "adapter_for_model_type",
    "from_pretrained",
    "register_adapter",
    "save_pretrained",
]
