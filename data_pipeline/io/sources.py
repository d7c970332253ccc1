"""Read raw documents into a ``datasets.Dataset``: the common input of every pipeline stage.

Why ``datasets``: it memory-maps Arrow files, so corpora larger than RAM stream through ``map`` and
fingerprinted results are cached between runs.
"""

from __future__ import annotations

from pathlib import Path

import datasets

_JSON_SUFFIXES = (".jsonl", ".jsonl.gz", ".json", ".json.gz")


def load_documents(
    paths: list[str | Path],
    text_field: str = "text",
    id_field: str = "id",
    cache_dir: str | Path | None = None,
) -> datasets.Dataset:
    """Load JSON-lines files (optionally gzipped) into one dataset with ``text`` and ``id`` columns.

    Rows keep file order, then line order, so everything downstream is deterministic. ``cache_dir``
    keeps the Arrow cache next to the run's other artefacts instead of ``~/.cache``.
    """
    files = [str(p) for p in paths]
    if not files:
        raise ValueError("load_documents needs at least one file")
    for f in files:
        if not f.endswith(_JSON_SUFFIXES):
            raise ValueError(f"unsupported document file {f!r}: expected one of {_JSON_SUFFIXES}")
        if not Path(f).is_file():
            raise FileNotFoundError(f)
    ds = datasets.load_dataset(
        "json", data_files=files, split="train", cache_dir=None if cache_dir is None else str(cache_dir)
    )
    missing = [c for c in (text_field, id_field) if c not in ds.column_names]
    if missing:
        raise ValueError(f"documents lack field(s) {missing}; columns are {ds.column_names}")
    renames = {old: new for old, new in ((text_field, "text"), (id_field, "id")) if old != new}
    return ds.rename_columns(renames) if renames else ds
