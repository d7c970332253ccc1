"""DeepSeek-V3's block-FP8 hub format: loading it (dequantised block by block), writing it
(``save_pretrained(..., fp8=True)``), and transformers reading what we write.

The release layout is written here independently of our writer, the way DeepSeek's own kernels
define it: per 128x128 block (ragged at the edges) ``scale_inv = amax / 448``, ``q =
fp8(w / scale_inv)``, and a weight's value is ``fp32(q) * scale_inv``. The tiny model has dims that
are not multiples of 128 (192, 160, 80, ...), so every tensor has ragged edge blocks, as the
release's 576-row ``kv_a_proj_with_mqa`` does.
"""

from __future__ import annotations

import json
import math
import re
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file
from transformers import AutoModelForCausalLM

from data_contract.errors import ConfigError
from dsl_lit.hf import adapter_for_family, from_pretrained, save_pretrained
from dsl_lit.hf.reader import HFCheckpoint
from dsl_lit.models import ModelConfig, Transformer, build_model
from tests.conftest import edit_config_json

BLOCK = 128
E4M3 = torch.float8_e4m3fn
QUANT = {"quant_method": "fp8", "fmt": "e4m3", "weight_block_size": [BLOCK, BLOCK], "activation_scheme": "dynamic"}


def _config(**overrides: object) -> ModelConfig:
    values: dict = dict(
        family="deepseek_v3", vocab_size=256, n_layers=2, d_model=192, n_heads=3, n_kv_heads=3, ffn_hidden=320,
        max_seq_len=64, q_lora_rank=160, kv_lora_rank=64, qk_nope_head_dim=32, qk_rope_head_dim=16,
        v_head_dim=48, n_dense_layers=1, n_routed_experts=4, n_shared_experts=1, n_activated_experts=2,
        moe_ffn_hidden=160, n_expert_groups=2, n_limited_groups=1, score_func="sigmoid", route_scale=1.5,
        norm_topk_prob=True, mtp_depth=1, attn_backend="eager",
    )  # fmt: skip
    values.update(overrides)
    return ModelConfig(**values)


def _model(cfg: ModelConfig | None = None, seed: int = 0) -> Transformer:
    """Random weights; each matrix row-scaled so that blocks get different scales."""
    model = build_model(cfg or _config()).eval()
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            if p.ndim == 1:
                p.copy_(torch.rand(p.shape, generator=gen) + 0.5)
            else:
                rows = torch.rand(p.shape[:-1], generator=gen)[..., None] * 0.3 + 0.01
                p.copy_(torch.randn(p.shape, generator=gen) * rows)
        for name, b in model.named_buffers():
            if name.endswith("expert_bias"):
                b.copy_(torch.randn(b.shape, generator=gen) * 0.1)
    return model


def _deepseek_quantise(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per 128x128 block: scale_inv = amax / 448 and the FP8 values of w / scale_inv."""
    rows, cols = w.shape
    scale = torch.empty(math.ceil(rows / BLOCK), math.ceil(cols / BLOCK))
    q = torch.empty(rows, cols, dtype=E4M3)
    for i in range(scale.shape[0]):
        for j in range(scale.shape[1]):
            block = (slice(i * BLOCK, (i + 1) * BLOCK), slice(j * BLOCK, (j + 1) * BLOCK))
            tile = w[block].float()
            scale[i, j] = tile.abs().max() / 448
            q[block] = (tile / scale[i, j]).to(E4M3)
    return q, scale


def _dequantise(q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    rows, cols = q.shape
    full = scale.repeat_interleave(BLOCK, 0)[:rows].repeat_interleave(BLOCK, 1)[:, :cols]
    return q.float() * full


def _release_layout(model: Transformer, directory: Path) -> dict[str, torch.Tensor]:
    """Write ``model`` as the hub does (FP8 projections with their scales, the rest bf16, sharded by
    layer, a scale in another file than its weight for layer 1); returns the dequantised HF state."""
    cfg = model.config
    adapter = adapter_for_family(cfg.family)
    hf_state = adapter.to_hf(model.state_dict(), cfg)
    shards: dict[str, dict[str, torch.Tensor]] = {}
    dequantised: dict[str, torch.Tensor] = {}
    for name, tensor in hf_state.items():
        layer = name.split(".")[2] if name.startswith("model.layers.") else "top"
        file = f"model-{layer}.safetensors"
        if adapter.quantizes_fp8(name):
            q, scale = _deepseek_quantise(tensor)
            shards.setdefault(file, {})[name] = q
            scale_file = "model-top.safetensors" if layer == "1" else file
            shards.setdefault(scale_file, {})[name + "_scale_inv"] = scale
            dequantised[name] = _dequantise(q, scale)
        else:
            kept = tensor.float() if name.endswith("e_score_correction_bias") else tensor.to(torch.bfloat16)
            shards.setdefault(file, {})[name] = kept.contiguous().clone()
            dequantised[name] = kept.float()
    directory.mkdir(parents=True, exist_ok=True)
    mapping = {}
    for file, tensors in shards.items():
        save_file(tensors, str(directory / file), {"format": "pt"})
        mapping.update(dict.fromkeys(tensors, file))
    (directory / "model.safetensors.index.json").write_text(json.dumps({"weight_map": mapping}))
    config = adapter.config_to_hf(cfg) | {"torch_dtype": "bfloat16", "quantization_config": QUANT}
    (directory / "config.json").write_text(json.dumps(config))
    return dequantised


def _logits(model: torch.nn.Module, seed: int = 1) -> torch.Tensor:
    ids = torch.randint(0, 256, (2, 20), generator=torch.Generator().manual_seed(seed))
    with torch.no_grad():
        return model(ids)


def test_the_weights_quantised_are_the_releases() -> None:
    """DeepSeek-V3's hub index: scales for the attention and MLP / expert / shared-expert
    projections of every layer (the MTP layer 61 too), none for the rest."""
    adapter = adapter_for_family("deepseek_v3")
    quantised = [
        "model.layers.0.self_attn.q_a_proj.weight", "model.layers.0.self_attn.q_b_proj.weight",
        "model.layers.0.self_attn.kv_a_proj_with_mqa.weight", "model.layers.0.self_attn.kv_b_proj.weight",
        "model.layers.0.self_attn.o_proj.weight", "model.layers.0.mlp.gate_proj.weight",
        "model.layers.2.mlp.down_proj.weight", "model.layers.3.mlp.experts.255.up_proj.weight",
        "model.layers.3.mlp.shared_experts.gate_proj.weight", "model.layers.61.self_attn.o_proj.weight",
        "model.layers.61.mlp.experts.0.down_proj.weight",
    ]  # fmt: skip
    kept = [
        "model.embed_tokens.weight", "lm_head.weight", "model.norm.weight", "model.layers.3.mlp.gate.weight",
        "model.layers.3.mlp.gate.e_score_correction_bias", "model.layers.0.input_layernorm.weight",
        "model.layers.0.self_attn.q_a_layernorm.weight", "model.layers.0.self_attn.kv_a_layernorm.weight",
        "model.layers.61.eh_proj.weight", "model.layers.61.enorm.weight", "model.layers.61.shared_head.head.weight",
        "model.layers.61.embed_tokens.weight",
    ]  # fmt: skip
    assert all(adapter.quantizes_fp8(n) for n in quantised)
    assert not any(adapter.quantizes_fp8(n) for n in kept)


def test_the_release_layout_loads_as_its_dequantised_weights(tmp_path: Path) -> None:
    model = _model()
    dequantised = _release_layout(model, tmp_path / "fp8")
    adapter = adapter_for_family("deepseek_v3")
    # the same weights, dequantised by hand, as a plain fp32 checkpoint
    plain = tmp_path / "plain"
    plain.mkdir()
    save_file({k: v.contiguous() for k, v in dequantised.items()}, str(plain / "model.safetensors"), {"format": "pt"})
    (plain / "config.json").write_text(json.dumps(adapter.config_to_hf(model.config)))

    loaded, cfg = from_pretrained(tmp_path / "fp8", dtype="float32", attn_backend="eager")
    reference, _ = from_pretrained(plain, dtype="float32", attn_backend="eager")
    assert cfg.mtp_depth == 1
    assert torch.equal(_logits(loaded), _logits(reference))
    for name, tensor in reference.state_dict().items():
        assert torch.equal(loaded.state_dict()[name], tensor), name

    as_released, _ = from_pretrained(tmp_path / "fp8")  # config.json's torch_dtype: bf16
    bf16 = as_released.state_dict()
    assert bf16["layers.1.feed_forward.experts.w1"].dtype == torch.bfloat16
    assert bf16["layers.1.feed_forward.gate.expert_bias"].dtype == torch.float32
    for name, tensor in reference.state_dict().items():
        assert torch.equal(bf16[name], tensor.to(bf16[name].dtype)), name


def test_a_shard_reads_its_region_of_the_blocks(tmp_path: Path) -> None:
    """A tensor-parallel shard starting mid-block reads the dequantised values of its region."""
    model = _model()
    dequantised = _release_layout(model, tmp_path)
    checkpoint = HFCheckpoint(tmp_path)
    full = dequantised["model.layers.0.self_attn.q_b_proj.weight"]  # [3 * 48, 160]: ragged both ways
    experts = torch.stack([dequantised[f"model.layers.1.mlp.experts.{e}.down_proj.weight"] for e in range(4)])
    rows = torch.empty(70, 150)
    local_experts = torch.empty(2, 192, 150)
    checkpoint.fill({
        "layers.0.attention.wq_b.weight": (rows, (50, 9)),
        "layers.1.feed_forward.experts.w2": (local_experts, (2, 0, 10)),
    })  # fmt: skip
    assert torch.equal(rows, full[50:120, 9:159])
    assert torch.equal(local_experts, experts[2:4, :, 10:160])


def test_fp8_export_round_trip(tmp_path: Path) -> None:
    model = _model()
    save_pretrained(model, tmp_path, max_shard_size="200KB", fp8=True)
    config = json.loads((tmp_path / "config.json").read_text())
    assert config["quantization_config"] == QUANT
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())["weight_map"]
    assert len(set(index.values())) > 1
    adapter = adapter_for_family("deepseek_v3")
    stored: dict[str, torch.Tensor] = {}
    for name, file in index.items():
        with safe_open(str(tmp_path / file), framework="pt") as f:
            stored[name] = f.get_tensor(name)
    weights = [n for n in stored if not n.endswith("_scale_inv")]
    assert {n for n in weights if stored[n].dtype == E4M3} == {n for n in weights if adapter.quantizes_fp8(n)}
    original = adapter.to_hf(model.state_dict(), model.config)
    back, _ = from_pretrained(tmp_path, attn_backend="eager")
    back_hf = adapter.to_hf(back.state_dict(), back.config)
    for name in weights:
        if stored[name].dtype != E4M3:
            assert torch.equal(back_hf[name], original[name]), name
            continue
        scale = stored[name + "_scale_inv"]
        assert index[name + "_scale_inv"] == index[name]  # one file holds a weight and its scales
        assert scale.dtype == torch.float32 and scale.shape == (math.ceil(stored[name].shape[0] / BLOCK),
                                                                math.ceil(stored[name].shape[1] / BLOCK))
        assert torch.equal(back_hf[name], _dequantise(stored[name], scale)), name
        # e4m3 keeps 3 mantissa bits: half an ulp is 2^-4 of the value; subnormals 2^-10 of the scale
        bound = original[name].abs() * 2**-4 + scale.repeat_interleave(BLOCK, 0).repeat_interleave(BLOCK, 1)[
            : original[name].shape[0], : original[name].shape[1]] * 2**-10
        assert ((back_hf[name] - original[name]).abs() <= bound * (1 + 1e-6)).all(), name
        assert not torch.equal(back_hf[name], original[name])


def test_transformers_loads_our_fp8_export(tmp_path: Path) -> None:
    """transformers' CPU path dequantises FP8 checkpoints (it needs dims that are multiples of the
    block: every projection here is 128 or 256 wide); its logits are ours."""
    cfg = _config(d_model=256, n_heads=2, n_kv_heads=2, ffn_hidden=256, q_lora_rank=128, kv_lora_rank=128,
                  qk_nope_head_dim=128, qk_rope_head_dim=128, v_head_dim=128, moe_ffn_hidden=128, mtp_depth=0)
    save_pretrained(_model(cfg), tmp_path, fp8=True)
    ours, _ = from_pretrained(tmp_path, dtype="float32", attn_backend="eager")
    hf = AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32, attn_implementation="eager").eval()
    assert type(hf.model.layers[0].self_attn.q_a_proj) is torch.nn.Linear  # dequantised on load
    ids = torch.randint(0, 256, (2, 20), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        diff = (hf(ids).logits - ours(ids)).abs().max()
    assert diff < 1e-5  # fp32, in two implementations' evaluation orders


@pytest.mark.parametrize(
    ("edit", "match"),
    [
        ({"quantization_config": {"quant_method": "bitsandbytes"}}, "quant_method='bitsandbytes'"),
        ({"quantization_config": {**QUANT, "weight_block_size": [128]}}, "weight_block_size"),
        ({"quantization_config": {**QUANT, "activation_scheme": "static"}}, "activation_scheme"),
        ({"quantization_config": None}, r"stored as torch.float8_e4m3fn without .*_scale_inv' and config.json has no"),
    ],
)
def test_bad_fp8_checkpoints_are_config_errors(tmp_path: Path, edit: dict, match: str) -> None:
    save_pretrained(_model(), tmp_path, fp8=True)
    edit_config_json(tmp_path, **edit)
    with pytest.raises(ConfigError, match=match):
        from_pretrained(tmp_path)


def test_a_wrong_scale_shape_is_a_config_error(tmp_path: Path) -> None:
    save_pretrained(_model(), tmp_path, fp8=True)
    edit_config_json(tmp_path, quantization_config={**QUANT, "weight_block_size": [64, 128]})
    with pytest.raises(ConfigError, match=r"in \[64, 128\] blocks needs"):
        from_pretrained(tmp_path)


def test_fp8_export_of_a_layout_without_one_is_a_config_error(tmp_path: Path) -> None:
    llm = build_model(ModelConfig.from_name("deepseek_llm_tiny", n_layers=1))
    with pytest.raises(ConfigError, match="has no FP8 form"):
        save_pretrained(llm, tmp_path, fp8=True)


def test_a_nan_scale_is_refused_naming_the_tensor_and_file(tmp_path: Path) -> None:
    """Before: starting from an FP8 checkpoint whose ``weight_scale_inv`` was NaN skipped every step
    silently and could save a "complete" checkpoint of NaN weights. Now reading it is a one-line
    error naming the tensor, its scale and the file."""
    from safetensors.torch import load_file

    save_pretrained(_model(), tmp_path, fp8=True)
    file = tmp_path / "model.safetensors"
    tensors = load_file(file)
    name = next(n for n in sorted(tensors) if n.endswith("weight_scale_inv"))
    tensors[name][0, 0] = float("nan")
    save_file(tensors, file, metadata={"format": "pt"})
    weight = name.removesuffix("_scale_inv")
    with pytest.raises(ConfigError, match=rf"model\.safetensors: tensor {re.escape(weight)} \(or its _scale_inv\) holds NaN"):
        from_pretrained(tmp_path)


def test_an_index_may_not_point_outside_its_directory(tmp_path: Path) -> None:
    """Before: an index mapping tensors to ``../base/model.safetensors`` read them from outside."""
    base, child = tmp_path / "base", tmp_path / "child"
    save_pretrained(_model(), base)
    child.mkdir()
    (child / "config.json").write_text((base / "config.json").read_text())
    names = list(json.loads((base / "model.safetensors").read_bytes()[8:8 + int.from_bytes(
        (base / "model.safetensors").read_bytes()[:8], "little")]))
    index = {"metadata": {}, "weight_map": {n: "../base/model.safetensors" for n in names if n != "__metadata__"}}
    (child / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(ConfigError, match=r"maps tensors to files outside .*child: '\.\./base/model\.safetensors'"):
        from_pretrained(child)
    # a symlink inside the directory that leads out is outside too
    (child / "model.safetensors.index.json").write_text(json.dumps(
        {**index, "weight_map": dict.fromkeys(index["weight_map"], "linked.safetensors")}))
    (child / "linked.safetensors").symlink_to(base / "model.safetensors")
    with pytest.raises(ConfigError, match="outside"):
        from_pretrained(child)


def test_a_hugging_face_hub_snapshot_loads_through_its_blob_symlinks(tmp_path: Path) -> None:
    """The hub cache's layout (``models--org--name/snapshots/<rev>/<file>`` symlinked into
    ``../../blobs/<hash>``): before, refused as "maps tensors to files outside"; now it loads as the
    same files copied would, while an index entry that walks out of the snapshot is still refused."""
    import hashlib

    model = _model()
    plain = tmp_path / "plain"
    save_pretrained(model, plain)
    (plain / "model.safetensors").rename(plain / "model-00001-of-00001.safetensors")
    names = list(json.loads((plain / "model-00001-of-00001.safetensors").read_bytes()[8:8 + int.from_bytes(
        (plain / "model-00001-of-00001.safetensors").read_bytes()[:8], "little")]))
    index = {"metadata": {}, "weight_map": {n: "model-00001-of-00001.safetensors" for n in names if n != "__metadata__"}}
    (plain / "model.safetensors.index.json").write_text(json.dumps(index))
    repo = tmp_path / "hub" / "models--org--tiny"
    snapshot = repo / "snapshots" / "0123abc"
    (repo / "blobs").mkdir(parents=True)
    snapshot.mkdir(parents=True)
    for file in plain.iterdir():
        blob = repo / "blobs" / hashlib.sha256(file.read_bytes()).hexdigest()
        blob.write_bytes(file.read_bytes())
        (snapshot / file.name).symlink_to(Path("../..") / "blobs" / blob.name)
    torch.testing.assert_close(_logits(from_pretrained(snapshot)[0]), _logits(from_pretrained(plain)[0]), atol=0, rtol=0)
    (snapshot / "model.safetensors.index.json").unlink()
    (snapshot / "model.safetensors.index.json").write_text(json.dumps(
        {**index, "weight_map": dict.fromkeys(index["weight_map"], "../../blobs/" + next((repo / "blobs").iterdir()).name)}))
    with pytest.raises(ConfigError, match="outside"):
        from_pretrained(snapshot)
