"""Quality and language filters on crafted documents, normalisation, remix proportions, tokenizer rules."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import pytest
from tokenizers import Tokenizer

from data_pipeline.config import load_config
from data_pipeline.filters.c4 import C4Config, c4
from data_pipeline.filters.fineweb import FineWebConfig, fineweb
from data_pipeline.filters.gopher_quality import GopherQualityConfig, gopher_quality
from data_pipeline.filters.gopher_repetition import GopherRepetitionConfig, gopher_repetition
from data_pipeline.runner import run
from data_pipeline.stages.language_filter import identify
from data_pipeline.stages.normalize import NormalizeConfig, normalize_text
from data_pipeline.stages.quality_filter import QualityFilterConfig, judge
from dsl_lit.data.packed import PackedTokens

rng = np.random.default_rng(0)
VOCAB = [
    "".join(rng.choice(list("abcdefghijklmnopqrstuvwxyz"), size=rng.integers(3, 9))) for _ in range(2000)
]


def prose(n_sentences: int = 8, seed: int = 0) -> str:
    r = np.random.default_rng(seed)
    return " ".join(f"The {' '.join(r.choice(VOCAB, 9))} and {r.choice(VOCAB)}." for _ in range(n_sentences))


GOOD = prose()


def test_good_prose_passes_every_rule() -> None:
    assert judge(GOOD, QualityFilterConfig()) == (None, GOOD)


@pytest.mark.parametrize(
    ("text", "rule"),
    [
        ("Too short to be a page.", "min_doc_words"),
        (" ".join(["a b c and the"] * 30), "min_avg_word_length"),
        (" ".join(["supercalifragilisticexpialidocious the"] * 30), "max_avg_word_length"),
        (GOOD + " #tag" * 20, "max_symbol_word_ratio"),
        ("\n".join(f"- the {w} and" for w in VOCAB[:40]), "max_bullet_lines_ratio"),
        (
            "\n".join(f"the {w} and some more words in this line here..." for w in VOCAB[:40]),
            "max_ellipsis_lines_ratio",
        ),
        (" ".join(["12345 678"] * 40) + " the and " + " ".join(VOCAB[:10]), "max_non_alpha_words_ratio"),
        (" ".join(VOCAB[:80]), "min_stop_words"),
    ],
)
def test_gopher_quality_rules(text: str, rule: str) -> None:
    assert gopher_quality(text, GopherQualityConfig())[0] == f"gopher_quality:{rule}"
    assert (
        gopher_quality(
            text,
            GopherQualityConfig(
                enabled=True,
                min_doc_words=0,
                min_avg_word_length=0,
                max_avg_word_length=99,
                max_symbol_word_ratio=9,
                max_bullet_lines_ratio=9,
                max_ellipsis_lines_ratio=9,
                max_non_alpha_words_ratio=0,
                min_stop_words=0,
            ),
        )[0]
        is None
    )


def test_gopher_repetition_rules() -> None:
    cfg = GopherRepetitionConfig()
    assert gopher_repetition(GOOD, cfg)[0] is None
    assert (
        gopher_repetition("\n".join([prose(1, 1)] * 3 + [prose(1, 2)]), cfg)[0]
        == "gopher_repetition:dup_line_frac"
    )
    assert gopher_repetition("\n\n".join([prose(4, 1)] * 2 + [prose(2, i) for i in range(2, 6)]), cfg)[0] == (
        "gopher_repetition:dup_para_char_frac"
    )
    assert (
        gopher_repetition(" ".join(["the cat"] * 30) + " " + prose(4), cfg)[0]
        == "gopher_repetition:top_2_gram"
    )
    words = prose(8).split()
    assert gopher_repetition(" ".join(words + words[:25]), cfg)[0] == "gopher_repetition:dup_5_grams"


def test_c4_drops_lines_and_rejects_pages() -> None:
    cfg = C4Config()
    page = "\n".join(
        [
            prose(3, 1),
            "Menu Home About",
            prose(3, 2),
            "Enable javascript to see this page.",
            "Read our privacy policy here.",
            prose(1, 3) + " [1]",
        ]
    )
    reason, text = c4(page, cfg)
    assert reason is None and text.split("\n") == [prose(3, 1), prose(3, 2), prose(1, 3)]
    assert c4(GOOD + "\nLorem ipsum dolor sit amet.", cfg)[0] == "c4:lorem_ipsum"
    assert c4(GOOD + "\nfunction f() { return 1; }", cfg)[0] == "c4:curly_bracket"
    assert c4(prose(2), cfg)[0] == "c4:min_num_sentences"
    assert c4(prose(2), C4Config(min_num_sentences=-1))[0] is None
    assert judge(page, QualityFilterConfig(c4=C4Config(enabled=False)))[1] == page  # switchable


def test_fineweb_rules() -> None:
    cfg = FineWebConfig()
    assert fineweb(GOOD, cfg)[0] is None
    assert (
        fineweb("\n".join(f"{w} without a full stop here" for w in VOCAB[:20]), cfg)[0]
        == "fineweb:line_punct_ratio"
    )
    assert fineweb("\n".join(f"{w} ok." for w in VOCAB[:20]), cfg)[0] == "fineweb:short_line_ratio"
    assert (
        fineweb("\n".join([prose(2, 1)] * 2 + [prose(2, i) for i in range(2, 9)]), cfg)[0]
        == "fineweb:char_dup_ratio"
    )
    listing = "\n".join(f"{a} {b} done." for a, b in zip(VOCAB[:20], VOCAB[20:40]))
    assert fineweb(listing, FineWebConfig(short_line_thr=1.1))[0] == "fineweb:list_ratio"


def test_language_identification_ships_its_model() -> None:
    assert identify("The committee will meet on Thursday to discuss the budget for next year.")[0] == "en"
    assert identify("Der Ausschuss trifft sich am Donnerstag, um den Haushalt zu besprechen.")[0] == "de"
    assert identify("委员会将于星期四开会讨论明年的预算。")[0] == "zh"


def test_normalize_unicode_and_whitespace() -> None:
    text = "Cafe\u0301\u200b  menu\r\n\r\n\r\n\r\nnext\tline \x07 "
    assert normalize_text(text, NormalizeConfig()) == "Café menu\n\nnext line"
    assert (
        normalize_text(text, NormalizeConfig(form="none", max_newlines=0, collapse_spaces=False)).count("\n")
        == 4
    )


def _jsonl(path: Path, records: list[dict]) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def test_language_filter_and_remix_proportions(tmp_path: Path) -> None:
    english = "The committee will meet on Thursday to discuss the budget for next year, said the chair."
    german = "Der Ausschuss trifft sich am Donnerstag, um den Haushalt für das nächste Jahr zu besprechen."
    records = [{"id": f"w{i}", "text": f"{english} Item {i}.", "source": "web"} for i in range(300)]
    records += [{"id": f"b{i}", "text": f"{english} Book {i}.", "source": "books"} for i in range(60)]
    records += [{"id": f"d{i}", "text": f"{german} Punkt {i}.", "source": "web"} for i in range(20)]
    values = {
        "input": {"path": str(_jsonl(tmp_path / "in.jsonl", records))},
        "output_dir": str(tmp_path / "out"),
        "stages": ["language_filter", "remix"],
        "remix": {"targets": {"web": 0.5, "books": 0.5}, "total": 400},
    }
    stats = run(load_config(values))
    assert stats["stages"]["language_filter"]["removed"] == {"language:de": 20}
    kept = [r for f in sorted((tmp_path / "out" / "kept").glob("*")) for r in pq.read_table(f).to_pylist()]
    assert len(kept) == 400 and abs(sum(r["source"] == "books" for r in kept) / 400 - 0.5) <= 0.01
    assert all(r["language"] == "en" for r in kept)
    assert sum(r["remix_copy"] > 0 for r in kept) == 140 and "b0#1" in {r["id"] for r in kept}  # 60 -> 200
    report = stats["stages"]["remix"]["details"]["remix.plan"]["groups"]
    assert (
        report["books"]["before_share"] == pytest.approx(60 / 360, abs=1e-6)
        and report["books"]["after_share"] == 0.5
    )
    assert stats["stages"]["remix"]["removed"] == {"remix_downsampled": 100}  # web: 300 -> 200


def test_tokenizer_stages_deepseek_rules(tmp_path: Path) -> None:
    """Byte-exact round trips (English, Chinese, code), single digits, no token across a newline,
    the embedding padded to 102400 (so uint32 shards), and one EOS after every document."""
    english = "In 1611 the translators finished: 31102 verses, and the work was done.\n"
    chinese = "委员会将于星期四开会，讨论明年的预算。数字 2024 年。\n"
    code = "def add(a, b):\n    return a + b  # 42\n\nprint(add(1, 2))\r\n"
    records = [
        {"id": f"d{i}", "text": (english, chinese, code)[i % 3] * (1 + i % 4) + f"#{i}"} for i in range(60)
    ]
    values = {
        "input": {"path": str(_jsonl(tmp_path / "in.jsonl", records))},
        "output_dir": str(tmp_path / "out"),
        "stages": ["train_tokenizer", "tokenize_pack"],
        "tokenizer": {"vocab_size": 600, "padded_vocab_size": 102400, "max_bytes": None},
        "pack": {"shard_tokens": 500},
    }
    stats = run(load_config(values))
    tok_dir = tmp_path / "out" / "tokenizer"
    meta = json.loads((tok_dir / "meta.json").read_text())
    assert meta["padded_vocab_size"] == 102400 and meta["eos_id"] == 1
    tokenizer = Tokenizer.from_file(str(tok_dir / "tokenizer.json"))
    vocab = tokenizer.get_vocab()
    assert not [t for t in vocab if sum(c.isdigit() for c in t) > 1]
    assert not [t for t in vocab if ("Ċ" in t or "č" in t) and len(t) > 1]  # \n and \r stand alone
    for text in (english, chinese, code):
        assert tokenizer.decode(tokenizer.encode(text).ids) == text
    packed = PackedTokens(tmp_path / "out" / "shards")
    assert packed.meta["dtype"] == "uint32" and len(packed.meta["shards"]) > 1
    texts = [r["text"] for r in records]
    doc_tokens = sum(len(tokenizer.encode(t).ids) for t in texts)
    assert (
        len(packed)
        == doc_tokens + len(texts)
        == stats["stages"]["tokenize_pack"]["details"]["tokenize_pack.merge"]["tokens"]
    )
    ends = packed.document_ends
    stream = packed.window(0, len(packed))
    assert (stream[ends - 1] == packed.eos_id).all() and (stream == packed.eos_id).sum() == len(texts)
    starts = np.concatenate([[0], ends[:-1]])
    assert [tokenizer.decode(stream[s : e - 1].tolist()) for s, e in zip(starts, ends)] == texts
