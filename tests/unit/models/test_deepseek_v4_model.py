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


E8M0 = torch.float8_e8m0fnu
RELEASE_QUANT = {"quant_method": "fp8", "fmt": "e4m3", "weight_block_size": [128, 128], "activation_scheme": "dynamic",
                 "scale_fmt": "ue8m0", "expert_dtype": "fp4"}


def _dequantised(values: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """A stored weight's value as transformers computes it (FP8 or packed FP4, the block from the
    scale grid)."""
    from transformers.integrations.finegrained_fp8 import Fp8Dequantize

    return Fp8Dequantize(None)._dequantize_one(values, scales, output_dtype=torch.float32)


def test_an_fp8_release_checkpoint_is_v4s_fp4_experts_and_ue8m0_scales(tmp_path: Path):
    """``save_pretrained(fp8=True)`` writes DeepSeek-V4's release: the routed experts FP4 (int8 [out,
    in/2], a [out, in/32] ``float8_e8m0fnu`` scale), the attention projections, the indexer's query
    projection and the shared experts e4m3 in 128x128 blocks with ``float8_e8m0fnu`` scales, each
    scale named ``<module>.scale``; the compressors, the indexer's weights_proj, the router and mHC
    not quantised. Read back, every weight is its dequantised value, exactly."""
    from safetensors.torch import load_file

    from dsl_lit.hf import adapter_for_family

    model = _randomised(build_model(_cfg()), seed=8).eval()
    save_pretrained(model, tmp_path, fp8=True)
    config = json.loads((tmp_path / "config.json").read_text())
    assert config["quantization_config"] == RELEASE_QUANT and config["expert_dtype"] == "fp4"
    stored = load_file(tmp_path / "model.safetensors")
    assert not [n for n in stored if n.endswith("_scale_inv")]
    scales = {n.removesuffix(".scale") + ".weight": t for n, t in stored.items() if n.endswith(".scale")}
    assert {t.dtype for t in scales.values()} == {E8M0}
    fp4 = {n for n, t in stored.items() if t.dtype == torch.int8}
    fp8 = {n for n, t in stored.items() if t.dtype == torch.float8_e4m3fn}
    assert fp4 | fp8 == set(scales)
    assert fp4 == {f"layers.{i}.ffn.experts.{e}.w{w}.weight" for i in range(LAYERS) for e in range(8) for w in (1, 2, 3)}
    assert stored["layers.2.ffn.experts.5.w2.weight"].shape == (D, 32 // 2) and scales["layers.2.ffn.experts.5.w2.weight"].shape == (D, 1)
    assert stored["layers.2.ffn.experts.5.w1.weight"].shape == (32, D // 2) and scales["layers.2.ffn.experts.5.w1.weight"].shape == (32, 2)
    for name in ("layers.2.attn.wq_a.weight", "layers.2.attn.wo_b.weight", "layers.2.attn.indexer.wq_b.weight",
                 "layers.1.ffn.shared_experts.w1.weight"):
        assert name in fp8 and scales[name].shape == (1, 1), name
    for name in ("layers.2.attn.compressor.wkv.weight", "layers.2.attn.indexer.compressor.wgate.weight",
                 "layers.2.attn.indexer.weights_proj.weight", "layers.1.ffn.gate.weight", "embed.weight", "head.weight"):
        assert stored[name].dtype == torch.float32 and name not in scales, name

    back, _ = from_pretrained(tmp_path)
    adapter = adapter_for_family("deepseek_v4")
    read, original = adapter.to_hf(back.state_dict(), back.config), adapter.to_hf(model.state_dict(), model.config)
    for name in read:
        if name in scales:
            assert torch.equal(read[name], _dequantised(stored[name], scales[name])), name
            # a value moves by at most half the widest gap of its format (e2m1: 2, e4m3: 32 at 448) times its scale
            assert ((read[name] - original[name]).abs() <= scales[name].float().max() * (1 if name in fp4 else 16)).all()
        else:
            assert torch.equal(read[name], original[name]), name


V4_128 = dict(d_model=128, n_heads=2, attention_head_dim=128, q_lora_rank=128, qk_rope_head_dim=16, moe_ffn_hidden=128,
              o_groups=2, o_lora_rank=64, index_n_heads=2, index_head_dim=64)
"""Every FP8 weight a whole number of 128x128 blocks and every FP4 one of 32-column groups: transformers
derives the block from the scale grid and refuses ragged ones."""


def test_transformers_reads_our_fp4_release_as_we_do(tmp_path: Path):
    """transformers 5.24 dequantises FP8/FP4 checkpoints on a CPU (``FineGrainedFP8Config(dequantize=True)``;
    without a GPU it does so unasked): from our V4 release it gets exactly our weights, and fp32 logits
    within reordering tolerance of ours."""
    from safetensors import safe_open
    from transformers import AutoModelForCausalLM, FineGrainedFP8Config

    save_pretrained(_randomised(build_model(_cfg(**V4_128)), seed=9), tmp_path, fp8=True)
    with safe_open(tmp_path / "model.safetensors", "pt") as f:
        assert f.get_slice("layers.1.ffn.experts.0.w1.weight").get_dtype() == "I8"
        assert f.get_slice("layers.1.attn.wq_a.scale").get_dtype() == "F8_E8M0"
    ours, _ = from_pretrained(tmp_path, dtype="float32")
    reference = AutoModelForCausalLM.from_pretrained(
        tmp_path, attn_implementation="eager", dtype=torch.float32, quantization_config=FineGrainedFP8Config(dequantize=True)
    ).eval()
    theirs = reference.model.layers[1]
    mine = ours.layers["1"]
    assert theirs.mlp.experts.gate_up_proj.dtype == torch.float32  # dequantised on load
    assert torch.equal(theirs.mlp.experts.gate_up_proj, torch.cat([mine.feed_forward.experts.w1, mine.feed_forward.experts.w3], 1))
    assert torch.equal(theirs.mlp.experts.down_proj, mine.feed_forward.experts.w2)
    assert torch.equal(theirs.self_attn.q_a_proj.weight, mine.attention.wq_a.weight)
    ids = _ids()
    with torch.no_grad():
        assert_close_fp32(ours.eval()(ids), reference(input_ids=ids).logits, 128 * LAYERS * SEQ)


def test_a_rank_reads_its_slice_of_the_fp4_experts(tmp_path: Path):
    """The lazy path of ``init_from`` (expert parallelism, a column shard starting at column 18: inside
    a 32-column scale group, on a byte): the slice of the whole model's tensor, reading this rank's rows
    of packed bytes and one-byte scales only; from the release's ``.scale`` names and from
    transformers' ``weight_scale_inv`` spelling alike."""
    from safetensors.torch import load_file, save_file

    from dsl_lit.hf.reader import HFCheckpoint

    save_pretrained(_randomised(build_model(_cfg()), seed=10), tmp_path / "release", fp8=True)
    whole = from_pretrained(tmp_path / "release")[0].state_dict()
    renamed = tmp_path / "weight_scale_inv"
    renamed.mkdir()
    tensors = load_file(tmp_path / "release" / "model.safetensors")
    save_file({n.removesuffix(".scale") + ".weight_scale_inv" if n.endswith(".scale") else n: t for n, t in tensors.items()},
              renamed / "model.safetensors", {"format": "pt"})
    (renamed / "config.json").write_text((tmp_path / "release" / "config.json").read_text())
    for directory in (tmp_path / "release", renamed):
        checkpoint = HFCheckpoint(directory)
        w2, w1, wq_b = torch.empty(3, 40, 12), torch.empty(2, 32, 30), torch.empty(50, 21)
        checkpoint.fill({"layers.3.feed_forward.experts.w2": (w2, (4, 10, 18)),
                         "layers.2.feed_forward.experts.w1": (w1, (6, 0, 34))})
        # per expert 40 rows of 32 / 2 bytes and their 40 scales of one byte
        assert checkpoint.bytes_read == 3 * 40 * (16 + 1) + 2 * 32 * (32 + 2)
        checkpoint.fill({"layers.1.attention.wq_b.weight": (wq_b, (70, 3))})  # FP8, a ragged block
        assert torch.equal(w2, whole["layers.3.feed_forward.experts.w2"][4:7, 10:50, 18:30]), directory.name
        assert torch.equal(w1, whole["layers.2.feed_forward.experts.w1"][6:8, :, 34:64]), directory.name
        assert torch.equal(wq_b, whole["layers.1.attention.wq_b.weight"][70:120, 3:24]), directory.name


@pytest.mark.parametrize(
    ("edit", "match"),
    [
        ({"expert_dtype": None, "quantization_config": {**RELEASE_QUANT, "expert_dtype": None}},
         r"is stored as torch.int8 with block scales.* declares no expert_dtype 'fp4'; add"),
        ({"quantization_config": {**RELEASE_QUANT, "weight_block_size": [64, 128]}}, r"FP8 weight in \[64, 128\] blocks needs"),
        ({"expert_dtype": "fp16"}, r"quantization_config.expert_dtype='fp4' disagree"),
    ],
    ids=["no-expert_dtype", "block", "disagree"],
)
def test_a_mislabelled_fp4_release_is_a_config_error(tmp_path: Path, edit: dict, match: str):
    from tests.conftest import edit_config_json

    save_pretrained(_randomised(build_model(_cfg())), tmp_path, fp8=True)
    edit_config_json(tmp_path, **edit)
    with pytest.raises(ConfigError, match=match):
        from_pretrained(tmp_path)


def test_an_fp4_scale_of_the_wrong_shape_is_a_config_error(tmp_path: Path):
    from safetensors.torch import load_file, save_file

    save_pretrained(_randomised(build_model(_cfg())), tmp_path, fp8=True)
    tensors = load_file(tmp_path / "model.safetensors")
    tensors["layers.1.ffn.experts.0.w1.scale"] = tensors["layers.1.ffn.experts.0.w1.scale"][:, :1].clone()
    save_file(tensors, tmp_path / "model.safetensors", {"format": "pt"})
    with pytest.raises(ConfigError, match=r"'layers\.1\.ffn\.experts\.0\.w1\.scale' has shape \(32, 1\); a \(32, 64\) "
                                          r"FP4 weight in \[1, 32\] blocks needs \(32, 2\) \(config.json's"):
        from_pretrained(tmp_path)


def test_fp4_experts_need_widths_of_whole_scale_groups(tmp_path: Path):
    with pytest.raises(ConfigError, match=r"an FP4 weight of shape \(64, 48\) cannot be written"):
        save_pretrained(build_model(_cfg(moe_ffn_hidden=48)), tmp_path, fp8=True)
