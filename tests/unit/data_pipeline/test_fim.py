"""Fill-in-the-middle at the document level (DeepSeek-V3 section 4.1)."""

from __future__ import annotations

from pathlib import Path

import pytest
from tokenizers import Tokenizer

from data_contract.errors import ConfigError
from data_contract.format import FIM_BEGIN_TOKEN, FIM_END_TOKEN, FIM_HOLE_TOKEN
from data_pipeline.tokenizer.fim import encode_documents, fim_token_ids, plan_document
from data_pipeline.tokenizer.spec import load_spec
from data_pipeline.tokenizer.training import train_tokenizer
from dsl_lit.config.data import DataConfig
from tests.conftest import ROOT, scratch_dir

TEXTS = [f"Verse {i}: and the waters prevailed upon the earth {i * 7} days. " * (1 + i % 3) for i in range(400)]


@pytest.fixture(scope="module")
def tokenizer(request: pytest.FixtureRequest) -> Tokenizer:
    directory = train_tokenizer(TEXTS, 400, scratch_dir(request, "tok") / "tokenizer")  # the bundled spec
    return Tokenizer.from_file(str(directory / "tokenizer.json"))


def test_plans_are_deterministic_per_document_and_hit_the_rate():
    plans = [plan_document("x" * 50, 0.1, 0.5, seed=7, shard=s, row=r) for s in range(4) for r in range(2500)]
    assert plans == [plan_document("x" * 50, 0.1, 0.5, seed=7, shard=s, row=r) for s in range(4) for r in range(2500)]
    cut = [p for p in plans if p.cuts is not None]
    assert abs(len(cut) / len(plans) - 0.1) < 0.015  # 10000 Bernoulli(0.1) draws: std 0.003
    assert abs(sum(p.spm for p in cut) / len(cut) - 0.5) < 0.06
    assert all(0 <= i <= j <= 50 for i, j in (p.cuts for p in cut))
    assert plans != [plan_document("x" * 50, 0.1, 0.5, seed=8, shard=s, row=r) for s in range(4) for r in range(2500)]


@pytest.mark.parametrize("spm", [False, True], ids=["psm", "spm"])
def test_documents_are_rearranged_with_the_fim_tokens_and_keep_their_text(tokenizer, spm):
    begin, hole, end = fim_token_ids(tokenizer)
    assert [tokenizer.id_to_token(i) for i in (begin, hole, end)] == [FIM_BEGIN_TOKEN, FIM_HOLE_TOKEN, FIM_END_TOKEN]
    text = TEXTS[5]
    plan = type(plan_document(text, 1.0, 0.0, 0, 0, 0))((11, 40), spm=spm)
    (ids,) = encode_documents(tokenizer, [text], [plan], (begin, hole, end))
    assert ids[0] == begin and ids.count(hole) == ids.count(end) == 1

    def decode(part: list[int]) -> str:
        return tokenizer.decode(part, skip_special_tokens=False)

    h, e = ids.index(hole), ids.index(end)
    if spm:  # begin hole suffix end prefix+middle
        assert h == 1 and decode(ids[2:e]) == text[40:] and decode(ids[e + 1 :]) == text[:40]
    else:  # begin prefix hole suffix end middle
        assert decode(ids[1:h]) == text[:11] and decode(ids[h + 1 : e]) == text[40:] and decode(ids[e + 1 :]) == text[11:40]
    (plain,) = encode_documents(tokenizer, [text], [type(plan)(None)], None)
    assert plain == tokenizer.encode(text, add_special_tokens=False).ids


def test_a_tokenizer_without_fim_tokens_fails_early_naming_data_fim_rate(tmp_path):
    released_llm = train_tokenizer(TEXTS, 400, tmp_path / "llm", spec=load_spec("deepseek_llm"), embedding_size=102400)
    with pytest.raises(ConfigError, match=r"data.fim_rate=0.1 needs fill-in-the-middle tokens"):
        DataConfig(corpus_dir=str(ROOT / "data" / "corpus"), cache_dir=str(tmp_path / "cache"),
                   tokenizer_dir=str(released_llm), fim_rate=0.1).validate()
    with pytest.raises(ConfigError, match="pack.fim_rate > 0 needs the tokenizer's fill-in-the-middle tokens"):
        fim_token_ids(Tokenizer.from_file(str(Path(released_llm) / "tokenizer.json")))
