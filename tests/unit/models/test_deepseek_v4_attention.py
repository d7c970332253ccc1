"""DeepSeek-V4's attention (``models/deepseek_v4/attention.py``) against transformers 5.24's
``DeepseekV4Attention`` (``cache=None``, the full-sequence forward), one layer of each kind, with the
same weights: sliding window only, compressed sparse attention (overlapping windows, the lightning
indexer's top-k) and heavily compressed attention."""

from __future__ import annotations

import pytest
import torch

from dsl_lit.models.deepseek_v4.attention import PairRotary, V4Attention, visible_windows

KINDS = {"sliding_attention": "sliding", "compressed_sparse_attention": "csa", "heavily_compressed_attention": "hca"}
# ours -> transformers' (DeepSeek's release names on our side)
NAMES = {"wq_a": "q_a_proj", "q_norm": "q_a_norm", "wq_b": "q_b_proj", "wkv": "kv_proj", "wo_a": "o_a_proj",
         "wo_b": "o_b_proj", "attn_sink": "sinks", "compressor.wkv": "compressor.kv_proj",
         "compressor.wgate": "compressor.gate_proj", "compressor.ape": "compressor.position_bias",
         "compressor.norm": "compressor.kv_norm", "indexer.compressor.wkv": "compressor.indexer.kv_proj",
         "indexer.compressor.wgate": "compressor.indexer.gate_proj",
         "indexer.compressor.ape": "compressor.indexer.position_bias",
         "indexer.compressor.norm": "compressor.indexer.kv_norm", "indexer.wq_b": "compressor.indexer.q_b_proj",
         "indexer.weights_proj": "compressor.indexer.scorer.weights_proj"}
SEQ = 40  # 10 CSA windows (rate 4), 2 HCA windows (rate 16), a sliding window of 8: all three reach


def _config():
    from transformers.models.deepseek_v4.configuration_deepseek_v4 import DeepseekV4Config

    config = DeepseekV4Config(
        vocab_size=128, hidden_size=64, num_hidden_layers=3, num_attention_heads=4, head_dim=32,
        qk_rope_head_dim=8, q_lora_rank=24, o_groups=2, o_lora_rank=16, sliding_window=8,
        layer_types=list(KINDS), compress_rates={"compressed_sparse_attention": 4, "heavily_compressed_attention": 16},
        index_n_heads=2, index_head_dim=16, index_topk=3, n_routed_experts=4, num_experts_per_tok=2,
        moe_intermediate_size=32, rope_theta=10000.0, compress_rope_theta=160000.0)
    config._attn_implementation = "eager"
    return config


def _ours(config, layer: int) -> V4Attention:
    kind = KINDS[config.layer_types[layer]]
    main = kind == "sliding"
    rotary = PairRotary(config.qk_rope_head_dim, config.rope_theta if main else config.compress_rope_theta)
    rate = 0 if main else config.compress_rates[config.layer_types[layer]]
    return V4Attention(kind=kind, d_model=config.hidden_size, n_heads=config.num_attention_heads,
                       head_dim=config.head_dim, rope_dim=config.qk_rope_head_dim, q_lora_rank=config.q_lora_rank,
                       o_groups=config.o_groups, o_lora_rank=config.o_lora_rank, sliding_window=config.sliding_window,
                       rotary=rotary, compress_rate=rate, index_n_heads=config.index_n_heads,
                       index_head_dim=config.index_head_dim, index_topk=config.index_topk, norm_eps=config.rms_norm_eps)


def _transformers_name(ours: str) -> str:
    for mine, theirs in sorted(NAMES.items(), key=lambda kv: -len(kv[0])):
        if ours == mine or ours.startswith(mine + "."):
            return theirs + ours[len(mine):]
    return ours  # kv_norm.weight


@pytest.mark.parametrize("layer", [0, 1, 2], ids=list(KINDS.values()))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_each_kind_of_layer_equals_transformers(layer, dtype):
    from transformers.masking_utils import create_sliding_window_causal_mask
    from transformers.models.deepseek_v4.modeling_deepseek_v4 import (
        DeepseekV4Attention,
        DeepseekV4RotaryEmbedding,
    )

    config = _config()
    g = torch.Generator().manual_seed(layer)
    ours = _ours(config, layer)
    with torch.no_grad():
        for p in ours.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * (0.3 if p.ndim == 1 else p.shape[-1] ** -0.5))
    reference = DeepseekV4Attention(config, layer)
    state = {_transformers_name(k): v for k, v in ours.state_dict().items() if not k.endswith("inv_freq")}
    reference.load_state_dict(state)  # every parameter has its counterpart
    ours, reference = ours.to(dtype), reference.to(dtype)
    for module in (ours, reference):  # V4 keeps its norms, sinks and window biases in fp32
        for name, p in module.named_parameters():
            if any(k in name for k in ("norm", "sink", "ape", "position_bias")):
                p.data = p.data.float()
    hidden = torch.randn(2, SEQ, config.hidden_size, generator=g).to(dtype)
    positions = torch.arange(SEQ).unsqueeze(0)
    rotary = DeepseekV4RotaryEmbedding(config)
    embeddings = {kind: rotary(hidden, positions, layer_type=kind) for kind in ("main", "compress")}
    mask = create_sliding_window_causal_mask(config=config, inputs_embeds=hidden, attention_mask=None, cache=None,
                                             position_ids=positions)
    expected = reference(hidden, embeddings, positions, mask)[0]
    got = ours(hidden, positions.expand(2, -1))
    if dtype == torch.float32:
        torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
    else:  # the same roundings but for a GEMM's order of sums: within a few bf16 ulps of the output scale
        scale = expected.float().abs().max()
        assert (got.float() - expected.float()).abs().max() <= 4 * 2**-8 * scale


def test_a_query_sees_only_windows_it_has_passed():
    """Window w of rate m holds positions w*m .. w*m+m-1: query t sees it once t >= w*m + m - 1."""
    seen = visible_windows(torch.arange(12).unsqueeze(0), windows=3, rate=4)[0]
    assert [int(row.sum()) for row in seen] == [0, 0, 0, 1, 1, 1, 1, 2, 2, 2, 2, 3]
