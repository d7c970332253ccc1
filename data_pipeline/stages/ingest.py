"""Stage 0: raw inputs -> document shards, with every malformed record set aside and counted.

Why our own readers instead of ``datasets.load_dataset("json")``: that loader stops at the first bad
line or invalid UTF-8 byte, and one broken record must not cost a whole crawl file. Each range of
at most ``input.rows_per_shard`` rows of an input file (lines of JSON lines, rows of Parquet or of
a saved dataset; ``data_pipeline.io.input_splits``), or group of ``.txt`` files, is one unit and
becomes one shard, so the shard layout depends only on the input listing and the config.
"""

from __future__ import annotations

import dataclasses as dc
import glob
import gzip
import json
import zlib
from collections.abc import Iterator
from dataclasses import dataclass
from itertools import islice
from pathlib import Path
from typing import Any

import datasets
import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from data_contract.corpus import (
    CONTENT_BUDGET_BYTES,
    DOCUMENT_SUFFIXES,
    document_files,
    file_listing,
    listing_digest,
)
from data_contract.errors import ConfigError
from data_pipeline.context import Context
from data_pipeline.document_step import Verdicts, write_split
from data_pipeline.io.input_splits import CACHE_FILE, json_line_ranges, parquet_row_ranges, scan_all
from data_pipeline.stage import InputPlan, Phase, Stage, Step

JSONL_SUFFIXES = (".jsonl", ".jsonl.gz", ".json", ".json.gz")
SUFFIXES = DOCUMENT_SUFFIXES  # JSON lines, .txt, .parquet
KEPT_CHARS = 10_000  # of a set-aside record too large or not text: enough to recognise it


@dataclass
class InputConfig:
    path: str = (
        ""  # a directory (of .txt/.jsonl/.jsonl.gz/.parquet files), a glob, a file, or a saved dataset
    )
    text_field: str = "text"
    id_field: str = "id"  # documents without one get "<file>:<line>" (or "<file>:<row>")
    source_field: str = "source"  # copied to the `source` column; defaults to the file's name
    metadata_fields: list[str] = dc.field(default_factory=list)  # other fields kept as string columns
    files_per_shard: int = 1000  # .txt inputs: documents (files) per shard (and at most rows_per_shard)
    rows_per_shard: int = 100_000
    """Every input is cut into shards of at most this many rows: lines of a JSON-lines file (gzipped
    or not), rows of a Parquet file or a saved dataset, files of a ``.txt`` directory."""
    max_doc_bytes: int = 10_000_000
    """A larger record (a JSON line, a .txt file, a row's text) is set aside as ``too_large`` (its
    first characters kept in removed/): one huge document would otherwise cost ~100x its size in the
    dedup, filter and tokenizer stages."""
    fingerprint_bytes: int = CONTENT_BUDGET_BYTES
    """Inputs up to this many bytes in total are identified by content (xxh3 of every file), larger
    ones by file sizes and modification times (data_contract.corpus); 0: always by size and mtime."""

    def validate(self) -> InputConfig:
        if not self.path:
            raise ConfigError("input.path is empty: pass input.path=<dir|glob|file|saved dataset>")
        for name in ("files_per_shard", "rows_per_shard"):
            if getattr(self, name) <= 0:
                raise ConfigError(f"input.{name}={getattr(self, name)} must be a positive integer")
        if self.max_doc_bytes <= 0:
            raise ConfigError(f"input.max_doc_bytes={self.max_doc_bytes} must be a positive number of bytes")
        if self.fingerprint_bytes < 0:
            raise ConfigError(f"input.fingerprint_bytes={self.fingerprint_bytes} must be >= 0")
        return self


def _kind(path: Path) -> str:
    name = path.name
    if name.endswith(JSONL_SUFFIXES):
        return "jsonl"
    return "txt" if name.endswith(".txt") else "parquet"


def _is_saved_dataset(path: Path) -> bool:
    return path.is_dir() and (path / "dataset_info.json").is_file() and (path / "state.json").is_file()


@dataclass
class InputFiles:
    """What ``input.path`` names: a saved dataset, or document files relative to ``root``."""

    root: Path
    files: list[str]  # relative POSIX paths, in the order their shards come
    saved: bool = False


def find_inputs(cfg: InputConfig) -> InputFiles:
    """The input's files, in a fixed order (sorted paths); a ConfigError when there are none."""
    path = Path(cfg.path)
    if _is_saved_dataset(path):
        return InputFiles(path, [], saved=True)
    if path.is_dir():
        root = path
        files = sorted(path / rel for rel in document_files(path))
    elif path.is_file():
        root, files = path.parent, [path]
    else:  # a glob: paths are relative to the directory before the first wildcard
        parts = Path(cfg.path).parts
        fixed = next((i for i, p in enumerate(parts) if any(c in p for c in "*?[")), len(parts) - 1)
        root = Path(*parts[:fixed]) if fixed else Path(".")
        files = sorted(Path(p) for p in glob.glob(cfg.path, recursive=True) if Path(p).is_file())
    files = [f for f in files if f.name.endswith(SUFFIXES)]
    if not files:
        raise ConfigError(f"input.path={cfg.path}: no {', '.join(SUFFIXES)} files or saved dataset there")
    return InputFiles(root, [f.relative_to(root).as_posix() for f in files])


def file_identities(cfg: InputConfig, inputs: InputFiles) -> list[list[Any]]:
    """``[rel, size, content hash or mtime]`` of every input file, sorted by path: what identifies
    the input (for a directory, ``data_contract.corpus.file_listing`` of its ``document_files``, as
    the data module computes it)."""
    files = (
        sorted(p.name for p in inputs.root.iterdir() if p.is_file()) if inputs.saved else sorted(inputs.files)
    )
    return file_listing(inputs.root, files, cfg.fingerprint_bytes)


def plan_units(
    cfg: InputConfig, inputs: InputFiles, identities: list[list[Any]], cache_file: Path | None = None
) -> list[dict[str, Any]]:
    """The input split into units (one per future shard): each file's row ranges, then the ``.txt``
    files in groups. ``cache_file`` keeps the JSON-lines scans (see ``input_splits``)."""
    root = inputs.root
    if inputs.saved:
        n = datasets.load_from_disk(str(root)).num_rows
        return [
            {"kind": "saved", "root": str(root), "start": s, "stop": min(s + cfg.rows_per_shard, n)}
            for s in range(0, max(n, 1), cfg.rows_per_shard)
        ]
    jsonl = [e for e in identities if _kind(Path(e[0])) == "jsonl"]
    scans = scan_all(root, jsonl, cfg.rows_per_shard, cache_file)
    units: list[dict[str, Any]] = []
    txt: list[str] = []
    for rel in inputs.files:
        kind = _kind(Path(rel))
        if kind == "txt":
            txt.append(rel)
            continue
        ranges = (
            json_line_ranges(scans[rel], cfg.rows_per_shard)
            if kind == "jsonl"
            else parquet_row_ranges(root / rel, cfg.rows_per_shard)
        )
        units += [{"kind": kind, "root": str(root), "files": [rel], **r} for r in ranges]
    per_shard = min(cfg.files_per_shard, cfg.rows_per_shard)
    for i in range(0, len(txt), per_shard):
        units.append({"kind": "txt", "root": str(root), "files": txt[i : i + per_shard]})
    return units


def input_listing(identities: list[list[Any]], units: list[dict[str, Any]]) -> list[Any]:
    """What the step fingerprints identify the input by: its files, and a saved dataset's row ranges."""
    if units[0]["kind"] == "saved":
        return [*identities, [[u["start"], u["stop"]] for u in units]]
    return identities


def _stem(rel: str) -> str:
    name = Path(rel).name
    for suffix in SUFFIXES:
        if name.endswith(suffix):
            return name[: -len(suffix)]
    return name


class _Collector:
    """Rows of one shard: documents, and malformed records with their reason."""

    def __init__(self, cfg: InputConfig) -> None:
        self.cfg = cfg
        self.rows: dict[str, list[Any]] = {k: [] for k in ("id", "text", "source", *cfg.metadata_fields)}
        self.reasons: list[str | None] = []
        self.blank_lines = 0

    def add(self, record: dict[str, Any], default_id: str, default_source: str) -> None:
        text = record.get(self.cfg.text_field)
        doc_id = record.get(self.cfg.id_field)
        source = record.get(self.cfg.source_field)
        self.rows["id"].append(default_id if doc_id is None else str(doc_id))
        self.rows["source"].append(default_source if source is None else str(source))
        for name in self.cfg.metadata_fields:
            value = record.get(name)
            self.rows[name].append(value if value is None or isinstance(value, str) else json.dumps(value))
        if not isinstance(text, str):
            self.rows["text"].append(None if text is None else json.dumps(text)[:KEPT_CHARS])
            self.reasons.append("missing_text")
        elif len(text) * 4 > self.cfg.max_doc_bytes and len(text.encode("utf-8")) > self.cfg.max_doc_bytes:
            self.rows["text"].append(text[:KEPT_CHARS])
            self.reasons.append("too_large")
        else:
            self.rows["text"].append(text)
            self.reasons.append(None if text.strip() else "empty_text")

    def bad(self, doc_id: str, source: str, reason: str, raw: str | None) -> None:
        self.add({self.cfg.text_field: raw}, doc_id, source)
        self.reasons[-1] = reason

    def too_large(self, doc_id: str, source: str, head: bytes) -> None:
        self.bad(doc_id, source, "too_large", head.decode("utf-8", errors="replace")[:KEPT_CHARS])


class _Oversized(bytes):
    """The first bytes of a line longer than ``input.max_doc_bytes`` (the rest was skipped unread)."""


def _json_lines(path: Path, max_bytes: int, unit: dict[str, Any]) -> Iterator[tuple[int, bytes | None]]:
    """(line number, raw bytes) of the unit's lines of a possibly gzipped file; (n, None) when the
    file breaks off. The unit's lines start at byte ``offset`` (of the decompressed stream: a gzip
    stream is decompressed up to it) with line ``start + 1``; ``stop`` None reads to the end.

    A line over ``max_bytes`` comes as an ``_Oversized`` head: memory stays bounded by ``max_bytes``.
    """
    opener = gzip.open if path.name.endswith(".gz") else open
    line_no = unit["start"]
    try:
        with opener(path, "rb") as f:
            f.seek(unit["offset"])
            while (unit["stop"] is None or line_no < unit["stop"]) and (raw := f.readline(max_bytes + 1)):
                line_no += 1
                if len(raw) > max_bytes and not raw.endswith(b"\n"):
                    while (rest := f.readline(1 << 20)) and not rest.endswith(b"\n"):
                        pass
                    raw = _Oversized(raw[: 4 * KEPT_CHARS])
                yield line_no, raw
    except (EOFError, OSError, zlib.error):
        yield line_no + 1, None


def _read_jsonl(root: Path, rel: str, out: _Collector, unit: dict[str, Any]) -> None:
    source = _stem(rel)
    for line_no, raw in _json_lines(root / rel, out.cfg.max_doc_bytes, unit):
        where = f"{rel}:{line_no}"
        if raw is None:
            out.bad(where, source, "truncated_file", None)
            return
        if isinstance(raw, _Oversized):
            out.too_large(where, source, raw)
            continue
        if not raw.strip():
            out.blank_lines += 1
            continue
        try:
            line = raw.decode("utf-8")
        except UnicodeDecodeError:
            out.bad(where, source, "invalid_utf8", raw.decode("utf-8", errors="replace"))
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            out.bad(where, source, "bad_json", line)
            continue
        if not isinstance(record, dict):
            out.bad(where, source, "not_an_object", line)
            continue
        out.add(record, where, source)


def _read_txt(root: Path, rel: str, out: _Collector, unit: dict[str, Any]) -> None:
    parts = Path(rel).parts
    source = parts[0] if len(parts) > 1 else root.name
    if (root / rel).stat().st_size > out.cfg.max_doc_bytes:
        with open(root / rel, "rb") as f:
            out.too_large(rel, source, f.read(4 * KEPT_CHARS))
        return
    raw = (root / rel).read_bytes()
    try:
        out.add({out.cfg.text_field: raw.decode("utf-8")}, rel, source)
    except UnicodeDecodeError:
        out.bad(rel, source, "invalid_utf8", raw.decode("utf-8", errors="replace"))


def _read_rows(rows: Iterator[dict[str, Any]], prefix: str, source: str, out: _Collector) -> None:
    for i, record in rows:
        out.add(record, f"{prefix}:{i}", source)


def _read_parquet(root: Path, rel: str, out: _Collector, unit: dict[str, Any]) -> None:
    """Rows ``start`` to ``stop`` of the file, reading only the row groups that hold them."""
    parquet = pq.ParquetFile(root / rel)
    sizes = [parquet.metadata.row_group(g).num_rows for g in range(parquet.num_row_groups)]
    starts = np.concatenate([[0], np.cumsum(sizes, dtype=np.int64)])
    groups = [g for g in range(len(sizes)) if starts[g] < unit["stop"] and starts[g + 1] > unit["start"]]
    if not groups:
        return
    first_row = int(starts[groups[0]])

    def rows() -> Iterator[tuple[int, dict[str, Any]]]:
        records = (
            r for b in parquet.iter_batches(batch_size=10_000, row_groups=groups) for r in b.to_pylist()
        )
        skipped = islice(enumerate(records, start=first_row), unit["start"] - first_row, None)
        yield from islice(skipped, unit["stop"] - unit["start"])

    _read_rows(rows(), rel, _stem(rel), out)


def _read_saved(unit: dict[str, Any], out: _Collector) -> None:
    ds = datasets.load_from_disk(unit["root"]).select(range(unit["start"], unit["stop"]))
    rows = ((unit["start"] + i, r) for i, r in enumerate(ds))
    _read_rows(rows, Path(unit["root"]).name, Path(unit["root"]).name, out)


def read_unit(cfg: InputConfig, unit: dict[str, Any]) -> _Collector:
    out = _Collector(cfg)
    if unit["kind"] == "saved":
        _read_saved(unit, out)
        return out
    reader = {"jsonl": _read_jsonl, "txt": _read_txt, "parquet": _read_parquet}[unit["kind"]]
    for rel in unit["files"]:
        reader(Path(unit["root"]), rel, out, unit)
    return out


def run_unit(ctx: Context, unit: int) -> dict[str, Any]:
    collected = read_unit(ctx.config, ctx.input_units[unit])
    schema = pa.schema([(k, pa.string()) for k in collected.rows])
    table = pa.Table.from_pydict(collected.rows, schema=schema)
    stats = write_split(ctx, unit, datasets.Dataset(table), Verdicts(collected.reasons))
    stats["blank_lines"] = collected.blank_lines
    return stats


class Ingest(Stage):
    """The first stage of every run (not listed in ``stages``): it reads ``input``, and its settings
    and the input's listing fingerprint every step."""

    name = "ingest"
    Config = InputConfig
    section = "input"
    phase = Phase.INGEST
    always = True
    reads_input = True

    def settings(self) -> None:
        return None

    def steps(self) -> list[Step]:
        return [self.step(run_unit, writes_documents=True)]

    def find_input(self) -> tuple[InputFiles, Path | None]:
        found = find_inputs(self.config)
        return found, None if Path(self.config.path).is_file() else found.root

    def plan_input(self, found: InputFiles, cache_dir: Path | None) -> InputPlan:
        identities = file_identities(self.config, found)
        units = plan_units(self.config, found, identities, cache_dir / CACHE_FILE if cache_dir is not None else None)
        listing = input_listing(identities, units)
        corpus = {"path": str(Path(self.config.path).resolve()), "fingerprint": listing_digest(listing)}
        return InputPlan(units, corpus, [dc.asdict(self.config), listing])
