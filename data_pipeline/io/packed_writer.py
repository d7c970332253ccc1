"""Writing the packed token format (``data_contract.format``): documents streamed into flat shards.

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

from data_contract.format import FORMAT_VERSION, META_FILE, index_name, shard_name, token_dtype
from data_contract.fs import publish_dir
from data_pipeline.io.shards import make_temp_dir


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
        arr = np.asarray(tokens)
        if arr.size and arr.ndim != 1:
            raise ValueError(f"a document is a 1-D token sequence, got shape {arr.shape}")
        self.add_documents(arr.reshape(-1), np.array([arr.size]))

    def add_documents(self, tokens: np.ndarray, lengths: np.ndarray) -> None:
        """Append documents given as one flat token array and their lengths, each followed by EOS.

        Why flat: the EOS insertion and the shard roll-over are a few numpy operations per batch
        instead of Python work per document. Empty documents are counted in ``num_empty_skipped``.
        """
        if self._closed:
            raise RuntimeError("writer is closed")
        tokens, lengths = np.asarray(tokens), np.asarray(lengths, dtype=np.int64)
        if tokens.ndim != 1 or lengths.ndim != 1 or int(lengths.sum()) != tokens.size or (lengths < 0).any():
            raise ValueError(f"{tokens.size} tokens in shape {tokens.shape} do not split into lengths summing "
                             f"to {int(lengths.sum())}")
        if tokens.size and (int(tokens.min()) < 0 or int(tokens.max()) >= self.padded_vocab_size):
            raise ValueError(f"token ids must lie in [0, {self.padded_vocab_size})")
        empty = lengths == 0
        self.num_empty_skipped += int(empty.sum())
        ends = np.cumsum(lengths[~empty] + 1)  # each document's end in the stream with its EOS
        stream = np.full(int(ends[-1]) if ends.size else 0, self.eos_id, dtype=self.dtype)
        is_token = np.ones(stream.size, dtype=bool)
        is_token[ends - 1] = False
        stream[is_token] = tokens
        self._write_stream(stream, ends)

    def _write_stream(self, stream: np.ndarray, ends: np.ndarray) -> None:
        """Write whole documents (``stream`` cut at ``ends``) into shards: a document that does not
        fit the open shard starts the next one; a fresh shard takes at least one document."""
        done = 0  # documents written
        while done < ends.size:
            base = int(ends[done - 1]) if done else 0
            current = self._ends[-1] if self._ends else 0
            room = self.shard_tokens - current if self._file is not None else self.shard_tokens
            fit = int(np.searchsorted(ends[done:] - base, room, side="right"))
            if fit == 0 and self._file is not None:
                self._finish_shard()
                continue
            fit = max(fit, 1)
            if self._file is None:
                self._file = open(self._tmp_dir / shard_name(len(self._shards)), "wb")  # noqa: SIM115
                current = 0
            stop = int(ends[done + fit - 1])
            self._file.write(stream[base:stop].tobytes())
            self._ends.extend((ends[done : done + fit] - base + current).tolist())
            done += fit

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
