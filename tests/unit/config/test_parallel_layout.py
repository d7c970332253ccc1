"""Parallel layouts are validated at start-up, naming the field, before any process group exists."""

from __future__ import annotations

import pytest

from data_contract.errors import ConfigError
from dsl_lit.config import ParallelConfig, TrainConfig
from dsl_lit.config.parallel import ParallelLayout
from dsl_lit.models import ModelConfig
from tests.conftest import compose_config

LLM = ModelConfig.from_name("deepseek_llm_7b")  # 32 heads, 32 kv heads, 30 layers, no experts
V3 = ModelConfig.from_name("deepseek_v3_671b")  # 128 heads, 61 layers, 256 experts


@pytest.mark.parametrize(
    ("layout", "model", "world", "message"),
    [
        (dict(tp=3), LLM, 6, "parallel.tp=3 does not divide model.n_heads=32"),
        (dict(tp=2, pp=2, sequence_parallel=True), LLM, 4, "parallel.sequence_parallel=true with parallel.pp=2"),
        (dict(tp=6), ModelConfig.from_name("deepseek_llm_tiny", n_heads=12, n_kv_heads=4, d_model=384), 6,
         "parallel.tp=6 and model.n_kv_heads=4: one must divide the other"),
        (dict(tp=2, pp=2), LLM, 6, "parallel.tp=2 x parallel.pp=2 = 4 does not divide the world size"),
        (dict(dp=3), LLM, 4, "parallel.dp=3 x tp=1 x pp=1 must equal the world size"),
        (dict(pp=8, pp_virtual_stages=4, pp_schedule="Interleaved1F1B"), LLM, 8, "32 stages exceed model.n_layers=30"),
        (dict(pp=2, pp_schedule="Interleaved1F1B"), LLM, 2, "set parallel.pp_virtual_stages=2"),
        (dict(pp=2, pp_virtual_stages=2), LLM, 2, "parallel.pp_schedule=1F1B runs one stage per rank"),
        (dict(pp=2, pp_schedule="DualPipeV", pp_virtual_stages=3), LLM, 2, "must be 2 (or 1, read as 2)"),
        (dict(pp=2), ModelConfig.from_name("deepseek_llm_tiny", tie_embeddings=True), 2,
         "model.tie_embeddings=true with parallel.pp=2"),
        (dict(ep=2), LLM, 2, "parallel.ep=2 needs a model with routed experts"),
        (dict(ep=3), V3, 3, "parallel.ep=3 does not divide model.n_routed_experts=256"),
        (dict(ep=4), V3, 2, "parallel.ep=4 does not divide the data-parallel size 2"),
        (dict(ep=2, zero1=True), V3, 2, "parallel.zero1=true with parallel.ep=2 is not implemented yet"),
        (dict(ep=3), ModelConfig.from_name("deepseek_v3_tiny", n_routed_experts=12), 3,
         "model.n_expert_groups=4 and parallel.ep=3"),
        (dict(cp=2, tp=2, sequence_parallel=True), V3, 4, "parallel.cp=2 with parallel.sequence_parallel=true"),
        (dict(cp=4, tp=2), V3, 4, "parallel.tp=2 x parallel.pp=1 x parallel.cp=4 = 8 does not divide the world size"),
        (dict(dp=2, cp=2), V3, 8, "parallel.dp=2 x tp=1 x pp=1 x cp=2 must equal the world size"),
        (dict(cp=0), V3, 1, "parallel.cp=0 must be >= 1"),
    ],
)
def test_bad_layouts_name_the_field(layout, model, world, message):
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(")", r"\)")):
        ParallelLayout.create(ParallelConfig(**layout).validate(), model, world)


def test_dp_defaults_to_what_tp_and_pp_leave():
    assert ParallelLayout.create(ParallelConfig().validate(), LLM, 8).dp == 8
    assert ParallelLayout.create(ParallelConfig(dp=4).validate(), LLM, 4).dp == 4
    assert ParallelLayout.create(ParallelConfig(tp=4).validate(), ModelConfig.from_name("deepseek_llm_67b"), 8).dp == 2
    assert ParallelLayout.create(ParallelConfig(tp=8).validate(), V3, 16).dp == 2  # MLA: tp divides the 128 heads
    # context-parallel ranks are not data-parallel replicas, but gradients average over both
    layout = ParallelLayout.create(ParallelConfig(cp=2, tp=2, ep=2).validate(), V3, 16)
    assert (layout.dp, layout.replicas, layout.mesh_shape) == (4, 8, (1, 2, 2, 2, 2))
    # DeepSeek LLM 67B has 8 kv heads: tp=16 replicates each on two ranks
    assert ParallelLayout.create(ParallelConfig(tp=16).validate(), ModelConfig.from_name("deepseek_llm_67b"), 32).dp == 2


@pytest.mark.parametrize(
    ("override", "message"),
    [
        ("parallel.pp_schedule=ZB", "parallel.pp_schedule='ZB' is unknown"),
        ("parallel.sequence_parallel=true", "parallel.sequence_parallel=true needs parallel.tp > 1"),
        ("parallel.tp=2 parallel.sequence_parallel=true trainer.devices=2 data.seq_len=63", "make data.seq_len a multiple"),
        ("trainer.val_every_n_steps=5 data.val_windows=8", "set data.val_windows to at least data.global_batch_size=16"),
        ("data.val_windows=-1", "data.val_windows=-1 must be >= 0"),
        ("precision=fp8_blockwise parallel.tp=2 trainer.devices=2", "precision.fp8=fp8_blockwise with parallel.tp=2"),
        ("precision.fp8=fp8_blockwise", "runs FP8 GEMMs inside bf16 training"),
        ("precision=fp16 optim.fused=true optim.foreach=true", "optim.fused=true and optim.foreach=true exclude"),
        ("parallel.tp=0", "parallel.tp=0 must be >= 1"),
        ("parallel=cp2 trainer.devices=2 data.seq_len=66", "data.seq_len=66 must be a multiple of 2 x parallel.cp = 4"),
    ],
)
def test_parallel_group_errors(override, message):
    with pytest.raises(ConfigError, match=message.replace("(", r"\(")):
        TrainConfig.from_hydra(compose_config(overrides=override.split()))


def test_zero1_group_composes():
    cfg = TrainConfig.from_hydra(compose_config(overrides=["parallel=zero1", "trainer.devices=2"]))
    assert cfg.parallel.zero1 and cfg.parallel.dp is None and cfg.world_size == 2


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["parallel.pp=2", "parallel.pp_schedule=DualPipeV"], "DualPipeV needs at least 2 x parallel.pp=4 micro-batches"),
        (["parallel.pp=4", "+model.n_layers=4"], "1F1B needs at least parallel.pp=4 micro-batches per step, got 2"),
        (["parallel.pp=2", "parallel.pp_schedule=Interleaved1F1B", "parallel.pp_virtual_stages=2",
          "trainer.devices=2", "data.global_batch_size=10"], "the 5 micro-batches per step to be a multiple"),
    ],
)
def test_pipeline_micro_batch_counts(overrides, message):
    base = ["trainer.devices=4", "data.global_batch_size=4", "data.micro_batch_size=2"]
    with pytest.raises(ConfigError, match=message.replace("(", r"\(")):
        TrainConfig.from_hydra(compose_config(overrides=[*base, *overrides]))


def test_context_parallelism_is_for_pretraining():
    """Post-training rows carry positions and masks the cp shard does not split: refused by name."""
    for recipe in ("sft", "dpo", "grpo"):
        composed = compose_config(recipe, overrides=["parallel=cp2", "trainer.devices=2"])
        with pytest.raises(ConfigError, match="parallel.cp=2 is built for pretraining"):
            TrainConfig.from_hydra(composed, post_training=True)
    assert TrainConfig.from_hydra(compose_config(overrides=["parallel=cp2", "trainer.devices=2"])).layout.cp == 2


def test_routing_replay_needs_routers_and_takes_any_layout():
    """R3 needs routers to replay to (one line for a dense model); the pipeline carries the routes
    to its stages like the other layouts."""
    composed = compose_config("grpo", overrides=["grpo.routing_replay=true"])
    with pytest.raises(ConfigError, match="model deepseek_llm_tiny has no routed experts"):
        TrainConfig.from_hydra(composed, post_training=True)
    for layout in ([], ["parallel=pp_1f1b", "trainer.devices=2", "data.global_batch_size=4", "data.micro_batch_size=1"]):
        ok = compose_config("grpo", overrides=["grpo.routing_replay=true", "model=deepseek_v3_tiny", *layout])
        assert TrainConfig.from_hydra(ok, post_training=True).post.grpo.routing_replay
