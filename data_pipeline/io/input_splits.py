"""Row ranges of one input file, so that a large file becomes several shards (``input.rows_per_shard``).

Why rows, found by a scan: a shard's memory and time in every later step follow its rows, and a
10 GB ``.jsonl.gz`` as one shard would be one unit of every per-shard step. Parquet files state
their row count in the footer. JSON lines must be read to count them: the scan finds the lines
(``\\n``-separated, as the reader splits them) and the byte offset where each range starts, so a
plain file's unit seeks straight there; a gzip stream cannot be entered in the middle, so its unit
decompresses and discards what comes before its range (C speed, no parsing). Files are scanned
in threads (decompression and numpy release the GIL), and once an output directory is the
pipeline's the result is kept in its ``.data_pipeline.input_lines.json`` under each file's identity (the
input listing's ``[path, size, content hash or mtime]``), so a resumed run or each task of a
scheduler array does not scan again.
"""

from __future__ import annotations

import gzip
import json
import os
import zlib
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow.parquet as pq

from data_pipeline.io.shards import write_json

CACHE_FILE = ".data_pipeline.input_lines.json"  # beside the output directory's marker
_CHUNK = 1 << 24


def scan_json_lines(path: Path, every: int) -> dict[str, Any]:
    """``{"lines": n, "offsets": [...]}``: the lines of a (possibly gzipped) JSON-lines file and the
    byte offset (in the decompressed stream) of lines ``0, every, 2 * every, ...``. A stream that
    breaks off is scanned up to the break; its last range reads on to it, as an unsplit file would."""
    opener = gzip.open if path.name.endswith(".gz") else open
    offsets, lines, position, ends_with_newline = [0], 0, 0, True
    try:
        with opener(path, "rb") as f:
            while chunk := f.read1(_CHUNK):  # one raw read each: a break loses nothing read before it
                newlines = np.flatnonzero(np.frombuffer(chunk, dtype=np.uint8) == 10)
                # line k starts after newline k - 1 (0-based); the next range starts at line len(offsets) * every
                wanted = len(offsets) * every - 1 - lines  # >= 0: that line lies beyond what was read
                offsets += (position + newlines[wanted::every] + 1).tolist()
                lines += newlines.size
                position += len(chunk)
                ends_with_newline = chunk.endswith(b"\n")
    except (EOFError, OSError, zlib.error):
        ends_with_newline = True  # the partial line after the break belongs to the last range anyway
    if not ends_with_newline:
        lines += 1  # a last line without its newline is still a line
    offsets = [o for o in offsets if o < position or o == 0]  # no range starting at the very end
    return {"lines": lines, "offsets": offsets}


def json_line_ranges(scan: dict[str, Any], every: int) -> list[dict[str, Any]]:
    """``{"start", "stop", "offset"}`` per range of ``every`` lines; the last range reads to the end
    (``stop`` None), so whatever follows the scanned lines, a break included, is read exactly once."""
    offsets = scan["offsets"]
    return [
        {"start": k * every, "stop": (k + 1) * every if k + 1 < len(offsets) else None, "offset": offset}
        for k, offset in enumerate(offsets)
    ]


def parquet_row_ranges(path: Path, every: int) -> list[dict[str, Any]]:
    rows = pq.ParquetFile(path).metadata.num_rows
    return [{"start": s, "stop": min(s + every, rows), "offset": 0} for s in range(0, max(rows, 1), every)]


def _cache_key(entry: list[Any], every: int) -> str:
    return json.dumps([entry, every])


def scan_all(
    root: Path, listing: list[list[Any]], every: int, cache_file: Path | None
) -> dict[str, dict[str, Any]]:
    """The scan of every JSON-lines file of ``listing`` (entries ``[rel, size, identity]``), by
    relative path: from ``cache_file`` where it holds the same file identity, else scanned (in
    threads) and added to it."""
    cache: dict[str, Any] = {}
    if cache_file is not None and cache_file.is_file():
        cache = json.loads(cache_file.read_text(encoding="utf-8"))
    todo = [e for e in listing if _cache_key(e, every) not in cache]
    if todo:
        with ThreadPoolExecutor(min(len(todo), os.cpu_count() or 1, 8)) as pool:
            scans = pool.map(lambda e: scan_json_lines(root / e[0], every), todo)
            for entry, scan in zip(todo, scans):
                cache[_cache_key(entry, every)] = scan
        if cache_file is not None:
            write_json(cache, cache_file)
    return {e[0]: cache[_cache_key(e, every)] for e in listing}
