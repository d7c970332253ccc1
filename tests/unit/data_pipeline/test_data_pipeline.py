"""Pipeline mechanics: inputs and quarantine, accounting, determinism, kill-and-rerun, scheduler tasks, config."""

from __future__ import annotations

import gzip
import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import datasets
import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

import data_pipeline.stages.quality_filter as quality_filter
from data_contract.errors import ConfigError
from data_pipeline import registry
from data_pipeline.config import load_config
from data_pipeline.document_step import Verdicts, write_split
from data_pipeline.io.shards import read_documents, shard_file
from data_pipeline.runner import plan, run
from data_pipeline.stage import Stage, Step
from tests.conftest import scratch_dir
from tests.forked_python import run_python

ROOT = Path(__file__).resolve().parents[3]
STAGES = ["normalize", "exact_dedup", "near_dedup", "quality_filter"]


def _doc(i: int) -> str:
    """Eight sentences of random words (with stop words): passes every default quality rule."""
    rng = np.random.default_rng(i)
    words = ["".join(rng.choice(list("abcdefghijklmnop"), size=rng.integers(3, 9))) for _ in range(80)]
    return " ".join(f"The {' '.join(words[k * 10 : k * 10 + 8])} and {words[k * 10 + 9]}." for k in range(8))


@pytest.fixture(scope="module")
def messy_input(request: pytest.FixtureRequest) -> Path:
    """jsonl, gzipped jsonl (truncated), txt files, parquet and broken records: 25 documents in all."""
    root = scratch_dir(request, "messy") / "in"
    (root / "txt" / "sub").mkdir(parents=True)
    lines = [json.dumps({"id": f"j{i}", "text": _doc(i), "source": "web"}).encode() for i in range(8)]
    lines[2] = b'{"id": "broken", "text": "no closing brace"'
    lines[3] = json.dumps({"id": "j3", "body": "text under another key"}).encode()
    lines[4] = b'{"id": "j4", "text": "bad byte \xff here"}'
    lines[5] = b"[1, 2, 3]"
    lines.append(json.dumps({"text": _doc(1)}).encode())  # no id (and an exact duplicate of j1's text)
    (root / "a.jsonl").write_bytes(b"\n".join(lines) + b"\n\n")
    whole = gzip.compress(
        b"".join(json.dumps({"id": f"g{i}", "text": _doc(10 + i)}).encode() + b"\n" for i in range(5))
    )
    (root / "b.jsonl.gz").write_bytes(whole[: len(whole) - 12])  # cut off: the last records are lost
    (root / "txt" / "one.txt").write_text(_doc(20) + "\r\n\r\n\r\n\r\nWith   extra   spaces.  ")
    (root / "txt" / "sub" / "two.txt").write_text(_doc(21))
    (root / "txt" / "bad.txt").write_bytes(b"latin-1 \xe9t\xe9")
    table = pa.table(
        {"id": ["p0", "p1", None], "text": [_doc(30), "", _doc(31)], "source": ["books", "books", None]}
    )
    pq.write_table(table, root / "c.parquet")
    return root


def run_pipeline(input_path: Path, output_dir: Path, **overrides) -> dict | None:
    values = {
        "input": {"path": str(input_path)},
        "output_dir": str(output_dir),
        "stages": STAGES,
        **overrides,
    }
    return run(load_config(values))


def rows(directory: Path) -> list[dict]:
    return [r for f in sorted(directory.glob("*.parquet")) for r in pq.read_table(f).to_pylist()]


def output_bytes(output_dir: Path) -> dict[str, bytes]:
    return {
        str(p.relative_to(output_dir)): p.read_bytes()
        for sub in ("kept", "removed", "tokenizer", "shards")
        for p in sorted((output_dir / sub).rglob("*"))
        if p.is_file()
    }


@pytest.fixture(scope="module")
def messy_run(messy_input: Path, request: pytest.FixtureRequest) -> Path:
    out = scratch_dir(request, "messy_out") / "out"
    assert run_pipeline(messy_input, out) is not None
    return out


def test_malformed_records_are_quarantined_and_counted(messy_run: Path) -> None:
    removed = {r["id"]: r for r in rows(messy_run / "removed")}
    stats = json.loads((messy_run / "stats.json").read_text())
    ingest = stats["stages"]["ingest"]
    assert ingest["removed"] == {
        "bad_json": 1,
        "empty_text": 1,
        "invalid_utf8": 2,
        "missing_text": 1,
        "not_an_object": 1,
        "truncated_file": 1,
    }
    assert removed["a.jsonl:3"]["reason"] == "bad_json" and removed["a.jsonl:3"]["stage"] == "ingest"
    assert removed["j3"]["reason"] == "missing_text"
    assert removed["a.jsonl:5"]["reason"] == "invalid_utf8" and "\ufffd" in removed["a.jsonl:5"]["text"]
    assert removed["txt/bad.txt"]["reason"] == "invalid_utf8"
    assert removed["p1"]["reason"] == "empty_text"
    assert ingest["blank_lines_skipped"] == 1
    assert (
        removed["a.jsonl:9"]["reason"] == "exact_duplicate" and removed["a.jsonl:9"]["duplicate_of"] == "j1"
    )


def test_every_document_is_kept_or_removed_exactly_once(messy_run: Path) -> None:
    kept = rows(messy_run / "kept")
    removed = rows(messy_run / "removed")
    stats = json.loads((messy_run / "stats.json").read_text())
    assert (
        stats["input"]["documents"]
        == len(kept) + len(removed)
        == stats["output"]["documents"] + stats["output"]["removed"]
    )
    ids = [r["id"] for r in kept + removed]
    assert len(ids) == len(set(ids))
    assert {"c.parquet:2", "txt/one.txt", "txt/sub/two.txt"} <= {r["id"] for r in kept}
    sources = {r["id"]: r["source"] for r in kept}
    assert sources["txt/sub/two.txt"] == "txt" and sources["c.parquet:2"] == "c" and sources["p0"] == "books"
    one = next(r["text"] for r in kept if r["id"] == "txt/one.txt")
    assert "\r" not in one and "  " not in one and "\n\n\n" not in one and not one.endswith(" ")
    for name in STAGES:
        assert stats["stages"][name]["seconds"] >= 0 and "bytes_in" in stats["stages"][name]


def test_saved_dataset_input_is_cut_into_shards(tmp_path: Path) -> None:
    datasets.Dataset.from_dict({"text": [_doc(i) for i in range(7)]}).save_to_disk(str(tmp_path / "saved"))
    run(
        load_config(
            {
                "input": {"path": str(tmp_path / "saved"), "rows_per_shard": 3},
                "output_dir": str(tmp_path / "o"),
                "stages": ["normalize"],
            }
        )
    )
    assert sorted(p.name for p in (tmp_path / "o" / "kept").iterdir()) == [
        f"shard-0000{i}.parquet" for i in range(3)
    ]
    assert [r["id"] for r in rows(tmp_path / "o" / "kept")][:2] == ["saved:0", "saved:1"]


def test_same_input_same_bytes_whatever_num_proc(messy_input: Path, messy_run: Path, tmp_path: Path) -> None:
    assert run_pipeline(messy_input, tmp_path / "again", num_proc=2) is not None
    assert output_bytes(tmp_path / "again") == output_bytes(messy_run)


def test_killed_run_reruns_only_the_missing_units(
    messy_input: Path, messy_run: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    calls: list[int] = []
    killed: list[int] = []
    original = quality_filter.run_unit

    def dies_on_shard_2(ctx, unit):
        calls.append(unit)
        if unit == 2 and not killed:
            killed.append(unit)
            raise SystemExit("killed")
        return original(ctx, unit)

    monkeypatch.setattr(quality_filter, "run_unit", dies_on_shard_2)
    with pytest.raises(SystemExit):
        run_pipeline(messy_input, tmp_path / "out")
    assert calls == [0, 1, 2] and not (tmp_path / "out" / "kept").exists()
    step = next(
        p
        for p in plan(
            load_config(
                {"input": {"path": str(messy_input)}, "output_dir": str(tmp_path / "out"), "stages": STAGES}
            )
        )
        if p.step.name == "quality_filter"
    )
    (step.context.step_dir / ".shard-00002.parquet.tmp-left-by-the-kill").write_bytes(b"partial")
    calls.clear()
    assert run_pipeline(messy_input, tmp_path / "out") is not None
    assert calls == [2, 3]  # finished shards are not redone
    assert output_bytes(tmp_path / "out") == output_bytes(messy_run)


def test_scheduler_tasks_one_step_at_a_time(messy_input: Path, messy_run: Path, tmp_path: Path) -> None:
    """As a SLURM array would run it: each step as 3 tasks (in any order), one step after another."""
    base = {"input": {"path": str(messy_input)}, "output_dir": str(tmp_path / "out"), "stages": STAGES}
    steps = [p.step.name for p in plan(load_config(base))]
    with pytest.raises(RuntimeError, match="needs ingest complete first"):
        run(load_config({**base, "step": "normalize"}))
    for name in steps:
        for task in (2, 0, 1):
            run(load_config({**base, "step": name, "task_index": task, "task_count": 3}))
    assert output_bytes(tmp_path / "out") == output_bytes(messy_run)
    assert (tmp_path / "out" / "stats.json").is_file()


@pytest.mark.parametrize(
    ("override", "message"),
    [
        ({"near_dedup": {"threshold": 1.5}}, "near_dedup.threshold"),
        ({"stages": ["normalize", "dedupe"]}, "unknown stage"),
        ({"stages": ["tokenize_pack", "normalize"]}, "must come last"),
        (
            {"quality_filter": {"c4": {"min_sentences": 3}}},
            "quality_filter.c4.min_sentences is not a known field",
        ),
        ({"near_dedup": {"bands": 20}}, "near_dedup.bands and near_dedup.rows go together"),
        ({"task_count": 4}, "task_count > 1 needs step"),
        ({"stages": ["remix"]}, "remix"),
    ],
)
def test_bad_config_fails_early_naming_the_field(override: dict, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        load_config({"input": {"path": "x"}, "output_dir": "y", **override})


def test_command_line(messy_input: Path, tmp_path: Path) -> None:
    cmd = [
        sys.executable,
        "-m",
        "data_pipeline",
        f"input.path={messy_input}",
        f"output_dir={tmp_path / 'cli'}",
    ]
    bad = run_python([*cmd, "near_dedup.verify=maybe"], cwd=ROOT)
    assert bad.returncode == 2 and "near_dedup.verify" in bad.stderr + bad.stdout
    ok = run_python([*cmd, "stages=[normalize,exact_dedup,language_filter]", "quality_filter=bundled"], cwd=ROOT)
    assert ok.returncode == 0, ok.stderr
    stats = json.loads((tmp_path / "cli" / "stats.json").read_text())
    assert set(stats["stages"]) == {"ingest", "normalize", "exact_dedup", "language_filter", "finalize"}


@pytest.mark.slow
def test_sigkill_then_the_same_command_finishes_only_the_rest(tmp_path: Path) -> None:
    """A real SIGKILL of the command while the quality filter is half done: the same command again
    reruns only the unfinished units and writes the bytes of an uninterrupted run."""
    corpus = tmp_path / "in"
    corpus.mkdir()
    for shard in range(6):
        lines = [json.dumps({"id": f"s{shard}-{i}", "text": _doc(shard * 1000 + i)}) for i in range(150)]
        (corpus / f"part-{shard}.jsonl").write_text("\n".join(lines) + "\n")
    cmd = [sys.executable, "-m", "data_pipeline", f"input.path={corpus}", "stages=[normalize,quality_filter]"]
    full = subprocess.run([*cmd, f"output_dir={tmp_path / 'full'}"], capture_output=True, text=True, cwd=ROOT)
    assert full.returncode == 0, full.stderr
    out = tmp_path / "killed"
    process = subprocess.Popen(
        [*cmd, f"output_dir={out}"], cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
    )
    deadline = time.monotonic() + 120
    while not list(out.glob("work/*quality_filter*/done/*.json")):
        assert process.poll() is None and time.monotonic() < deadline, (
            "the run ended before the filter started"
        )
        time.sleep(0.005)
    process.send_signal(signal.SIGKILL)
    process.wait()
    done = len(list(out.glob("work/*quality_filter*/done/*.json")))
    assert 0 < done < 6 and not (out / "kept").exists()
    rerun = subprocess.run([*cmd, f"output_dir={out}"], capture_output=True, text=True, cwd=ROOT)
    assert rerun.returncode == 0, rerun.stderr
    assert f"quality_filter: {6 - done} of 6 units to run" in rerun.stderr + rerun.stdout
    assert output_bytes(out) == output_bytes(tmp_path / "full")


@dataclass
class ShortConfig:
    min_words: int = 1

    def validate(self) -> ShortConfig:
        if self.min_words < 0:
            raise ConfigError(f"drop_short.min_words={self.min_words} must be >= 0")
        return self


def _drop_short(ctx, unit: int) -> dict:
    docs = read_documents(ctx.docs_dir / shard_file(unit))
    reasons = [None if len(t.split()) >= ctx.config.min_words else "too_short" for t in docs["text"]]
    return write_split(ctx, unit, docs, Verdicts(reasons))


class DropShort(Stage):
    name = "drop_short"
    Config = ShortConfig

    def steps(self) -> list[Step]:
        return [self.step(_drop_short, writes_documents=True)]


def test_a_new_stage_is_a_class_and_a_registry_entry(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """What data_pipeline/README.md says adding a stage takes: the class, and its line in STAGES."""
    monkeypatch.setitem(registry.STAGES, "drop_short", DropShort)
    corpus = tmp_path / "in"
    corpus.mkdir()
    texts = [" ".join(["word"] * n) for n in (3, 12, 7, 20)]
    (corpus / "a.jsonl").write_text(
        "".join(json.dumps({"id": f"d{i}", "text": t}) + "\n" for i, t in enumerate(texts))
    )
    with pytest.raises(ConfigError, match=r"drop_short\.min_words=-1"):
        run_pipeline(corpus, tmp_path / "bad", stages=["drop_short"], drop_short={"min_words": -1})
    stats = run_pipeline(
        corpus, tmp_path / "out", stages=["normalize", "drop_short"], drop_short={"min_words": 10}
    )
    assert stats is not None
    assert sorted(r["id"] for r in rows(tmp_path / "out" / "kept")) == ["d1", "d3"]
    assert stats["stages"]["drop_short"]["removed"] == {"too_short": 2}
    assert [(r["id"], r["stage"]) for r in rows(tmp_path / "out" / "removed")] == [
        ("d0", "drop_short"),
        ("d2", "drop_short"),
    ]


ENGLISH = (
    "river stone light house garden morning winter music letter window people mountain bread story "
    "friend evening road table summer water forest village teacher market country family"
).split()


def _english_doc(i: int) -> str:
    """Eight sentences of common English words: kept by every default filter, the language one included."""
    rng = np.random.default_rng(i)
    return " ".join(
        f"The {' '.join(rng.choice(ENGLISH, size=8))} and the {rng.choice(ENGLISH)}." for _ in range(8)
    )


def test_every_stage_accepts_empty_shards(tmp_path: Path) -> None:
    """b.jsonl repeats a.jsonl under new ids (exact dedup empties its shard) and c.jsonl holds only
    malformed lines (ingest leaves nothing): every later stage, remix and the tokenizer stages
    included, runs on the empty shards, and the same command runs again."""
    corpus = tmp_path / "in"
    corpus.mkdir()
    texts = [_english_doc(i) for i in range(6)]
    for name, prefix in (("a.jsonl", "a"), ("b.jsonl", "b")):
        lines = [json.dumps({"id": f"{prefix}{i}", "text": t}) for i, t in enumerate(texts)]
        (corpus / name).write_text("\n".join(lines) + "\n")
    (corpus / "c.jsonl").write_text('{"id": "c0", "text": \n[1, 2]\n{"id": "c2"}\n')
    stages = [*STAGES, "language_filter", "remix", "train_tokenizer", "tokenize_pack"]
    overrides = {
        "stages": stages,
        "near_dedup": {"save_index": True},
        "remix": {"targets": {"a": 1.0}},
        "tokenizer": {"vocab_size": 300, "padded_vocab_size": None, "max_bytes": None},
    }
    stats = run_pipeline(corpus, tmp_path / "out", **overrides)
    assert stats is not None
    assert stats["stages"]["ingest"]["removed"] == {"bad_json": 1, "missing_text": 1, "not_an_object": 1}
    assert stats["stages"]["exact_dedup"]["removed"] == {"exact_duplicate": 6}
    kept = [pq.read_table(p) for p in sorted((tmp_path / "out" / "kept").glob("*.parquet"))]
    assert [t.num_rows for t in kept] == [6, 0, 0]
    assert all(t.schema.equals(kept[0].schema) for t in kept)  # one schema, language columns included
    assert (
        stats["output"]["documents"] == 6
        and stats["stages"]["tokenize_pack"]["details"]["tokenize_pack.merge"]["documents"] == 6
    )
    before = output_bytes(tmp_path / "out")
    assert run_pipeline(corpus, tmp_path / "out", **overrides) is not None
    assert output_bytes(tmp_path / "out") == before


# -- output_dir belongs to the pipeline -------------------------------------------------------------
def _files(directory: Path) -> dict[str, bytes]:
    return {p.relative_to(directory).as_posix(): p.read_bytes() for p in directory.rglob("*") if p.is_file()}


def test_an_unrelated_output_dir_is_refused_and_left_as_it_was(messy_input: Path, tmp_path: Path) -> None:
    out = tmp_path / "mine"
    mine = {
        "kept/important.parquet": b"PAR1 not ours",
        "removed/x.txt": b"keep me",
        "stats.json": b"{}",
        "shards/shard-00000.bin": b"\x00\x01",
        "tokenizer/tokenizer.json": b"{}",
    }
    for rel, data in mine.items():
        (out / rel).parent.mkdir(parents=True, exist_ok=True)
        (out / rel).write_bytes(data)
    with pytest.raises(
        ConfigError, match=r"output_dir=.*mine is not empty and holds no \.data_pipeline\.json"
    ):
        run_pipeline(messy_input, out)
    assert _files(out) == mine
    cli = run_python([sys.executable, "-m", "data_pipeline", f"input.path={messy_input}", f"output_dir={out}"], cwd=ROOT)
    assert cli.returncode == 2 and "output_dir=" in cli.stdout + cli.stderr
    assert {k: v for k, v in _files(out).items() if not k.startswith("logs/")} == mine  # Hydra's log only


def test_output_dir_inside_the_input_is_refused(messy_input: Path) -> None:
    with pytest.raises(ConfigError, match=r"output_dir=.*/out lies inside the input"):
        run_pipeline(messy_input, messy_input / "txt" / "out")
    assert not (messy_input / "txt" / "out").exists()


def test_an_empty_or_marked_output_dir_is_the_pipelines(tmp_path: Path) -> None:
    corpus = tmp_path / "in"
    corpus.mkdir()
    (corpus / "a.jsonl").write_text(json.dumps({"id": "a", "text": _doc(0)}) + "\n")
    out = tmp_path / "out"
    out.mkdir()
    assert run_pipeline(corpus, out, stages=["normalize"]) is not None  # empty: claimed
    assert (out / ".data_pipeline.json").is_file()
    (out / "stats.json").unlink()
    assert run_pipeline(corpus, out, stages=["normalize"]) is not None  # marked: the pipeline's own
    (out / ".data_pipeline.json").unlink()  # as written before the marker existed: work/ of step dirs
    assert run_pipeline(corpus, out, stages=["normalize"]) is not None
    assert (out / ".data_pipeline.json").is_file()


def test_an_edit_keeping_size_and_mtime_is_not_taken_for_finished_work(tmp_path: Path) -> None:
    """Inputs within input.fingerprint_bytes are identified by content; beyond it (here 0) only by
    size and mtime, which such an edit keeps (the documented trade-off)."""
    corpus = tmp_path / "in"
    corpus.mkdir()
    path = corpus / "a.jsonl"
    path.write_text(json.dumps({"id": "a", "text": "The first version of the page."}) + "\n")

    def edit_keeping_size_and_mtime(old: str, new: str) -> None:
        st = path.stat()
        path.write_text(path.read_text().replace(old, new))
        os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))
        assert (path.stat().st_size, path.stat().st_mtime_ns) == (st.st_size, st.st_mtime_ns)

    def kept_text(out: Path, **input_cfg) -> str:
        run(
            load_config(
                {"input": {"path": str(corpus), **input_cfg}, "output_dir": str(out), "stages": ["normalize"]}
            )
        )
        return rows(out / "kept")[0]["text"]

    assert kept_text(tmp_path / "out") == "The first version of the page."
    edit_keeping_size_and_mtime("first", "FIRST")
    assert kept_text(tmp_path / "out") == "The FIRST version of the page."
    assert kept_text(tmp_path / "by_stat", fingerprint_bytes=0) == "The FIRST version of the page."
    edit_keeping_size_and_mtime("FIRST", "final")
    assert kept_text(tmp_path / "by_stat", fingerprint_bytes=0) == "The FIRST version of the page."


@pytest.mark.parametrize("umask", [0o022, 0o027])
def test_written_files_follow_the_umask(tmp_path: Path, umask: int) -> None:
    """kept/, removed/, stats.json, the tokenizer, the shards, the index and the work files get
    0o666 & ~umask (directories 0o777 & ~umask), not a temporary file's private 0o600."""
    corpus = tmp_path / "in"
    corpus.mkdir()
    (corpus / "a.jsonl").write_text(
        "".join(json.dumps({"id": f"a{i}", "text": _english_doc(i)}) + "\n" for i in range(3))
    )
    previous = os.umask(umask)
    try:
        stats = run_pipeline(
            corpus,
            tmp_path / "out",
            stages=["normalize", "near_dedup", "train_tokenizer", "tokenize_pack"],
            near_dedup={"save_index": True},
            tokenizer={"vocab_size": 300, "padded_vocab_size": None, "max_bytes": None},
        )
    finally:
        os.umask(previous)
    assert stats is not None
    paths = list((tmp_path / "out").rglob("*"))
    wrong = {
        str(p.relative_to(tmp_path / "out")): oct(p.stat().st_mode & 0o777)
        for p in paths
        if p.stat().st_mode & 0o777 != (0o777 if p.is_dir() else 0o666) & ~umask
    }
    assert wrong == {}
    names = {p.relative_to(tmp_path / "out").as_posix() for p in paths}
    assert {"stats.json", "kept/shard-00000.parquet", "tokenizer/tokenizer.json", "shards/meta.json"} <= names


def test_documents_over_max_doc_bytes_are_set_aside_as_too_large(tmp_path: Path) -> None:
    corpus = tmp_path / "in"
    corpus.mkdir()
    big = "word " * 4000  # 20,000 bytes, over the 4,000 allowed
    lines = [{"id": "a1", "text": _doc(1)}, {"id": "huge", "text": big}, {"id": "a3", "text": _doc(3)}]
    (corpus / "a.jsonl").write_text("".join(json.dumps(r) + "\n" for r in lines))
    (corpus / "b.txt").write_text(big)
    pq.write_table(pa.table({"id": ["p0", "p1"], "text": [_doc(5), big]}), corpus / "c.parquet")
    stats = run_pipeline(
        corpus, tmp_path / "out", stages=["normalize"], input={"path": str(corpus), "max_doc_bytes": 4000}
    )
    assert stats is not None and stats["stages"]["ingest"]["removed"] == {"too_large": 3}
    assert sorted(r["id"] for r in rows(tmp_path / "out" / "kept")) == ["a1", "a3", "p0"]
    removed = {r["id"]: r for r in rows(tmp_path / "out" / "removed")}
    assert set(removed) == {"a.jsonl:2", "b.txt", "p1"}  # the line is never parsed: its place is its id
    assert all(r["reason"] == "too_large" and "word word word" in r["text"] for r in removed.values())
    assert [len(removed[i]["text"]) for i in ("b.txt", "p1")] == [10_000, 10_000]  # the head is kept
    with pytest.raises(ConfigError, match=r"input\.max_doc_bytes=0"):
        load_config({"input": {"path": "x", "max_doc_bytes": 0}, "output_dir": "y"})
