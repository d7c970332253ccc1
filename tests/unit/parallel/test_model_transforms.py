"""``transform_model``: the one place a built model is changed, in the order ARCHITECTURE.md states
(issue 35, item 2)."""

from __future__ import annotations

import re

import pytest
import torch

from dsl_lit.models import ModelConfig, build_model
from dsl_lit.ops import chunk_kernels_backend, compile_chunk_kernels
from dsl_lit.parallel.model_transforms import TRANSFORM_ORDER, TransformPlan, transform_model
from dsl_lit.precision.fp8 import Fp8Linear
from tests.conftest import ROOT


def test_the_order_is_the_one_architecture_md_states():
    line = re.search(r"^Order: (.+)$", (ROOT / "ARCHITECTURE.md").read_text(), re.MULTILINE)
    assert line is not None
    assert tuple(part.strip() for part in line.group(1).split("->")) == TRANSFORM_ORDER


def test_transforms_run_in_order_once(monkeypatch):
    torch.manual_seed(0)
    model = build_model(ModelConfig.from_name("deepseek_v3_tiny"))
    names = [n for n, _ in model.named_parameters()]
    calls: list[str] = []
    seen_fp8_when_recomputing = []
    import dsl_lit.parallel.model_transforms as transforms

    def recording_recompute(m, mode, blocks):  # recompute must see the FP8 modules
        seen_fp8_when_recomputing.append(any(isinstance(x, Fp8Linear) for x in m.modules()))
        calls.append("recompute")
        return 0

    monkeypatch.setattr(transforms, "apply_recompute", recording_recompute)
    steps = {name: (lambda name=name: calls.append(name)) for name in ("context", "tensor", "pipeline", "expert")}
    plan = TransformPlan(fp8="fp8_rowwise", recompute="selective", compile=False, expert_weight_copies=True)
    applied = transform_model(model, plan, steps)
    assert applied == ["fp8", "expert_weight_copies", "recompute", "pipeline", "tensor", "expert", "context"]
    assert calls == ["recompute", "pipeline", "tensor", "expert", "context"] and seen_fp8_when_recomputing == [True]
    assert transform_model(model, plan, steps) == [] and len(calls) == 5  # once per model
    assert [n for n, _ in model.named_parameters()] == names  # names (checkpoint keys) unchanged
    with pytest.raises(ValueError, match="not among"):
        transform_model(build_model(ModelConfig.from_name("deepseek_llm_tiny")), plan, {"data": lambda: None})


def test_compile_only_when_fitting():
    model = build_model(ModelConfig.from_name("deepseek_llm_tiny"))
    assert transform_model(model, TransformPlan(compile=True), fitting=False) == []
    assert "_compiled_call_impl" not in vars(model.layers["0"]) or model.layers["0"]._compiled_call_impl is None
    assert chunk_kernels_backend() is None


def test_a_transform_is_one_object_in_the_order(monkeypatch):
    """An extension point, not an if chain: a transform added to TRANSFORMS runs in its place,
    when it says it is wanted, with the same context as the others."""
    import dsl_lit.parallel.model_transforms as transforms

    seen = []

    class Probe(transforms.ModelTransform):
        name = "probe"

        def wanted(self, ctx):
            return ctx.fitting

        def apply(self, model, ctx):
            seen.append((ctx.plan.recompute, sorted(ctx.layout_steps)))

    monkeypatch.setattr(transforms, "TRANSFORMS", (*transforms.TRANSFORMS[:2], Probe(), *transforms.TRANSFORMS[2:]))
    model = build_model(ModelConfig.from_name("deepseek_llm_tiny"))
    assert transform_model(model, TransformPlan(recompute="full"), {"tensor": lambda: None}) == ["probe", "recompute", "tensor"]
    assert transform_model(build_model(ModelConfig.from_name("deepseek_llm_tiny")), TransformPlan(), fitting=False) == []
    assert seen == [("full", ["tensor"])]


def test_compile_also_compiles_the_cross_entropy_chunks():
    model = build_model(ModelConfig.from_name("deepseek_llm_tiny"))
    try:
        assert transform_model(model, TransformPlan(compile=True, compile_backend="aot_eager")) == ["compile"]
        assert chunk_kernels_backend() == "aot_eager"
    finally:
        compile_chunk_kernels(None)
    assert chunk_kernels_backend() is None


def test_a_module_that_asks_for_transforms_refuses_a_strategy_that_applies_none():
    """Only dsl_lit's strategies transform a model (:class:`ModelSetup`, the one caller of
    ``transform_model``): under a strategy of Lightning's own, a module whose plan asks for FP8 or
    recompute stops with a line naming the fix instead of training without them; built by hand (no
    trainer) the model is left as built; under ``DeepSeekStrategy`` (one process here) it is transformed when the
    strategy sets it up."""
    import lightning as L

    from dsl_lit.config.memory import MemoryConfig
    from dsl_lit.config.optim import OptimConfig, ScheduleConfig
    from dsl_lit.config.precision import PrecisionConfig
    from dsl_lit.parallel.strategy import DeepSeekStrategy
    from dsl_lit.training import PretrainModule

    def module(strategy=None) -> PretrainModule:
        made = PretrainModule(ModelConfig.from_name("deepseek_llm_tiny", n_layers=2), OptimConfig(), ScheduleConfig(),
                              2, total_steps=2, precision=PrecisionConfig(name="bf16", fp8="fp8_rowwise").validate(),
                              memory=MemoryConfig(recompute="selective").validate())
        if strategy is not None:
            made.trainer = L.Trainer(accelerator="cpu", strategy=strategy, logger=False, enable_checkpointing=False,
                                     enable_progress_bar=False, enable_model_summary=False)
        return made

    with pytest.raises(RuntimeError, match=r"^fp8, recompute of this module are applied by dsl_lit's strategy: "
                                           r"build the Trainer with .*build_trainer\(cfg\), or pass the strategy of dsl_lit\.parallel\.strategy"):
        module("auto").configure_model()
    by_hand = module()
    by_hand.configure_model()
    assert not any(isinstance(m, Fp8Linear) for m in by_hand.model.modules())

    strategy = DeepSeekStrategy()
    transformed = module(strategy)
    transformed.configure_model()
    assert not any(isinstance(m, Fp8Linear) for m in transformed.model.modules())  # the strategy's to do
    strategy.connect(transformed)
    strategy._setup_model(transformed)
    assert any(isinstance(m, Fp8Linear) for m in transformed.model.modules())
    assert "forward" in vars(transformed.model.layers["0"])  # recompute wraps each block's forward


def test_fp8_that_converts_no_layer_is_a_config_error():
    """Before: an INFO line ("0 Linear layers ... in FP8") and a bf16 run under an FP8 name."""
    from data_contract.errors import ConfigError
    from dsl_lit.models import ModelConfig, build_model
    from dsl_lit.parallel.model_transforms import TransformPlan, transform_model

    narrow = build_model(ModelConfig.from_name("deepseek_llm_tiny", d_model=72, n_heads=4, n_kv_heads=4,
                                               ffn_hidden=100, n_layers=1, vocab_size=100))
    with pytest.raises(ConfigError, match=r"^precision\.fp8=fp8_blockwise converts no layer of this model .*multiples of 128"):
        transform_model(narrow, TransformPlan(fp8="fp8_blockwise"))


@pytest.mark.parametrize("compiled, cuda, warned", [(False, True, True), (True, True, False), (False, False, False)])
def test_fp8_without_compile_on_a_gpu_says_it_is_slow(monkeypatch, caplog, compiled, cuda, warned):
    """On CUDA eager FP8 runs torchao's casts unfused (an H200 measured 2.7x bf16 eager's step): a
    run that asks for it hears so once; on CPU (the reference path) and compiled, nothing."""
    monkeypatch.setattr("dsl_lit.parallel.model_transforms._on_cuda", lambda: cuda)
    model = build_model(ModelConfig.from_name("deepseek_llm_tiny"))
    monkeypatch.setattr("dsl_lit.parallel.model_transforms.compile_blocks", lambda model, shapes, backend: 0)
    with caplog.at_level("WARNING", logger="dsl_lit.parallel.model_transforms"):
        transform_model(model, TransformPlan(fp8="fp8_rowwise", compile=compiled))
    assert any("without trainer.compile=true" in r.getMessage() for r in caplog.records) == warned
