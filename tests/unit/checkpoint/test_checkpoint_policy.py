"""When and how checkpoints are written: the time trigger (rank 0 decides), asynchronous saves that
do not block training and still hold the weights of the moment they were taken, keep_last pruning,
and latest_checkpoint skipping incomplete or corrupt directories."""

from __future__ import annotations

import logging
import threading
import time
from pathlib import Path
from types import SimpleNamespace

import lightning as L
import pytest
import torch
from lightning.pytorch.trainer.states import TrainerFn
from torch.distributed.checkpoint import HuggingFaceStorageWriter
from torch.distributed.checkpoint.api import CheckpointException
from torch.utils.data import DataLoader

from data_contract.errors import ConfigError
from dsl_lit.checkpoint.directory import (
    DirectoryCheckpointIO,
    StepCheckpoint,
    latest_checkpoint,
    prune_checkpoints,
)
from dsl_lit.checkpoint.sharded import read_full_tensors
from dsl_lit.config import TrainConfig
from dsl_lit.config.optim import OptimConfig, ScheduleConfig
from dsl_lit.models import ModelConfig
from dsl_lit.training import PretrainModule
from dsl_lit.training.build import build_trainer
from tests.conftest import compose_config

FILES = ("shards", "trainer_state.pt", "config.yaml", "meta.json")


def _module(steps: int, optim: OptimConfig | None = None, schedule: ScheduleConfig | None = None) -> PretrainModule:
    cfg = ModelConfig.from_name("deepseek_llm_tiny", vocab_size=128, n_layers=2, d_model=64, n_heads=4,
                                n_kv_heads=2, ffn_hidden=96)
    return PretrainModule(cfg, optim or OptimConfig(lr=1e-2), schedule or ScheduleConfig(name="constant", warmup_steps=0),
                          micro_batch_size=8, total_steps=steps)


def _batches(steps: int) -> list[dict[str, torch.Tensor]]:
    out = []
    for seed in range(steps):
        tokens = torch.randint(0, 128, (8, 33), generator=torch.Generator().manual_seed(seed))
        out.append({"input_ids": tokens[:, :-1], "labels": tokens[:, 1:].clone()})
    return out


def _fit(steps: int, checkpoint: StepCheckpoint, io: DirectoryCheckpointIO,
         callbacks: tuple[L.Callback, ...] = ()) -> tuple[L.Trainer, PretrainModule]:
    torch.manual_seed(0)
    module = _module(steps)
    trainer = L.Trainer(accelerator="cpu", max_steps=steps, logger=False, callbacks=[*callbacks, checkpoint],
                        enable_progress_bar=False, enable_model_summary=False, use_distributed_sampler=False,
                        plugins=[io])
    trainer.fit(module, train_dataloaders=DataLoader(_batches(steps), batch_size=None))
    return trainer, module


def _listing(root: Path) -> list[str]:
    return sorted(p.name for p in root.iterdir())


@pytest.fixture
def slow_disk(monkeypatch):
    """A slow disk: every shard write first sleeps ``delay`` s or, with a ``gate``, waits until the
    gate opens (at most 30 s; ``opened`` records which). Patched where DCP writes the files."""
    disk = SimpleNamespace(delay=0.0, gate=None, opened=[])
    original = HuggingFaceStorageWriter.write_data

    def write_data(self, plan, planner):
        if disk.gate is not None:
            disk.opened.append(disk.gate.wait(timeout=30))
        time.sleep(disk.delay)
        return original(self, plan, planner)

    monkeypatch.setattr(HuggingFaceStorageWriter, "write_data", write_data)
    return disk


class RecordingIO(DirectoryCheckpointIO):
    """Records which checkpoints were already published each time ``save_checkpoint`` returned."""

    def __init__(self, **kwargs) -> None:
        super().__init__(**kwargs)
        self.published_on_return: dict[str, list[str]] = {}

    def save_checkpoint(self, checkpoint, path, storage_options=None):
        super().save_checkpoint(checkpoint, path, storage_options)
        self.published_on_return[Path(path).name] = [n for n in _listing(Path(path).parent) if n.startswith("step-")]


class Sleep(L.Callback):
    def __init__(self, seconds: float) -> None:
        self.seconds = seconds

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        time.sleep(self.seconds)


class Snapshot(L.Callback):
    """At ``at_step``, a copy of the weights and optimizer state; at ``open_at_step``, opens ``gate``.
    Checkpoint callbacks run after the others, so this sees what the save sees."""

    def __init__(self, at_step: int, open_at_step: int, gate: threading.Event) -> None:
        self.at_step, self.open_at_step, self.gate = at_step, open_at_step, gate
        self.weights: dict[str, torch.Tensor] = {}
        self.moments: dict[int, dict[str, torch.Tensor]] = {}

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if trainer.global_step == self.at_step:
            self.weights = {k: v.detach().clone() for k, v in pl_module.state_dict().items()}
            state = trainer.optimizers[0].state_dict()["state"]
            self.moments = {i: {k: v.clone() for k, v in s.items() if torch.is_tensor(v)} for i, s in state.items()}
        if trainer.global_step == self.open_at_step:
            self.gate.set()


class Boom(L.Callback):
    def __init__(self, at_step: int) -> None:
        self.at_step = at_step

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if trainer.global_step == self.at_step:
            raise RuntimeError("boom")


# -- when -----------------------------------------------------------------------------------------
@pytest.mark.parametrize("every_minutes, expected", [(0.0005, [1, 2, 3, 4]), (10.0, [4])])
def test_time_trigger_fires_after_the_interval_and_not_before(tmp_path, every_minutes, expected):
    """0.0005 min = 30 ms < the 50 ms each step takes here: every step saves. With 10 min only the
    final step is saved (it always is)."""
    checkpoint = StepCheckpoint(tmp_path, every_n_steps=0, every_minutes=every_minutes)
    _fit(4, checkpoint, DirectoryCheckpointIO(async_save=True), callbacks=(Sleep(0.05),))
    assert _listing(tmp_path) == sorted(f"step-{n}" for n in expected)


def _fake_trainer(step: int, broadcast_answer: bool, calls: list) -> SimpleNamespace:
    def broadcast(obj, src=0):
        calls.append((obj, src))
        return broadcast_answer

    return SimpleNamespace(fast_dev_run=False, state=SimpleNamespace(fn=TrainerFn.FITTING), sanity_checking=False,
                           global_step=step, strategy=SimpleNamespace(broadcast=broadcast), world_size=1,
                           received_sigterm=False)


def test_time_decision_is_rank_zeros_broadcast(tmp_path):
    """Every rank asks rank 0 (broadcast from src 0) and follows its answer, whatever its own clock
    says; the step trigger needs no collective (every rank computes the same)."""
    checkpoint = StepCheckpoint(tmp_path, every_n_steps=10, every_minutes=1.0)
    calls: list = []
    checkpoint._last_save_time = time.monotonic() - 120  # this rank's clock: due
    assert not checkpoint.save_due(_fake_trainer(7, False, calls))  # rank 0's: not yet
    assert calls == [(True, 0)]
    checkpoint._last_save_time = time.monotonic()  # this rank's clock: not due
    assert checkpoint.save_due(_fake_trainer(7, True, calls))  # rank 0's: due
    calls.clear()
    assert checkpoint.save_due(_fake_trainer(20, False, calls)) and calls == []  # step trigger, no collective
    assert not StepCheckpoint(tmp_path, every_n_steps=10).save_due(_fake_trainer(7, True, calls)) and calls == []


# -- how: asynchronous, consistent ----------------------------------------------------------------
def test_sync_save_blocks_training_for_the_whole_write(tmp_path, slow_disk):
    slow_disk.delay = 0.8
    checkpoint = StepCheckpoint(tmp_path, every_n_steps=3)
    _fit(4, checkpoint, DirectoryCheckpointIO(async_save=False))
    assert min(checkpoint.save_durations) >= 0.8
    assert _listing(tmp_path) == ["step-3", "step-4"]


def test_async_save_returns_before_the_write_and_keeps_the_weights_of_its_step(tmp_path, slow_disk):
    """The write of step-3 cannot start before training has reached step 5 (the gate): so the save
    returned at once, and steps 4 and 5 stepped the weights and moments in place meanwhile."""
    gate = threading.Event()
    slow_disk.gate = gate
    io = RecordingIO(async_save=True)
    checkpoint = StepCheckpoint(tmp_path, every_n_steps=3)
    snapshot = Snapshot(at_step=3, open_at_step=5, gate=gate)
    _, module = _fit(5, checkpoint, io, callbacks=(snapshot,))

    assert slow_disk.opened[0], "the save of step 3 blocked training"
    assert io.published_on_return["step-3"] == []  # returned before its write completed ...
    assert io.published_on_return["step-5"] == ["step-3"]  # ... and the next save waited for it first
    assert _listing(tmp_path) == ["step-3", "step-5"]
    for name in ("step-3", "step-5"):
        assert sorted(p.name for p in (tmp_path / name).iterdir()) == sorted(FILES)

    # step 3's weights and AdamW moments, although steps 4 and 5 changed them in place meanwhile
    saved = read_full_tensors(tmp_path / "step-3" / "shards")
    weights = {k.removeprefix("state_dict/"): v for k, v in saved.items() if k.startswith("state_dict/")}
    assert weights.keys() == snapshot.weights.keys()
    for name, value in snapshot.weights.items():
        torch.testing.assert_close(weights[name], value, rtol=0, atol=0, msg=name)
    final_weights = module.state_dict()
    assert any(not torch.equal(final_weights[k], v) for k, v in snapshot.weights.items())
    for index, moments in snapshot.moments.items():
        for key, value in moments.items():
            torch.testing.assert_close(saved[f"optimizer_states/0/state/{index}/{key}"], value, rtol=0, atol=0)


def test_an_exception_waits_for_the_save_in_flight(tmp_path, slow_disk):
    slow_disk.delay = 0.5
    with pytest.raises(RuntimeError, match="boom"):
        _fit(6, StepCheckpoint(tmp_path, every_n_steps=3), DirectoryCheckpointIO(async_save=True),
             callbacks=(Boom(at_step=4),))
    assert _listing(tmp_path) == ["step-3"]  # published by teardown; no temporary directory left
    assert latest_checkpoint(tmp_path) == tmp_path / "step-3"


def test_a_failed_write_raises_and_leaves_no_directory(tmp_path, monkeypatch):
    def disk_full(self, plan, planner):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(HuggingFaceStorageWriter, "write_data", disk_full)
    io = DirectoryCheckpointIO(async_save=True)
    io.save_checkpoint({"state_dict": {"w": torch.ones(2)}, "global_step": 1}, tmp_path / "step-1")
    with pytest.raises(CheckpointException, match="No space left"):  # DCP reports every rank's error
        io.wait()
    io.teardown()
    assert _listing(tmp_path) == []
    with pytest.raises(Exception):  # noqa: B017  (pickling errors differ by Python version)
        io.save_checkpoint({"global_step": 2, "unpicklable": lambda: 0}, tmp_path / "step-2")
    assert _listing(tmp_path) == []


# -- keep_last ------------------------------------------------------------------------------------
@pytest.mark.parametrize("async_save", [True, False])
def test_keep_last_leaves_the_newest_complete_dirs(tmp_path, async_save):
    (tmp_path / ".tmp-step-99").mkdir(parents=True)  # leftovers of an interrupted run are swept
    (tmp_path / ".removing-step-1-0123abcd").mkdir()
    (tmp_path / "step-0").mkdir()  # incomplete: not counted, not removed (latest_checkpoint skips it)
    _fit(5, StepCheckpoint(tmp_path, every_n_steps=1), DirectoryCheckpointIO(async_save=async_save, keep_last=2))
    assert _listing(tmp_path) == ["step-0", "step-4", "step-5"]


def _fake_checkpoint(path: Path) -> None:
    (path / "shards").mkdir(parents=True)
    for name in FILES[1:]:
        (path / name).write_text("{}")


def test_prune_never_removes_the_checkpoint_just_written(tmp_path):
    for step in (10, 20, 30):
        _fake_checkpoint(tmp_path / f"step-{step}")
    _fake_checkpoint(tmp_path / "step-5")  # written last, e.g. after resuming from an older step
    removed = prune_checkpoints(tmp_path, 2, keep=tmp_path / "step-5")
    assert sorted(p.name for p in removed) == ["step-10", "step-20"]
    assert _listing(tmp_path) == ["step-30", "step-5"]
    assert prune_checkpoints(tmp_path, 0) == [] and prune_checkpoints(tmp_path, None) == []


# -- latest_checkpoint ----------------------------------------------------------------------------
def test_latest_checkpoint_skips_incomplete_and_corrupt_dirs_with_a_warning(tmp_path, caplog):
    _fit(3, StepCheckpoint(tmp_path, every_n_steps=1), DirectoryCheckpointIO(async_save=False))
    (tmp_path / ".tmp-step-9").mkdir()  # an unfinished write: ignored
    assert latest_checkpoint(tmp_path) == tmp_path / "step-3"

    (tmp_path / "step-3" / "meta.json").unlink()
    with caplog.at_level(logging.WARNING, logger="dsl_lit.checkpoint.directory"):
        assert latest_checkpoint(tmp_path) == tmp_path / "step-2"
    assert "step-3" in caplog.text and "meta.json" in caplog.text

    (shard,) = (tmp_path / "step-2" / "shards").iterdir()
    shard.write_bytes(shard.read_bytes()[: shard.stat().st_size // 2])
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="dsl_lit.checkpoint.directory"):
        assert latest_checkpoint(tmp_path) == tmp_path / "step-1"
    assert "step-2" in caplog.text and shard.name in caplog.text

    state = tmp_path / "step-1" / "trainer_state.pt"
    state.write_bytes(state.read_bytes()[: state.stat().st_size // 2])
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="dsl_lit.checkpoint.directory"):
        assert latest_checkpoint(tmp_path) is None
    assert "step-1" in caplog.text and "trainer_state.pt" in caplog.text


# -- config and wiring ----------------------------------------------------------------------------
@pytest.mark.parametrize("override, field", [
    ("checkpoint.every_minutes=-1", "checkpoint.every_minutes"),
    ("checkpoint.every_minutes=inf", "checkpoint.every_minutes"),
    ("checkpoint.keep_last=-2", "checkpoint.keep_last"),
    ("checkpoint.async_save=sometimes", "checkpoint.async_save"),
])
def test_bad_checkpoint_values_fail_naming_the_field(override, field):
    with pytest.raises(ConfigError, match=field.replace(".", r"\.")):
        TrainConfig.from_hydra(compose_config(overrides=[override]))


def test_build_trainer_wires_the_policy(tmp_path):
    cfg = TrainConfig.from_hydra(compose_config(overrides=["logger=csv", "trainer.accelerator=cpu"]), str(tmp_path))
    assert (cfg.checkpoint.every_minutes, cfg.checkpoint.async_save, cfg.checkpoint.keep_last) == (5, True, 3)
    trainer = build_trainer(cfg)
    io = trainer.strategy.checkpoint_io
    assert isinstance(io, DirectoryCheckpointIO) and io.async_save and io.keep_last == 3
    checkpoint = trainer.checkpoint_callback
    assert isinstance(checkpoint, StepCheckpoint)
    assert (checkpoint.every_n_steps, checkpoint.every_minutes) == (cfg.checkpoint.every_n_steps, 5)

    off = TrainConfig.from_hydra(compose_config(overrides=[
        "logger=csv", "trainer.accelerator=cpu", "checkpoint.every_n_steps=0", "checkpoint.every_minutes=0",
        "checkpoint.async_save=false", "checkpoint.keep_last=null"]), str(tmp_path))
    trainer = build_trainer(off)
    assert trainer.checkpoint_callback is None
    assert not trainer.strategy.checkpoint_io.async_save and trainer.strategy.checkpoint_io.keep_last is None


def test_sigterm_saves_now_with_rank_zeros_answer(tmp_path):
    """SIGTERM reaches ranks at slightly different moments: with several ranks, rank 0's flag decides
    (one broadcast per step), so every rank enters the collective save at the same step."""
    checkpoint = StepCheckpoint(tmp_path, every_n_steps=10)
    calls: list = []
    one_rank = _fake_trainer(7, False, calls)
    one_rank.received_sigterm = True
    assert checkpoint.save_due(one_rank) and calls == []
    ranks = _fake_trainer(7, True, calls)
    ranks.world_size = 2  # this rank has not seen the signal yet, rank 0 has
    assert checkpoint.save_due(ranks) and calls == [(False, 0)]
