"""The packed token format: documents concatenated into flat binary shards read through ``np.memmap``.

Why: pretraining reads fixed-length windows at random offsets of one long token stream (documents
are packed without cross-document masks, as in DeepSeek-V3). Raw little-endian arrays let every
DataLoader worker map the same pages without copying or parsing.

Layout of a dataset directory::

    shard-00000.bin       tokens, little-endian uint16 (padded vocab <= 65536) or uint32;
                          an EOS follows every document
    shard-00000.idx.npy   int64 cumulative document end offsets within that shard
    ...
    meta.json             written last: its presence marks a complete dataset

Shards roll at document boundaries (a shard exceeds ``shard_tokens`` only to hold one huge
document), so each shard's index describes whole documents.
"""

from __future__ import annotations

import json
import shutil
import tempfile
from collections.abc import Sequence
from pathlib import Path
from types import TracebackType
from typing import Any

import numpy as np

from dsl_lit.utils.fs import publish_dir

FORMAT_VERSION = 1
META_FILE = "meta.json"


def token_dtype(padded_vocab_size: int) -> np.dtype:
    """The narrowest little-endian unsigned dtype that holds every id: halves the bytes for <= 64K vocabs."""
    if padded_vocab_size <= 0:
        raise ValueError(f"padded_vocab_size must be positive, got {padded_vocab_size}")
    return np.dtype("<u2") if padded_vocab_size <= 2**16 else np.dtype("<u4")


def shard_name(index: int) -> str:
    return f"shard-{index:05d}.bin"


def index_name(index: int) -> str:
    return f"shard-{index:05d}.idx.npy"




class PackedShardWriter:
    """Streams documents into shards under a temporary directory; ``close()`` publishes it.

    Use as a context manager: on an exception the partial output is removed and nothing appears at
    ``output_dir``.
    """

    def __init__(
        self,
        output_dir: str | Path,
        *,
        eos_id: int,
        vocab_size: int,
        padded_vocab_size: int,
        shard_tokens: int = 2**24,
        tokenizer_sha256: str | None = None,
    ) -> None:
        if shard_tokens <= 0:
            raise ValueError(f"shard_tokens must be positive, got {shard_tokens}")
        if not 0 <= eos_id < padded_vocab_size:
            raise ValueError(f"eos_id={eos_id} outside the vocab of {padded_vocab_size}")
        self.output_dir = Path(output_dir)
        self.dtype = token_dtype(padded_vocab_size)
        self.eos_id = eos_id
        self.vocab_size = vocab_size
        self.padded_vocab_size = padded_vocab_size
        self.shard_tokens = shard_tokens
        self.tokenizer_sha256 = tokenizer_sha256
        self.num_empty_skipped = 0
        self._shards: list[dict[str, Any]] = []
        self._file: Any = None
        self._ends: list[int] = []  # document ends within the open shard
        self._closed = False
        self.output_dir.parent.mkdir(parents=True, exist_ok=True)
        self._tmp_dir = Path(
            tempfile.mkdtemp(dir=self.output_dir.parent, prefix=f".{self.output_dir.name}.tmp-")
        )
        self._tmp_dir.chmod(0o755)  # mkdtemp makes it private; the published directory should not be

    @property
    def num_tokens(self) -> int:
        return sum(s["num_tokens"] for s in self._shards) + (self._ends[-1] if self._ends else 0)

    @property
    def num_documents(self) -> int:
        return sum(s["num_documents"] for s in self._shards) + len(self._ends)

    def add_document(self, tokens: Sequence[int] | np.ndarray) -> None:
        """Append one document followed by EOS; an empty one is counted in ``num_empty_skipped``."""
        if self._closed:
            raise RuntimeError("writer is closed")
        arr = np.asarray(tokens)
        if arr.size == 0:
            self.num_empty_skipped += 1
            return
        if arr.ndim != 1:
            raise ValueError(f"a document is a 1-D token sequence, got shape {arr.shape}")
        if int(arr.min()) < 0 or int(arr.max()) >= self.padded_vocab_size:
            raise ValueError(f"token ids must lie in [0, {self.padded_vocab_size})")
        n = arr.size + 1
        current = self._ends[-1] if self._ends else 0
        if self._file is not None and current + n > self.shard_tokens:
            self._finish_shard()
        if self._file is None:
            self._file = open(self._tmp_dir / shard_name(len(self._shards)), "wb")  # noqa: SIM115
            current = 0
        self._file.write(arr.astype(self.dtype, copy=False).tobytes())
        self._file.write(np.array([self.eos_id], dtype=self.dtype).tobytes())
        self._ends.append(current + n)

    def _finish_shard(self) -> None:
        index = len(self._shards)
        self._file.close()
        self._file = None
        np.save(self._tmp_dir / index_name(index), np.asarray(self._ends, dtype=np.int64))
        self._shards.append(
            {"file": shard_name(index), "num_tokens": self._ends[-1], "num_documents": len(self._ends)}
        )
        self._ends = []

    def close(self, extra_meta: dict[str, Any] | None = None) -> Path:
        """Finish the last shard, write meta.json last, and rename the directory into place."""
        if self._closed:
            return self.output_dir
        if self._file is not None:
            self._finish_shard()
        meta = {
            "format_version": FORMAT_VERSION,
            "dtype": self.dtype.name,
            "num_tokens": self.num_tokens,
            "num_documents": self.num_documents,
            "num_empty_skipped": self.num_empty_skipped,
            "shards": self._shards,
            "eos_id": self.eos_id,
            "vocab_size": self.vocab_size,
            "padded_vocab_size": self.padded_vocab_size,
            "tokenizer_sha256": self.tokenizer_sha256,
            **(extra_meta or {}),
        }
        (self._tmp_dir / META_FILE).write_text(json.dumps(meta, indent=2) + "\n", encoding="utf-8")
        publish_dir(self._tmp_dir, self.output_dir)
        self._closed = True
        return self.output_dir

    def abort(self) -> None:
        """Drop everything written so far."""
        if self._file is not None:
            self._file.close()
            self._file = None
        self._closed = True
        shutil.rmtree(self._tmp_dir, ignore_errors=True)

    def __enter__(self) -> PackedShardWriter:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        if exc_type is None:
            self.close()
        else:
            self.abort()


class PackedTokens:
    """Read-only view of a packed dataset as one token stream.

    Memmaps open on first access, so pickling (to DataLoader workers) sends only the path and meta.
    """

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        meta_path = self.path / META_FILE
        if not meta_path.is_file():
            raise FileNotFoundError(f"{meta_path} missing: not a complete packed dataset (build it first)")
        self.meta: dict[str, Any] = json.loads(meta_path.read_text(encoding="utf-8"))
        if self.meta.get("format_version") != FORMAT_VERSION:
            raise ValueError(
                f"{self.path}: format_version {self.meta.get('format_version')} != {FORMAT_VERSION}"
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
