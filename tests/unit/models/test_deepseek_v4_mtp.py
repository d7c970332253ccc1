"""DeepSeek-V4's multi-token prediction (``V4MTPModule``): DeepSeek's ``MTPBlock`` as its V4
inference code writes it (``inference/model.py`` of the V4 release; read in the copy of
DeepSeek-V4-Pro's code on GitHub, Nicooo-Wang/DeepSeek-V4-Pro-code, ``inference/model.py``), restated
here: its forward from the main model's streams, its tensors in the release layout both ways (the
FP8/FP4 release too), and transformers still loading the export (it skips ``mtp.*``) with the main
model's logits unchanged.

The restatement of ``MTPBlock.forward`` (``x`` the last layer's streams [b, s, hc, d])::

    e = self.enorm(self.embed(input_ids))
    x = self.hnorm(x)
    x = self.e_proj(e).unsqueeze(2) + self.h_proj(x)
    x = super().forward(x, start_pos, input_ids)            # a whole V4 Block
    logits = self.head(x, self.hc_head_fn, self.hc_head_scale, self.hc_head_base, self.norm)

where ``head`` is the main model's ``ParallelHead``: ``hc_head`` (sigmoid of the RMS-scaled
streams' mix, plus ``hc_eps``, weighting the streams' sum), then ``norm``, then its weight. Its
``Block`` is transformers' ``DeepseekV4DecoderLayer`` here (the parity reference of our blocks), run
as layer ``n_layers`` of a transformers model one layer deeper, which holds the MTP block's weights;
the layer is sliding-window attention and top-k routed, as the release's ``compress_ratios`` (0 for
the MTP layer) and ``Gate`` (hash routing below ``n_hash_layers`` only) make it.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from dsl_lit.hf import from_pretrained, save_pretrained
from dsl_lit.models import build_model
from tests.numerics import assert_close_fp32
from tests.unit.models.test_deepseek_v4_model import (
    LAYERS,
    SEQ,
    V4_128,
    D,
    _cfg,
    _dequantised,
    _ids,
    _randomised,
    _transformers_model,
)

MTP_OWN = ("enorm.weight", "hnorm.weight", "e_proj.weight", "h_proj.weight", "norm.weight", "hc_head_fn",
           "hc_head_base", "hc_head_scale")
"""The release's names of an MTP layer's own tensors (after ``mtp.<k>.``); the rest are its block's."""


def _rms(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """DeepSeek's ``RMSNorm.forward``: in fp32, the weight times the normalised input, cast back."""
    h = x.float()
    return (weight * (h * torch.rsqrt(h.square().mean(-1, keepdim=True) + eps))).to(x.dtype)


def _hf_layers(reference: torch.nn.Module, streams: torch.Tensor, layers: range | list[int], input_ids: torch.Tensor):
    """transformers' decoder layers ``layers`` over ``streams`` [b, s, hc, d] at positions 0 .. s - 1,
    as ``DeepseekV4Model.forward`` runs them."""
    from transformers.masking_utils import create_sliding_window_causal_mask

    model = reference.model
    embeds = streams[:, :, 0]  # (the mask and the rotary tables read its shape and dtype only)
    position_ids = torch.arange(streams.shape[1]).unsqueeze(0)
    mask = create_sliding_window_causal_mask(config=model.config, inputs_embeds=embeds, attention_mask=None,
                                             cache=None, position_ids=position_ids)
    rope = {kind: model.rotary_emb(embeds, position_ids=position_ids, layer_type=kind) for kind in ("main", "compress")}
    for i in layers:
        streams = model.layers[i](streams, position_embeddings=rope, position_ids=position_ids, attention_mask=mask,
                                  input_ids=input_ids, cache=None)
    return streams


def _one_layer_deeper(release: Path, out: Path) -> dict[str, torch.Tensor]:
    """``release`` (ours, with ``mtp.0``) rewritten as a transformers checkpoint whose layer
    ``LAYERS`` is the MTP layer's block (sliding window, top-k routed); returns the MTP layer's own
    tensors (release names, without ``mtp.0.``)."""
    from safetensors.torch import load_file, save_file

    tensors = load_file(release / "model.safetensors")
    own = {name: tensors.pop(f"mtp.0.{name}") for name in MTP_OWN}
    deeper = {(f"layers.{LAYERS}." + n.removeprefix("mtp.0.")) if n.startswith("mtp.0.") else n: t
              for n, t in tensors.items()}
    out.mkdir()
    save_file(deeper, out / "model.safetensors", {"format": "pt"})
    config = json.loads((release / "config.json").read_text())
    config.update(num_hidden_layers=LAYERS + 1, num_nextn_predict_layers=0,
                  layer_types=[*config["layer_types"], "sliding_attention"],
                  mlp_layer_types=[*config["mlp_layer_types"], "moe"])
    (out / "config.json").write_text(json.dumps(config))
    return own


def test_the_mtp_module_is_deepseeks_mtpblock(tmp_path: Path):
    """Depth 1's logits are DeepSeek's ``MTPBlock`` on the streams of transformers' main layers (before
    their collapse) and the embeddings of the next tokens, to fp32 reordering."""
    cfg = _cfg(mtp_depth=1)
    ours = _randomised(build_model(cfg), seed=11).eval()
    assert ours.mtp["0"].block.attention.kind == "sliding" and ours.mtp["0"].block.attention.compressor is None
    save_pretrained(ours, tmp_path / "release")
    own = _one_layer_deeper(tmp_path / "release", tmp_path / "deeper")
    reference = _transformers_model(tmp_path / "deeper")
    ids = _ids(seed=12)
    eps, hc_eps = cfg.norm_eps, cfg.hc_eps
    with torch.no_grad():
        embed = reference.model.embed_tokens
        h = _hf_layers(reference, embed(ids).unsqueeze(2).expand(-1, -1, cfg.hc_mult, -1).contiguous(), range(LAYERS), ids)
        # (the main layers, so run, are transformers' model of the release itself)
        main = _transformers_model(tmp_path / "release")(input_ids=ids, use_cache=False).logits
        assert torch.equal(reference.lm_head(reference.model.norm(reference.model.hc_head(h))), main)
        # MTPBlock.forward at depth 1: position i reads h_i and token i + 1 and predicts token i + 2
        e = _rms(embed(ids[:, 1:]), own["enorm.weight"], eps)
        x = _rms(h[:, :-1], own["hnorm.weight"], eps)
        x = F.linear(e, own["e_proj.weight"]).unsqueeze(2) + F.linear(x, own["h_proj.weight"])
        x = _hf_layers(reference, x, [LAYERS], ids[:, 1:])
        # ParallelHead.forward: hc_head, the MTP layer's norm, the shared head
        flat = x.flatten(2).float()
        mixes = F.linear(flat, own["hc_head_fn"]) * torch.rsqrt(flat.square().mean(-1, keepdim=True) + eps)
        pre = torch.sigmoid(mixes * own["hc_head_scale"] + own["hc_head_base"]) + hc_eps
        collapsed = torch.sum(pre.unsqueeze(-1) * x, dim=2)
        expected = F.linear(_rms(collapsed, own["norm.weight"], eps).float(), reference.lm_head.weight)

        (logits,) = ours.mtp_logits(ours.residual(ids), ids)
        assert logits.shape == (2, SEQ - 1, cfg.vocab_size)
        assert_close_fp32(logits, expected, D * (LAYERS + 1) * SEQ)
        # the streams are what it reads: the collapsed hidden state is refused
        with pytest.raises(ValueError, match="residual streams"):
            ours.mtp_logits(ours.hidden_states(ids), ids)
        # each stream's projection is its own (the embedding's is added to every stream)
        ours.mtp["0"].h_proj.weight.copy_(ours.mtp["0"].h_proj.weight.flip(0))
        assert (ours.mtp_logits(ours.residual(ids), ids)[0] - expected).abs().max() > 1e-2


def test_a_checkpoint_with_mtp_round_trips_exactly(tmp_path: Path):
    """``mtp.0.*`` in the release names (its block's as a layer's, no copy of the shared embedding or
    head), read back into the same tensors and written again byte for byte; config.json's
    ``num_nextn_predict_layers`` says how many."""
    from safetensors.torch import load_file

    model = _randomised(build_model(_cfg(mtp_depth=1)), seed=13).eval()
    save_pretrained(model, tmp_path / "first")
    assert json.loads((tmp_path / "first" / "config.json").read_text())["num_nextn_predict_layers"] == 1
    first = load_file(tmp_path / "first" / "model.safetensors")
    for name in (*(f"mtp.0.{n}" for n in MTP_OWN), "mtp.0.attn.wq_a.weight", "mtp.0.attn.attn_sink", "mtp.0.attn.kv_norm.weight",
                 "mtp.0.attn_norm.weight", "mtp.0.ffn_norm.weight", "mtp.0.hc_attn_fn", "mtp.0.hc_ffn_scale",
                 "mtp.0.ffn.gate.weight", "mtp.0.ffn.gate.bias", "mtp.0.ffn.experts.7.w2.weight",
                 "mtp.0.ffn.shared_experts.w1.weight"):
        assert name in first, name
    mtp = sorted(n for n in first if n.startswith("mtp."))
    assert not [n for n in mtp if ".compressor." in n or ".indexer." in n or "tid2eid" in n or "block" in n]
    assert not {"mtp.0.head.weight", "mtp.0.embed.weight"} & set(mtp)
    assert first["mtp.0.hc_head_fn"].dtype == first["mtp.0.enorm.weight"].dtype == torch.float32

    back, cfg = from_pretrained(tmp_path / "first")
    assert cfg.mtp_depth == 1
    expected = model.state_dict()
    assert back.state_dict().keys() == expected.keys()
    assert all(torch.equal(t, expected[k]) for k, t in back.state_dict().items())
    ids = _ids(seed=14)
    with torch.no_grad():
        assert torch.equal(back.eval().mtp_logits(back.residual(ids), ids)[0], model.mtp_logits(model.residual(ids), ids)[0])
    save_pretrained(back, tmp_path / "back")
    again = load_file(tmp_path / "back" / "model.safetensors")
    assert first.keys() == again.keys() and all(torch.equal(first[k], again[k]) for k in first)


def test_mtp_layers_the_files_lack_or_the_model_leaves_out(tmp_path: Path, caplog: pytest.LogCaptureFixture):
    """A config.json declaring an MTP layer the files do not hold (what transformers' own
    ``save_pretrained`` writes) loads without it, with a warning; a release's MTP layer is left out
    (with a log line) of a model built without one; a copy of the shared head in it is dropped."""
    import logging

    from safetensors.torch import load_file, save_file

    from dsl_lit.hf import adapter_for_family

    save_pretrained(_randomised(build_model(_cfg()), seed=15), tmp_path / "none")
    config = json.loads((tmp_path / "none" / "config.json").read_text())
    (tmp_path / "none" / "config.json").write_text(json.dumps({**config, "num_nextn_predict_layers": 1}))
    with caplog.at_level(logging.WARNING, logger="dsl_lit.models.deepseek_v4.hf_adapter"):
        model, cfg = from_pretrained(tmp_path / "none")
    assert cfg.mtp_depth == 0 and not model.mtp and "num_nextn_predict_layers=1" in caplog.text

    save_pretrained(_randomised(build_model(_cfg(mtp_depth=1)), seed=16), tmp_path / "with")
    tensors = load_file(tmp_path / "with" / "model.safetensors")
    tensors["mtp.0.head.weight"] = tensors["head.weight"].clone()  # as DeepSeek-V4-Flash-Base ships it
    save_file(tensors, tmp_path / "with" / "model.safetensors", {"format": "pt"})
    withheld, cfg = from_pretrained(tmp_path / "with")
    assert cfg.mtp_depth == 1 and len(withheld.mtp) == 1
    adapter = adapter_for_family("deepseek_v4")
    without = adapter.from_hf(tensors, _cfg())
    assert not [n for n in without if n.startswith("mtp.")] and without.keys() == build_model(_cfg()).state_dict().keys()


def test_the_fp8_release_quantises_the_mtp_layer_as_the_others(tmp_path: Path):
    """``save_pretrained(fp8=True)``: the MTP layer's routed experts FP4, its attention projections,
    shared experts, ``e_proj`` and ``h_proj`` e4m3 with ``float8_e8m0fnu`` scales (``<module>.scale``),
    its norms and mHC in fp32; read back, each is its dequantised value."""
    from safetensors.torch import load_file

    from dsl_lit.hf import adapter_for_family

    model = _randomised(build_model(_cfg(mtp_depth=1, **V4_128)), seed=17).eval()
    save_pretrained(model, tmp_path, fp8=True)
    stored = load_file(tmp_path / "model.safetensors")
    scales = {n.removesuffix(".scale") + ".weight": t for n, t in stored.items() if n.endswith(".scale")}
    fp4 = {n for n, t in stored.items() if t.dtype == torch.int8 and n.startswith("mtp.")}
    fp8 = {n for n, t in stored.items() if t.dtype == torch.float8_e4m3fn and n.startswith("mtp.")}
    assert fp4 == {f"mtp.0.ffn.experts.{e}.w{w}.weight" for e in range(8) for w in (1, 2, 3)}
    assert fp8 == {f"mtp.0.{n}.weight" for n in ("e_proj", "h_proj", "attn.wq_a", "attn.wq_b", "attn.wkv", "attn.wo_a",
                                                 "attn.wo_b", "ffn.shared_experts.w1", "ffn.shared_experts.w2",
                                                 "ffn.shared_experts.w3")}
    assert fp4 | fp8 <= set(scales) and {scales[n].dtype for n in fp4 | fp8} == {torch.float8_e8m0fnu}
    for name in ("enorm.weight", "norm.weight", "hc_head_fn", "hc_attn_fn", "attn.attn_sink", "ffn.gate.weight"):
        assert stored[f"mtp.0.{name}"].dtype == torch.float32 and f"mtp.0.{name}" not in scales, name

    back, cfg = from_pretrained(tmp_path)
    assert cfg.mtp_depth == 1
    read = adapter_for_family("deepseek_v4").to_hf(back.state_dict(), back.config)
    for name in fp4 | fp8:
        assert torch.equal(read[name], _dequantised(stored[name], scales[name])), name


@pytest.mark.parametrize("fp8", [False, True], ids=["fp32", "fp8"])
def test_transformers_loads_the_export_skipping_mtp_with_the_same_logits(tmp_path: Path, fp8: bool):
    """transformers 5.24 builds no MTP layer and skips ``mtp.*`` on load: our export with one loads,
    and its logits are ours (the main model's, which the MTP module does not touch)."""
    from transformers import AutoModelForCausalLM, FineGrainedFP8Config

    model = _randomised(build_model(_cfg(mtp_depth=1, **V4_128)), seed=18).eval()
    save_pretrained(model, tmp_path, fp8=fp8)
    quantised = {"quantization_config": FineGrainedFP8Config(dequantize=True)} if fp8 else {}
    reference = AutoModelForCausalLM.from_pretrained(tmp_path, attn_implementation="eager", dtype=torch.float32,
                                                     **quantised).eval()
    assert not [n for n in reference.state_dict() if "mtp" in n]
    ours = from_pretrained(tmp_path, dtype="float32")[0].eval() if fp8 else model
    assert len(ours.mtp) == 1
    ids = _ids(seed=19)
    with torch.no_grad():
        assert_close_fp32(ours(ids), reference(input_ids=ids).logits, 128 * LAYERS * SEQ)


def test_pipeline_stages_hand_the_mtp_module_the_token_embeddings():
    """Cut into two pipeline stages (run here in one process): the first sends its streams and the
    token embeddings (not the streams they were copied into), the last runs the MTP module on them;
    the logits and MTP logits are the whole model's."""
    from dsl_lit.parallel.pipeline import PipelineStageModule

    model = _randomised(build_model(_cfg(mtp_depth=1)), seed=20).eval()
    ids = _ids(seed=21)
    first, last = (PipelineStageModule(model, layers, s == 0, s == 1) for s, layers in enumerate(([0, 1], [2, 3])))
    with torch.no_grad():
        streams, embeddings = first(ids, token_ids=ids)
        assert embeddings.shape == (*ids.shape, D) and streams.shape == (*ids.shape, 4, D)
        logits, mtp = last(streams, embeddings, token_ids=ids)
        residual = model.residual(ids)
        assert_close_fp32(logits, model.head(model.collapse(residual)), D * LAYERS * SEQ)
        assert_close_fp32(mtp, model.mtp_logits(residual, ids)[0], D * (LAYERS + 1) * SEQ)
