"""Hugging Face checkpoint interop: load HF checkpoints into our models and export ours to HF.

``from_pretrained(path)`` reads a directory written by ``transformers`` (config.json + safetensors);
``save_pretrained(model, path)`` writes one that ``transformers.AutoModelForCausalLM`` loads without
``trust_remote_code``. Per-family name and config translation lives in ``adapter``.
"""

from dsl_lit.hf.adapter import (
    DeepSeekLLMAdapter,
    HFAdapter,
    adapter_for_family,
    adapter_for_model_type,
    register_adapter,
)
from dsl_lit.hf.io import from_pretrained, save_pretrained

__all__ = [
    "DeepSeekLLMAdapter",
    "HFAdapter",
    "adapter_for_family",
    "adapter_for_model_type",
    "from_pretrained",
    "register_adapter",
    "save_pretrained",
]
