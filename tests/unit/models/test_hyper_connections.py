"""DeepSeek-V4's manifold-constrained hyper-connections (``models/common/hyper_connections.py``)
against transformers 5.24's ``DeepseekV4HyperConnection`` / ``DeepseekV4HyperHead``, with the same
weights: the same fp32 operations in the same order, so equal to fp32 rounding."""

from __future__ import annotations

import pytest
import torch

from dsl_lit.models.common.hyper_connections import HyperConnection, HyperHead, expand_streams, sinkhorn

D, N, ITERS = 64, 4, 20


def _reference_config():
    from transformers.models.deepseek_v4.configuration_deepseek_v4 import DeepseekV4Config

    return DeepseekV4Config(hidden_size=D, hc_mult=N, hc_sinkhorn_iters=ITERS, hc_eps=1e-6, rms_norm_eps=1e-6,
                            num_hidden_layers=2, vocab_size=128, num_attention_heads=2, head_dim=32, q_lora_rank=16,
                            n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=32)


def _random_(module: torch.nn.Module, generator: torch.Generator) -> None:
    with torch.no_grad():
        for p in module.parameters():
            p.copy_(torch.randn(p.shape, generator=generator) * 0.5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_hyper_connection_equals_transformers(dtype):
    from transformers.models.deepseek_v4.modeling_deepseek_v4 import DeepseekV4HyperConnection

    g = torch.Generator().manual_seed(0)
    ours = HyperConnection(D, N, ITERS)
    _random_(ours, g)
    reference = DeepseekV4HyperConnection(_reference_config()).float()
    reference.load_state_dict(ours.state_dict())  # the same names: fn, base, scale
    streams = torch.randn(2, 5, N, D, generator=g).to(dtype)
    post, comb, collapsed = reference(streams)
    pre, our_post, our_comb = ours.weights(streams)
    torch.testing.assert_close(our_post, post, rtol=0, atol=0)
    torch.testing.assert_close(our_comb, comb, rtol=0, atol=0)
    torch.testing.assert_close(our_comb.sum(-2), torch.ones(2, 5, N), atol=1e-5, rtol=0)  # the last pass: columns
    # the whole residual step, with a sub-block, as DeepseekV4DecoderLayer composes it
    block = torch.nn.Linear(D, D).to(dtype)
    expected = post.to(dtype).unsqueeze(-1) * block(collapsed).unsqueeze(-2) + comb.to(dtype).transpose(-1, -2) @ streams
    torch.testing.assert_close(ours(streams, block), expected, rtol=0, atol=0)
    assert ((pre > 0) & (pre < 1 + 2e-6)).all() and ((our_post > 0) & (our_post < 2)).all()


def test_the_hyper_head_equals_transformers():
    from transformers.models.deepseek_v4.modeling_deepseek_v4 import DeepseekV4HyperHead

    g = torch.Generator().manual_seed(1)
    ours = HyperHead(D, N)
    _random_(ours, g)
    reference = DeepseekV4HyperHead(_reference_config()).float()
    reference.load_state_dict({"hc_fn": ours.fn, "hc_base": ours.base, "hc_scale": ours.scale})
    streams = torch.randn(3, 7, N, D, generator=g)
    torch.testing.assert_close(ours(streams), reference(streams), rtol=0, atol=0)


def test_at_its_initialisation_the_mix_is_doubly_stochastic():
    """Rows and columns of ``comb`` sum to 1 where Sinkhorn has converged: the residual is averaged
    across streams, never amplified."""
    torch.manual_seed(0)
    comb = HyperConnection(D, N, ITERS).weights(torch.randn(2, 5, N, D))[2]
    torch.testing.assert_close(comb.sum(-1), torch.ones(2, 5, N), atol=1e-5, rtol=0)
    torch.testing.assert_close(comb.sum(-2), torch.ones(2, 5, N), atol=1e-5, rtol=0)


def test_streams_start_as_copies_and_an_identity_mix_keeps_them():
    hidden = torch.randn(2, 3, D)
    streams = expand_streams(hidden, N)
    assert streams.shape == (2, 3, N, D) and all(torch.equal(streams[..., i, :], hidden) for i in range(N))
    # a comb with a large diagonal converges to the identity: the streams pass through unmixed
    identity = sinkhorn(torch.eye(N) * 50.0, ITERS, 1e-6)
    torch.testing.assert_close(identity, torch.eye(N), atol=1e-5, rtol=0)
