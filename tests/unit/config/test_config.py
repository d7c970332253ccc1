"""Hydra composition of the real conf/ tree and start-up validation naming the bad field."""

from __future__ import annotations

import sys
import time

import pytest

from data_contract.errors import ConfigError
from dsl_lit.config import TrainConfig
from tests.conftest import CONF, ROOT, compose_config, with_stage_inputs
from tests.forked_python import run_python


def test_default_config_is_the_cpu_demo():
    cfg = TrainConfig.from_hydra(compose_config())
    assert cfg.model.name == "deepseek_v3_tiny" and cfg.model.mtp_depth == 1 and cfg.model.is_moe
    assert cfg.objective.mtp_weight == [0.3, 0.1] and cfg.objective.bias_update_rate[-1] == 0.0
    assert cfg.optim.lr == 2.0e-3 and cfg.optim.betas == (0.9, 0.95)
    assert cfg.precision.name == "fp32"
    assert cfg.logger.wandb.enabled and cfg.logger.wandb.mode == "offline" and cfg.logger.csv
    assert cfg.data.corpus_dir.endswith("data/corpus")


@pytest.mark.parametrize("experiment", sorted(p.stem for p in (CONF / "experiment").glob("*.yaml")))
def test_every_experiment_composes_and_validates(experiment):
    cfg = TrainConfig.from_hydra(compose_config(overrides=with_stage_inputs([f"experiment={experiment}"])))
    assert cfg.trainer.max_steps > 0


def test_deepseek_llm_7b_experiment_numbers():
    cfg = TrainConfig.from_hydra(compose_config(overrides=["experiment=deepseek_llm_7b"]))
    assert (cfg.model.n_layers, cfg.model.d_model, cfg.model.vocab_size) == (30, 4096, 102400)
    assert cfg.data.global_batch_size == 2304 and cfg.data.seq_len == 4096 and cfg.optim.lr == 4.2e-4
    # 2T tokens at 2304 x 4096 tokens per step
    assert cfg.trainer.max_steps * 2304 * 4096 == pytest.approx(2e12, rel=1e-4)


def test_deepseek_v3_671b_experiment_numbers():
    cfg = TrainConfig.from_hydra(compose_config(overrides=["experiment=deepseek_v3_671b"]))
    m = cfg.model
    assert (m.n_layers, m.d_model, m.n_heads, m.vocab_size) == (61, 7168, 128, 129280)
    assert (m.n_routed_experts, m.n_activated_experts, m.n_expert_groups, m.n_limited_groups) == (256, 8, 8, 4)
    assert cfg.optim.lr == 2.2e-4 and cfg.data.seq_len == 4096 and cfg.data.global_batch_size == 15360
    batches = cfg.data.batch_schedule
    assert batches.size_at(0) == 3072 and batches.size_at(batches.ramp_samples) == 15360
    assert batches.advance(0, cfg.trainer.max_steps) * 4096 == pytest.approx(14.8e12, rel=1e-4)
    assert cfg.schedule.name == "deepseek_v3_tokens"


def test_overrides_reach_the_dataclasses():
    cfg = TrainConfig.from_hydra(compose_config(overrides=[
        "optim.lr=1e-3", "trainer.max_steps=50", "precision=bf16", "logger=csv", "schedule=cosine",
        "+model.n_layers=2", "data.micro_batch_size=4", "checkpoint.every_n_steps=7",
    ]))
    assert cfg.optim.lr == 1e-3 and cfg.trainer.max_steps == 50 and cfg.precision.name == "bf16"
    assert not cfg.logger.wandb.enabled and cfg.schedule.name == "cosine" and cfg.model.n_layers == 2
    assert cfg.data.micro_batch_size == 4 and cfg.checkpoint.every_n_steps == 7


@pytest.mark.parametrize(
    "override, field",
    [
        ("optim.lr=-1", "optim.lr"),
        ("optim.lr=abc", "optim.lr"),
        ("data.seq_len=4096", "data.seq_len"),
        ("data.global_batch_size=12", "data.global_batch_size"),
        ("parallel.tp=2", "parallel.tp"),
        ("schedule.warmup_steps=-5", "schedule.warmup_steps"),
        ("trainer.max_steps=0", "trainer.max_steps"),
        ("+model.n_expert_groups=3", "model.n_expert_groups"),
        ("objective.mtp_weight=[0.3]", "objective.mtp_weight"),
        ("data.tokenizer_vocab_size=16384", "data.tokenizer_vocab_size"),
        ("logger.wandb.mode=sometimes", "logger.wandb.mode"),
    ],
)
def test_bad_values_fail_naming_the_field(override, field):
    with pytest.raises(ConfigError, match=field.replace(".", r"\.")):
        TrainConfig.from_hydra(compose_config(overrides=[override]))


def test_recipe_rejects_negative_lr_at_once(tmp_path):
    start = time.perf_counter()
    result = run_python([sys.executable, str(ROOT / "recipes" / "pretrain.py"), "optim.lr=-1", f"hydra.run.dir={tmp_path}"],
                        cwd=ROOT, timeout=120)
    elapsed = time.perf_counter() - start
    assert result.returncode != 0
    assert "optim.lr=-1" in result.stderr
    assert not (tmp_path / "checkpoints").exists() and not (tmp_path / "metrics.csv").exists()
    assert elapsed < 60


def test_a_bad_config_prints_one_line_and_exits_2():
    """No Hydra traceback before the message (HYDRA_FULL_ERROR=1 keeps it)."""
    import sys

    from tests.conftest import ROOT

    env = {k: v for k, v in __import__("os").environ.items() if k != "HYDRA_FULL_ERROR"}
    for override, message in (("optim.lr=-1", "error: optim.lr=-1 must be > 0"),
                              ("trainer.accelerator=gpu", "error: trainer.accelerator=gpu but this machine has no")):
        if override.endswith("gpu"):
            import torch

            if torch.cuda.is_available():
                continue
        result = run_python([sys.executable, str(ROOT / "recipes" / "pretrain.py"), override], cwd=ROOT, env=env,
                            timeout=120)
        assert result.returncode == 2, result.stderr[-2000:]
        assert result.stderr.strip().splitlines() == [result.stderr.strip().splitlines()[0]]
        assert result.stderr.startswith(message), result.stderr
        assert "Traceback" not in result.stderr + result.stdout


def test_hydra_full_error_keeps_the_traceback_of_a_config_error():
    import os
    import sys

    from tests.conftest import ROOT

    result = run_python([sys.executable, str(ROOT / "recipes" / "pretrain.py"), "optim.lr=-1"], cwd=ROOT,
                        env={**os.environ, "HYDRA_FULL_ERROR": "1"}, timeout=120)
    assert result.returncode == 2, result.stderr[-2000:]
    assert "Traceback" in result.stderr and "ConfigError" in result.stderr, result.stderr[-2000:]
    assert "optim.lr=-1 must be > 0" in result.stderr


@pytest.mark.parametrize(
    "overrides, field, lacks",
    [
        (["model=deepseek_llm_tiny", "+model.n_routed_experts=32"], "model.n_routed_experts", "routed experts"),
        (["model=deepseek_llm_tiny", "+model.mtp_depth=1"], "model.mtp_depth", "multi-token prediction"),
        (["model=deepseek_llm_tiny", "+model.kv_lora_rank=64"], "model.kv_lora_rank", "latent attention"),
        (["model=deepseek_v3_tiny", "+model.n_kv_heads=2"], "model.n_kv_heads", "one key/value head per query head"),
    ],
)
def test_a_field_the_family_does_not_read_is_refused(overrides, field, lacks):
    """Before: the same model was built and trained without a word (the dense preset stayed dense)."""
    with pytest.raises(ConfigError, match=rf"^{field.replace('.', '[.]')} is not used by .*{lacks}"):
        TrainConfig.from_hydra(compose_config(overrides=overrides))
    TrainConfig.from_hydra(compose_config(overrides=["model=deepseek_v3_tiny", "+model.n_routed_experts=8",
                                                     "+model.n_expert_groups=2", "+model.n_limited_groups=1"]))


@pytest.mark.parametrize("key, value", [("chat_template_name", ["default", "tool_use"]), ("tokenizer_dir", ["a", "b"])])
def test_post_training_names_given_as_lists_are_one_line(key, value):
    """Before: a list reached the tokenizer code and ended in a traceback."""
    from dsl_lit.config.posttrain import PostTrainConfig

    with pytest.raises(ConfigError, match=rf"^{key}=\[.*\] must be one name \(a string\), not a list$"):
        PostTrainConfig.from_raw({"tokenizer_dir": "tok", key: value})
