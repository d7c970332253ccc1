"""DeepSeek-V3 model: preset sizes, MLA, routing (bias, node limit), grouped experts, balance loss,
MTP, YaRN, config errors. Tiny models in fp32; references written independently of the code."""

from __future__ import annotations

import math

import pytest
import torch

from data_contract.errors import ConfigError
from dsl_lit.flops import matmul_params_per_token
from dsl_lit.models import ModelConfig, build_model
from dsl_lit.models.common.layers import RotaryEmbedding, rope_frequencies, yarn_softmax_scale
from dsl_lit.models.common.moe import MoE, TopKRouter
from tests.numerics import assert_close_fp32


def _meta(name: str, **overrides):
    with torch.device("meta"):
        return build_model(ModelConfig.from_name(name, **overrides))


def test_deepseek_v3_671b_has_671b_total_and_37b_activated_parameters():
    model = _meta("deepseek_v3_671b")
    total, activated = model.num_params(), model.num_params(activated=True)
    assert 670.5e9 < total < 671.5e9, total
    assert 37.0e9 < activated < 38.0e9, activated  # the paper: 37B activated per token
    mtp = model.num_params(include_mtp=True) - total
    assert 11e9 < mtp < 12e9  # one MTP module (the paper's 14B also counts the shared embedding/head)


def test_deepseek_v2_lite_is_16b_total():
    model = _meta("deepseek_v2_lite")
    assert 15.6e9 < model.num_params() < 15.8e9  # the paper: 15.7B
    assert 2.4e9 < model.num_params(activated=True) < 2.7e9  # 2.4B without the output head copy
    assert model.layers["0"].attention.wq is not None and model.layers["0"].attention.wq_a is None


def test_flops_count_matches_the_activated_matmul_weights_of_the_built_model():
    for name in ("deepseek_v3_tiny", "deepseek_v2_lite", "deepseek_v3_671b"):
        cfg = ModelConfig.from_name(name)
        model = _meta(name)
        count = 0
        for param_name, p in model.named_parameters():
            if p.ndim < 2 or param_name.startswith("tok_embeddings"):
                continue
            numel = p.numel()
            if ".experts.w" in param_name:
                numel = numel // cfg.n_routed_experts * cfg.n_activated_experts
            count += numel
        count += cfg.mtp_depth * cfg.d_model * cfg.vocab_size  # the shared head runs once per depth
        assert matmul_params_per_token(cfg) == count, name


def _tiny(**overrides) -> ModelConfig:
    base = dict(vocab_size=256, n_layers=3, n_dense_layers=1, d_model=64, n_heads=4, q_lora_rank=32,
                kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16, ffn_hidden=96,
                n_routed_experts=8, n_activated_experts=2, n_expert_groups=4, n_limited_groups=2,
                moe_ffn_hidden=32, mtp_depth=1, max_seq_len=128)
    return ModelConfig.from_name("deepseek_v3_tiny", **{**base, **overrides})


def _randomise(model: torch.nn.Module, seed: int = 0) -> None:
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=gen) * 0.2 if p.ndim > 1 else torch.rand(p.shape, generator=gen) + 0.5)


def _reference_route(scores, bias, n_groups, n_keep, k, route_scale, normalise):
    """Per-token Python loops: the node-limited top-k of DeepSeek-V3, written from the paper."""
    n_tokens, n_experts = scores.shape
    size = n_experts // n_groups
    weights, chosen = [], []
    for t in range(n_tokens):
        biased = (scores[t] + bias).tolist()
        group_score = [sum(sorted(biased[g * size:(g + 1) * size], reverse=True)[:2]) for g in range(n_groups)]
        groups = sorted(range(n_groups), key=lambda g: -group_score[g])[:n_keep]
        allowed = [e for e in range(n_experts) if e // size in groups]
        top = sorted(allowed, key=lambda e: -biased[e])[:k]
        w = [scores[t, e].item() for e in top]
        total = sum(w) if normalise else 1.0
        chosen.append(sorted(top))
        weights.append({e: wi / total * route_scale for e, wi in zip(top, w)})
    return chosen, weights


@pytest.mark.parametrize("with_bias", [False, True])
def test_router_matches_a_per_token_reference_of_node_limited_routing(with_bias):
    cfg = _tiny(n_routed_experts=16, n_activated_experts=4, n_expert_groups=4, n_limited_groups=2, route_scale=2.5)
    router = TopKRouter(cfg)
    torch.manual_seed(0)
    torch.nn.init.normal_(router.weight, std=0.5)
    if with_bias:
        router.expert_bias.copy_(torch.randn(16) * 0.3)
    x = torch.randn(40, cfg.d_model)
    scores, weights, indices = router(x)
    torch.testing.assert_close(scores, torch.sigmoid(x @ router.weight.T))
    chosen, ref_weights = _reference_route(scores, router.expert_bias, 4, 2, 4, 2.5, True)
    for t in range(40):
        assert sorted(indices[t].tolist()) == chosen[t]
        for slot, e in enumerate(indices[t].tolist()):
            assert weights[t, slot].item() == pytest.approx(ref_weights[t][e], rel=1e-5)
        groups = {e // 4 for e in indices[t].tolist()}
        assert len(groups) <= 2  # node-limited: at most n_limited_groups groups per token


def test_bias_changes_selection_but_not_gate_values():
    cfg = _tiny(n_expert_groups=1, n_limited_groups=1)
    router = TopKRouter(cfg)
    torch.manual_seed(1)
    torch.nn.init.normal_(router.weight, std=0.5)
    x = torch.randn(64, cfg.d_model)
    scores, _, before = router(x)
    router.expert_bias[5] = 10.0  # make expert 5 win every selection
    scores_after, weights, after = router(x)
    torch.testing.assert_close(scores_after, scores)  # affinities do not see the bias
    assert (after == 5).any(dim=-1).all() and not (before == 5).any(dim=-1).all()
    expected = scores.gather(1, after)
    expected = expected / expected.sum(-1, keepdim=True) * cfg.route_scale
    torch.testing.assert_close(weights, expected)  # gate values: unbiased scores, normalised
    assert not router.expert_bias.requires_grad and "expert_bias" in dict(router.named_buffers())


def test_router_stays_fp32_under_bf16_autocast():
    router = TopKRouter(_tiny())
    torch.nn.init.normal_(router.weight, std=0.5)
    x = torch.randn(16, 64)
    reference = torch.sigmoid(x @ router.weight.T)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        scores, weights, _ = router(x.bfloat16())
    assert scores.dtype == weights.dtype == torch.float32
    torch.testing.assert_close(scores, torch.sigmoid(x.bfloat16().float() @ router.weight.T))
    assert (scores - reference).abs().max() < 2e-2  # only the bf16 input rounding remains


def test_bias_update_is_sign_of_mean_minus_load():
    router = TopKRouter(_tiny())
    router.update_bias(torch.tensor([10.0, 0, 2, 2, 2, 2, 2, 4]), rate=0.001)
    expected = torch.tensor([-1.0, 1, 1, 1, 1, 1, 1, -1]) * 0.001  # mean load is 3
    torch.testing.assert_close(router.expert_bias, expected)


@pytest.mark.parametrize("score_func", ["sigmoid", "softmax"])
def test_grouped_and_split_experts_equal_the_per_expert_loop(score_func):
    torch.manual_seed(0)
    outputs, grads = {}, {}
    for backend in ("grouped_mm", "split", "loop"):
        torch.manual_seed(0)
        moe = MoE(_tiny(expert_backend=backend, score_func=score_func, n_shared_experts=1))
        _randomise(moe)
        moe.gate.expert_bias.copy_(torch.linspace(-0.3, 0.3, 8))
        x = torch.randn(3, 20, 64, generator=torch.Generator().manual_seed(2), requires_grad=True)
        out = moe(x)
        out.square().sum().backward()
        outputs[backend] = out
        grads[backend] = [x.grad, *(p.grad for p in moe.parameters())]
    for backend in ("grouped_mm", "split"):
        assert_close_fp32(outputs[backend], outputs["loop"], 64, msg=backend)  # sums over the width
        for a, b in zip(grads[backend], grads["loop"]):
            assert_close_fp32(a, b, 3 * 20 * 64, msg=backend)  # and over the 60 tokens


def test_experts_compute_in_the_autocast_dtype_on_every_backend():
    """bf16 autocast reached F.linear (split, loop) but not torch._grouped_mm, which ran the experts
    in fp32 on CPU and on CUDA fell back to the per-expert loop (its kernel takes bf16 only)."""
    outputs, grads = {}, {}
    for backend in ("grouped_mm", "split"):
        torch.manual_seed(0)
        moe = MoE(_tiny(expert_backend=backend, n_shared_experts=0))
        _randomise(moe)
        x = torch.randn(60, 64, generator=torch.Generator().manual_seed(2))
        sorted_counts = torch.tensor([10, 0, 5, 9, 12, 8, 7, 9])
        with torch.autocast("cpu", dtype=torch.bfloat16):
            out = moe.experts(x, sorted_counts)
        out.float().square().sum().backward()
        assert out.dtype == torch.bfloat16, backend
        outputs[backend], grads[backend] = out, moe.experts.w1.grad
    # the same bf16 matmuls in another order: within bf16 rounding (2^-8) of the outputs' scale
    scale = outputs["split"].float().abs().max()
    assert (outputs["grouped_mm"].float() - outputs["split"].float()).abs().max() <= 4 * 2**-8 * scale
    assert grads["grouped_mm"].dtype == torch.float32  # fp32 master weights' gradients
    assert (grads["grouped_mm"] - grads["split"]).abs().max() <= 4 * 2**-8 * grads["split"].abs().max()


def test_grouped_mm_unavailable_falls_back_to_split_loudly(caplog, monkeypatch):
    from dsl_lit.models.common import moe as moe_module

    moe = MoE(_tiny())
    _randomise(moe)
    x = torch.randn(2, 9, 64)
    expected = moe(x)
    monkeypatch.setattr(moe_module, "_grouped_mm_usable", lambda _: False)  # e.g. fp32 on a CUDA GPU
    monkeypatch.setattr(moe_module, "_warned", set())
    with caplog.at_level("WARNING", logger="dsl_lit.models.common.moe"):
        assert_close_fp32(moe(x), expected, 64, msg="split")
    assert "using expert_backend=split" in caplog.text


def test_sequence_balance_loss_matches_the_paper_formula():
    cfg = _tiny(seq_balance_alpha=0.01, batch_balance_alpha=0.0)
    moe = MoE(cfg).train()
    _randomise(moe)
    x = torch.randn(3, 10, 64)
    moe(x)
    scores, _, idx = moe.gate(x.reshape(-1, 64))
    E, K, T = 8, 2, 10
    expected = 0.0
    for b in range(3):
        s, i = scores[b * T:(b + 1) * T], idx[b * T:(b + 1) * T]
        f = torch.stack([(i == e).any(-1).float().sum() * E / (K * T) for e in range(E)])
        p = (s / s.sum(-1, keepdim=True)).mean(0)
        expected += 0.01 * (f * p).sum() / 3
    torch.testing.assert_close(moe.balance_loss, expected)
    moe.balance_loss.backward()
    assert moe.gate.weight.grad is not None and moe.gate.weight.grad.abs().sum() > 0
    unbalanced = MoE(_tiny(seq_balance_alpha=0.0, batch_balance_alpha=0.0)).train()
    assert unbalanced(x).shape == x.shape and unbalanced.balance_loss is None  # both alphas 0: no loss term
    moe.eval()
    moe(x)
    assert moe.balance_loss is None


def test_router_counts_loads_only_in_training():
    moe = MoE(_tiny())
    x = torch.randn(2, 5, 64)
    moe.eval()(x)
    assert moe.gate.load.counts.sum() == 0
    moe.train()(x)
    moe.train()(x)
    assert moe.gate.load.counts.sum() == 2 * 2 * 5 * 2  # two forwards x 10 tokens x top-2


def test_mtp_logits_predict_k_ahead_and_the_main_model_runs_without_them():
    torch.manual_seed(0)
    with_mtp = build_model(_tiny(mtp_depth=2))
    _randomise(with_mtp)
    tokens = torch.randint(0, 256, (2, 12))
    hidden = with_mtp.hidden_states(tokens)
    logits = with_mtp.mtp_logits(hidden, tokens)
    assert [tuple(t.shape) for t in logits] == [(2, 11, 256), (2, 10, 256)]
    # depth 1 by hand: combine h_i with emb(t_{i+1}), one block, shared head
    module = with_mtp.mtp["0"]
    h = module.eh_proj(torch.cat([module.enorm(with_mtp.tok_embeddings(tokens[:, 1:])), module.hnorm(hidden[:, :-1])], -1))
    h = module.block(h, with_mtp.rope(11))
    torch.testing.assert_close(logits[0], with_mtp.output(module.norm(h)))
    # inference model without MTP modules: same weights minus mtp.*, same logits
    without = build_model(_tiny(mtp_depth=0))
    without.load_state_dict({k: v for k, v in with_mtp.state_dict().items() if not k.startswith("mtp.")})
    torch.testing.assert_close(without(tokens), with_mtp(tokens))


def test_mla_without_query_compression_and_with_both_backends():
    torch.manual_seed(0)
    cfg = _tiny(q_lora_rank=None)
    model = build_model(cfg).eval()
    _randomise(model)
    tokens = torch.randint(0, 256, (2, 17))
    eager = build_model(_tiny(q_lora_rank=None, attn_backend="eager")).eval()
    eager.load_state_dict(model.state_dict())
    assert_close_fp32(model(tokens), eager(tokens), cfg.d_model * cfg.n_layers, msg="sdpa vs eager MLA")
    # causal: changing a later token leaves earlier logits alone
    changed = tokens.clone()
    changed[:, 10] = (changed[:, 10] + 1) % 256
    torch.testing.assert_close(model(changed)[:, :10], model(tokens)[:, :10])


def test_yarn_frequencies_and_mscale():
    dim, theta = 64, 10000.0
    plain, factor_plain = rope_frequencies(dim, theta, None)
    scaling = dict(factor=40.0, original_max_seq_len=4096, beta_fast=32, beta_slow=1, mscale=1.0, mscale_all_dim=1.0)
    yarn, attention_factor = rope_frequencies(dim, theta, scaling)
    assert factor_plain == 1.0 and attention_factor == pytest.approx(1.0)  # mscale / mscale_all_dim
    torch.testing.assert_close(yarn[:4], plain[:4])  # high frequencies: kept
    torch.testing.assert_close(yarn[-4:], plain[-4:] / 40.0)  # low frequencies: interpolated
    assert ((yarn <= plain + 1e-12) & (yarn >= plain / 40.0 - 1e-12)).all()
    assert yarn_softmax_scale(scaling) == pytest.approx((0.1 * math.log(40.0) + 1.0) ** 2)
    _, only_mscale = rope_frequencies(dim, theta, {**scaling, "mscale_all_dim": 0})
    assert only_mscale == pytest.approx(0.1 * math.log(40.0) + 1.0)
    rope = RotaryEmbedding(dim, 16, theta, {**scaling, "mscale_all_dim": 0})
    assert rope.cos[0, 0].item() == pytest.approx(only_mscale)


@pytest.mark.parametrize(
    ("overrides", "field"),
    [
        ({"n_expert_groups": 3}, "model.n_expert_groups=3 does not divide n_routed_experts=8"),
        ({"n_limited_groups": 5}, "model.n_limited_groups=5 exceeds n_expert_groups=4"),
        ({"n_activated_experts": 5}, "model.n_activated_experts=5"),
        ({"score_func": "relu"}, "model.score_func='relu'"),
        ({"kv_lora_rank": 0}, "model.kv_lora_rank=0"),
        ({"qk_rope_head_dim": 7}, "model.qk_rope_head_dim=7"),
        ({"rope_scaling": {"factor": 4}}, "model.rope_scaling.original_max_seq_len"),
        ({"expert_backend": "magic"}, "model.expert_backend='magic'"),
    ],
)
def test_bad_v3_config_names_the_field(overrides, field):
    with pytest.raises(ConfigError, match=field.replace("(", r"\(").replace(")", r"\)")):
        _tiny(**overrides)
