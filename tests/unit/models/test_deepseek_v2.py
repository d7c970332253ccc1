"""The deepseek_v2 family: DeepSeek-V2's sizes, its group-limited routing (groups ranked by their best
expert), and logits equal to transformers' ``DeepseekV2ForCausalLM`` both ways.

The tiny random model (fp32) has 16 experts in 4 groups, of which 2 are searched, and picks 4: a
token's 4 best experts often span more than 2 groups, so the group limit changes the routing (and
ranking groups by the sum of their two best, as DeepSeek-V3 does, would change it again); both are
asserted, so a router that ignored the limit or ranked groups the V3 way fails the parity checks.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from transformers import DeepseekV2Config, DeepseekV2ForCausalLM

from data_contract.errors import ConfigError
from dsl_lit.hf import adapter_for_family, adapter_for_model_type, from_pretrained, save_pretrained
from dsl_lit.models import ModelConfig, Transformer, build_model, family_spec
from dsl_lit.models.common.moe import TopKRouter
from tests.unit.hf.test_hf_interop_v3 import _hf_load, _randomise, _weights

VOCAB, D, LAYERS, HEADS, FFN, MOE_FFN = 256, 64, 3, 4, 96, 32
EXPERTS, TOP_K, GROUPS, TOPK_GROUPS, ROUTE_SCALE = 16, 4, 4, 2, 1.5
SEQ = 24

OVERRIDES = dict(
    vocab_size=VOCAB, n_layers=LAYERS, d_model=D, n_heads=HEADS, n_kv_heads=HEADS, ffn_hidden=FFN, max_seq_len=64,
    rope_theta=5000.0, q_lora_rank=32, kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16,
    n_dense_layers=1, n_routed_experts=EXPERTS, n_shared_experts=2, n_activated_experts=TOP_K, moe_ffn_hidden=MOE_FFN,
    n_expert_groups=GROUPS, n_limited_groups=TOPK_GROUPS, route_scale=ROUTE_SCALE, attn_backend="eager",
)


def _tolerance(logits: torch.Tensor) -> float:
    """64 fp32 ulps of the largest logit: both sides sum the same products in other orders (expert
    outputs, fused vs separate projections, softmax), and reordering a sum of n terms moves it by
    at most ~n ulps of its magnitude; the widest reduction here is d_model = 64 terms."""
    return 64 * torch.finfo(torch.float32).eps * logits.abs().max().item()


def _ids(seed: int = 1) -> torch.Tensor:
    return torch.randint(0, VOCAB, (2, SEQ), generator=torch.Generator().manual_seed(seed))


def _ours(**overrides: object) -> Transformer:
    model = build_model(ModelConfig.from_name("deepseek_v2_tiny", **{**OVERRIDES, **overrides})).eval()
    _randomise(model, bias=False)
    return model


def _hf_model() -> DeepseekV2ForCausalLM:
    cfg = DeepseekV2Config(
        vocab_size=VOCAB, hidden_size=D, intermediate_size=FFN, moe_intermediate_size=MOE_FFN,
        num_hidden_layers=LAYERS, num_attention_heads=HEADS, num_key_value_heads=HEADS, n_shared_experts=2,
        n_routed_experts=EXPERTS, routed_scaling_factor=ROUTE_SCALE, kv_lora_rank=32, q_lora_rank=32,
        qk_rope_head_dim=8, v_head_dim=16, qk_nope_head_dim=16, num_experts_per_tok=TOP_K, first_k_dense_replace=1,
        max_position_embeddings=64, rope_parameters={"rope_type": "default", "rope_theta": 5000.0},
        topk_method="group_limited_greedy", n_group=GROUPS, topk_group=TOPK_GROUPS, bos_token_id=0, eos_token_id=1,
    )
    cfg._attn_implementation = "eager"
    model = DeepseekV2ForCausalLM(cfg).eval()
    _randomise(model)
    return model


@torch.no_grad()
def _logits(model: torch.nn.Module, ids: torch.Tensor) -> torch.Tensor:
    out = model(input_ids=ids) if isinstance(model, DeepseekV2ForCausalLM) else model(ids)
    return (out.logits if isinstance(model, DeepseekV2ForCausalLM) else out).float()


# -- sizes and routing -----------------------------------------------------------------------------------


def test_deepseek_v2_236b_has_236b_total_and_21b_activated_parameters():
    with torch.device("meta"):
        model = build_model(ModelConfig.from_name("deepseek_v2_236b"))
    assert 235.0e9 < model.num_params() < 237.0e9  # the paper: 236B
    assert 21.0e9 < model.num_params(activated=True) < 22.0e9  # the paper: 21B activated per token
    assert not model.mtp and model.config.mtp_modules == 0
    assert (model.config.rope_dim, model.config.kv_heads, model.config.attention.latent) == (64, 128, True)


def _reference_group_limited_greedy(scores: torch.Tensor, n_groups: int, n_keep: int, k: int) -> list[list[int]]:
    """Per-token Python loops, written from DeepSeek-V2's description: groups ranked by their best
    expert's score, the top-k experts picked inside the best ``n_keep`` groups."""
    n_tokens, n_experts = scores.shape
    size = n_experts // n_groups
    chosen = []
    for t in range(n_tokens):
        s = scores[t].tolist()
        best = [max(s[g * size:(g + 1) * size]) for g in range(n_groups)]
        groups = sorted(range(n_groups), key=lambda g: -best[g])[:n_keep]
        allowed = [e for e in range(n_experts) if e // size in groups]
        chosen.append(sorted(sorted(allowed, key=lambda e: -s[e])[:k]))
    return chosen


def test_router_ranks_groups_by_their_best_expert():
    model = _ours()
    router = model.layers["1"].feed_forward.gate
    assert isinstance(router, TopKRouter) and type(router) is not TopKRouter
    torch.manual_seed(0)
    torch.nn.init.normal_(router.weight, std=0.5)
    x = torch.randn(200, D)
    scores, weights, indices = router(x)
    torch.testing.assert_close(scores, (x @ router.weight.T).softmax(dim=-1))
    picked = indices.sort(dim=-1).values.tolist()
    assert picked == _reference_group_limited_greedy(scores, GROUPS, TOPK_GROUPS, TOP_K)
    torch.testing.assert_close(weights, scores.gather(1, indices) * ROUTE_SCALE)  # V2: no renormalisation
    # the limit matters for these tokens, and V3's ranking (sum of the best two) would pick otherwise
    greedy = scores.topk(TOP_K, dim=-1).indices.sort(dim=-1).values.tolist()
    assert sum(a != b for a, b in zip(picked, greedy)) > 20
    v3 = TopKRouter(model.config)
    v3.load_state_dict(router.state_dict())
    v3_picked = v3(x)[2].sort(dim=-1).values.tolist()
    assert sum(a != b for a, b in zip(picked, v3_picked)) > 5


# -- transformers parity ---------------------------------------------------------------------------------


def test_ours_to_hf_logits_match(tmp_path: Path):
    ours = _ours()
    save_pretrained(ours, tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    assert (config["model_type"], config["architectures"]) == ("deepseek_v2", ["DeepseekV2ForCausalLM"])
    assert (config["topk_method"], config["n_group"], config["topk_group"]) == ("group_limited_greedy", GROUPS, TOPK_GROUPS)
    assert (config["scoring_func"], config["norm_topk_prob"], config["routed_scaling_factor"]) == ("softmax", False, ROUTE_SCALE)
    hf = _hf_load(tmp_path)
    assert isinstance(hf, DeepseekV2ForCausalLM)
    ids = _ids()
    expected = _logits(ours, ids)
    assert (_logits(hf, ids) - expected).abs().max().item() < _tolerance(expected)
    # the check can fail: without the group limit the same weights give other logits
    ungrouped = _ours(n_limited_groups=GROUPS)
    ungrouped.load_state_dict(ours.state_dict())
    assert (_logits(ungrouped, ids) - expected).abs().max().item() > 100 * _tolerance(expected)


def test_hf_to_ours_logits_match_and_write_back(tmp_path: Path):
    hf = _hf_model()
    hf.save_pretrained(tmp_path / "hf")
    ours, cfg = from_pretrained(tmp_path / "hf", attn_backend="eager")
    assert cfg.family == "deepseek_v2" and isinstance(ours.layers["1"].feed_forward.gate, type(_ours().layers["1"].feed_forward.gate))
    assert (cfg.n_expert_groups, cfg.n_limited_groups, cfg.n_activated_experts) == (GROUPS, TOPK_GROUPS, TOP_K)
    assert (cfg.score_func, cfg.norm_topk_prob, cfg.route_scale, cfg.mtp_depth) == ("softmax", False, ROUTE_SCALE, 0)
    ids = _ids(seed=2)
    expected = _logits(hf, ids)
    assert (_logits(ours, ids) - expected).abs().max().item() < _tolerance(expected)
    assert (_logits(from_pretrained(tmp_path / "hf", attn_backend="sdpa")[0], ids) - expected).abs().max().item() < (
        _tolerance(expected)
    )
    save_pretrained(ours, tmp_path / "back")
    written = json.loads((tmp_path / "back" / "config.json").read_text())
    assert (written["model_type"], written["topk_method"], written["topk_group"]) == (
        "deepseek_v2", "group_limited_greedy", TOPK_GROUPS
    )
    original, back = _weights(tmp_path / "hf"), _weights(tmp_path / "back")
    assert original.keys() == back.keys()
    assert all(torch.equal(original[k], back[k]) for k in original)


def test_greedy_checkpoints_read_without_a_group_limit(tmp_path: Path):
    """``topk_method: greedy`` ignores n_group / topk_group in transformers, so we read no limit."""
    save_pretrained(_ours(n_limited_groups=GROUPS), tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    assert config["topk_method"] == "greedy"
    config.update(n_group=GROUPS, topk_group=1)
    (tmp_path / "config.json").write_text(json.dumps(config))
    _, cfg = from_pretrained(tmp_path)
    assert (cfg.family, cfg.n_expert_groups, cfg.n_limited_groups) == ("deepseek_v2", 1, 1)


# -- the family in the registry ----------------------------------------------------------------------------


def test_the_family_is_found_through_the_registry():
    spec = family_spec("deepseek_v2")
    assert {"deepseek_v2_236b", "deepseek_v2_tiny"} <= set(spec.card.presets)
    assert adapter_for_family("deepseek_v2") is adapter_for_model_type("deepseek_v2")
    assert adapter_for_family("deepseek_v3") is not adapter_for_model_type("deepseek_v2")
    plan = spec.tp_plan(ModelConfig.from_name("deepseek_v2_tiny"), 2, False)
    assert plan == family_spec("deepseek_v3").tp_plan(ModelConfig.from_name("deepseek_v2_tiny", family="deepseek_v3"), 2, False)


@pytest.mark.parametrize(
    ("overrides", "match"),
    [
        (dict(score_func="sigmoid"), r"model\.score_func='sigmoid': the deepseek_v2 family routes with softmax"),
        (dict(mtp_depth=1), r"model\.mtp_depth=1: the deepseek_v2 family has no multi-token prediction"),
        (dict(n_limited_groups=5), r"model\.n_limited_groups=5 exceeds n_expert_groups=4"),
    ],
)
def test_config_errors(overrides: dict, match: str):
    with pytest.raises(ConfigError, match=match):
        ModelConfig.from_name("deepseek_v2_tiny", **overrides)
