"""``precision=auto``: measured once per run, inherited by the ranks the run starts, and refused
when independently started ranks decide differently."""

from __future__ import annotations

import math
import os

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from data_contract.errors import ConfigError
from dsl_lit.config import TrainConfig
from dsl_lit.config.precision import PrecisionConfig
from dsl_lit.precision.auto import (
    BF16_MIN_SPEEDUP,
    DECISION_VARIABLE,
    check_ranks_agree,
    decide,
    resolve_precision,
)
from dsl_lit.precision.gemm_speed import bf16_speedup
from dsl_lit.training.build import build_trainer
from tests.conftest import compose_config
from tests.ranks import spawn


def test_the_decision_follows_the_measured_ratio():
    assert decide(BF16_MIN_SPEEDUP) == "bf16" and decide(8.5) == "bf16"
    assert decide(BF16_MIN_SPEEDUP - 1e-3) == "fp32" and decide(0.3) == "fp32"


def test_auto_measures_once_and_records_it(monkeypatch):
    monkeypatch.delenv(DECISION_VARIABLE, raising=False)
    fixed = PrecisionConfig(name="fp16").validate()
    assert resolve_precision(fixed, "cpu") is fixed and DECISION_VARIABLE not in os.environ
    resolved = resolve_precision(PrecisionConfig(name="auto").validate(), "cpu")
    name, speedup = os.environ[DECISION_VARIABLE].split()
    assert resolved.name == name == decide(float(speedup)) and float(speedup) > 0
    # a rank Lightning starts inherits the variable and does not measure again
    monkeypatch.setenv(DECISION_VARIABLE, "bf16 7.000")
    assert resolve_precision(PrecisionConfig(name="auto"), "cpu").name == "bf16"


def test_the_gemm_ratio_is_a_ratio_of_real_timings():
    """Positive and finite; its size depends on the CPU (AMX: 5-120x at small sizes, no native
    bf16: below 1), so only the decision's use of it is pinned (above)."""
    ratio = bf16_speedup("cpu", size=256, rounds=1)
    assert math.isfinite(ratio) and ratio > 0


@pytest.mark.parametrize("recorded, dtype", [("bf16 4.000", torch.bfloat16), ("fp32 0.400", None)])
def test_the_trainer_autocasts_to_the_decision(monkeypatch, tmp_path, recorded, dtype):
    monkeypatch.setenv(DECISION_VARIABLE, recorded)
    cfg = TrainConfig.from_hydra(compose_config(overrides=["precision=auto", "logger=csv"]), run_dir=str(tmp_path))
    assert cfg.precision.name == "auto"
    assert build_trainer(cfg).precision_plugin.dtype == dtype


def test_fp8_needs_bf16_not_auto():
    with pytest.raises(ConfigError, match="precision.fp8=fp8_blockwise needs bf16 on every machine"):
        TrainConfig.from_hydra(compose_config(overrides=["precision=fp8_blockwise", "precision.name=auto"]))


def _rank(rank: int, init_file: str, decisions: list[str], errors: dict) -> None:
    os.environ[DECISION_VARIABLE] = decisions[rank]
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=len(decisions))
    try:
        check_ranks_agree()
        errors[rank] = ""
    except RuntimeError as e:
        errors[rank] = str(e)
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("decisions, refused", [(["bf16 3.1", "bf16 2.9"], False), (["bf16 1.3", "fp32 1.1"], True)])
def test_ranks_that_decided_differently_stop(tmp_path, decisions, refused):
    with mp.Manager() as manager:
        errors = manager.dict()
        spawn(_rank, args=(str(tmp_path / "init"), decisions, errors), nprocs=2)
        messages = dict(errors)
    for rank in range(2):
        assert ("decided differently on different ranks" in messages[rank]) == refused, messages
