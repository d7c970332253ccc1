"""recipes/export_hf.py end to end: a checkpoint written by the real pretrain recipe (2 steps of a
2-layer tiny model) is exported, transformers loads the export with ``AutoModelForCausalLM`` (no
remote code), and its logits equal those of our model built from the same checkpoint (fp32, 1e-5).
Also: the EMA weights (``weights=ema``), a bf16 export, the tokenizer's bos/eos/pad ids in
config.json and generation_config.json (ours and DeepSeek's released ones), and the errors for bad inputs."""

from __future__ import annotations

import importlib.util
import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml
from safetensors.torch import load_file
from tokenizers import Tokenizer
from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig

from data_contract.errors import ConfigError
from data_contract.tokenizer_dir import read_tokenizer_meta
from dsl_lit.checkpoint.export_hf import run_tokenizer_dir
from dsl_lit.checkpoint.integrity import file_checksum
from dsl_lit.checkpoint.sharded import read_full_tensors
from dsl_lit.hf.token_ids import hf_token_ids, write_token_ids
from dsl_lit.models import ModelConfig, build_model
from tests.conftest import ROOT, scratch_dir
from tests.forked_python import run_python
from tests.numerics import assert_close_fp32
from tests.recipe_runs import run_recipe
from tests.unit.data_pipeline.test_released_tokenizers import reference_file

pytestmark = pytest.mark.slow  # trains with the recipe in a subprocess per family

EMA_DECAY = 0.9
# The dense family's run also keeps an EMA, so one checkpoint serves both weight sources.
RUNS = {
    "deepseek_llm_tiny": [f"memory.ema_decay={EMA_DECAY}"],
    "deepseek_v3_tiny": [],
}


def _load_recipe():
    spec = importlib.util.spec_from_file_location("export_hf_recipe", ROOT / "recipes" / "export_hf.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


export_hf = _load_recipe()


def run_export(*overrides: str) -> subprocess.CompletedProcess:
    return run_python([sys.executable, str(ROOT / "recipes" / "export_hf.py"), *overrides], cwd=ROOT, timeout=300)


@pytest.fixture(scope="module", params=list(RUNS))
def checkpoint(request) -> Path:
    run_dir = scratch_dir(request, request.param)
    run_recipe(run_dir, f"model={request.param}", "trainer.max_steps=2", "checkpoint.every_n_steps=2",
               "logger=csv", *RUNS[request.param])
    return run_dir / "checkpoints" / "step-2"


def _our_model(checkpoint: Path, ema: dict[str, torch.Tensor] | None = None) -> torch.nn.Module:
    """Our Transformer from the checkpoint, built independently of the recipe's loader."""
    cfg = ModelConfig.from_name(**yaml.safe_load((checkpoint / "config.yaml").read_text())["model"])
    model = build_model(cfg)
    weights = read_full_tensors(checkpoint / "shards", prefix="state_dict/")
    state = {k.removeprefix("model."): v for k, v in weights.items()}
    model.load_state_dict({**state, **(ema or {})}, strict=True)
    return model.eval()


def _ema(checkpoint: Path) -> dict[str, torch.Tensor]:
    callbacks = torch.load(checkpoint / "trainer_state.pt", weights_only=True)["callbacks"]
    (key,) = [k for k in callbacks if "EMACallback" in k]
    assert callbacks[key]["decay"] == EMA_DECAY
    return read_full_tensors(checkpoint / "shards", prefix=f"callbacks/{key}/ema/")


@torch.no_grad()
def _assert_same_logits(ours: torch.nn.Module, export_dir: Path) -> None:
    """transformers on the export gives our logits up to fp32 reordering (width x layers x sequence)."""
    hf = AutoModelForCausalLM.from_pretrained(export_dir, attn_implementation="eager").eval()
    ids = torch.randint(0, ours.config.vocab_size, (2, 48), generator=torch.Generator().manual_seed(0))
    reduction = ours.config.d_model * ours.config.n_layers * ids.shape[1]
    assert_close_fp32(ours(ids), hf(input_ids=ids).logits, reduction)


def test_export_loads_in_transformers_with_our_logits(checkpoint: Path, tmp_path: Path) -> None:
    out = tmp_path / "hf"
    result = run_export(f"checkpoint={checkpoint}", f"output={out}")
    assert result.returncode == 0, result.stderr[-3000:]
    config = json.loads((out / "config.json").read_text())
    assert config["dtype"] == "float32"
    ours = _our_model(checkpoint)
    _assert_same_logits(ours, out)
    weights = load_file(out / "model.safetensors")
    if ours.config.family == "deepseek_v3":
        assert config["architectures"] == ["DeepseekV3ForCausalLM"] and config["num_nextn_predict_layers"] == 1
        n = ours.config.n_layers  # the MTP module is exported as the extra layer n_layers
        assert torch.equal(weights[f"model.layers.{n}.eh_proj.weight"], ours.mtp["0"].eh_proj.weight)
        bias = weights["model.layers.1.mlp.gate.e_score_correction_bias"]
        assert bias.abs().sum() > 0 and torch.equal(bias, ours.layers["1"].feed_forward.gate.expert_bias)
    else:
        assert config["architectures"] == ["LlamaForCausalLM"]
    assert not list(tmp_path.glob(".tmp-*"))  # written beside the output, then renamed into place
    # the run's tokenizer travels with the weights: AutoTokenizer gives the ids we trained on
    text = "And God said, Let there be light: and there was light. 1234"
    cache = yaml.safe_load((checkpoint / "config.yaml").read_text())["data"]["cache_dir"]
    ours_tok = Tokenizer.from_file(str(Path(cache) / "tokenizer" / "tokenizer.json"))
    assert AutoTokenizer.from_pretrained(out)(text, add_special_tokens=False)["input_ids"] == ours_tok.encode(
        text, add_special_tokens=False).ids


def test_export_ema_weights(checkpoint: Path, tmp_path: Path) -> None:
    if not yaml.safe_load((checkpoint / "config.yaml").read_text())["memory"]["ema_decay"]:
        with pytest.raises(ConfigError, match="holds no EMA of the weights"):
            export_hf.export(checkpoint, tmp_path / "ema", weights="ema")
        return
    ema = _ema(checkpoint)
    out = export_hf.export(checkpoint, tmp_path / "ema", weights="ema")
    weights = load_file(out / "model.safetensors")
    assert torch.equal(weights["model.embed_tokens.weight"], ema["tok_embeddings.weight"])
    trained = read_full_tensors(checkpoint / "shards", prefix="state_dict/")["model.tok_embeddings.weight"]
    assert (trained - ema["tok_embeddings.weight"]).abs().max() > 1e-4  # the average lags the weights
    _assert_same_logits(_our_model(checkpoint, ema), out)


def test_export_bf16_and_the_latest_step_of_a_run_dir(checkpoint: Path, tmp_path: Path) -> None:
    out = export_hf.export(checkpoint.parents[1], tmp_path / "bf16", dtype="bf16")  # the run dir
    config = json.loads((out / "config.json").read_text())
    weights = load_file(out / "model.safetensors")
    assert config["dtype"] == "bfloat16" and weights["model.embed_tokens.weight"].dtype == torch.bfloat16
    for name, tensor in weights.items():  # transformers keeps the router bias in fp32, so do we
        assert tensor.dtype == (torch.float32 if name.endswith("e_score_correction_bias") else torch.bfloat16)
    with pytest.raises(FileExistsError, match="not empty; pass overwrite=true"):
        export_hf.export(checkpoint, out)
    export_hf.export(checkpoint, out, overwrite=True)
    assert json.loads((out / "config.json").read_text())["dtype"] == "float32"


def test_export_names_the_tokenizers_token_ids(checkpoint: Path, tmp_path: Path) -> None:
    """generate stops on our eos: without the ids transformers takes the architecture's (Llama's
    eos 2, our pad)."""
    out = export_hf.export(checkpoint, tmp_path / "hf")
    meta = read_tokenizer_meta(run_tokenizer_dir(checkpoint))  # the data pipeline's meta.json
    ids = {"bos_token_id": meta["bos_id"], "eos_token_id": meta["eos_id"], "pad_token_id": meta["pad_id"]}
    for name in ("config.json", "generation_config.json"):
        written = json.loads((out / name).read_text())
        assert {key: written.get(key) for key in ids} == ids, name
    assert GenerationConfig.from_pretrained(out).eos_token_id == meta["eos_id"]
    assert AutoTokenizer.from_pretrained(out).eos_token_id == meta["eos_id"]


@pytest.mark.parametrize(("name", "released"), [("deepseek_llm", (100000, 100001, 100001)),
                                                 ("deepseek_v3", (0, 1, 1))])
def test_released_tokenizers_ids_as_in_their_configs(name: str, released: tuple, tmp_path: Path) -> None:
    """A released tokenizer's files (AddedToken dicts, the eos as pad) give its config.json's ids;
    without a bos, config.json says null (not Llama's default 1) and generation_config.json nothing."""
    spec = json.loads(reference_file().read_text(encoding="utf-8"))[name]
    tokenizer = {"model": {"type": "BPE", "vocab": {}}, "added_tokens": spec["added_tokens"]}
    (tmp_path / "tokenizer.json").write_text(json.dumps(tokenizer))
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(spec["tokenizer_config"]))
    (tmp_path / "config.json").write_text(json.dumps({"bos_token_id": 1, "eos_token_id": 2}))
    write_token_ids(tmp_path, hf_token_ids(tmp_path))
    config = json.loads((tmp_path / "config.json").read_text())
    assert (config["bos_token_id"], config["eos_token_id"], config["pad_token_id"]) == released
    assert GenerationConfig.from_pretrained(tmp_path).eos_token_id == released[1]

    del spec["tokenizer_config"]["bos_token"]
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(spec["tokenizer_config"]))
    write_token_ids(tmp_path, hf_token_ids(tmp_path))
    assert json.loads((tmp_path / "config.json").read_text())["bos_token_id"] is None
    assert "bos_token_id" not in json.loads((tmp_path / "generation_config.json").read_text())


def test_bad_inputs_give_clear_errors(tmp_path: Path) -> None:
    incomplete = tmp_path / "checkpoints" / "step-4"
    incomplete.mkdir(parents=True)
    (incomplete / "trainer_state.pt").write_bytes(b"")
    # the command's one-line error (main() turns the exception into SystemExit(message), no traceback)
    with pytest.raises(SystemExit, match="is not a complete checkpoint: no meta.json"):
        export_hf.main([f"checkpoint={incomplete}", f"output={tmp_path / 'out'}"])
    assert not (tmp_path / "out").exists()

    with pytest.raises(SystemExit, match="checkpoint=<dir> is required"):
        export_hf.main([f"output={tmp_path / 'out'}"])
    with pytest.raises(SystemExit, match=r"unknown key \('ckpt'\)"):
        export_hf.main([f"ckpt={incomplete}", f"output={tmp_path / 'out'}"])

    with pytest.raises(FileNotFoundError, match="no such directory"):
        export_hf.export(tmp_path / "nowhere", tmp_path / "out")
    with pytest.raises(FileNotFoundError, match="holds no complete one"):
        export_hf.export(tmp_path / "checkpoints", tmp_path / "out")  # its only step is incomplete
    with pytest.raises(ConfigError, match="weights='best' is unknown"):
        export_hf.export(incomplete, tmp_path / "out", weights="best")


def test_unknown_family_is_a_config_error(checkpoint: Path, tmp_path: Path) -> None:
    copy = tmp_path / "step-2"
    shutil.copytree(checkpoint, copy)
    config = yaml.safe_load((copy / "config.yaml").read_text())
    config["model"]["family"] = "mamba"
    (copy / "config.yaml").write_text(yaml.safe_dump(config))
    meta = json.loads((copy / "meta.json").read_text())  # an intended edit: record its checksum
    meta["checksums"]["config.yaml"] = file_checksum(copy / "config.yaml")
    meta["files"]["config.yaml"] = (copy / "config.yaml").stat().st_size
    (copy / "meta.json").write_text(json.dumps(meta))
    with pytest.raises(ConfigError, match="model.family='mamba' is unknown"):
        export_hf.export(copy, tmp_path / "out")


def test_a_bad_input_is_one_line_and_exit_2(tmp_path):
    """As every recipe's bad input (before: the message and exit status 1)."""
    from tests.forked_python import run_python

    result = run_python([sys.executable, str(ROOT / "recipes" / "export_hf.py"), f"checkpoint={tmp_path / 'none'}",
                         f"output={tmp_path / 'hf'}"], cwd=tmp_path, timeout=300)
    assert result.returncode == 2
    assert result.stderr.strip().splitlines()[-1] == f"export_hf: error: checkpoint={tmp_path / 'none'}: no such directory"
