"""Writing the packed token format (``dsl_lit.data.format``): documents streamed into flat shards.

Why on the pipeline's side: only ``tokenize_pack`` produces packed datasets; the trainer reads them
with ``dsl_lit.data.packed.PackedTokens`` and shares nothing with this module but the format.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Sequence
from pathlib import Path
from types import TracebackType
from typing import Any

import numpy as np

from data_pipeline.shard_io import make_temp_dir
from dsl_lit.data.format import FORMAT_VERSION, META_FILE, index_name, shard_name, token_dtype
from dsl_lit.utils.fs import publish_dir


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
        self._tmp_dir = make_temp_dir(self.output_dir)  # published by rename in close()

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
