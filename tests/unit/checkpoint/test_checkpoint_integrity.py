"""Damaged checkpoints, as disks and people damage them: bytes overwritten in place (same size), a
``trainer_state.pt`` that no longer unpickles, a tensor renamed in a shard header. Each is caught on
resume (checksums recorded in ``meta.json``, then a weights-only load), skipped with a warning
naming the file, and the previous complete checkpoint is used; with every checkpoint bad the run
stops with an error that names the directory and how to start afresh."""

from __future__ import annotations

import json
import logging
import math
import os
import re
import shutil
import stat
import struct
from pathlib import Path

import lightning as L
import pytest
import torch
import xxhash
import yaml
from torch.utils.data import DataLoader

from data_contract.errors import ConfigError
from dsl_lit.checkpoint.config_drift import check_config_drift
from dsl_lit.checkpoint.directory import (
    DirectoryCheckpointIO,
    StepCheckpoint,
    latest_checkpoint,
    prune_checkpoints,
)
from dsl_lit.checkpoint.integrity import checksum_problem
from dsl_lit.checkpoint.reader import find_checkpoint
from dsl_lit.checkpoint.resume import check_resume, resume_checkpoint
from dsl_lit.checkpoint.sharded import read_full_tensors
from dsl_lit.config import CheckpointConfig, ModelConfig, TrainConfig
from dsl_lit.config.optim import OptimConfig, ScheduleConfig
from dsl_lit.hf import save_pretrained
from dsl_lit.models import build_model
from dsl_lit.optim.schedules import cosine_multiplier
from dsl_lit.parallel.strategy import DeepSeekStrategy
from tests.conftest import compose_config, scratch_dir
from tests.recipe_runs import losses, metric, run_recipe
from tests.unit.checkpoint.test_checkpoint_policy import _batches, _module

HEAD = "state_dict/model.output.weight"


# -- damaging a checkpoint -------------------------------------------------------------------------
def _header(shard: Path) -> tuple[int, dict]:
    with shard.open("rb") as f:
        size = struct.unpack("<Q", f.read(8))[0]
        return size, json.loads(f.read(size))


def _shard(step_dir: Path, key: str) -> Path:
    """The shard holding ``key`` (each rank writes its own)."""
    (shard,) = [s for s in (step_dir / "shards").glob("*.safetensors") if key in _header(s)[1]]
    return shard


def nan_tensor(step_dir: Path, key: str = HEAD) -> None:
    """Overwrite the bytes of one tensor with 0xFF (a NaN in every float format): same size."""
    shard = _shard(step_dir, key)
    size, header = _header(shard)
    start, end = header[key]["data_offsets"]
    with shard.open("r+b") as f:
        f.seek(8 + size + start)
        f.write(b"\xff" * (end - start))


def rename_tensor(step_dir: Path, key: str, new_key: str) -> None:
    """Rename a tensor in the shard's header and DCP's metadata there, in place (same length, size)."""
    assert len(key) == len(new_key)
    shard = _shard(step_dir, key)
    data = shard.read_bytes()
    assert key.encode() in data
    shard.write_bytes(data.replace(key.encode(), new_key.encode()))


def scribble_state(step_dir: Path) -> None:
    """Overwrite 64 bytes inside ``trainer_state.pt``'s pickle (same size): torch's weights-only
    unpickler then fails with a message that suggests ``weights_only=False``."""
    path = step_dir / "trainer_state.pt"
    data = bytearray(path.read_bytes())
    start = data.index(b"data.pkl") + 200
    data[start:start + 64] = b"A" * 64
    path.write_bytes(bytes(data))


def forget_checksums(step_dir: Path) -> None:
    """``meta.json`` as checkpoints written before checksums were recorded have it."""
    meta = json.loads((step_dir / "meta.json").read_text())
    meta.pop("checksum", None)
    meta.pop("checksums", None)
    (step_dir / "meta.json").write_text(json.dumps(meta))


# -- training and resuming in this process ---------------------------------------------------------
class ResumedAt(L.Callback):
    """Records the step training starts at and the weights it starts from."""

    def on_train_start(self, trainer, pl_module):
        self.step = trainer.global_step
        self.weights = {k: v.detach().clone() for k, v in pl_module.state_dict().items()}


class Hyperparameters(L.Callback):
    """Each step's optimizer hyperparameters as the step uses them, and the scheduler's base lrs."""

    def __init__(self) -> None:
        self.groups: dict[int, list[dict]] = {}
        self.base_lrs: dict[int, list[float]] = {}

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        step = trainer.global_step
        self.groups[step] = [{k: v for k, v in g.items() if k != "params"} for g in trainer.optimizers[0].param_groups]
        self.base_lrs[step] = list(trainer.lr_scheduler_configs[0].scheduler.base_lrs)


def train(root: Path, steps: int, resume: Path | None = None, fall_back: bool = True,
          keep_last: int | None = None, module: L.LightningModule | None = None,
          callbacks: tuple[L.Callback, ...] = (), resolved_config: dict | None = None) -> ResumedAt:
    """A real Trainer with our one-device strategy (the recipe's), saving every 2 steps under ``root``."""
    torch.manual_seed(0)
    started = ResumedAt()
    trainer = L.Trainer(
        accelerator="cpu", strategy=DeepSeekStrategy(), max_steps=steps, logger=False,
        callbacks=[started, *callbacks, StepCheckpoint(root, every_n_steps=2)], enable_progress_bar=False,
        enable_model_summary=False, use_distributed_sampler=False,
        plugins=[DirectoryCheckpointIO(resolved_config, fall_back=fall_back, keep_last=keep_last)],
    )
    trainer.fit(module or _module(steps), train_dataloaders=DataLoader(_batches(steps), batch_size=None),
                ckpt_path=str(resume) if resume else None)
    return started


@pytest.fixture
def four_steps(tmp_path) -> Path:
    """``step-2`` and ``step-4`` of a short run."""
    train(tmp_path, 4)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step-2", "step-4"]
    return tmp_path


def _weights(step_dir: Path) -> dict[str, torch.Tensor]:
    return {k.removeprefix("state_dict/"): v for k, v in read_full_tensors(step_dir / "shards").items()
            if k.startswith("state_dict/")}


def assert_resumed_from_step_2(started: ResumedAt, root: Path) -> None:
    assert started.step == 2
    for name, value in _weights(root / "step-2").items():
        torch.testing.assert_close(started.weights[name], value, rtol=0, atol=0, msg=name)


# -- checksums ---------------------------------------------------------------------------------------
def test_meta_json_records_a_checksum_of_every_file(four_steps):
    step = four_steps / "step-4"
    meta = json.loads((step / "meta.json").read_text())
    files = sorted(str(p.relative_to(step)) for p in step.rglob("*") if p.is_file() and p.name != "meta.json")
    assert "config.yaml" in files and "trainer_state.pt" in files
    assert meta["checksum"] == "xxh3_128" and sorted(meta["checksums"]) == files == sorted(meta["files"])
    for name in files:
        assert meta["checksums"][name] == xxhash.xxh3_128((step / name).read_bytes()).hexdigest(), name


@pytest.mark.parametrize("damage, named", [
    (nan_tensor, "shards/shard-"),
    (scribble_state, "trainer_state.pt"),
    (lambda d: rename_tensor(d, HEAD, HEAD.replace("output", "outpux")), "shards/shard-"),
])
def test_a_same_size_damage_is_skipped_with_a_warning_naming_the_file(four_steps, caplog, damage, named):
    damage(four_steps / "step-4")
    with caplog.at_level(logging.WARNING):
        started = train(four_steps, 6, resume=four_steps / "step-4")
    assert_resumed_from_step_2(started, four_steps)
    warning = next(r.getMessage() for r in caplog.records if "skipping corrupt checkpoint" in r.getMessage())
    assert "step-4" in warning and named in warning and "checksum" in warning
    assert "weights_only=False" not in caplog.text


@pytest.mark.parametrize("damage, named", [
    (scribble_state, "trainer_state.pt does not load as a weights-only torch file"),
    (lambda d: rename_tensor(d, HEAD, HEAD.replace("output", "outpux")), HEAD),
])
def test_without_checksums_a_load_failure_falls_back_too(four_steps, caplog, damage, named):
    """A checkpoint written before checksums were recorded: the damage shows when it is loaded."""
    damage(four_steps / "step-4")
    forget_checksums(four_steps / "step-4")
    with caplog.at_level(logging.WARNING):
        started = train(four_steps, 6, resume=four_steps / "step-4")
    assert_resumed_from_step_2(started, four_steps)
    assert named in caplog.text
    assert "weights_only=False" not in caplog.text


def test_every_checkpoint_damaged_stops_with_an_error_naming_the_dir_and_the_fix(four_steps):
    nan_tensor(four_steps / "step-4")
    scribble_state(four_steps / "step-2")
    forget_checksums(four_steps / "step-2")
    with pytest.raises(ConfigError) as caught:
        train(four_steps, 6, resume=four_steps / "step-4")
    message = str(caught.value)
    assert str(four_steps) in message and "checkpoint.resume=false" in message
    assert "step-4: shards/" in message and "step-2: trainer_state.pt" in message
    assert "weights_only=False" not in message and caught.value.__cause__ is None


def test_a_named_checkpoint_that_is_damaged_is_an_error_not_a_fallback(four_steps):
    nan_tensor(four_steps / "step-4")
    with pytest.raises(ConfigError, match=r"step-4 cannot be resumed from: shards/shard-.*checksum"):
        train(four_steps, 6, resume=four_steps / "step-4", fall_back=False)


def test_readers_verify_checksums(four_steps, caplog):
    """The HF export, evaluation and init_from read checkpoints through ``find_checkpoint``: a run
    whose newest checkpoint was written whole and is damaged since is an error naming it and the
    older step to name instead (before: the older step silently stood in, and a reproduce stage
    trained on it); an interrupted save (no meta.json) is still skipped for the latest complete one."""
    nan_tensor(four_steps / "step-4")
    assert latest_checkpoint(four_steps) == four_steps / "step-4"  # sizes and headers only
    with caplog.at_level(logging.WARNING):
        assert latest_checkpoint(four_steps, verify=True) == four_steps / "step-2"
    assert "step-4" in caplog.text and "checksum" in caplog.text
    with pytest.raises(FileNotFoundError, match=r"its newest checkpoint step-4 is corrupt \(shards/.*checksum.*"
                                                r"checkpoint=.*step-2"):
        find_checkpoint(four_steps)
    with pytest.raises(FileNotFoundError, match="checksum"):
        find_checkpoint(four_steps / "step-4")
    assert find_checkpoint(four_steps / "step-2") == four_steps / "step-2"
    (four_steps / "step-4" / "meta.json").unlink()  # an interrupted save instead: skipped, as resuming does
    assert find_checkpoint(four_steps) == four_steps / "step-2"


# -- one directory per step, retention, all broken ---------------------------------------------------
def _listing(root: Path) -> list[str]:
    return sorted(p.name for p in root.iterdir())


@pytest.mark.parametrize("keep_last, kept", [(None, ["step-2", "step-4", "step-6"]), (2, ["step-4", "step-6"])])
def test_resaving_a_step_after_a_fallback_replaces_its_directory(four_steps, keep_last, kept):
    """Lightning's ModelCheckpoint would write ``step-4-v1`` beside the damaged ``step-4``, which
    resume ignores and retention never counts."""
    nan_tensor(four_steps / "step-4")
    assert train(four_steps, 6, resume=four_steps / "step-4", keep_last=keep_last).step == 2
    assert _listing(four_steps) == kept
    assert checksum_problem(four_steps / "step-4") is None  # the new step-4, not the damaged one
    assert json.loads((four_steps / "step-4" / "meta.json").read_text())["global_step"] == 4


def _fake_checkpoint(path: Path, *files: str) -> None:
    (path / "shards").mkdir(parents=True)
    for name in files:
        (path / name).write_text("{}")


def test_keep_last_counts_every_step_directory_we_wrote(tmp_path):
    """Ours: anything holding our meta.json, damaged or not, and the ``-v<K>`` names older versions
    made. A ``step-<N>`` without meta.json may not be ours: left alone."""
    _fake_checkpoint(tmp_path / "step-0")  # not ours
    _fake_checkpoint(tmp_path / "step-2", "trainer_state.pt", "meta.json")
    _fake_checkpoint(tmp_path / "step-3-v1", "trainer_state.pt", "meta.json")  # a re-save of step 3, long ago
    _fake_checkpoint(tmp_path / "step-4", "meta.json")  # damaged since: trainer_state.pt lost
    _fake_checkpoint(tmp_path / "step-6", "trainer_state.pt", "meta.json")
    _fake_checkpoint(tmp_path / "step-8", "trainer_state.pt", "meta.json")
    removed = prune_checkpoints(tmp_path, 2, keep=tmp_path / "step-8")
    assert sorted(p.name for p in removed) == ["step-2", "step-3-v1", "step-4"]
    assert _listing(tmp_path) == ["step-0", "step-6", "step-8"]


def test_a_run_dir_of_unusable_checkpoints_stops_unless_told_to_start_afresh(tmp_path):
    assert resume_checkpoint(CheckpointConfig(), tmp_path / "none") is None  # a first run
    _fake_checkpoint(tmp_path / "step-2", "trainer_state.pt")  # no meta.json
    _fake_checkpoint(tmp_path / "step-4", "trainer_state.pt", "meta.json")  # an empty meta.json
    with pytest.raises(ConfigError) as caught:
        resume_checkpoint(CheckpointConfig(), tmp_path)
    message = str(caught.value)
    assert str(tmp_path) in message and "checkpoint.resume=false" in message
    assert "step-2: no meta.json" in message and "step-4: meta.json does not mark it complete" in message
    assert resume_checkpoint(CheckpointConfig(resume=False), tmp_path) is None


# -- resuming with changed settings -----------------------------------------------------------------
def test_changed_optimizer_and_schedule_settings_apply_from_the_resumed_step(tmp_path):
    """Resumed at step 2 with another lr, betas, weight decay and schedule: step 2 already trains
    with them (lr = new peak x the new schedule's multiplier at step 2); the moments are the
    checkpoint's. Resumed unchanged, every value is bit for bit the uninterrupted run's."""
    before = Hyperparameters()
    train(tmp_path, 4, callbacks=(before,))
    shutil.rmtree(tmp_path / "step-4")
    unchanged = Hyperparameters()
    train(tmp_path, 4, resume=tmp_path / "step-2", callbacks=(unchanged,))
    assert unchanged.groups == {s: before.groups[s] for s in (2, 3)}
    assert unchanged.base_lrs == {s: before.base_lrs[s] for s in (2, 3)}

    optim = OptimConfig(lr=3e-2, betas=(0.8, 0.9), weight_decay=0.05, eps=1e-6)
    schedule = ScheduleConfig(name="cosine", warmup_steps=1, min_ratio=0.2)
    after = Hyperparameters()
    started = train(tmp_path, 4, resume=tmp_path / "step-2", module=_module(4, optim, schedule), callbacks=(after,))
    assert started.step == 2
    for step in (2, 3):
        decay, no_decay = after.groups[step]
        assert decay["lr"] == no_decay["lr"] == 3e-2 * cosine_multiplier(step, 4, 1, min_ratio=0.2)
        assert (decay["weight_decay"], no_decay["weight_decay"]) == (0.05, 0.0)
        assert decay["betas"] == (0.8, 0.9) and decay["eps"] == 1e-6 and decay["initial_lr"] == 3e-2
        assert after.base_lrs[step] == [3e-2, 3e-2]


def _run_config(run_dir: Path, *overrides: str) -> TrainConfig:
    return TrainConfig.from_hydra(compose_config(overrides=["model=deepseek_llm_tiny", "logger=csv", *overrides]),
                                  str(run_dir))


def _saved_checkpoint(step_dir: Path, cfg: TrainConfig) -> Path:
    """The config.yaml and meta.json a save of ``cfg``'s run writes (all the drift check reads)."""
    step_dir.mkdir(parents=True)
    (step_dir / "config.yaml").write_text(yaml.safe_dump(cfg.raw, sort_keys=False))
    (step_dir / "meta.json").write_text(json.dumps({"global_step": 4, "complete": True}))
    return step_dir


@pytest.mark.parametrize("override, key", [
    ("+model.n_layers=3", "model.n_layers"),
    ("+model.rope_theta=500000.0", "model.rope_theta"),
    ("model=deepseek_v3_tiny", "model.family"),
    ("data.tokenizer_vocab_size=4096", "data.tokenizer_vocab_size"),
])
def test_a_changed_model_or_tokenizer_is_a_config_error_naming_the_key(tmp_path, override, key):
    step = _saved_checkpoint(tmp_path / "step-4", _run_config(tmp_path))
    cfg = _run_config(tmp_path, override)
    with pytest.raises(ConfigError, match=rf"resuming .*step-4: {key}=.* but the checkpoint has"):
        check_config_drift(step, cfg.raw, cfg.model)


def test_another_optimizer_on_resume_is_a_config_error(tmp_path):
    """AdamW's moments cannot continue as Muon's momentum (nor back): refused in one line."""
    step = _saved_checkpoint(tmp_path / "step-4", _run_config(tmp_path))  # the adamw group (no optim.name)
    muon = _run_config(tmp_path, "optim=muon")
    with pytest.raises(ConfigError, match=r"optim.name='muon' but the checkpoint was trained with 'adamw'.*init_from="):
        check_config_drift(step, muon.raw, muon.model)
    trained_with_muon = _saved_checkpoint(tmp_path / "muon" / "step-4", muon)
    assert check_config_drift(trained_with_muon, muon.raw, muon.model) == {}
    with pytest.raises(ConfigError, match=r"optim.name='adamw' but the checkpoint was trained with 'muon'"):
        check_config_drift(trained_with_muon, _run_config(tmp_path).raw, muon.model)


def test_other_changes_are_listed_in_one_warning(tmp_path, caplog):
    step = _saved_checkpoint(tmp_path / "step-4", _run_config(tmp_path, "optim.lr=2e-3", "run_name=a"))
    same = _run_config(tmp_path, "optim.lr=2e-3", "run_name=b", "checkpoint.resume_from=x")
    with caplog.at_level(logging.WARNING):
        assert check_config_drift(step, same.raw, same.model) == {}
    assert caplog.text == ""
    cfg = _run_config(tmp_path, "optim.lr=1e-2", "schedule.warmup_steps=7", "trainer.max_steps=9",
                      "+model.attn_backend=eager")
    with caplog.at_level(logging.WARNING):
        changes = check_config_drift(step, cfg.raw, cfg.model)
    assert changes == {"model.attn_backend": ("sdpa", "eager"), "optim.lr": (0.002, 0.01),
                       "schedule.warmup_steps": (same.schedule.warmup_steps, 7),
                       "trainer.max_steps": (same.trainer.max_steps, 9)}
    (warning,) = [r.getMessage() for r in caplog.records]
    assert "in effect from step 4" in warning and "optim.lr: 0.002 -> 0.01" in warning


# -- checked at start-up ---------------------------------------------------------------------------------
@pytest.mark.parametrize("make, problem", [
    (lambda path: None, "no such directory"),
    (lambda path: path.write_text("x"), "is not a usable checkpoint (it is a file)"),
    (lambda path: (path / "shards").mkdir(parents=True), "is not a usable checkpoint (no meta.json)"),
])
def test_a_bad_resume_from_is_a_config_error_naming_it(tmp_path, make, problem):
    path = tmp_path / "step-3"
    make(path)
    with pytest.raises(ConfigError, match=rf"^checkpoint\.resume_from={path}:? .*{re.escape(problem)}"):
        check_resume(_run_config(tmp_path / "run", f"checkpoint.resume_from={path}"))


@pytest.mark.parametrize("named", [False, True])
def test_resuming_another_models_checkpoint_is_a_config_error_naming_the_field(tmp_path, named):
    """Its own run dir's, or one named by ``checkpoint.resume_from``: not a bare KeyError from the load."""
    checkpoints = tmp_path / "run" / "checkpoints"
    train(checkpoints, 2, resolved_config=_run_config(tmp_path / "run").raw)
    overrides = ["+model.n_layers=3", "+model.d_model=128"]
    if named:
        overrides.append(f"checkpoint.resume_from={checkpoints / 'step-2'}")
    with pytest.raises(ConfigError, match=r"model\.n_layers=3 but the checkpoint has 4; model\.d_model=128 but"):
        check_resume(_run_config(tmp_path / ("other" if named else "run"), *overrides))


# -- file modes ----------------------------------------------------------------------------------------
@pytest.fixture(params=[0o022, 0o027])
def umask(request):
    old = os.umask(request.param)
    yield request.param
    os.umask(old)


def _modes(root: Path) -> set[tuple[str, int]]:
    return {("dir" if p.is_dir() else "file", stat.S_IMODE(p.stat().st_mode)) for p in root.rglob("*")}


def test_checkpoint_files_follow_the_umask(tmp_path, umask):
    train(tmp_path, 2)
    assert _modes(tmp_path) == {("dir", 0o777 & ~umask), ("file", 0o666 & ~umask)}


@pytest.mark.parametrize("max_shard_size", ["5GB", 20_000])
def test_exported_weights_follow_the_umask(tmp_path, umask, max_shard_size):
    """safetensors' ``save_file`` creates its files ``-rw-------`` whatever the umask."""
    model = build_model(ModelConfig.from_name("deepseek_llm_tiny", n_layers=1, d_model=32, n_heads=2, n_kv_heads=1,
                                              ffn_hidden=64, vocab_size=64))
    save_pretrained(model, tmp_path / "hf", max_shard_size=max_shard_size)
    assert (len(list((tmp_path / "hf").glob("*.safetensors"))) > 1) == (max_shard_size != "5GB")
    assert _modes(tmp_path / "hf") == {("file", 0o666 & ~umask)}


# -- the recipe ---------------------------------------------------------------------------------------
TINY = ["model=deepseek_llm_tiny", "logger=csv", "trainer.accelerator=cpu", "checkpoint.every_n_steps=2",
        "checkpoint.every_minutes=0"]


@pytest.fixture(scope="module")
def recipe_run_of_4_steps(request: pytest.FixtureRequest) -> Path:
    run = scratch_dir(request, "recipe") / "run"
    run_recipe(run, *TINY, "trainer.max_steps=4")
    return run


@pytest.fixture
def four_step_run(recipe_run_of_4_steps, tmp_path) -> Path:
    """A copy of one recipe run of 4 steps (checkpoints step-2 and step-4), for a test to damage
    or resume; one run serves every test of this module."""
    return Path(shutil.copytree(recipe_run_of_4_steps, tmp_path / "run"))


@pytest.mark.slow
def test_recipe_resumes_past_a_nan_shard(four_step_run):
    """A NaN head written over step-4's shard (same size): the rerun warns naming the shard, resumes
    from step-2 and repeats steps 2 and 3 bit for bit, instead of training on NaN; step-4 is saved
    again in place (one directory per step: no step-4-v1)."""
    run = four_step_run
    first = losses(run)
    nan_tensor(run / "checkpoints" / "step-4")
    result = run_recipe(run, *TINY, "trainer.max_steps=6")
    output = result.stdout + result.stderr
    assert "skipping corrupt checkpoint" in output and "checksum" in output and "shards/shard-" in output
    resumed = losses(run)
    assert sorted(resumed) == list(range(6)) and all(resumed[s] == first[s] for s in (2, 3))
    assert all(math.isfinite(float(loss)) for loss in resumed.values())
    assert _listing(run / "checkpoints") == ["step-2", "step-4", "step-6"]
    assert checksum_problem(run / "checkpoints" / "step-4") is None


@pytest.mark.slow
def test_two_processes_agree_to_fall_back(tmp_path):
    """Two ranks, each hashing half of the files and reading its own shards: both skip the damaged
    step-4 and resume from step-2, repeating steps 2 and 3 exactly (no rank hangs in a collective)."""
    run = tmp_path / "run"
    run_recipe(run, *TINY, "trainer.devices=2", "trainer.max_steps=4")
    first = losses(run)
    assert len(list((run / "checkpoints" / "step-4" / "shards").glob("*.safetensors"))) == 2
    nan_tensor(run / "checkpoints" / "step-4")
    result = run_recipe(run, *TINY, "trainer.devices=2", "trainer.max_steps=6")
    output = result.stdout + result.stderr
    assert "skipping corrupt checkpoint" in output and "checksum" in output
    resumed = losses(run)
    assert sorted(resumed) == list(range(6)) and all(resumed[s] == first[s] for s in (2, 3))
    assert _listing(run / "checkpoints") == ["step-2", "step-4", "step-6"]


@pytest.mark.slow
def test_recipe_with_every_checkpoint_damaged_stops_until_told_to_start_afresh(four_step_run):
    run = four_step_run
    first = losses(run)
    for step in ("step-2", "step-4"):
        nan_tensor(run / "checkpoints" / step)
    result = run_recipe(run, *TINY, "trainer.max_steps=4", succeed=False)
    output = result.stdout + result.stderr
    assert f"no checkpoint under {run / 'checkpoints'} can be resumed from" in output
    assert "checkpoint.resume=false" in output and "weights_only=False" not in output
    run_recipe(run, *TINY, "trainer.max_steps=4", "checkpoint.resume=false")
    assert losses(run) == first  # from step 0 again
    assert all(checksum_problem(run / "checkpoints" / step) is None for step in ("step-2", "step-4"))


@pytest.mark.slow
def test_recipe_resumed_with_another_lr_trains_with_it_from_the_resumed_step(four_step_run):
    """The issue's case: resumed with optim.lr=1e-2 (was 3e-3), steps 4 and 5 log lr 1e-2 (the
    schedule is at its peak there), and the warning names the change."""
    run = four_step_run
    result = run_recipe(run, *TINY, "trainer.max_steps=6", "optim.lr=1e-2")
    assert "optim.lr: 0.003 -> 0.01" in result.stdout + result.stderr
    lrs = {step: float(value) for step, value in metric(run, "train/lr").items()}
    fp32 = 2**-24  # the logged lr went through a float32 tensor: rounded to 24 significant bits
    assert [lrs[s] for s in (2, 3, 4, 5)] == pytest.approx([3e-3, 3e-3, 1e-2, 1e-2], rel=fp32)


@pytest.mark.slow
@pytest.mark.parametrize("override, named", [
    ("checkpoint.resume_from=/nonexistent/step-3", "checkpoint.resume_from=/nonexistent/step-3: no such directory"),
    ("++model.n_layers=3", "model.n_layers=3 but the checkpoint has 2"),
])
def test_recipe_stops_at_start_up_naming_the_option(four_step_run, override, named):
    """Before the seed is set, so before any data preparation or model build."""
    result = run_recipe(four_step_run, *TINY, "trainer.max_steps=6", override, succeed=False)
    output = result.stdout + result.stderr
    assert result.returncode == 2 and result.stderr.startswith("error: ") and named in result.stderr  # one line
    assert "KeyError" not in output and "Traceback" not in output
    assert "Seed set to" not in output
