"""The quality filters decide exactly as the per-document implementation did (recorded verdicts).

``tests/fixtures/filter_verdicts.json`` holds, for the bundled corpus, seeded messy pages and the
multilingual samples, under the defaults and under settings where each rule set's later rules
decide, which documents each configuration removed, for which rule, and a digest of the texts C4
left: any change of a statistic that flips one decision, or of C4's rewriting, fails here.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.fixtures.make_filter_verdicts import configs, corpora, verdicts

RECORDED = json.loads((Path(__file__).resolve().parents[2] / "fixtures" / "filter_verdicts.json").read_text(encoding="utf-8"))
CORPORA = corpora()


@pytest.mark.parametrize("config", sorted(configs()))
@pytest.mark.parametrize("corpus", sorted(CORPORA))
def test_verdicts_equal_the_recorded_ones(corpus: str, config: str) -> None:
    expected = RECORDED[f"{corpus}/{config}"]
    got = verdicts(CORPORA[corpus], configs()[config])
    for reason in sorted(set(expected["removed"]) | set(got["removed"])):
        assert got["removed"].get(reason, []) == expected["removed"].get(reason, []), reason
    assert got["texts_sha256"] == expected["texts_sha256"]


@pytest.mark.parametrize("batch_size", [1, 7])
def test_batching_changes_nothing(batch_size: int) -> None:
    """One document at a time (``judge``) or in odd batches, the verdicts are the recorded ones."""
    for config in ("default", "gopher_repetition_top", "gopher_quality_late"):
        expected = RECORDED[f"messy/{config}"]
        assert verdicts(CORPORA["messy"], configs()[config], batch_size) == expected, config


def test_the_recorded_verdicts_cover_every_rule() -> None:
    """Each rule removed something somewhere, so none of them goes unchecked."""
    reasons = {r for entry in RECORDED.values() for r in entry["removed"]}
    expected = {
        "gopher_quality:" + r
        for r in ("min_doc_words", "max_doc_words", "min_avg_word_length", "max_avg_word_length",
                  "max_symbol_word_ratio", "max_bullet_lines_ratio",
                  "max_ellipsis_lines_ratio", "max_non_alpha_words_ratio", "min_stop_words")
    } | {
        "gopher_repetition:" + r
        for r in ("dup_line_frac", "dup_line_char_frac", "dup_para_frac", "dup_para_char_frac", "top_1_gram",
                  "top_2_gram", "top_3_gram", "top_4_gram", *(f"dup_{n}_grams" for n in range(5, 11)))
    } | {"c4:" + r for r in ("curly_bracket", "lorem_ipsum", "min_num_sentences", "no_lines_left")} | {
        "fineweb:" + r for r in ("empty", "line_punct_ratio", "short_line_ratio", "char_dup_ratio", "list_ratio")
    }
    assert expected <= reasons, sorted(expected - reasons)
