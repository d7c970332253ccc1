"""Hugging Face interop: logits match transformers' Llama both ways, sharding, tying, dtype, errors.

Tiny random models (vocab 256, 2 layers, d_model 64) in fp32. Every weight, norms included, is
randomised so that a swapped name (e.g. the two norms of a block, or gate/up) changes the logits;
rope_theta and rms_norm_eps are non-default so a dropped config field does too.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM

from data_contract.errors import ConfigError
from dsl_lit.hf import adapter_for_family, adapter_for_model_type, from_pretrained, save_pretrained
from dsl_lit.hf.io import parse_size
from dsl_lit.models import ModelConfig, Transformer, build_model
from tests.conftest import edit_config_json
from tests.numerics import assert_close_fp32

VOCAB, D, LAYERS, HEADS, FFN = 256, 64, 2, 4, 128
THETA, EPS = 5000.0, 1e-5
KV_HEADS = {"mha": HEADS, "gqa": 2}


def _randomise(model: torch.nn.Module, seed: int = 0) -> None:
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            if p.ndim > 1:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.1)
            else:  # norm weights: away from 1 so a swapped norm shows up in the logits
                p.copy_(torch.rand(p.shape, generator=gen) + 0.5)


def _ids(seed: int = 1) -> torch.Tensor:
    return torch.randint(0, VOCAB, (2, 24), generator=torch.Generator().manual_seed(seed))


def _hf_model(n_kv_heads: int, tie: bool = False, attn: str = "eager") -> LlamaForCausalLM:
    cfg = LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=D,
        intermediate_size=FFN,
        num_hidden_layers=LAYERS,
        num_attention_heads=HEADS,
        num_key_value_heads=n_kv_heads,
        max_position_embeddings=64,
        rope_theta=THETA,
        rms_norm_eps=EPS,
        tie_word_embeddings=tie,
        bos_token_id=0,
        eos_token_id=1,
    )
    cfg._attn_implementation = attn
    model = LlamaForCausalLM(cfg).eval()
    _randomise(model)
    return model


def _our_model(n_kv_heads: int, tie: bool = False) -> Transformer:
    cfg = ModelConfig(
        vocab_size=VOCAB,
        n_layers=LAYERS,
        d_model=D,
        n_heads=HEADS,
        n_kv_heads=n_kv_heads,
        ffn_hidden=FFN,
        max_seq_len=64,
        rope_theta=THETA,
        norm_eps=EPS,
        tie_embeddings=tie,
        extra={"bos_token_id": 0, "eos_token_id": 1},
    )
    model = build_model(cfg).eval()
    _randomise(model)
    return model


def _hf_load(path: Path, attn: str = "eager", **kwargs) -> torch.nn.Module:
    return AutoModelForCausalLM.from_pretrained(path, attn_implementation=attn, **kwargs).eval()


@torch.no_grad()
def _assert_same_logits(ours: torch.nn.Module, hf: torch.nn.Module) -> None:
    """Our logits equal transformers' up to fp32 reordering (sums over the width, per layer, and
    attention over the sequence)."""
    ids = _ids()
    assert_close_fp32(ours(ids).float(), hf(input_ids=ids).logits.float(), D * LAYERS * ids.shape[1])


def _weights(path: Path) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    for file in sorted(path.glob("*.safetensors")):
        out.update(load_file(file))
    return out


# -- logits parity ---------------------------------------------------------------------------------


@pytest.mark.parametrize("heads", ["mha", "gqa"])
@pytest.mark.parametrize("backend", ["sdpa", "eager"])
def test_hf_to_ours_logits_match(tmp_path: Path, heads: str, backend: str) -> None:
    hf = _hf_model(KV_HEADS[heads])
    hf.save_pretrained(tmp_path)
    ours, cfg = from_pretrained(tmp_path, attn_backend=backend)
    assert (cfg.n_kv_heads, cfg.rope_theta, cfg.norm_eps, cfg.attn_backend) == (
        KV_HEADS[heads],
        THETA,
        EPS,
        backend,
    )
    assert cfg.extra == {"bos_token_id": 0, "eos_token_id": 1}
    assert ours.rope.cos.device.type == "cpu" and ours.rope.cos.dtype == torch.float32
    assert not any(t.is_meta for t in [*ours.parameters(), *ours.buffers()])
    _assert_same_logits(ours, hf)


@pytest.mark.parametrize("heads", ["mha", "gqa"])
@pytest.mark.parametrize("hf_attn", ["eager", "sdpa"])
def test_ours_to_hf_logits_match(tmp_path: Path, heads: str, hf_attn: str) -> None:
    ours = _our_model(KV_HEADS[heads])
    out = save_pretrained(ours, tmp_path)
    assert out == tmp_path
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "config.json",
        "generation_config.json",
        "model.safetensors",
    ]
    config = json.loads((tmp_path / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"] and config["model_type"] == "llama"
    assert config["dtype"] == config["torch_dtype"] == "float32"
    assert (config["rope_theta"], config["rms_norm_eps"], config["tie_word_embeddings"]) == (
        THETA,
        EPS,
        False,
    )
    assert (config["bos_token_id"], config["eos_token_id"]) == (0, 1)
    generation = json.loads((tmp_path / "generation_config.json").read_text())
    assert (generation["bos_token_id"], generation["eos_token_id"]) == (0, 1)
    with safe_open(str(tmp_path / "model.safetensors"), framework="pt") as f:
        assert f.metadata() == {"format": "pt"}
    hf = _hf_load(tmp_path, attn=hf_attn)
    assert hf.config.num_key_value_heads == KV_HEADS[heads]
    _assert_same_logits(ours, hf)


def test_round_trip_is_exact(tmp_path: Path) -> None:
    ours = _our_model(KV_HEADS["gqa"])
    save_pretrained(ours, tmp_path)
    back, cfg = from_pretrained(tmp_path)
    for field in (
        "vocab_size",
        "n_layers",
        "d_model",
        "n_heads",
        "n_kv_heads",
        "ffn_hidden",
        "max_seq_len",
        "rope_theta",
        "norm_eps",
        "init_std",
        "tie_embeddings",
        "extra",
    ):
        assert getattr(cfg, field) == getattr(ours.config, field), field
    expected = ours.state_dict()
    got = back.state_dict()
    assert got.keys() == expected.keys()
    for name in expected:
        assert torch.equal(got[name], expected[name]), name
    torch.testing.assert_close(back.rope.cos, ours.rope.cos, rtol=0, atol=0)


def test_sharded_save_round_trip(tmp_path: Path) -> None:
    ours = _our_model(KV_HEADS["gqa"])
    limit = 40_000  # bytes; the embedding and head (64 KiB each) exceed it and get shards of their own
    save_pretrained(ours, tmp_path, max_shard_size="40KB")
    shards = sorted(tmp_path.glob("model-*-of-*.safetensors"))
    assert len(shards) > 2 and not (tmp_path / "model.safetensors").exists()
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    assert set(index["weight_map"].values()) == {p.name for p in shards}
    assert index["metadata"]["total_size"] == sum(t.numel() * 4 for t in _weights(tmp_path).values())
    for shard in shards:
        tensors = load_file(shard)
        size = sum(t.numel() * t.element_size() for t in tensors.values())
        assert size <= limit or len(tensors) == 1, shard.name

    hf = _hf_load(tmp_path)
    _assert_same_logits(ours, hf)
    back, _ = from_pretrained(tmp_path)
    for name, tensor in ours.state_dict().items():
        assert torch.equal(back.state_dict()[name], tensor), name

    # Saving again unsharded into the same directory removes the old shards and index.
    save_pretrained(ours, tmp_path)
    assert sorted(p.name for p in tmp_path.glob("model*")) == ["model.safetensors"]
    _assert_same_logits(from_pretrained(tmp_path)[0], hf)


def test_parse_size() -> None:
    assert parse_size("5GB") == 5 * 10**9
    assert parse_size("500MiB") == 500 * 2**20
    assert parse_size("40kb") == 40_000
    assert parse_size(123) == 123
    with pytest.raises(ConfigError, match="max_shard_size"):
        parse_size("five gigs")


# -- tied embeddings -------------------------------------------------------------------------------


def test_tied_embeddings_ours_to_hf(tmp_path: Path) -> None:
    ours = _our_model(KV_HEADS["gqa"], tie=True)
    save_pretrained(ours, tmp_path)
    weights = _weights(tmp_path)
    assert "lm_head.weight" not in weights and "model.embed_tokens.weight" in weights
    assert json.loads((tmp_path / "config.json").read_text())["tie_word_embeddings"] is True
    hf = _hf_load(tmp_path)
    assert hf.lm_head.weight.data_ptr() == hf.model.embed_tokens.weight.data_ptr()
    _assert_same_logits(ours, hf)

    back, cfg = from_pretrained(tmp_path)
    assert cfg.tie_embeddings
    assert back.output.weight is back.tok_embeddings.weight
    assert back.num_params() == ours.num_params()
    _assert_same_logits(back, hf)


def test_tied_embeddings_hf_to_ours(tmp_path: Path) -> None:
    hf = _hf_model(KV_HEADS["mha"], tie=True)
    hf.save_pretrained(tmp_path)
    ours, cfg = from_pretrained(tmp_path)
    assert cfg.tie_embeddings and ours.output.weight is ours.tok_embeddings.weight
    _assert_same_logits(ours, hf)


# -- dtype -----------------------------------------------------------------------------------------


def test_dtype_on_save_and_load(tmp_path: Path) -> None:
    ours = _our_model(KV_HEADS["gqa"])
    save_pretrained(ours, tmp_path, dtype=torch.bfloat16)
    assert all(t.dtype == torch.bfloat16 for t in _weights(tmp_path).values())
    config = json.loads((tmp_path / "config.json").read_text())
    assert config["dtype"] == config["torch_dtype"] == "bfloat16"
    assert all(p.dtype == torch.float32 for p in ours.parameters())  # saving does not touch the model

    as_stored, _ = from_pretrained(tmp_path)  # dtype None: the checkpoint's
    assert {p.dtype for p in as_stored.parameters()} == {torch.bfloat16}
    assert as_stored.rope.cos.dtype == torch.float32  # tables stay fp32 as in transformers
    upcast, _ = from_pretrained(tmp_path, dtype="float32")
    assert {p.dtype for p in upcast.parameters()} == {torch.float32}
    for name, tensor in ours.state_dict().items():
        assert torch.equal(upcast.state_dict()[name], tensor.bfloat16().float()), name

    # The bf16 files load in transformers and agree with our upcast model when it runs fp32 too.
    hf = _hf_load(tmp_path, dtype=torch.float32)
    _assert_same_logits(upcast, hf)
    hf_bf16 = _hf_load(tmp_path)  # transformers keeps the checkpoint dtype, bf16
    assert hf_bf16.dtype == torch.bfloat16
    with torch.no_grad():
        ref = hf(input_ids=_ids()).logits
        ours_bf16 = as_stored(_ids()).float()
        theirs_bf16 = hf_bf16(input_ids=_ids()).logits.float()
    # Both bf16 runs are within bf16 noise of the fp32 reference.
    assert (ours_bf16 - ref).abs().max() < 0.1 and (theirs_bf16 - ref).abs().max() < 0.1


# -- checkpoints in the form DeepSeek LLM was released -----------------------------------------------


def test_released_deepseek_llm_config_format(tmp_path: Path) -> None:
    """config.json as deepseek-ai/deepseek-llm-7b-base has it (transformers 4.33 era, top-level
    rope_theta, rope_scaling null, torch_dtype) and a stale ``rotary_emb.inv_freq`` tensor."""
    hf = _hf_model(KV_HEADS["mha"])
    state = {name: t.contiguous() for name, t in hf.state_dict().items()}
    state["model.layers.0.self_attn.rotary_emb.inv_freq"] = torch.ones(D // HEADS // 2)
    save_file(state, str(tmp_path / "model.safetensors"), {"format": "pt"})
    released = {
        "architectures": ["LlamaForCausalLM"],
        "bos_token_id": 0,
        "eos_token_id": 1,
        "hidden_act": "silu",
        "hidden_size": D,
        "initializer_range": 0.02,
        "intermediate_size": FFN,
        "max_position_embeddings": 64,
        "model_type": "llama",
        "num_attention_heads": HEADS,
        "num_hidden_layers": LAYERS,
        "num_key_value_heads": HEADS,
        "pretraining_tp": 1,
        "rms_norm_eps": EPS,
        "rope_scaling": None,
        "rope_theta": THETA,
        "tie_word_embeddings": False,
        "torch_dtype": "float32",
        "transformers_version": "4.33.1",
        "use_cache": True,
        "vocab_size": VOCAB,
    }
    (tmp_path / "config.json").write_text(json.dumps(released))
    ours, cfg = from_pretrained(tmp_path)
    assert cfg.rope_theta == THETA and cfg.init_std == 0.02
    _assert_same_logits(ours, hf)


# -- errors ----------------------------------------------------------------------------------------


@pytest.fixture
def saved(tmp_path: Path) -> Path:
    save_pretrained(_our_model(KV_HEADS["gqa"]), tmp_path)
    return tmp_path


@pytest.mark.parametrize(
    ("changes", "match"),
    [
        ({"rope_scaling": {"type": "linear", "factor": 2.0}}, "rope_scaling"),
        ({"rope_parameters": {"rope_type": "yarn", "rope_theta": THETA, "factor": 4.0}}, "rope_type"),
        ({"attention_bias": True}, "attention_bias"),
        ({"mlp_bias": True}, "mlp_bias"),
        ({"model_type": "mistral"}, "model_type='mistral'"),
        ({"hidden_act": "gelu"}, "hidden_act"),
        ({"head_dim": 32}, "head_dim"),
        ({"architectures": ["LlamaForSequenceClassification"]}, "architectures"),
        ({"num_key_value_heads": 3}, "n_kv_heads"),
        ({"vocab_size": 300}, r"shape mismatch.*tok_embeddings\.weight \(256, 64\) != \(300, 64\)"),
        ({"dtype": "int8", "torch_dtype": "int8"}, "floating-point"),
    ],
)
def test_unsupported_config_is_a_config_error(saved: Path, changes: dict[str, object], match: str) -> None:
    edit_config_json(saved, **changes)
    with pytest.raises(ConfigError, match=match):
        from_pretrained(saved)


def test_missing_and_unexpected_weights_are_listed(saved: Path) -> None:
    state = load_file(saved / "model.safetensors")
    del state["model.layers.1.mlp.up_proj.weight"]
    save_file(state, str(saved / "model.safetensors"), {"format": "pt"})
    with pytest.raises(ConfigError, match=r"missing 1 weight\(s\): 'layers\.1\.feed_forward\.w3\.weight'"):
        from_pretrained(saved)

    state["model.layers.1.mlp.up_proj.weight"] = torch.zeros(FFN, D)
    state["model.layers.0.self_attn.q_proj.bias"] = torch.zeros(D)
    state["model.vision_tower.proj.weight"] = torch.zeros(2, 2)
    save_file(state, str(saved / "model.safetensors"), {"format": "pt"})
    with pytest.raises(ConfigError, match=r"2 weight\(s\).*q_proj\.bias.*vision_tower"):
        from_pretrained(saved)

    del state["model.layers.0.self_attn.q_proj.bias"], state["model.vision_tower.proj.weight"]
    state["model.layers.2.input_layernorm.weight"] = torch.ones(D)  # one layer more than config.json says
    save_file(state, str(saved / "model.safetensors"), {"format": "pt"})
    with pytest.raises(ConfigError, match=r"unexpected 1 weight\(s\): 'layers\.2\.attention_norm\.weight'"):
        from_pretrained(saved)


def test_pickled_weights_are_refused(saved: Path) -> None:
    (saved / "model.safetensors").unlink()
    (saved / "pytorch_model.bin").write_bytes(b"not unpickled")
    with pytest.raises(ConfigError, match="safetensors only"):
        from_pretrained(saved)


def test_missing_files(tmp_path: Path, saved: Path) -> None:
    with pytest.raises(FileNotFoundError, match="config.json"):
        from_pretrained(tmp_path / "nowhere")
    (saved / "model.safetensors").unlink()
    with pytest.raises(FileNotFoundError, match="model.safetensors"):
        from_pretrained(saved)


def test_save_errors(tmp_path: Path) -> None:
    stage = _our_model(KV_HEADS["gqa"])
    del stage.layers["1"]  # a pipeline stage holds only some layers
    with pytest.raises(ConfigError, match=r"missing 9 weight\(s\).*layers\.1\."):
        save_pretrained(stage, tmp_path)
    with pytest.raises(ConfigError, match="max_shard_size"):
        save_pretrained(_our_model(KV_HEADS["gqa"]), tmp_path, max_shard_size="-1GB")
    with pytest.raises(ConfigError, match="dtype"):
        save_pretrained(_our_model(KV_HEADS["gqa"]), tmp_path, dtype="int8")
    with pytest.raises(ConfigError, match="ModelConfig"):
        save_pretrained(torch.nn.Linear(2, 2), tmp_path)
    assert not any(tmp_path.iterdir())  # nothing was written by the failed saves


def test_adapter_registry() -> None:
    assert adapter_for_model_type("llama") is adapter_for_family("deepseek_llm")
    with pytest.raises(ConfigError, match=r"model_type='mixtral'.*supported model types.*'llama'"):
        adapter_for_model_type("mixtral")
    with pytest.raises(ConfigError, match="model.family"):
        adapter_for_family("nope")
