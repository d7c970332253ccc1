"""DeepSeek LLM model: preset sizes, attention backends, shapes, determinism of init."""

from __future__ import annotations

import logging

import pytest
import torch

from data_contract.errors import ConfigError
from dsl_lit.models import ModelConfig, build_model
from dsl_lit.models.common import attention
from dsl_lit.models.common.attention import causal_attention
from tests.numerics import assert_close_fp32


def _meta_params(name: str) -> tuple[int, int]:
    with torch.device("meta"):
        model = build_model(ModelConfig.from_name(name))
    return model.num_params(), model.num_params(exclude_embeddings=True)


def test_deepseek_llm_7b_parameter_count():
    total, _ = _meta_params("deepseek_llm_7b")
    # 2 x 102400 x 4096 embeddings/head + 30 x (4 x 4096^2 + 3 x 4096 x 11008 + 2 x 4096) + 4096
    assert total == 2 * 102400 * 4096 + 30 * (4 * 4096**2 + 3 * 4096 * 11008 + 2 * 4096) + 4096
    assert 6.85e9 < total < 6.95e9  # the paper's "7B" is 6.9B parameters


def test_deepseek_llm_67b_parameter_count():
    total, _ = _meta_params("deepseek_llm_67b")
    attn = 2 * 8192 * 8192 + 2 * 8192 * 1024  # GQA: 8 kv heads of 128
    assert total == 2 * 102400 * 8192 + 95 * (attn + 3 * 8192 * 22016 + 2 * 8192) + 8192
    assert 67.0e9 < total < 67.8e9


def _tiny(**overrides) -> ModelConfig:
    return ModelConfig.from_name("deepseek_llm_tiny", **{"vocab_size": 256, "n_layers": 2, **overrides})


@pytest.mark.parametrize("n_kv_heads", [8, 4, 1])
def test_attention_backends_agree(n_kv_heads):
    torch.manual_seed(0)
    q = torch.randn(2, 33, 8, 32)
    k = torch.randn(2, 33, n_kv_heads, 32)
    v = torch.randn(2, 33, n_kv_heads, 32)
    eager = causal_attention(q, k, v, "eager")
    sdpa = causal_attention(q, k, v, "sdpa")
    assert_close_fp32(sdpa, eager, 33)  # softmax over up to 33 keys, dot products of 32
    # causality: the first position attends only to itself, so it returns its own value
    groups = 8 // n_kv_heads
    assert_close_fp32(eager[:, 0], v[:, 0].repeat_interleave(groups, dim=1), 1)


def test_flash_attn_falls_back_loudly_on_cpu(caplog, monkeypatch):
    monkeypatch.setattr(attention, "_warned", set())  # forget warnings other tests triggered
    q = k = v = torch.randn(1, 8, 2, 16)
    with caplog.at_level(logging.WARNING, logger="dsl_lit.models.common.attention"):
        out = causal_attention(q, k, v, "flash_attn")
    torch.testing.assert_close(out, causal_attention(q, k, v, "sdpa"))
    assert "falling back to sdpa" in caplog.text


def test_model_backends_give_same_logits():
    """Against the eager softmax(QK^T)V (flash_attn falls back to sdpa on CPU)."""
    torch.manual_seed(0)
    cfg = _tiny()
    model = build_model(cfg)
    tokens = torch.randint(0, 256, (2, 40))
    for layer in model.layers.values():
        layer.attention.backend = "eager"
    reference = model(tokens)
    for backend in ("sdpa", "flash_attn"):
        for layer in model.layers.values():
            layer.attention.backend = backend
        assert_close_fp32(model(tokens), reference, cfg.d_model * cfg.n_layers, msg=backend)
    assert reference.shape == (2, 40, 256)


def test_model_is_causal():
    torch.manual_seed(0)
    model = build_model(_tiny())
    tokens = torch.randint(0, 256, (1, 24))
    changed = tokens.clone()
    changed[0, 12:] = (changed[0, 12:] + 1) % 256
    torch.testing.assert_close(model(tokens)[:, :12], model(changed)[:, :12])
    assert not torch.allclose(model(tokens)[:, 12:], model(changed)[:, 12:])


def test_init_std_and_norms():
    torch.manual_seed(0)
    model = build_model(ModelConfig.from_name("deepseek_llm_tiny"))
    assert abs(model.layers["0"].feed_forward.w1.weight.std().item() - 0.006) < 3e-4
    assert torch.equal(model.norm.weight, torch.ones(256))


def test_meta_build_then_materialise_matches_rope():
    with torch.device("meta"):
        model = build_model(_tiny())
    model.to_empty(device="cpu")
    model.init_weights()
    reference = build_model(_tiny())
    torch.testing.assert_close(model.rope.cos, reference.rope.cos)
    torch.testing.assert_close(model.rope.sin, reference.rope.sin)


@pytest.mark.parametrize(
    "overrides, field",
    [
        ({"n_heads": 7}, "model.n_heads"),
        ({"n_kv_heads": 3}, "model.n_kv_heads"),
        ({"attn_backend": "magic"}, "model.attn_backend"),
        ({"d_model": -4}, "model.d_model"),
        ({"n_layerz": 2}, "model.n_layerz"),
    ],
)
def test_bad_model_config_names_the_field(overrides, field):
    with pytest.raises(ConfigError, match=field.replace(".", r"\.")):
        ModelConfig.from_name("deepseek_llm_tiny", **overrides)


def test_unknown_preset():
    with pytest.raises(ConfigError, match="model.name='gpt5'"):
        ModelConfig.from_name("gpt5")
