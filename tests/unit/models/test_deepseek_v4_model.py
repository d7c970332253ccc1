"""DeepSeek-V4 (``models/deepseek_v4/``) against transformers 5.24's ``DeepseekV4ForCausalLM``: the
MoE layer (top-k with sqrt-softplus scores and the balancing bias, hash routing, the clamped
SwiGLU), and the whole model through checkpoints in DeepSeek's release layout both ways, fp32
logits within reordering tolerance; plus what the config refuses."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from data_contract.errors import ConfigError
from dsl_lit.config.model import ModelConfig
from dsl_lit.hf import from_pretrained, save_pretrained
from dsl_lit.models import build_model
from dsl_lit.models.common.moe import MoE
from tests.numerics import assert_close_fp32

VOCAB, D, LAYERS, SEQ = 96, 64, 4, 40


def _cfg(**overrides) -> ModelConfig:
    """deepseek_v4_tiny narrowed to a small vocabulary and width, every kind of layer and router."""
    values = dict(vocab_size=VOCAB, d_model=D, n_heads=4, attention_head_dim=32, q_lora_rank=24, qk_rope_head_dim=8,
                  moe_ffn_hidden=32, o_groups=2, o_lora_rank=16, index_n_heads=2, index_head_dim=16, index_topk=3,
                  sliding_window=8, hca_rate=16, n_layers=LAYERS, attention_kinds=["hca", "sliding", "csa", "hca"],
                  n_hash_layers=1, swiglu_limit=0.5, init_std=0.05)
    values.update(overrides)
    return ModelConfig.from_name("deepseek_v4_tiny", **values)


def _randomised(model: torch.nn.Module, seed: int = 0) -> torch.nn.Module:
    """Every float weight drawn afresh (biases, sinks and window biases too: zeros would hide a
    misplaced one), hash tables shuffled."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            scale = 0.3 if p.ndim == 1 or name.endswith(("ape", "base", "scale")) else p.shape[-1] ** -0.5
            p.copy_(torch.randn(p.shape, generator=g) * scale + (1.0 if name.endswith("norm.weight") else 0.0))
        for name, b in model.named_buffers():
            if name.endswith("expert_bias"):
                b.copy_(torch.randn(b.shape, generator=g) * 0.1)
            elif name.endswith("tid2eid"):  # k distinct experts of 8 per token id
                b.copy_(torch.stack([torch.randperm(8, generator=g)[: b.shape[1]] for _ in range(b.shape[0])]))
    return model


def _ids(seed: int = 1) -> torch.Tensor:
    return torch.randint(0, VOCAB, (2, SEQ), generator=torch.Generator().manual_seed(seed))


def _transformers_model(path: Path) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, attn_implementation="eager").eval()


@pytest.mark.parametrize("hash_routed", [False, True], ids=["topk", "hash"])
def test_the_moe_layer_equals_transformers(hash_routed):
    from transformers.models.deepseek_v4.configuration_deepseek_v4 import DeepseekV4Config
    from transformers.models.deepseek_v4.modeling_deepseek_v4 import DeepseekV4SparseMoeBlock

    cfg = _cfg()
    layer = 0 if hash_routed else 2
    ours = _randomised(build_model(cfg)).layers[str(layer)].feed_forward
    assert isinstance(ours, MoE)
    config = DeepseekV4Config(vocab_size=VOCAB, hidden_size=D, num_hidden_layers=LAYERS, n_routed_experts=8,
                              num_experts_per_tok=2, moe_intermediate_size=32, scoring_func="sqrtsoftplus",
                              routed_scaling_factor=1.5, swiglu_limit=0.5, mlp_layer_types=["hash_moe"] + ["moe"] * 3)
    reference = DeepseekV4SparseMoeBlock(config, layer)
    state = {"gate.weight": ours.gate.weight,
             "experts.gate_up_proj": torch.cat([ours.experts.w1, ours.experts.w3], dim=1),
             "experts.down_proj": ours.experts.w2,
             **{f"shared_experts.{hf}.weight": getattr(ours.shared_experts, w).weight
                for w, hf in (("w1", "gate_proj"), ("w2", "down_proj"), ("w3", "up_proj"))}}
    state |= {"gate.tid2eid": ours.gate.tid2eid} if hash_routed else {"gate.e_score_correction_bias": ours.gate.expert_bias}
    reference.load_state_dict(state)
    x = torch.randn(2, SEQ, D, generator=torch.Generator().manual_seed(3))
    ids = _ids()
    ours.eval()
    with torch.no_grad():
        expected = reference(x, input_ids=ids)
        assert_close_fp32(ours(x, ids), expected, D * 3)
        # the clamp is in the experts: without it the output moves
        ours.experts.limit = ours.shared_experts.limit = None
        assert (ours(x, ids) - expected).abs().max() > 1e-3


def test_ours_to_release_layout_loads_in_transformers_with_the_same_logits(tmp_path: Path):
    ours = _randomised(build_model(_cfg())).eval()
    save_pretrained(ours, tmp_path)
    written = json.loads((tmp_path / "config.json").read_text())
    assert written["model_type"] == "deepseek_v4" and written["layer_types"][2] == "compressed_sparse_attention"
    assert written["mlp_layer_types"] == ["hash_moe", "moe", "moe", "moe"]
    from safetensors import safe_open

    with safe_open(tmp_path / "model.safetensors", "pt") as f:
        names = set(f.keys())
    # DeepSeek's release names, one tensor per expert
    for name in ("embed.weight", "head.weight", "hc_head_fn", "layers.0.ffn.gate.tid2eid", "layers.1.ffn.gate.bias",
                 "layers.2.attn.indexer.compressor.wkv.weight", "layers.2.hc_attn_fn", "layers.3.ffn.experts.7.w2.weight",
                 "layers.0.attn.attn_sink", "layers.0.attn_norm.weight"):
        assert name in names, name
    reference = _transformers_model(tmp_path)
    ids = _ids()
    with torch.no_grad():
        assert_close_fp32(ours(ids), reference(input_ids=ids).logits, D * LAYERS * SEQ)


def test_a_release_checkpoint_loads_into_ours_and_round_trips_exactly(tmp_path: Path):
    save_pretrained(_randomised(build_model(_cfg()), seed=5), tmp_path / "first")
    reference = _transformers_model(tmp_path / "first")
    ours, cfg = from_pretrained(tmp_path / "first")
    assert cfg.family == "deepseek_v4" and cfg.attention_kinds == ["hca", "sliding", "csa", "hca"]
    assert (cfg.n_hash_layers, cfg.swiglu_limit, cfg.score_func) == (1, 0.5, "sqrtsoftplus")
    ids = _ids(seed=4)
    with torch.no_grad():
        assert_close_fp32(ours.eval()(ids), reference(input_ids=ids).logits, D * LAYERS * SEQ)
    save_pretrained(ours, tmp_path / "back")
    from safetensors.torch import load_file

    first, back = load_file(tmp_path / "first" / "model.safetensors"), load_file(tmp_path / "back" / "model.safetensors")
    assert first.keys() == back.keys() and all(torch.equal(first[k], back[k]) for k in first)
    assert first["layers.0.ffn.gate.tid2eid"].dtype == torch.int64 and first["layers.0.attn.attn_sink"].dtype == torch.float32


def test_a_checkpoint_transformers_saved_reads_as_the_release_does(tmp_path: Path):
    """transformers' own ``save_pretrained`` writes V4 under its module names (``model.`` prefix,
    ``embed_tokens``, ``hc_head.hc_*``, ``attn.norm``): read, eagerly and slice by slice (the lazy path
    of ``init_from``), as the release layout is, into the same tensors."""
    from dsl_lit.hf.reader import HFCheckpoint

    save_pretrained(_randomised(build_model(_cfg()), seed=6), tmp_path / "release")
    _transformers_model(tmp_path / "release").save_pretrained(tmp_path / "saved")
    from safetensors import safe_open

    with safe_open(tmp_path / "saved" / "model.safetensors", "pt") as f:
        saved_names = set(f.keys())
    assert {"model.embed_tokens.weight", "model.hc_head.hc_fn", "model.layers.1.attn.norm.weight"} <= saved_names
    assert "embed.weight" not in saved_names
    release, _ = from_pretrained(tmp_path / "release")
    saved, cfg = from_pretrained(tmp_path / "saved")
    assert cfg.attention_kinds == ["hca", "sliding", "csa", "hca"]
    expected = release.state_dict()
    assert saved.state_dict().keys() == expected.keys()
    assert all(torch.equal(t, expected[k]) for k, t in saved.state_dict().items())
    # a rank's slice, read by name from the transformers-saved files
    checkpoint = HFCheckpoint(tmp_path / "saved")
    part = torch.empty(4, expected["layers.3.feed_forward.experts.w2"].shape[1], expected["layers.3.feed_forward.experts.w2"].shape[2])
    checkpoint.fill({"layers.3.feed_forward.experts.w2": (part, (4, 0, 0))})
    assert torch.equal(part, expected["layers.3.feed_forward.experts.w2"][4:8])


def test_a_fresh_hash_table_spreads_the_vocabulary_over_every_expert():
    router = build_model(_cfg()).layers["0"].feed_forward.gate
    counts = torch.bincount(router.tid2eid.flatten(), minlength=8)
    assert counts.min() == counts.max() == VOCAB * 2 // 8
    assert (router.tid2eid[:, 0] != router.tid2eid[:, 1]).all()  # k different experts per token


@pytest.mark.parametrize("override, message", [
    ({"n_dense_layers": 1}, "every DeepSeek-V4 block is MoE"),
    ({"attention_kinds": ["hca", "csa"]}, "a kind for each of the 4 layers"),
    ({"attention_kinds": ["hca", "full", "csa", "hca"]}, "'full' is unknown"),
    ({"o_groups": 3}, "o_groups=3 does not divide"),
    ({"n_hash_layers": 5}, "n_hash_layers=5 must be between 0 and n_layers=4"),
])
def test_bad_v4_fields_are_refused_naming_them(override, message):
    with pytest.raises(ConfigError, match=message):
        _cfg(**override)


def test_fields_v4_does_not_read_are_refused_and_v4_fields_elsewhere_too():
    with pytest.raises(ConfigError, match=r"model.kv_lora_rank is not used by model.name=deepseek_v4_tiny"):
        _cfg().refuse_unused(["kv_lora_rank"])
    with pytest.raises(ConfigError, match=r"model.hc_mult is not used by model.name=deepseek_v3_tiny .*DeepSeek-V4"):
        ModelConfig.from_name("deepseek_v3_tiny").refuse_unused(["hc_mult"])
    _cfg().refuse_unused(["q_lora_rank", "index_topk", "hc_mult", "n_routed_experts"])  # read by V4: accepted


def test_score_func_sqrtsoftplus_is_v4s_alone():
    with pytest.raises(ConfigError, match="DeepSeek-V4's routing"):
        ModelConfig.from_name("deepseek_v3_tiny", score_func="sqrtsoftplus")


def test_the_attention_shape_counts_what_the_modules_hold():
    """FLOPs, stage costs and the planner read V4's attention from its shape class: its weights are
    the layers' own (averaged over the schedule), and at long sequences its scores cost what the
    window and the compressed keys cost, far below dense attention."""
    from dsl_lit.config.model_parts.v4_attention import V4AttentionShape
    from dsl_lit.scaling.planner.attention_costs import V4AttentionCosts

    cfg = _cfg()
    model = build_model(cfg)
    attentions = [model.layers[str(i)].attention for i in range(cfg.n_layers)]
    matrices = sum(p.numel() for a in attentions for n, p in a.named_parameters() if p.ndim == 2 and "ape" not in n)
    vectors = sum(p.numel() for a in attentions for n, p in a.named_parameters() if p.ndim == 1)
    assert matrices == pytest.approx(cfg.n_layers * V4AttentionShape.matmul_params(cfg), abs=cfg.n_layers)
    assert vectors == pytest.approx(cfg.n_layers * V4AttentionCosts.norm_params(cfg), abs=cfg.n_layers)
    flash = ModelConfig.from_name("deepseek_v4_flash")
    dense = 2.0 * flash.n_heads * 2 * flash.attention_head_dim * 65536
    assert V4AttentionShape.score_flops(flash, 65536) < 0.1 * dense
    assert (flash.kv_heads, flash.rope_dim) == (1, 64)


def test_the_csa_indexer_learns_by_its_kl_alone():
    """A training forward leaves the CSA layer's indexer KL (and only there); the language-model loss
    gives the indexer no gradient and the KL gives nothing else one; steps on the KL alone lower it
    and raise the share of attention mass the selected windows hold."""
    torch.manual_seed(0)
    model = _randomised(build_model(_cfg(index_topk=2)), seed=2).train()
    csa = model.layers["2"].attention
    ids = _ids()
    logits = model(ids)
    assert csa.index_loss is not None and all(
        model.layers[i].attention.index_loss is None for i in ("0", "1", "3"))
    indexer = {id(p) for p in csa.indexer.parameters()}
    lm = torch.nn.functional.cross_entropy(logits.flatten(0, 1), ids.flatten())
    lm_grads = torch.autograd.grad(lm, list(model.parameters()), allow_unused=True, retain_graph=True)
    assert all(g is None for p, g in zip(model.parameters(), lm_grads) if id(p) in indexer)
    kl_grads = torch.autograd.grad(csa.index_loss, list(model.parameters()), allow_unused=True)
    touched = {id(p) for p, g in zip(model.parameters(), kl_grads) if g is not None and g.abs().sum() > 0}
    assert touched and touched <= indexer

    optimizer = torch.optim.Adam(csa.indexer.parameters(), lr=1e-2)
    first_kl, first_recall = float(csa.index_loss), float(csa.index_recall)
    for _ in range(30):
        model(ids)
        optimizer.zero_grad()
        csa.index_loss.backward()
        optimizer.step()
    model(ids)
    assert float(csa.index_loss) < 0.5 * first_kl
    assert float(csa.index_recall) > first_recall


@torch.no_grad()
def test_greedy_continuations_equal_transformers(tmp_path: Path):
    """KV-cache decoding on both sides, far enough for windows to complete while decoding (CSA every
    4 tokens, HCA every 16, a sliding window of 8): the same tokens."""
    from dsl_lit.inference.generation import generate

    save_pretrained(_randomised(build_model(_cfg()), seed=7), tmp_path)
    reference = _transformers_model(tmp_path)
    ours, _ = from_pretrained(tmp_path)
    prompt = _ids(seed=4)[0, :13]
    expected = reference.generate(prompt[None], max_new_tokens=24, do_sample=False, eos_token_id=None, pad_token_id=0,
                                  min_new_tokens=24)[0, 13:].tolist()
    got = generate(ours, [prompt.tolist()], max_new_tokens=24).sequences[0]
    assert [int(t) for t in got][-24:] == expected, (got, expected)


@torch.no_grad()
def test_cached_decoding_of_a_left_padded_batch_equals_recomputing_each_row_alone():
    """The cache keeps each layer's rotated keys and compressor projections; rows of different
    lengths count their windows from their own first token, so a row's continuation does not
    depend on the batch it is in."""
    from dsl_lit.inference.generation import generate

    model = _randomised(build_model(_cfg()), seed=3).eval()
    prompts = [_ids(seed=5)[0, :17].tolist(), _ids(seed=6)[0, :6].tolist()]
    cached = generate(model, prompts, max_new_tokens=20, use_cache=True, output_logits=True)
    recomputed = generate(model, prompts, max_new_tokens=20, use_cache=False, output_logits=True)
    assert torch.equal(cached.sequences, recomputed.sequences)
    assert_close_fp32(cached.logits, recomputed.logits, D * LAYERS * 40)
    for row, prompt in enumerate(prompts):
        alone = generate(model, [prompt], max_new_tokens=20, output_logits=True)
        assert alone.sequences[0].tolist()[-20:] == cached.sequences[row].tolist()[-20:]
        assert_close_fp32(alone.logits[0], cached.logits[row], D * LAYERS * 40)


def test_an_fp8_release_checkpoint_quantises_what_deepseek_quantises(tmp_path: Path):
    """``save_pretrained(fp8=True)``: the attention projections, the indexer's query projection and
    the experts in FP8 with a scale beside each; the compressors, the indexer's weights_proj, the
    router and mHC not. Read back, they are their dequantised values and the logits stay close."""
    from safetensors.torch import load_file

    model = _randomised(build_model(_cfg()), seed=8).eval()
    save_pretrained(model, tmp_path, fp8=True)
    stored = load_file(tmp_path / "model.safetensors")
    fp8 = {n for n, t in stored.items() if t.dtype == torch.float8_e4m3fn}
    for name in ("layers.2.attn.wq_a.weight", "layers.2.attn.wo_b.weight", "layers.2.attn.indexer.wq_b.weight",
                 "layers.0.ffn.experts.3.w2.weight", "layers.1.ffn.shared_experts.w1.weight"):
        assert name in fp8 and name.replace(".weight", ".weight_scale_inv") in stored, name
    for name in ("layers.2.attn.compressor.wkv.weight", "layers.2.attn.indexer.compressor.wgate.weight",
                 "layers.2.attn.indexer.weights_proj.weight", "layers.1.ffn.gate.weight", "embed.weight", "head.weight"):
        assert name not in fp8 and name.replace(".weight", ".weight_scale_inv") not in stored, name
    from dsl_lit.hf import adapter_for_family
    from tests.unit.hf.test_hf_fp8 import _dequantise

    back, _ = from_pretrained(tmp_path)
    adapter = adapter_for_family("deepseek_v4")
    read, original = adapter.to_hf(back.state_dict(), back.config), adapter.to_hf(model.state_dict(), model.config)
    for name in fp8:
        expected = _dequantise(stored[name], stored[name.replace(".weight", ".weight_scale_inv")])
        assert torch.equal(read[name], expected.to(read[name].dtype)), name
        # within e4m3's step of the weights written (3 mantissa bits: a relative step of 1/8 at most)
        assert (read[name] - original[name]).abs().max() <= original[name].abs().max() / 8, name
    assert torch.equal(read["layers.2.attn.compressor.wkv.weight"], original["layers.2.attn.compressor.wkv.weight"])
