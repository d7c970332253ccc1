"""Hydra multiruns of the training recipes: W&B runs named by the overrides the sweep varies and
grouped by sweep, and a summary table of the jobs (final loss, val loss, tokens/s) at the end."""

from __future__ import annotations

import csv
import os
import sys
from pathlib import Path

import pytest

from dsl_lit.report.sweep import SUMMARY_CSV, SUMMARY_FILE, markdown, summarize, write_summary
from dsl_lit.utils.sweep import override_keys, swept_keys
from tests.conftest import ROOT
from tests.forked_python import run_python

TINY = ["model=deepseek_llm_tiny", "+model.n_layers=1", "data.seq_len=32", "data.global_batch_size=4",
        "data.micro_batch_size=4", "data.val_windows=4", "trainer.val_every_n_steps=2", "trainer.max_steps=3",
        "trainer.log_every_n_steps=1", "trainer.progress_bar=false", "trainer.peak_tflops=1.0",
        "checkpoint.every_n_steps=0", "checkpoint.every_minutes=0", "schedule.warmup_steps=1"]


def wandb_run_record(run_dir: Path):
    """The run record (name, group, ...) of the job's offline W&B run, read from its ``run-<id>.wandb``:
    a LevelDB-style log (7-byte header, 32 KiB blocks of [crc 4, length 2, type 1, data] chunks)
    of ``wandb_internal_pb2.Record`` messages."""
    from wandb.proto import wandb_internal_pb2

    (path,) = run_dir.glob("wandb/offline-run-*/run-*.wandb")
    data, pos, pending = path.read_bytes(), 7, b""
    while pos + 7 <= len(data):
        if 32768 - pos % 32768 < 7:  # a block's tail too short for a chunk header is padding
            pos += 32768 - pos % 32768
            continue
        length, kind = int.from_bytes(data[pos + 4:pos + 6], "little"), data[pos + 6]
        pending += data[pos + 7:pos + 7 + length]
        pos += 7 + length
        if kind in (1, 4):  # FULL, LAST: a whole record
            record = wandb_internal_pb2.Record()
            record.ParseFromString(pending)
            pending = b""
            if record.WhichOneof("record_type") == "run":
                return record.run
    raise AssertionError(f"no run record in {path}")


@pytest.mark.slow
def test_a_pretrain_sweep_names_and_groups_its_wandb_runs_and_ends_with_a_summary(tmp_path):
    sweep = tmp_path / "sweeps" / "lr"
    result = run_python(
        [sys.executable, str(ROOT / "recipes" / "pretrain.py"), "-m", "optim.lr=1e-3,3e-3", *TINY,
         f"hydra.sweep.dir={sweep}"],
        cwd=ROOT, timeout=300, env={**os.environ, "WANDB_MODE": "offline", "WANDB_SILENT": "true"},
    )
    assert result.returncode == 0, result.stderr[-3000:]

    table = (sweep / SUMMARY_FILE).read_text()
    lines = table.splitlines()
    assert lines[0].split("|")[1:-1] == [" job ", " optim.lr ", " steps ", " loss   ", " val loss ", " tokens/s "]
    rows = [[c.strip() for c in line.split("|")[1:-1]] for line in lines[2:4]]
    assert [r[:3] for r in rows] == [["0", "0.001", "3"], ["1", "0.003", "3"]]  # only the swept key is a column
    with (sweep / SUMMARY_CSV).open() as f:
        saved = list(csv.DictReader(f))
    for row, job in zip(saved, ("0", "1")):  # the final losses are each job's last logged ones
        with (sweep / job / "metrics.csv").open() as f:
            logged = list(csv.DictReader(f))
        for metric in ("train/loss", "val/loss"):
            assert float(row[metric]) == float([r for r in logged if r.get(metric)][-1][metric])
        assert float(row["perf/tokens_per_s"]) > 0 and row["run_dir"] == str(sweep / job) and row["optim.lr"]
    assert lines[4].startswith("best val loss: job ")
    assert f"Sweep summary ({sweep / SUMMARY_FILE}):\n{table}" in result.stdout

    runs = [wandb_run_record(sweep / job) for job in ("0", "1")]
    assert [r.display_name for r in runs] == ["optim.lr=0.001", "optim.lr=0.003"]
    assert {r.run_group for r in runs} == {"sweeps/lr"}


def _job(sweep: Path, name: str, num: int, overrides: list[str], metrics: str | None) -> None:
    job = sweep / name
    (job / ".hydra").mkdir(parents=True)
    (job / ".hydra" / "overrides.yaml").write_text("".join(f"- {o}\n" for o in overrides))
    (job / ".hydra" / "hydra.yaml").write_text(f"hydra:\n  job:\n    num: {num}\n")
    if metrics is not None:
        (job / "metrics.csv").write_text(metrics)


def test_summary_of_jobs_finished_and_not(tmp_path):
    sweep = tmp_path / "multirun" / "x"
    header = "step,train/loss,val/loss,perf/tokens_per_s\n"
    _job(sweep, "10", 10, ["optim.lr=3e-3", "data.seq_len=64", "trainer.max_steps=4"],
         header + "0,9.0,,100\n1,8.0,8.5,300\n2,7.5,,200\n3,7.25,,250\n")
    _job(sweep, "2", 2, ["optim.lr=1e-3", "data.seq_len=64", "trainer.max_steps=4"], header + "0,9.5,,100\n1,9.1,9.2,120\n")
    _job(sweep, "3", 3, ["optim.lr=1e-2", "data.seq_len=64", "trainer.max_steps=4"], None)  # failed before logging
    jobs = summarize(sweep)
    assert [j.num for j in jobs] == [2, 3, 10]  # job order, not the directories' names
    text = markdown(jobs)
    assert text.splitlines() == [
        "| job | optim.lr | steps | loss   | val loss | tokens/s |",
        "|-----|----------|-------|--------|----------|----------|",
        "| 2   | 1e-3     | 2     | 9.1000 | 9.2000   | 110      |",
        "| 3   | 1e-2     | -     | -      | -        | -        |",
        "| 10  | 3e-3     | 4     | 7.2500 | 8.5000   | 225      |",
        "job 3: no metrics.csv (failed, still running, or logger.csv=false)",
        "best val loss: job 10 (optim.lr=3e-3), 8.5000",
    ]
    path, written = write_summary(sweep)
    assert path == sweep / SUMMARY_FILE and path.read_text() == written == text
    with (sweep / SUMMARY_CSV).open() as f:
        assert [(r["job"], r["optim.lr"], r["train/loss"], r["perf/tokens_per_s"], r["note"][:14])
                for r in csv.DictReader(f)] == [("2", "1e-3", "9.1", "110.0", ""), ("3", "1e-2", "", "", "no metrics.csv"),
                                                ("10", "3e-3", "7.25", "225.0", "")]
    assert markdown([]).endswith("no job logged a loss yet\n")


def test_swept_keys_from_the_sweeps_command_line_and_config(tmp_path):
    assert override_keys(["optim.lr=1e-3,3e-3", "+model.n_layers=1", "trainer.max_steps=3"], swept_only=True) == {
        "optim.lr": "optim.lr=1e-3,3e-3"}
    assert swept_keys(tmp_path) is None  # no multirun.yaml: unknown
    (tmp_path / "multirun.yaml").write_text(
        "hydra:\n  overrides:\n    task:\n    - optim.lr=1e-3,3e-3\n    - +model.n_layers=1,2\n    - data.seq_len=32\n")
    assert swept_keys(tmp_path, {"point": "range(3)"}) == {"optim.lr", "model.n_layers", "point"}
