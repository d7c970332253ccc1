"""Hugging Face interop for the deepseek_v3 family: logits match transformers' DeepseekV3 / DeepseekV2.

Tiny random models in fp32: vocab 256, d_model 64, 3 layers (the first dense), 8 routed experts top-2
in 4 groups of which 2 are searched, 1 shared expert, low-rank queries. Every weight is random
(norms away from 1, so swapped norms show up), the router weights are large enough that tokens pick
different experts, and the balancing bias is non-zero and large enough to change which experts are
picked (both asserted below), so a dropped or misnamed bias changes the logits. rope_theta and
routed_scaling_factor are non-default so a dropped config field does too.

The MLA latent norms use eps 1e-6 whatever rms_norm_eps says, in transformers, in DeepSeek's
reference code and in ours (dsl_lit.models.common.mla.LATENT_NORM_EPS).
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import (
    AutoModelForCausalLM,
    DeepseekV2Config,
    DeepseekV2ForCausalLM,
    DeepseekV3Config,
    DeepseekV3ForCausalLM,
)
from transformers.modeling_layers import MtpModel

from data_contract.errors import ConfigError
from dsl_lit.hf import (
    DeepSeekV2Adapter,
    DeepSeekV3Adapter,
    adapter_for_family,
    adapter_for_model_type,
    from_pretrained,
    save_pretrained,
)
from dsl_lit.models import ModelConfig, Transformer, build_model
from dsl_lit.models.common.moe import TopKRouter
from tests.conftest import edit_config_json
from tests.numerics import assert_close_fp32

VOCAB, D, LAYERS, HEADS, FFN, MOE_FFN = 256, 64, 3, 4, 96, 32
EXPERTS, TOP_K, GROUPS, TOPK_GROUPS = 8, 2, 4, 2
THETA, EPS, ROUTE_SCALE = 5000.0, 1e-6, 1.5
SEQ = 24
YARN = {"factor": 4.0, "original_max_seq_len": 32, "mscale": 1.0, "mscale_all_dim": 1.0}


def _our_config(**overrides: object) -> ModelConfig:
    values: dict = dict(
        family="deepseek_v3",
        vocab_size=VOCAB,
        n_layers=LAYERS,
        d_model=D,
        n_heads=HEADS,
        n_kv_heads=HEADS,
        ffn_hidden=FFN,
        max_seq_len=64,
        rope_theta=THETA,
        norm_eps=EPS,
        q_lora_rank=32,
        kv_lora_rank=32,
        qk_nope_head_dim=16,
        qk_rope_head_dim=8,
        v_head_dim=16,
        n_dense_layers=1,
        n_routed_experts=EXPERTS,
        n_shared_experts=1,
        n_activated_experts=TOP_K,
        moe_ffn_hidden=MOE_FFN,
        n_expert_groups=GROUPS,
        n_limited_groups=TOPK_GROUPS,
        score_func="sigmoid",
        route_scale=ROUTE_SCALE,
        norm_topk_prob=True,
        attn_backend="eager",
        extra={"bos_token_id": 0, "eos_token_id": 1},
    )
    values.update(overrides)
    return ModelConfig(**values)


# Softmax routing as DeepSeek-V2-Lite: no query compression, plain top-k, no renormalisation.
V2_LITE = dict(
    q_lora_rank=None, score_func="softmax", n_expert_groups=1, n_limited_groups=1, norm_topk_prob=False
)


def _randomise(model: torch.nn.Module, seed: int = 0, bias: bool = True) -> None:
    """Random weights: matrices N(0, 0.1), routers N(0, 0.3), norms U(0.5, 1.5), bias N(0, 0.3)."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.ndim == 1:  # norm weights: away from 1 so a swapped norm shows up in the logits
                p.copy_(torch.rand(p.shape, generator=gen) + 0.5)
            else:
                router = name.endswith(("feed_forward.gate.weight", "mlp.gate.weight"))
                p.copy_(torch.randn(p.shape, generator=gen) * (0.3 if router else 0.1))
        for name, b in model.named_buffers():
            if name.endswith(("expert_bias", "e_score_correction_bias")):
                b.copy_(torch.randn(b.shape, generator=gen) * 0.3 if bias else torch.zeros_like(b))


def _our_model(seed: int = 0, **overrides: object) -> Transformer:
    model = build_model(_our_config(**overrides)).eval()
    _randomise(model, seed, bias=model.config.score_func == "sigmoid")
    return model


def _hf_rope(rope_scaling: dict | None) -> dict:
    if not rope_scaling:
        return {"rope_type": "default", "rope_theta": THETA}
    yarn = dict(rope_scaling)
    yarn["original_max_position_embeddings"] = yarn.pop("original_max_seq_len")
    return {"rope_type": "yarn", "rope_theta": THETA, **yarn}


def _hf_common(rope_scaling: dict | None, max_pos: int) -> dict:
    """Config fields the V2 and V3 HF configs share."""
    return dict(
        vocab_size=VOCAB, hidden_size=D, intermediate_size=FFN, moe_intermediate_size=MOE_FFN,
        num_hidden_layers=LAYERS, num_attention_heads=HEADS, num_key_value_heads=HEADS, n_shared_experts=1,
        n_routed_experts=EXPERTS, routed_scaling_factor=ROUTE_SCALE, kv_lora_rank=32, qk_rope_head_dim=8,
        v_head_dim=16, qk_nope_head_dim=16, num_experts_per_tok=TOP_K, first_k_dense_replace=1,
        max_position_embeddings=max_pos, rms_norm_eps=EPS, rope_parameters=_hf_rope(rope_scaling),
        bos_token_id=0, eos_token_id=1,
    )


def _randomised_eager(model_cls, cfg) -> torch.nn.Module:
    cfg._attn_implementation = "eager"
    model = model_cls(cfg).eval()
    _randomise(model)
    return model


def _hf_v3_model(q_lora_rank: int | None = 32, rope_scaling: dict | None = None, max_pos: int = 64):
    # num_mtp_layers stays at its default 1: transformers writes it but saves no MTP layer
    cfg = DeepseekV3Config(**_hf_common(rope_scaling, max_pos), q_lora_rank=q_lora_rank, n_group=GROUPS,
                           topk_group=TOPK_GROUPS, norm_topk_prob=True)
    return _randomised_eager(DeepseekV3ForCausalLM, cfg)


def _hf_v2_model(rope_scaling: dict | None = None, max_pos: int = 64):
    cfg = DeepseekV2Config(**_hf_common(rope_scaling, max_pos), q_lora_rank=None, topk_method="greedy")
    return _randomised_eager(DeepseekV2ForCausalLM, cfg)


def _ids(seq: int = SEQ, seed: int = 1) -> torch.Tensor:
    return torch.randint(0, VOCAB, (2, seq), generator=torch.Generator().manual_seed(seed))


def _hf_load(path: Path, **kwargs) -> torch.nn.Module:
    return AutoModelForCausalLM.from_pretrained(path, attn_implementation="eager", **kwargs).eval()


@torch.no_grad()
def _assert_same_logits(ours: torch.nn.Module, hf: torch.nn.Module, seq: int = SEQ) -> None:
    """Our logits equal transformers' up to fp32 reordering (sums over the width, per layer, and
    attention over the sequence)."""
    ids = _ids(seq)
    assert_close_fp32(ours(ids).float(), hf(input_ids=ids).logits.float(), D * LAYERS * seq)


def _weights(path: Path) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    for file in sorted(path.glob("*.safetensors")):
        out.update(load_file(file))
    return out


@torch.no_grad()
def _routing(model: Transformer, ids: torch.Tensor) -> list[torch.Tensor]:
    """Sorted expert ids [tokens, k] each router of the main model picked for ``ids``."""
    picked: list[torch.Tensor] = []
    hooks = [
        m.register_forward_hook(lambda _m, _i, out: picked.append(out[2].sort(dim=-1).values))
        for m in model.layers.modules()
        if isinstance(m, TopKRouter)
    ]
    model(ids)
    for hook in hooks:
        hook.remove()
    return picked


def _assert_exact_copy(got: Transformer, expected: Transformer) -> None:
    want, have = expected.state_dict(), got.state_dict()
    assert have.keys() == want.keys()
    for name in want:
        assert have[name].dtype == want[name].dtype, name
        assert torch.equal(have[name], want[name]), name


# -- the test models exercise what they should -------------------------------------------------------


def test_routing_varies_per_token_and_bias_changes_it() -> None:
    model = _our_model(mtp_depth=1)
    ids = _ids()
    with_bias = _routing(model, ids)
    assert len(with_bias) == LAYERS - 1
    for picked in with_bias:  # tokens go to different expert pairs, in more than two groups
        assert len({tuple(row.tolist()) for row in picked}) > 5
        assert len(set((picked // (EXPERTS // GROUPS)).flatten().tolist())) > 2
    biases = [m.gate.expert_bias for m in model.moe_layers()]
    assert all(b.abs().min() > 0 for b in biases)
    with torch.no_grad():
        logits = model(ids)
        for b in biases:
            b.zero_()
        changed = [
            (a != b).any(dim=-1).float().mean().item() for a, b in zip(with_bias, _routing(model, ids))
        ]
        assert min(changed) > 0.2, changed  # the bias picks other experts for many tokens ...
        assert (model(ids) - logits).abs().max() > 0.1  # ... and that shows in the logits


# -- logits parity -----------------------------------------------------------------------------------


@pytest.mark.parametrize("mtp_depth", [0, 1])
def test_ours_to_hf_logits_match(tmp_path: Path, mtp_depth: int) -> None:
    ours = _our_model(mtp_depth=mtp_depth)
    save_pretrained(ours, tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    assert config["model_type"] == "deepseek_v3" and config["architectures"] == ["DeepseekV3ForCausalLM"]
    assert config["scoring_func"] == "sigmoid" and config["topk_method"] == "noaux_tc"
    assert config["num_nextn_predict_layers"] == mtp_depth
    assert [config[k] for k in ("n_group", "topk_group", "first_k_dense_replace")] == [GROUPS, TOPK_GROUPS, 1]
    assert (config["rope_theta"], config["routed_scaling_factor"]) == (THETA, ROUTE_SCALE)
    assert config["num_key_value_heads"] == HEADS
    hf = _hf_load(tmp_path)
    assert isinstance(hf, DeepseekV3ForCausalLM)
    assert hf.model.layers[1].mlp.gate.e_score_correction_bias.abs().min() > 0
    _assert_same_logits(ours, hf)


def test_mtp_logits_match_transformers_mtp_model(tmp_path: Path) -> None:
    """The MTP layer as transformers' own MtpModel (its speculative-decoding drafter) reads it."""
    ours = _our_model(mtp_depth=1)
    save_pretrained(ours, tmp_path)
    hf = _hf_load(tmp_path)
    # transformers finds MTP layers through this pattern, hard-coded to DeepSeek-V3's layer 61.
    hf._keys_to_ignore_on_load_unexpected = [rf"model\.layers\.{LAYERS}\..*"]
    mtp = MtpModel.from_pretrained(hf).eval()
    ids = _ids()
    positions = torch.arange(SEQ - 1).expand(2, -1)
    with torch.no_grad():
        hidden = ours.hidden_states(ids)
        expected = ours.mtp_logits(hidden, ids)[0]
        drafted = mtp.forward_layer(0, hidden[:, :-1], positions, None, input_ids=ids[:, 1:])
        theirs = mtp._project_to_logits(drafted)
    assert_close_fp32(expected, theirs, D * LAYERS * SEQ)
    with torch.no_grad():  # the check can fail: swap the MTP module's two input norms
        module = ours.mtp["0"]
        module.enorm.weight, module.hnorm.weight = module.hnorm.weight, module.enorm.weight
        assert (ours.mtp_logits(hidden, ids)[0] - theirs).abs().max().item() > 1e-2


def test_hf_to_ours_logits_match(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    hf = _hf_v3_model()
    hf.save_pretrained(tmp_path)
    assert json.loads((tmp_path / "config.json").read_text())["num_nextn_predict_layers"] == 1
    with caplog.at_level(logging.WARNING, logger="dsl_lit.models.deepseek_v3.hf_adapter"):
        ours, cfg = from_pretrained(tmp_path, attn_backend="eager")
    assert "num_nextn_predict_layers=1" in caplog.text  # declared, but transformers saved no MTP layer
    assert cfg.mtp_depth == 0 and not ours.mtp
    assert (cfg.n_expert_groups, cfg.n_limited_groups, cfg.n_dense_layers) == (GROUPS, TOPK_GROUPS, 1)
    assert (cfg.rope_theta, cfg.route_scale) == (THETA, ROUTE_SCALE)
    assert (cfg.score_func, cfg.norm_topk_prob) == ("sigmoid", True)
    assert cfg.extra == {"bos_token_id": 0, "eos_token_id": 1}
    bias = hf.model.layers[2].mlp.gate.e_score_correction_bias
    assert bias.abs().min() > 0 and torch.equal(ours.layers["2"].feed_forward.gate.expert_bias, bias)
    assert not any(t.is_meta for t in [*ours.parameters(), *ours.buffers()])
    _assert_same_logits(ours, hf)
    _assert_same_logits(from_pretrained(tmp_path, attn_backend="sdpa")[0], hf)  # our other backend too


@pytest.mark.parametrize(
    "overrides",
    [
        pytest.param(dict(q_lora_rank=None), id="no-query-lora"),
        pytest.param(dict(max_seq_len=128, rope_scaling=YARN), id="yarn"),
        pytest.param(dict(max_seq_len=128, rope_scaling={**YARN, "mscale_all_dim": 0.5}), id="yarn-mscale"),
        pytest.param(V2_LITE, id="v2-lite"),
        # mscale_all_dim 0: cos/sin scaled by 0.1 ln(factor) + 1, the softmax scale left alone
        pytest.param(
            dict(V2_LITE, max_seq_len=128, rope_scaling={**YARN, "mscale_all_dim": 0.0}), id="v2-lite-yarn"
        ),
    ],
)
def test_variants_ours_to_hf_logits_match(tmp_path: Path, overrides: dict) -> None:
    """Sequences of 48 > original_max_seq_len 32 run the YaRN-extended positions."""
    ours = _our_model(**overrides)
    save_pretrained(ours, tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    hf = _hf_load(tmp_path)
    softmax = overrides.get("score_func") == "softmax"
    assert config["model_type"] == ("deepseek_v2" if softmax else "deepseek_v3")
    assert isinstance(hf, DeepseekV2ForCausalLM if softmax else DeepseekV3ForCausalLM)
    attention = hf.model.layers[0].self_attn
    assert attention.scaling == pytest.approx(ours.layers["0"].attention.softmax_scale, rel=1e-12)
    assert hf.model.rotary_emb.attention_scaling == pytest.approx(
        (ours.rope.cos[0, 0]).item(), rel=1e-6
    )  # cos(0) * attention factor
    scaling = overrides.get("rope_scaling")
    if scaling:
        assert config["rope_parameters"]["rope_type"] == "yarn" and config["rope_scaling"]["type"] == "yarn"
        plain = (16 + 8) ** -0.5
        if scaling["mscale_all_dim"] == 0.0:
            assert hf.model.rotary_emb.attention_scaling > 1.0 and attention.scaling == pytest.approx(plain)
        elif scaling["mscale_all_dim"] != scaling["mscale"]:  # both YaRN factors are non-trivial
            assert hf.model.rotary_emb.attention_scaling != 1.0 and attention.scaling != pytest.approx(plain)
    _assert_same_logits(ours, hf, seq=48)


def test_hf_v2_lite_to_ours_logits_match(tmp_path: Path) -> None:
    rope_scaling = {**YARN, "mscale": 0.707, "mscale_all_dim": 0.707}  # DeepSeek-V2-Lite's values
    hf = _hf_v2_model(rope_scaling=rope_scaling, max_pos=128)
    hf.save_pretrained(tmp_path)
    ours, cfg = from_pretrained(tmp_path, attn_backend="eager")
    assert (cfg.score_func, cfg.q_lora_rank, cfg.norm_topk_prob, cfg.mtp_depth) == ("softmax", None, False, 0)
    assert cfg.rope_scaling == rope_scaling
    assert all(not m.gate.expert_bias.any() for m in ours.moe_layers())
    _assert_same_logits(ours, hf, seq=48)
    # ... and written back it is a deepseek_v2 checkpoint again, with the same weights.
    save_pretrained(ours, tmp_path / "back")
    assert json.loads((tmp_path / "back" / "config.json").read_text())["model_type"] == "deepseek_v2"
    assert _weights(tmp_path / "back").keys() == _weights(tmp_path).keys()


def test_hf_yarn_to_ours_logits_match(tmp_path: Path) -> None:
    hf = _hf_v3_model(q_lora_rank=None, rope_scaling={**YARN, "mscale_all_dim": 0.5}, max_pos=128)
    hf.save_pretrained(tmp_path)
    ours, cfg = from_pretrained(tmp_path, attn_backend="eager")
    assert cfg.rope_scaling == {**YARN, "mscale_all_dim": 0.5} and cfg.q_lora_rank is None
    _assert_same_logits(ours, hf, seq=48)


def test_hub_config_json_form(tmp_path: Path) -> None:
    """config.json as deepseek-ai/DeepSeek-V3 has it (transformers 4 era): top-level rope_theta,
    legacy rope_scaling with "type", scoring_func / topk_method, training-only keys; V2-Lite's
    rope_scaling says ``"type": "yarn"`` too."""
    ours = _our_model(mtp_depth=1, max_seq_len=128, rope_scaling=YARN)
    save_pretrained(ours, tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    for key in ("rope_parameters", "dtype", "use_cache"):
        del config[key]
    config.update(
        {
            "rope_scaling": {
                "type": "yarn",
                "factor": 4.0,
                "original_max_position_embeddings": 32,
                "beta_fast": 32,
                "beta_slow": 1,
                "mscale": 1.0,
                "mscale_all_dim": 1.0,
            },
            "aux_loss_alpha": 0.001,
            "seq_aux": True,
            "ep_size": 1,
            "torch_dtype": "float32",
            "transformers_version": "4.33.1",
        }
    )
    (tmp_path / "config.json").write_text(json.dumps(config))
    back, cfg = from_pretrained(tmp_path, attn_backend="eager")
    assert cfg.rope_scaling == {**YARN, "beta_fast": 32, "beta_slow": 1} and cfg.rope_theta == THETA
    assert cfg.mtp_depth == 1
    with torch.no_grad():
        assert torch.equal(back(_ids(48)), ours(_ids(48)))


# -- round trip, dtype, layout -----------------------------------------------------------------------


def test_round_trip_is_exact(tmp_path: Path) -> None:
    ours = _our_model(mtp_depth=1, max_seq_len=128, rope_scaling={**YARN, "mscale_all_dim": 0.5})
    save_pretrained(ours, tmp_path)
    back, cfg = from_pretrained(tmp_path, attn_backend="eager")
    for field in (
        "vocab_size", "n_layers", "d_model", "n_heads", "ffn_hidden", "max_seq_len", "rope_theta", "norm_eps",
        "init_std", "tie_embeddings", "q_lora_rank", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim",
        "v_head_dim", "rope_interleave", "rope_scaling", "n_dense_layers", "n_routed_experts", "n_shared_experts",
        "n_activated_experts", "moe_ffn_hidden", "n_expert_groups", "n_limited_groups", "score_func",
        "route_scale", "norm_topk_prob", "mtp_depth", "extra",
    ):  # fmt: skip
        assert getattr(cfg, field) == getattr(ours.config, field), field
    _assert_exact_copy(back, ours)  # mtp.* and expert_bias included
    assert any(name.startswith("mtp.0.block.feed_forward.experts.") for name in back.state_dict())
    torch.testing.assert_close(back.rope.cos, ours.rope.cos, rtol=0, atol=0)
    assert not back.layers["1"].feed_forward.gate.load.counts.is_meta  # the non-persistent load counter
    with torch.no_grad():
        assert torch.equal(back.mtp_logits(back.hidden_states(_ids()), _ids())[0],
                           ours.mtp_logits(ours.hidden_states(_ids()), _ids())[0])  # fmt: skip


@pytest.mark.parametrize(
    "overrides", [dict(tie_embeddings=True, mtp_depth=1), V2_LITE], ids=["tied-mtp", "v2-lite"]
)
def test_round_trip_variants(tmp_path: Path, overrides: dict) -> None:
    ours = _our_model(**overrides)
    save_pretrained(ours, tmp_path, max_shard_size="100KB")  # sharded, with the index
    assert (tmp_path / "model.safetensors.index.json").is_file()
    back, cfg = from_pretrained(tmp_path, attn_backend="eager")
    _assert_exact_copy(back, ours)
    if cfg.tie_embeddings:
        assert back.output.weight is back.tok_embeddings.weight
        assert "lm_head.weight" not in _weights(tmp_path)
    _assert_same_logits(back, _hf_load(tmp_path))


def test_bf16_keeps_expert_bias_fp32(tmp_path: Path) -> None:
    ours = _our_model(mtp_depth=1)
    save_pretrained(ours, tmp_path, dtype=torch.bfloat16)
    weights = _weights(tmp_path)
    biases = {n: t for n, t in weights.items() if n.endswith("e_score_correction_bias")}
    assert len(biases) == LAYERS - 1 + 1  # two MoE layers and the MTP layer
    assert {t.dtype for t in biases.values()} == {torch.float32}
    assert {t.dtype for n, t in weights.items() if n not in biases} == {torch.bfloat16}
    config = json.loads((tmp_path / "config.json").read_text())
    assert config["dtype"] == config["torch_dtype"] == "bfloat16"
    bias = ours.layers["1"].feed_forward.gate.expert_bias
    assert torch.equal(biases["model.layers.1.mlp.gate.e_score_correction_bias"], bias)

    as_stored, _ = from_pretrained(tmp_path, dtype="bfloat16")
    upcast, _ = from_pretrained(tmp_path, dtype="float32")
    for name, tensor in ours.state_dict().items():
        if name.endswith("expert_bias"):  # fp32 and exact whatever dtype is asked for
            assert as_stored.state_dict()[name].dtype == torch.float32
            assert torch.equal(as_stored.state_dict()[name], tensor), name
        else:
            assert as_stored.state_dict()[name].dtype == torch.bfloat16, name
            assert torch.equal(upcast.state_dict()[name], tensor.bfloat16().float()), name
    # A bf16 model with an fp32 bias saves without dtype= (the bias is not a "mixed dtype").
    save_pretrained(as_stored, tmp_path / "again")
    assert _weights(tmp_path / "again").keys() == weights.keys()
    hf_bf16 = _hf_load(tmp_path)
    assert hf_bf16.dtype == torch.bfloat16
    assert hf_bf16.model.layers[1].mlp.gate.e_score_correction_bias.dtype == torch.float32
    with torch.no_grad():  # bf16 runs on both sides stay close to the fp32 logits (on average: bf16
        ref = ours(_ids())  # rounding may flip a near-tie routing decision for a token or two)
        assert (as_stored(_ids()).float() - ref).abs().mean() < 0.05
        assert (hf_bf16(input_ids=_ids()).logits.float() - ref).abs().mean() < 0.05


def test_hub_layout(tmp_path: Path) -> None:
    ours = _our_model(mtp_depth=1)
    save_pretrained(ours, tmp_path)
    weights = _weights(tmp_path)
    j = LAYERS  # the MTP layer
    for layer in (1, 2, j):
        block = ours.mtp["0"].block if layer == j else ours.layers[str(layer)]
        for e in range(EXPERTS):
            for proj, stacked in (("gate_proj", "w1"), ("up_proj", "w3"), ("down_proj", "w2")):
                expected = getattr(block.feed_forward.experts, stacked)[e]
                assert torch.equal(weights[f"model.layers.{layer}.mlp.experts.{e}.{proj}.weight"], expected)
        assert f"model.layers.{layer}.mlp.gate.e_score_correction_bias" in weights
        assert f"model.layers.{layer}.mlp.shared_experts.gate_proj.weight" in weights
    assert weights["model.layers.1.mlp.experts.0.gate_proj.weight"].shape == (MOE_FFN, D)
    assert weights["model.layers.1.mlp.experts.0.down_proj.weight"].shape == (D, MOE_FFN)
    assert "model.layers.0.mlp.gate_proj.weight" in weights  # the dense layer
    assert "model.layers.0.mlp.gate.weight" not in weights
    assert not any("experts.w" in n or "gate_up_proj" in n for n in weights)
    assert weights[f"model.layers.{j}.eh_proj.weight"].shape == (D, 2 * D)
    for name in ("enorm", "hnorm", "shared_head.norm"):
        assert f"model.layers.{j}.{name}.weight" in weights
    assert torch.equal(weights[f"model.layers.{j}.embed_tokens.weight"], ours.tok_embeddings.weight)
    assert torch.equal(weights[f"model.layers.{j}.shared_head.head.weight"], ours.output.weight)
    assert torch.equal(weights[f"model.layers.{j}.shared_head.norm.weight"], ours.mtp["0"].norm.weight)
    assert "model.layers.1.self_attn.q_a_proj.weight" in weights
    assert "model.layers.1.self_attn.q_proj.weight" not in weights
    assert f"model.layers.{j + 1}.input_layernorm.weight" not in weights


def test_adapter_registry() -> None:
    assert isinstance(adapter_for_model_type("deepseek_v3"), DeepSeekV3Adapter)
    assert isinstance(adapter_for_model_type("deepseek_v2"), DeepSeekV2Adapter)
    assert adapter_for_family("deepseek_v3") is adapter_for_model_type("deepseek_v3")
    assert adapter_for_model_type("llama") is adapter_for_family("deepseek_llm")


# -- errors ------------------------------------------------------------------------------------------


@pytest.fixture
def saved(tmp_path: Path) -> Path:
    save_pretrained(_our_model(), tmp_path)
    return tmp_path


@pytest.fixture
def saved_v2(tmp_path: Path) -> Path:
    save_pretrained(_our_model(**V2_LITE), tmp_path)
    return tmp_path


@pytest.mark.parametrize(
    ("changes", "match"),
    [
        ({"attention_bias": True}, "attention_bias"),
        ({"hidden_act": "gelu"}, "hidden_act"),
        ({"scoring_func": "softmax"}, "scoring_func='softmax'"),
        ({"scoring_func": "tanh"}, "scoring_func='tanh'"),
        ({"topk_method": "greedy"}, "topk_method='greedy'"),
        ({"moe_layer_freq": 2}, "moe_layer_freq"),
        ({"num_key_value_heads": 2}, "num_key_value_heads"),
        ({"architectures": ["DeepseekV3ForSequenceClassification"]}, "architectures"),
        ({"rope_scaling": {"type": "linear", "factor": 2.0}}, "rope_type='linear'"),
        ({"rope_scaling": {"type": "yarn", "factor": 2.0, "attention_factor": 1.2}}, "attention_factor"),
        ({"quantization_config": {"quant_method": "fp8", "fmt": "e4m3"}}, "quantization_config"),
        ({"n_group": 3}, "n_expert_groups"),
        ({"n_routed_experts": 16}, r"missing 48 expert weight\(s\)"),  # 8 more, 3 projections, 2 layers
        (
            {"n_routed_experts": 4, "n_group": 2, "topk_group": 1},
            r"24 expert weight\(s\) beyond n_routed_experts=4",
        ),
    ],
)
def test_unsupported_v3_config_is_a_config_error(saved: Path, changes: dict, match: str) -> None:
    edit_config_json(saved, **changes)
    with pytest.raises(ConfigError, match=match):
        from_pretrained(saved)


@pytest.mark.parametrize(
    ("changes", "match"),
    [
        ({"scoring_func": "sigmoid"}, "scoring_func='sigmoid'"),
        ({"topk_method": "group_limited_greedy", "n_group": None}, "missing 'n_group'"),
        ({"norm_topk_prob": True}, "norm_topk_prob"),
        ({"mlp_bias": True}, "mlp_bias"),
        ({"rope_interleave": False}, "rope_interleave"),
    ],
)
def test_unsupported_v2_config_is_a_config_error(saved_v2: Path, changes: dict, match: str) -> None:
    edit_config_json(saved_v2, **changes)
    with pytest.raises(ConfigError, match=match):
        from_pretrained(saved_v2)


def test_weight_errors(saved: Path) -> None:
    state = load_file(saved / "model.safetensors")
    del state["model.layers.2.mlp.experts.5.up_proj.weight"]
    save_file(state, str(saved / "model.safetensors"), {"format": "pt"})
    with pytest.raises(
        ConfigError, match=r"missing 1 expert weight\(s\): 'layers\.2\.feed_forward\.experts\.w3\[5\]'"
    ):
        from_pretrained(saved)
    state["model.layers.2.mlp.experts.5.up_proj.weight"] = torch.zeros(MOE_FFN, D)
    state["model.layers.1.mlp.experts.0.gate_up_proj"] = torch.zeros(2 * MOE_FFN, D)
    save_file(state, str(saved / "model.safetensors"), {"format": "pt"})
    with pytest.raises(ConfigError, match=r"1 weight\(s\).*experts\.0\.gate_up_proj"):
        from_pretrained(saved)


@pytest.mark.parametrize(
    ("overrides", "match"),
    [
        (dict(V2_LITE, mtp_depth=1), "mtp_depth=1 .*deepseek_v2"),
        (dict(V2_LITE, norm_topk_prob=True), "norm_topk_prob=True"),
        (dict(V2_LITE, n_expert_groups=4, n_limited_groups=2), "n_limited_groups=2"),
        (dict(V2_LITE, rope_interleave=False), "rope_interleave=False"),
    ],
)
def test_unwritable_softmax_models(tmp_path: Path, overrides: dict, match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        save_pretrained(_our_model(**overrides), tmp_path)
    assert not any(tmp_path.iterdir())


def test_softmax_model_with_expert_bias_is_refused(tmp_path: Path) -> None:
    model = _our_model(**V2_LITE)
    with torch.no_grad():
        model.layers["1"].feed_forward.gate.expert_bias[3] = 0.5
    with pytest.raises(
        ConfigError, match=r"layers\.1\.feed_forward\.gate\.expert_bias is non-zero.*deepseek_v2"
    ):
        save_pretrained(model, tmp_path)
