"""DeepSeek-style BBPE tokenizer: pre-tokenization rules, special tokens, meta, transformers loading."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from tokenizers import Tokenizer

from data_contract.format import BOS_TOKEN, DEEPSEEK_SPECIAL_TOKENS, EOS_TOKEN, PAD_TOKEN
from data_pipeline.io.sources import load_documents
from data_pipeline.tokenizer.training import (
    build_pre_tokenizer,
    padded_vocab_size,
    sample_texts,
    train_tokenizer,
)
from tests.conftest import scratch_dir

CORPUS = Path(__file__).resolve().parents[3] / "data" / "corpus"
VOCAB = 512


@pytest.fixture(scope="module")
def corpus_texts(request: pytest.FixtureRequest) -> list[str]:
    files = sorted(CORPUS.glob("*.jsonl.gz"))
    ds = load_documents(files, cache_dir=scratch_dir(request, "hf_datasets"))
    return list(ds["text"])


@pytest.fixture(scope="module")
def tokenizer_dir(corpus_texts: list[str], request: pytest.FixtureRequest) -> Path:
    return train_tokenizer(
        corpus_texts, VOCAB, scratch_dir(request, "tok") / "tokenizer", max_bytes=400_000
    )


@pytest.fixture(scope="module")
def tokenizer(tokenizer_dir: Path) -> Tokenizer:
    return Tokenizer.from_file(str(tokenizer_dir / "tokenizer.json"))


def test_bundled_corpus_loads_with_ids_and_sources(corpus_texts: list[str]) -> None:
    assert len(corpus_texts) == 997 + 1189  # Devil's Dictionary entries + Bible chapters
    assert all(t.strip() for t in corpus_texts)


def test_pre_tokenizer_isolates_newlines_digits_and_cjk() -> None:
    pieces = [p for p, _ in build_pre_tokenizer().pre_tokenize_str("Verse 12:3,\n\nsaith 中文한국 ok")]
    # ByteLevel maps " " -> "Ġ", "\n" -> "Ċ"; the CJK run becomes its UTF-8 bytes.
    assert pieces[:8] == ["Verse", "Ġ", "1", "2", ":", "3", ",", "Ċ"]
    assert pieces[8:10] == ["Ċ", "saith"]
    assert pieces[-1] == "Ġok"


def test_digits_never_merge(tokenizer: Tokenizer) -> None:
    digits = set("0123456789")
    assert not [t for t in tokenizer.get_vocab() if sum(c in digits for c in t) > 1]
    tokens = tokenizer.encode("In 1611 AD, 31102 verses").tokens
    assert [t for t in tokens if digits & set(t)] == list("161131102")


def test_newlines_are_their_own_tokens(tokenizer: Tokenizer) -> None:
    assert not [t for t in tokenizer.get_vocab() if "Ċ" in t and t != "Ċ"]


def test_special_tokens_are_single_ids_in_order(tokenizer: Tokenizer) -> None:
    assert len(DEEPSEEK_SPECIAL_TOKENS) == 15 == len(set(DEEPSEEK_SPECIAL_TOKENS))
    for i, tok in enumerate(DEEPSEEK_SPECIAL_TOKENS):
        assert tokenizer.token_to_id(tok) == i
        assert tokenizer.encode(f"Amen.{tok}And", add_special_tokens=False).ids.count(i) == 1


def test_meta_has_padded_vocab_and_ids(tokenizer_dir: Path) -> None:
    meta = json.loads((tokenizer_dir / "meta.json").read_text())
    assert meta["vocab_size"] == VOCAB
    assert meta["padded_vocab_size"] % 128 == 0 and meta["padded_vocab_size"] >= meta["vocab_size"]
    assert (meta["bos_id"], meta["eos_id"], meta["pad_id"]) == (0, 1, 2)
    assert padded_vocab_size(100_015) == 100_096
    assert padded_vocab_size(8192) == 8192 and padded_vocab_size(8193) == 8320


def test_round_trip_on_corpus_and_unicode(tokenizer: Tokenizer, corpus_texts: list[str]) -> None:
    samples = corpus_texts[::40] + ["naïve café  \t tabs\r\n中文, 한국어; emoji 🙂 and  trailing  \n\n"]
    for text in samples:
        assert tokenizer.decode(tokenizer.encode(text).ids) == text


def test_loads_in_transformers_with_bos_eos_pad(tokenizer_dir: Path, tokenizer: Tokenizer) -> None:
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    auto = AutoTokenizer.from_pretrained(tokenizer_dir)
    assert (auto.bos_token, auto.eos_token, auto.pad_token) == (BOS_TOKEN, EOS_TOKEN, PAD_TOKEN)
    assert (auto.bos_token_id, auto.eos_token_id, auto.pad_token_id) == (0, 1, 2)
    text = "And God said, Let there be light:  and there was light.\n"
    assert auto.encode(text, add_special_tokens=False) == tokenizer.encode(text).ids
    assert auto.decode(auto.encode(text)) == text

    fast = PreTrainedTokenizerFast(
        tokenizer_file=str(tokenizer_dir / "tokenizer.json"), bos_token=BOS_TOKEN, eos_token=EOS_TOKEN
    )
    assert fast.encode(text, add_special_tokens=False) == tokenizer.encode(text).ids
    assert (fast.bos_token_id, fast.eos_token_id) == (0, 1)
    assert PreTrainedTokenizerFast.from_pretrained(tokenizer_dir).pad_token_id == 2


def test_sample_is_deterministic_and_order_free(corpus_texts: list[str]) -> None:
    budget = 200_000
    forward = list(sample_texts(corpus_texts, budget))
    backward = list(sample_texts(reversed(corpus_texts), budget))
    assert forward == backward
    size = sum(len(t.encode()) for t in forward)
    assert budget * 0.9 < size <= budget
    assert list(sample_texts(corpus_texts, None)) == corpus_texts
    with pytest.raises(ValueError, match="max_bytes"):
        list(sample_texts(["x" * 100], 10))


def test_training_is_deterministic_and_atomic(corpus_texts: list[str], tmp_path: Path) -> None:
    out = tmp_path / "tok"
    out.mkdir()
    (out / "stale.txt").write_text("from an older build")
    train_tokenizer(corpus_texts, 300, out, max_bytes=50_000)
    first = (out / "tokenizer.json").read_bytes()
    assert not (out / "stale.txt").exists()  # the directory was replaced whole
    train_tokenizer(corpus_texts, 300, out, max_bytes=50_000)
    assert (out / "tokenizer.json").read_bytes() == first
    assert sorted(p.name for p in tmp_path.iterdir()) == ["tok"]  # no temp dirs left behind
    assert sorted(p.name for p in out.iterdir()) == [
        "meta.json",
        "special_tokens_map.json",
        "tokenizer.json",
        "tokenizer_config.json",
    ]


@pytest.mark.parametrize(
    ("settings", "message"),
    [
        ({"spec": "gpt2"}, r"tokenizer\.spec='gpt2' is not one of \['bundled', 'deepseek_llm', 'deepseek_v3'\]"),
        ({"spec": "deepseek_v3", "vocab_size": 130_000}, r"tokenizer\.vocab_size=130000 is above deepseek_v3's"),
        ({"spec": "deepseek_llm", "special_tokens": ["<a>", "<b>", "<c>"]}, r"tokenizer\.special_tokens applies"),
        ({"spec": "deepseek_v3", "vocab_size": 128000, "padded_vocab_size": 128896}, None),
        ({"spec": "deepseek_v3", "vocab_size": 128000, "padded_vocab_size": 128512}, r"below the 128815 tokens"),
        ({"spec": "deepseek_llm", "vocab_size": 200}, r"tokenizer\.vocab_size=200 must be at least 256"),
        ({"path": "/nonexistent/DeepSeek-V3"}, r"tokenizer\.path=/nonexistent/DeepSeek-V3 has no tokenizer\.json"),
    ],
)
def test_tokenizer_settings_are_checked_naming_the_field(settings: dict, message: str | None) -> None:
    from data_contract.errors import ConfigError
    from data_pipeline.stages.train_tokenizer import TokenizerConfig

    config = TokenizerConfig(**{"padded_vocab_size": None, **settings})
    if message is None:
        config.validate()
        return
    with pytest.raises(ConfigError, match=message):
        config.validate()
