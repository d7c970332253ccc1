"""Inputs cut into shards by rows whatever their format, with the output of the uncut input."""

from __future__ import annotations

import gzip
import json
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

import data_pipeline.io.input_splits as input_splits
from data_pipeline.config import load_config
from data_pipeline.io.input_splits import CACHE_FILE, json_line_ranges, scan_json_lines
from data_pipeline.runner import plan, run
from data_pipeline.synthetic import planted_corpus

STAGES = ["normalize", "exact_dedup", "near_dedup"]


@pytest.fixture(scope="module")
def corpus() -> list[dict]:
    """1000 records: planted near duplicates (variants after all originals, so clusters cross
    shards), exact copies, blank and malformed lines in the middle of what become shards."""
    planted = planted_corpus(num_originals=450, words_per_doc=60, targets=[0.0, 0.9], seed=5)
    records: list[dict] = [{"id": i, "text": t} for i, t in zip(planted.ids, planted.texts)]
    records += [{"id": f"copy-{k}", "text": planted.texts[k * 2]} for k in range(1000 - len(records))]
    assert len(records) == 1000
    return records


def _lines(records: list[dict]) -> list[bytes]:
    lines = [json.dumps(r).encode() for r in records]
    lines[299] = b""  # blank: a line, not a document
    lines[301] = b'{"id": "broken", "text": '
    lines[650] = b'{"id": "bad-utf8", "text": "\xff"}'
    return lines


def write_input(kind: str, records: list[dict], directory: Path) -> Path:
    directory.mkdir(parents=True)
    if kind in ("jsonl", "jsonl.gz"):
        data = b"\n".join(_lines(records))  # no newline after the last line: still a line
        path = directory / f"web.{kind}"
        path.write_bytes(gzip.compress(data) if kind == "jsonl.gz" else data)
        return path
    if kind == "parquet":
        table = pa.table({"id": [r["id"] for r in records], "text": [r["text"] for r in records]})
        path = directory / "web.parquet"
        pq.write_table(table, path, row_group_size=128)  # ranges start and end inside row groups
        return path
    for i, r in enumerate(records):
        (directory / f"doc-{i:04d}.txt").write_text(r["text"], encoding="utf-8")
    return directory


def pipeline(input_path: Path, output_dir: Path, **overrides) -> dict:
    values = {"input": {"path": str(input_path)}, "output_dir": str(output_dir), "stages": STAGES}
    stats = run(load_config({**values, **overrides}))
    assert stats is not None
    return stats


def rows(directory: Path) -> list[dict]:
    return [r for f in sorted(directory.glob("*.parquet")) for r in pq.read_table(f).to_pylist()]


@pytest.mark.parametrize("kind", ["jsonl.gz", "jsonl", "parquet", "txt"])
def test_rows_per_shard_cuts_every_format_and_changes_no_output(
    kind: str, corpus: list[dict], tmp_path: Path
) -> None:
    path = write_input(kind, corpus, tmp_path / "in")
    whole = pipeline(path, tmp_path / "whole")
    cut = pipeline(path, tmp_path / "cut", input={"path": str(path), "rows_per_shard": 300})
    assert whole["stages"]["ingest"]["units"] == 1
    assert cut["stages"]["ingest"]["units"] == 4  # 1000 rows in 300s
    assert len(list((tmp_path / "cut" / "kept").glob("*.parquet"))) == 4
    assert rows(tmp_path / "cut" / "kept") == rows(tmp_path / "whole" / "kept")
    key = lambda r: r["id"]  # noqa: E731  (removed/ is grouped by step and shard)
    assert sorted(rows(tmp_path / "cut" / "removed"), key=key) == sorted(
        rows(tmp_path / "whole" / "removed"), key=key
    )
    assert cut["output"] == whole["output"]
    assert whole["stages"]["near_dedup"]["removed"]["near_duplicate"] >= 200
    assert whole["stages"]["exact_dedup"]["removed"]["exact_duplicate"] >= 300
    if kind.startswith("jsonl"):
        assert cut["stages"]["ingest"]["blank_lines_skipped"] == 1
        assert whole["stages"]["ingest"]["removed"] == {"bad_json": 1, "invalid_utf8": 1}


def test_a_gzip_stream_that_breaks_off_is_read_to_the_break_by_its_last_range(
    corpus: list[dict], tmp_path: Path
) -> None:
    data = gzip.compress(b"\n".join(_lines(corpus)) + b"\n")
    (tmp_path / "in").mkdir()
    path = tmp_path / "in" / "cut.jsonl.gz"
    path.write_bytes(data[: len(data) * 2 // 3])
    whole = pipeline(path, tmp_path / "whole", stages=["normalize"])
    cut = pipeline(
        path, tmp_path / "cut", input={"path": str(path), "rows_per_shard": 250}, stages=["normalize"]
    )
    assert whole["stages"]["ingest"]["removed"]["truncated_file"] == 1
    assert cut["stages"]["ingest"]["units"] > 1
    assert cut["stages"]["ingest"]["removed"] == whole["stages"]["ingest"]["removed"]
    assert rows(tmp_path / "cut" / "kept") == rows(tmp_path / "whole" / "kept")


@pytest.mark.parametrize("ending", [b"", b"\n", b"\n\n"])
def test_the_scan_finds_every_range_start_across_read_chunks(
    ending: bytes, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    rng = np.random.default_rng(0)
    lines = [b"x" * int(n) for n in rng.integers(0, 40, size=103)]
    data = b"\n".join(lines) + ending
    path = tmp_path / "a.jsonl"
    path.write_bytes(data)
    monkeypatch.setattr(input_splits, "_CHUNK", 64)  # many chunks, range starts inside and at their edges
    scan = scan_json_lines(path, every=10)
    physical = data.split(b"\n")
    if physical[-1] == b"":
        physical.pop()  # a final newline ends the last line; it starts none
    assert scan["lines"] == len(physical)
    starts = np.cumsum([0] + [len(line) + 1 for line in physical])[:-1]
    assert scan["offsets"] == starts[::10].tolist()
    ranges = json_line_ranges(scan, 10)
    assert [r["start"] for r in ranges] == list(range(0, len(physical), 10))
    assert ranges[-1]["stop"] is None and all(r["stop"] == r["start"] + 10 for r in ranges[:-1])


def test_scans_are_kept_in_the_output_dir_by_file_identity(
    corpus: list[dict], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = write_input("jsonl.gz", corpus, tmp_path / "in")
    values = {
        "input": {"path": str(path), "rows_per_shard": 300},
        "output_dir": str(tmp_path / "o"),
        "stages": [],
    }
    pipeline(path, tmp_path / "o", input=values["input"], stages=[])  # ingest only
    assert (tmp_path / "o" / CACHE_FILE).is_file()

    def no_scan(*args: object) -> None:
        raise AssertionError("scanned again")

    monkeypatch.setattr(input_splits, "scan_json_lines", no_scan)
    assert len(plan(load_config(values))[0].context.input_units) == 4  # from the kept scan
    path.write_bytes(gzip.compress(b"\n".join(json.dumps(r).encode() for r in corpus[:500])))
    monkeypatch.undo()
    assert len(plan(load_config(values))[0].context.input_units) == 2  # another file: scanned again


def test_a_filter_that_keeps_the_first_thousand_documents_of_a_shard_and_removes_a_later_one(
    tmp_path: Path,
) -> None:
    """datasets.map writes in batches of 1000: a column of only None in the first batch (every
    document kept) must still take the reason of a later removal. Shards of crawl size hit this."""
    words = "the river and the stone of a house in the garden with morning light".split()
    rng = np.random.default_rng(0)
    texts = [" ".join(rng.choice(words, size=60)) + "." for _ in range(1500)]
    texts[1200] = "the river and the stone"  # under gopher_quality.min_doc_words
    (tmp_path / "in").mkdir()
    (tmp_path / "in" / "a.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
    only_gopher = {name: {"enabled": False} for name in ("gopher_repetition", "c4", "fineweb")}
    stats = pipeline(tmp_path / "in", tmp_path / "out", stages=["quality_filter"], quality_filter=only_gopher)
    assert stats["stages"]["quality_filter"]["removed"] == {"gopher_quality:min_doc_words": 1}
    assert [r["id"] for r in rows(tmp_path / "out" / "removed")] == ["a.jsonl:1201"]
