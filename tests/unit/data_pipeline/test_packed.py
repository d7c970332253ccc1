"""Packed shard format and the tokenize_pack stage: round trips, rollover, dtype, determinism."""

from __future__ import annotations

import json
import pickle
from pathlib import Path

import datasets
import numpy as np
import pytest
from tokenizers import Tokenizer

from data_contract.format import file_sha256, token_dtype
from data_pipeline.io.packed_writer import PackedShardWriter
from data_pipeline.io.sources import load_documents
from data_pipeline.stages.tokenize_pack import tokenize_pack
from data_pipeline.tokenizer.training import train_tokenizer
from dsl_lit.data.packed import PackedTokens
from tests.conftest import scratch_dir

CORPUS = Path(__file__).resolve().parents[3] / "data" / "corpus"
EOS = 1


def _write(path: Path, docs: list[list[int]], shard_tokens: int, padded_vocab: int = 512) -> Path:
    with PackedShardWriter(
        path, eos_id=EOS, vocab_size=padded_vocab, padded_vocab_size=padded_vocab, shard_tokens=shard_tokens
    ) as writer:
        for doc in docs:
            writer.add_document(doc)
    return path


@pytest.fixture(scope="module")
def documents(request: pytest.FixtureRequest) -> datasets.Dataset:
    """The Devil's Dictionary's first 150 entries, plus an empty document in the middle."""
    full = load_documents([CORPUS / "devils_dictionary.jsonl.gz"], cache_dir=scratch_dir(request, "hf"))
    rows = full.select(range(150)).to_dict()
    rows["text"][70] = ""
    return datasets.Dataset.from_dict(rows)


@pytest.fixture(scope="module")
def tokenizer_dir(documents: datasets.Dataset, request: pytest.FixtureRequest) -> Path:
    return train_tokenizer(documents["text"], 384, scratch_dir(request, "tok") / "tokenizer")


def test_round_trip_with_shard_rollover(tmp_path: Path) -> None:
    rng = np.random.default_rng(0)
    docs = [rng.integers(2, 512, size=n).tolist() for n in (5, 0, 1, 17, 3, 9, 30, 2)]
    packed = PackedTokens(_write(tmp_path / "ds", docs, shard_tokens=10))
    kept = [d for d in docs if d]
    stream = np.concatenate([np.array(d + [EOS]) for d in kept])

    assert len(packed) == len(stream) and packed.num_documents == len(kept)
    assert packed.meta["num_empty_skipped"] == 1
    assert np.array_equal(packed.window(0, len(packed)), stream)
    assert np.array_equal(packed.document_ends, np.cumsum([len(d) + 1 for d in kept]))
    shards = packed.meta["shards"]
    assert len(shards) > 3 and all(s["num_tokens"] <= 10 or s["num_documents"] == 1 for s in shards)
    for start in range(len(stream)):  # every window that crosses shard boundaries
        for length in (0, 1, 7, 23):
            if start + length <= len(stream):
                assert np.array_equal(packed.window(start, length), stream[start : start + length])
    with pytest.raises(IndexError):
        packed.window(len(stream) - 2, 3)


def test_dtype_follows_padded_vocab(tmp_path: Path) -> None:
    assert token_dtype(65536) == np.uint16 and token_dtype(65536 + 128) == np.uint32
    small = PackedTokens(_write(tmp_path / "u16", [[65535, 7]], 100, padded_vocab=65536))
    big = PackedTokens(_write(tmp_path / "u32", [[70000, 7]], 100, padded_vocab=129280))
    assert small.meta["dtype"] == "uint16" and (tmp_path / "u16" / "shard-00000.bin").stat().st_size == 3 * 2
    assert big.meta["dtype"] == "uint32" and (tmp_path / "u32" / "shard-00000.bin").stat().st_size == 3 * 4
    assert small.window(0, 3).tolist() == [65535, 7, EOS] and big.window(0, 3).tolist() == [70000, 7, EOS]
    with pytest.raises(ValueError, match="token ids"):
        _write(tmp_path / "bad", [[512]], 100)


def test_failed_write_leaves_nothing(tmp_path: Path) -> None:
    with (
        pytest.raises(RuntimeError),
        PackedShardWriter(tmp_path / "ds", eos_id=EOS, vocab_size=512, padded_vocab_size=512) as w,
    ):
        w.add_document([3, 4])
        raise RuntimeError("interrupted")
    assert list(tmp_path.iterdir()) == []
    with pytest.raises(FileNotFoundError, match="meta.json"):
        PackedTokens(tmp_path / "ds")


def test_reader_pickles_without_its_memmaps(tmp_path: Path) -> None:
    packed = PackedTokens(_write(tmp_path / "ds", [list(range(2, 500))] * 40, 1000))
    packed.window(0, 10)
    _ = packed.document_ends
    blob = pickle.dumps(packed)
    assert len(blob) < 4096
    assert np.array_equal(pickle.loads(blob).window(990, 30), packed.window(990, 30))


def test_tokenize_pack_round_trip(documents: datasets.Dataset, tokenizer_dir: Path, tmp_path: Path) -> None:
    out = tokenize_pack(documents, tokenizer_dir, tmp_path / "shards", shard_tokens=4096)
    packed = PackedTokens(out)
    tokenizer = Tokenizer.from_file(str(tokenizer_dir / "tokenizer.json"))
    texts = [t for t in documents["text"] if t]
    meta = json.loads((out / "meta.json").read_text())

    assert meta["num_empty_skipped"] == 1 and packed.num_documents == len(texts) == 149
    assert meta["tokenizer_sha256"] == file_sha256(tokenizer_dir / "tokenizer.json")
    assert meta["padded_vocab_size"] == 384 and meta["dtype"] == "uint16" and len(meta["shards"]) > 1
    starts = np.concatenate([[0], packed.document_ends[:-1]])
    for text, start, end in zip(texts, starts, packed.document_ends):
        ids = packed.window(int(start), int(end - start)).tolist()
        assert ids[-1] == packed.eos_id and packed.eos_id not in ids[:-1]
        assert tokenizer.decode(ids[:-1]) == text


def test_tokenize_pack_is_deterministic_across_num_proc(
    documents: datasets.Dataset, tokenizer_dir: Path, tmp_path: Path
) -> None:
    one = tokenize_pack(documents, tokenizer_dir, tmp_path / "a", shard_tokens=4096, batch_size=64)
    two = tokenize_pack(
        documents, tokenizer_dir, tmp_path / "b", shard_tokens=4096, num_proc=2, batch_size=32
    )
    files = sorted(p.name for p in one.iterdir())
    assert files == sorted(p.name for p in two.iterdir())
    for name in files:
        assert (one / name).read_bytes() == (two / name).read_bytes(), name


def test_batched_writes_equal_document_by_document(tmp_path: Path) -> None:
    """``add_documents`` (flat tokens and lengths: EOS and shard roll-over in numpy) writes the bytes
    that ``add_document`` one at a time does, whatever the batches: empty documents, documents
    longer than a shard, batches that end mid-shard."""
    rng = np.random.default_rng(1)
    docs = [rng.integers(2, 512, size=n) for n in rng.choice([0, 1, 2, 5, 9, 17, 40], size=300)]
    one = _write(tmp_path / "one", docs, shard_tokens=16)
    cuts = np.sort(rng.choice(np.arange(1, len(docs)), size=20, replace=False))
    with PackedShardWriter(tmp_path / "batched", eos_id=EOS, vocab_size=512, padded_vocab_size=512,
                           shard_tokens=16) as writer:
        for part in np.split(np.arange(len(docs)), cuts):
            batch = [docs[i] for i in part]
            writer.add_documents(np.concatenate(batch), np.array([len(d) for d in batch]))
    files = sorted(p.name for p in one.iterdir())
    assert files == sorted(p.name for p in (tmp_path / "batched").iterdir()) and len(files) > 20
    for name in files:
        assert (one / name).read_bytes() == (tmp_path / "batched" / name).read_bytes(), name
    with pytest.raises(ValueError, match="lengths"):
        PackedShardWriter(tmp_path / "bad", eos_id=EOS, vocab_size=512, padded_vocab_size=512).add_documents(
            np.arange(5), np.array([2, 2]))


@pytest.mark.parametrize(("batch_size", "shard_tokens"), [(1000, 2**24), (37, 4096), (1, 512)])
def test_tokenize_pack_is_the_tokenizers_own_encoding(
    documents: datasets.Dataset, tokenizer_dir: Path, tmp_path: Path, batch_size: int, shard_tokens: int
) -> None:
    """The packed stream is ``Tokenizer.encode`` of each non-empty document followed by EOS, in
    document order, for any batch size (batches encode on threads while earlier ones are written)."""
    tokenizer = Tokenizer.from_file(str(tokenizer_dir / "tokenizer.json"))
    texts = [t for t in documents["text"] if t]
    expected = np.concatenate([np.array([*tokenizer.encode(t, add_special_tokens=False).ids, EOS]) for t in texts])
    packed = PackedTokens(tokenize_pack(documents, tokenizer_dir, tmp_path / "shards", shard_tokens=shard_tokens,
                                        batch_size=batch_size))
    assert packed.eos_id == EOS and packed.num_documents == len(texts)
    assert np.array_equal(packed.window(0, len(packed)), expected)
    assert all(s["num_tokens"] <= shard_tokens or s["num_documents"] == 1 for s in packed.meta["shards"])


def test_load_documents_reads_jsonl_and_renames_fields(tmp_path: Path) -> None:
    path = tmp_path / "docs.jsonl"
    path.write_text('{"key": "a", "content": "first"}\n{"key": "b", "content": "second"}\n')
    ds = load_documents([path], text_field="content", id_field="key", cache_dir=tmp_path / "hf")
    assert ds["text"][:] == ["first", "second"] and ds["id"][:] == ["a", "b"]
    assert any((tmp_path / "hf").iterdir())  # the Arrow cache stays under cache_dir
    with pytest.raises(ValueError, match="lack field"):
        load_documents([path], cache_dir=tmp_path / "hf")
    with pytest.raises(ValueError, match="unsupported"):
        load_documents([tmp_path / "docs.parquet"])
