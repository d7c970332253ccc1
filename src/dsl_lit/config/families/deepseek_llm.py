"""DeepSeek LLM (arXiv 2401.02954, Table 2): a LLaMA-style pre-norm decoder with grouped-query
attention and a dense SwiGLU FFN, 102400 vocab."""

from __future__ import annotations

from typing import Any

from dsl_lit.config.families.card import FamilyCard
from dsl_lit.config.model_parts.attention import GroupedQueryShape

PRESETS: dict[str, dict[str, Any]] = {
    "deepseek_llm_7b": dict(
        vocab_size=102400, n_layers=30, d_model=4096, n_heads=32, n_kv_heads=32, ffn_hidden=11008, max_seq_len=4096,
    ),
    "deepseek_llm_67b": dict(
        vocab_size=102400, n_layers=95, d_model=8192, n_heads=64, n_kv_heads=8, ffn_hidden=22016, max_seq_len=4096,
    ),
    # A few million parameters: trains on two CPU cores in minutes. GQA so the grouped path is exercised.
    "deepseek_llm_tiny": dict(
        vocab_size=8192, n_layers=4, d_model=256, n_heads=8, n_kv_heads=4, ffn_hidden=688, max_seq_len=1024,
    ),
    # ~100M parameters: the benchmark's "small but real" size.
    "deepseek_llm_100m": dict(
        vocab_size=32768, n_layers=12, d_model=640, n_heads=10, n_kv_heads=10, ffn_hidden=1728, max_seq_len=2048,
    ),
}

CARD = FamilyCard(name="deepseek_llm", presets=PRESETS, base_preset="deepseek_llm_tiny", attention=GroupedQueryShape)
