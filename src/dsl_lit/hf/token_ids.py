"""An export's bos/eos/pad token ids, taken from the tokenizer files it ships.

Why: ``transformers``' ``generate`` stops on, and pads with, the ids that config.json and
generation_config.json name, and falls back to the architecture's defaults where they name none
(Llama's eos is 2, the bundled tokenizer's pad). A training run's config carries no token
ids, so the export writes those of its tokenizer: ours or DeepSeek's released ones, read alike.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from data_contract.tokenizer_dir import derive_meta
from dsl_lit.hf.io import GENERATION_CONFIG_NAME
from dsl_lit.hf.reader import CONFIG_NAME


def hf_token_ids(tokenizer_dir: str | Path) -> dict[str, int | None]:
    """``bos_token_id`` (None without a bos token), ``eos_token_id`` and ``pad_token_id`` (the eos
    without a pad token; DeepSeek's releases name the eos as their pad) of a tokenizer directory.

    From its own files, not meta.json: they are what an export carries and ``AutoTokenizer`` reads.
    """
    meta = derive_meta(tokenizer_dir)
    return {"bos_token_id": meta["bos_id"], "eos_token_id": meta["eos_id"], "pad_token_id": meta["pad_id"]}


def _read_json(path: Path) -> dict[str, Any]:
    return json.loads(path.read_text(encoding="utf-8")) if path.is_file() else {}


def _write_json(path: Path, data: dict[str, Any]) -> None:
    path.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n", encoding="utf-8")


def write_token_ids(directory: str | Path, ids: dict[str, int | None]) -> None:
    """Put ``ids`` into the model directory's config.json, a missing id as null (left out, the
    architecture's default would apply), and into generation_config.json, a missing one left out
    (``GenerationConfig``'s default is None)."""
    config, generation = Path(directory) / CONFIG_NAME, Path(directory) / GENERATION_CONFIG_NAME
    _write_json(config, {**_read_json(config), **ids})
    kept = {k: v for k, v in _read_json(generation).items() if k not in ids}
    _write_json(generation, {**kept, **{k: v for k, v in ids.items() if v is not None}})
