"""``precision=auto``: decided by the hardware's native bf16 (the same on every run and every rank
of one machine, no state passed between processes), and refused when ranks on different hardware
decide differently."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from data_contract.errors import ConfigError
from dsl_lit.config import TrainConfig
from dsl_lit.config.precision import PrecisionConfig
from dsl_lit.precision import auto
from dsl_lit.precision.auto import check_ranks_agree, decide, native_bf16, resolve_precision
from dsl_lit.training.build import build_trainer
from tests.conftest import compose_config
from tests.ranks import spawn


def _cpu_has(monkeypatch, amx: bool, avx512_bf16: bool) -> None:
    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: amx)
    monkeypatch.setattr(torch.cpu, "_is_avx512_bf16_supported", lambda: avx512_bf16)
    monkeypatch.setattr(auto, "_decided_here", None)  # restored after the test


@pytest.mark.parametrize("amx, avx512_bf16, native, decision", [
    (True, True, ["AMX", "AVX512-BF16"], "bf16"),   # Sapphire Rapids
    (False, True, ["AVX512-BF16"], "bf16"),         # Zen 4
    (False, False, [], "fp32"),                     # bf16 emulated
])
def test_the_decision_follows_the_instruction_set(monkeypatch, amx, avx512_bf16, native, decision):
    _cpu_has(monkeypatch, amx, avx512_bf16)
    assert native_bf16("cpu") == native and decide(native) == decision


def test_gpus_from_ampere_have_native_bf16(monkeypatch):
    for capability, decision in [((9, 0), "bf16"), ((8, 0), "bf16"), ((7, 5), "fp32")]:
        monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *_, c=capability: c)
        assert decide(native_bf16("cuda")) == decision


def test_auto_resolves_and_other_names_pass_through(monkeypatch):
    fixed = PrecisionConfig(name="fp16").validate()
    assert resolve_precision(fixed, "cpu") is fixed
    for has, name in [(True, "bf16"), (False, "fp32")]:
        _cpu_has(monkeypatch, has, has)
        resolved = resolve_precision(PrecisionConfig(name="auto").validate(), "cpu")
        assert resolved.name == name and auto._decided_here.startswith(name)
        # the same machine decides the same way however often it is asked (a resumed run)
        assert resolve_precision(PrecisionConfig(name="auto").validate(), "cpu").name == name


@pytest.mark.parametrize("has_native, dtype", [(True, torch.bfloat16), (False, None)])
def test_the_trainer_autocasts_to_the_decision(monkeypatch, tmp_path, has_native, dtype):
    _cpu_has(monkeypatch, has_native, False)
    cfg = TrainConfig.from_hydra(compose_config(overrides=["precision=auto", "logger=csv"]), run_dir=str(tmp_path))
    assert cfg.precision.name == "auto"
    assert build_trainer(cfg).precision_plugin.dtype == dtype


def test_fp8_needs_bf16_not_auto():
    with pytest.raises(ConfigError, match="precision.fp8=fp8_blockwise needs bf16 on every machine"):
        TrainConfig.from_hydra(compose_config(overrides=["precision=fp8_blockwise", "precision.name=auto"]))


def _rank(rank: int, init_file: str, native: list[bool], errors: dict) -> None:
    torch.cpu._is_amx_tile_supported = lambda: native[rank]  # this rank's hardware
    torch.cpu._is_avx512_bf16_supported = lambda: False
    resolve_precision(PrecisionConfig(name="auto").validate(), "cpu")
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=len(native))
    try:
        check_ranks_agree()
        errors[rank] = ""
    except RuntimeError as e:
        errors[rank] = str(e)
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("native, refused", [([True, True], False), ([True, False], True)])
def test_ranks_on_different_hardware_stop(tmp_path, native, refused):
    with mp.Manager() as manager:
        errors = manager.dict()
        spawn(_rank, args=(str(tmp_path / "init"), native, errors), nprocs=2)
        messages = dict(errors)
    for rank in range(2):
        assert ("decided differently on different ranks" in messages[rank]) == refused, messages
