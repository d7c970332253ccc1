"""Reading the packed token format (``data_contract.format``) as one stream through ``np.memmap``.

Why: pretraining reads fixed-length windows at random offsets of one long token stream (documents
are packed without cross-document masks, as in DeepSeek-V3). Raw little-endian arrays let every
DataLoader worker map the same pages without copying or parsing. The pipeline writes the format
(``data_pipeline.io.packed_writer``); this side only reads it.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np

from data_contract.format import FORMAT_VERSION, META_FILE, index_name


class PackedTokens:
    """Read-only view of a packed dataset as one token stream.

    Memmaps open on first access, so pickling (to DataLoader workers) sends only the path and meta.
    """

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        meta_path = self.path / META_FILE
        if not meta_path.is_file():
            raise FileNotFoundError(f"{meta_path} missing: not a complete packed dataset (build it first)")
        try:
            self.meta: dict[str, Any] = json.loads(meta_path.read_text(encoding="utf-8"))
        except (json.JSONDecodeError, UnicodeDecodeError) as error:
            raise ValueError(f"{meta_path} is damaged ({error}): build the data again (delete {self.path})") from None
        if not isinstance(self.meta, dict) or self.meta.get("format_version") != FORMAT_VERSION:
            raise ValueError(
                f"{self.path}: format_version "
                f"{self.meta.get('format_version') if isinstance(self.meta, dict) else None} != {FORMAT_VERSION}"
            )
        self.dtype = np.dtype(self.meta["dtype"]).newbyteorder("<")
        sizes = [s["num_tokens"] for s in self.meta["shards"]]
        self._starts = np.concatenate([[0], np.cumsum(sizes, dtype=np.int64)])  # shard i spans [s[i], s[i+1])
        if int(self._starts[-1]) != self.meta["num_tokens"]:
            raise ValueError(f"{self.path}: shard sizes do not add up to num_tokens")
        self._maps: list[np.memmap] | None = None
        self._document_ends: np.ndarray | None = None

    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        state["_maps"] = None
        state["_document_ends"] = None
        return state

    @property
    def eos_id(self) -> int:
        return int(self.meta["eos_id"])

    @property
    def num_documents(self) -> int:
        return int(self.meta["num_documents"])

    def __len__(self) -> int:
        return int(self.meta["num_tokens"])

    def _shard_maps(self) -> list[np.memmap]:
        if self._maps is None:
            self._maps = [
                np.memmap(self.path / s["file"], dtype=self.dtype, mode="r", shape=(s["num_tokens"],))
                for s in self.meta["shards"]
            ]
        return self._maps

    def window(self, start: int, length: int) -> np.ndarray:
        """Tokens ``[start, start + length)`` of the whole stream (a copy), crossing shards as needed."""
        if start < 0 or length < 0 or start + length > len(self):
            raise IndexError(f"window [{start}, {start + length}) outside [0, {len(self)})")
        out = np.empty(length, dtype=self.dtype)
        maps = self._shard_maps()
        shard = int(np.searchsorted(self._starts, start, side="right")) - 1
        pos, filled = start, 0
        while filled < length:
            offset = pos - int(self._starts[shard])
            take = min(length - filled, int(self._starts[shard + 1]) - pos)
            out[filled : filled + take] = maps[shard][offset : offset + take]
            filled += take
            pos += take
            shard += 1
        return out

    @property
    def document_ends(self) -> np.ndarray:
        """Global end offset (exclusive, EOS included) of every document, in stream order."""
        if self._document_ends is None:
            parts = [
                np.load(self.path / index_name(i)) + self._starts[i] for i in range(len(self.meta["shards"]))
            ]
            self._document_ends = np.concatenate(parts) if parts else np.zeros(0, dtype=np.int64)
        return self._document_ends
