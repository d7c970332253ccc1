"""The profiler (issue 21): ``profiler.enabled=true`` writes a Chrome/Perfetto trace per rank and
cycle into the run directory, holding the training step's ops (matmuls forward and backward,
the optimizer), with memory events when asked; on one process and on two."""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

import pytest
import torch

from data_contract.errors import ConfigError
from dsl_lit.config import TrainConfig
from dsl_lit.config.profiler import ProfilerConfig
from dsl_lit.training.callbacks.profiler import can_snapshot_cuda_memory
from tests.conftest import compose_config
from tests.recipe_runs import run_recipe

PROFILED = ["model=deepseek_llm_tiny", "trainer.max_steps=4", "logger=csv", "checkpoint.every_n_steps=0",
            "checkpoint.every_minutes=0", "trainer.accelerator=cpu", "profiler.enabled=true", "profiler.wait=1",
            "profiler.warmup=1", "profiler.active=2"]


def event_names(trace: Path) -> Counter:
    """Names of the trace's events; the file must parse as Chrome trace JSON."""
    data = json.loads(trace.read_text())
    return Counter(event.get("name") for event in data["traceEvents"])


def assert_training_steps(names: Counter, steps: list[int]) -> None:
    assert {f"ProfilerStep#{s}" for s in steps} <= set(names), sorted(n for n in names if "ProfilerStep" in str(n))
    assert names["aten::mm"] > 0  # the projections, forward and backward
    assert any(str(n).startswith("autograd::engine::evaluate_function: MmBackward") for n in names)
    assert any("Optimizer.step" in str(n) for n in names)


@pytest.mark.slow
def test_one_process_trace_with_memory(tmp_path: Path) -> None:
    run_recipe(tmp_path, *PROFILED, "profiler.profile_memory=true")
    traces = sorted((tmp_path / "profiler").iterdir())
    assert [t.name for t in traces] == ["trace_rank0_step4.json"]  # wait 1 + warmup 1 + active 2
    names = event_names(traces[0])
    assert_training_steps(names, [2, 3])
    assert "ProfilerStep#1" not in names  # the warmup step is recorded, then discarded
    assert names["[memory]"] > 0  # profile_memory: allocations and frees


@pytest.mark.slow
def test_two_processes_write_one_trace_each(tmp_path: Path) -> None:
    run_recipe(tmp_path, *PROFILED, "trainer.devices=2")
    traces = sorted(p.name for p in (tmp_path / "profiler").iterdir())
    assert traces == ["trace_rank0_step4.json", "trace_rank1_step4.json"]
    for name in traces:
        names = event_names(tmp_path / "profiler" / name)
        assert_training_steps(names, [2, 3])
        assert any("all_reduce" in str(n) or "allreduce" in str(n) for n in names)  # the gradient reduction


def test_profiler_config_errors() -> None:
    with pytest.raises(ConfigError, match="profiler.active=0 must be >= 1"):
        ProfilerConfig(active=0).validate()
    with pytest.raises(ConfigError, match="profiler.wait=-1 must be >= 0"):
        ProfilerConfig(wait=-1).validate()
    with pytest.raises(ConfigError, match=r"profiler.wait\+warmup\+active=13 exceeds trainer.max_steps=4"):
        TrainConfig.from_hydra(compose_config(overrides=["profiler.enabled=true", "profiler.wait=10",
                                                         "trainer.max_steps=4"]))
    cfg = TrainConfig.from_hydra(compose_config(overrides=["profiler.enabled=true"]))
    assert cfg.profiler.steps_per_cycle == 4 and not can_snapshot_cuda_memory(torch.device("cpu"))
