"""Passkey retrieval: the shipped corpora are what the generator writes, the prompts are as long
and as deep as asked, and the score separates a model that retrieves from one that does not."""

from __future__ import annotations

import functools
import math
import random
from pathlib import Path

import pytest
import torch
from tokenizers import Tokenizer

from data_contract.errors import ConfigError
from dsl_lit.config.passkey import PasskeyConfig
from dsl_lit.evaluation.passkey import (
    passkey_accuracy,
    passkey_outcomes,
    passkey_prompt,
    shares,
    with_context,
)
from dsl_lit.models import ModelConfig, build_model
from dsl_lit.tasks.passkey import CORPORA, KEY_LENGTH, QUESTION, SHIPPED_DIR, key_sentence, write_corpus
from tests.passkey_models import Retriever, word_tokenizer


def test_shipped_corpora_are_what_the_generator_writes(tmp_path: Path) -> None:
    for corpus in CORPORA.values():
        shipped = SHIPPED_DIR / corpus.name / "passkey.jsonl.gz"
        assert write_corpus(corpus, tmp_path).read_bytes() == shipped.read_bytes(), corpus.name


@functools.cache
def _tokenizer() -> Tokenizer:
    return word_tokenizer()


@pytest.mark.parametrize("length", [64, 128, 512, 2048])
@pytest.mark.parametrize("depth", [0.0, 0.5, 1.0])
def test_prompts_fill_the_length_with_the_key_at_the_depth(length: int, depth: float) -> None:
    tokenizer = _tokenizer()
    prompt = passkey_prompt(tokenizer, random.Random(0), length, depth)
    assert length - 16 < len(prompt.tokens) <= length  # within one filler sentence of the length
    assert prompt.answer_len == KEY_LENGTH
    text = tokenizer.decode(prompt.tokens[prompt.key_position:prompt.key_position + 3])
    assert text.split()[:2] == ["Pass", "key"]
    fixed = len(tokenizer.encode(key_sentence("x") + QUESTION + " x").ids)  # all but the filler
    # depth counts sentences, of 3-6 tokens each: a sum of ~depth*n of them strays by a few sd
    assert abs(prompt.key_position - depth * (len(prompt.tokens) - fixed)) <= 0.02 * length + 8


def test_accuracy_separates_retrieval_from_a_near_miss() -> None:
    tokenizer = _tokenizer()
    lengths, depths = [96, 400], [0.0, 0.5, 1.0]
    perfect = passkey_accuracy(Retriever(tokenizer), tokenizer, lengths, depths, per_depth=4)
    assert all(a == 1.0 for row in perfect.values() for a in row.values())
    wrong = passkey_accuracy(Retriever(tokenizer, wrong=True), tokenizer, lengths, depths, per_depth=4)
    assert all(a == 0.0 for row in wrong.values() for a in row.values())


def test_outcomes_are_prompt_by_prompt_on_the_same_prompts() -> None:
    """Two models are compared prompt by prompt (the reproduce report's paired interval): one
    outcome per prompt, the same prompts for the same seed, other prompts for another seed."""
    tokenizer = _tokenizer()

    class Alternating(Retriever):  # right on every other prompt it is shown
        def __init__(self, tokenizer: Tokenizer) -> None:
            super().__init__(tokenizer)
            self.calls = 0

        def forward(self, tokens: torch.Tensor) -> torch.Tensor:
            self.calls += 1
            return super().forward(tokens) if self.calls % 2 else torch.zeros_like(super().forward(tokens))

    outcomes = passkey_outcomes(Alternating(tokenizer), tokenizer, [96, 400], [0.0, 1.0], per_depth=3)
    assert {n: {d: len(hits) for d, hits in row.items()} for n, row in outcomes.items()} == \
        {96: {0.0: 3, 1.0: 3}, 400: {0.0: 3, 1.0: 3}}
    assert [hit for row in outcomes.values() for hits in row.values() for hit in hits] == [True, False] * 6
    assert shares(outcomes)[96] == {0.0: 2 / 3, 1.0: 1 / 3}
    prompts = [passkey_prompt(tokenizer, random.Random(f"{seed}/96/0.0"), 96, 0.0).tokens for seed in (0, 0, 1)]
    assert prompts[0] == prompts[1] != prompts[2]


def test_with_context_extrapolates_or_applies_yarn_to_the_same_weights() -> None:
    torch.manual_seed(0)
    model = build_model(ModelConfig.from_name("deepseek_v3_tiny", max_seq_len=64, vocab_size=256)).eval()
    tokens = torch.randint(0, 256, (1, 200))
    longer = with_context(model, 256)
    with torch.no_grad():
        # the same tables where both have them: the first 64 positions give the same logits
        torch.testing.assert_close(longer(tokens[:, :64]), model(tokens[:, :64]), rtol=0, atol=0)
        longer(tokens)  # positions past the trained length now have tables
        yarn = with_context(model, 256, {"factor": 4, "original_max_seq_len": 64, "mscale": 1.0, "mscale_all_dim": 1.0})
        assert yarn.config.rope_scaling["factor"] == 4
        # YaRN interpolates the low frequencies (the first dims keep theirs) and, with mscale ==
        # mscale_all_dim, moves the attention temperature into MLA's softmax scale
        assert torch.equal(yarn.rope.cos[:64, 0], longer.rope.cos[:64, 0])
        assert not torch.allclose(yarn.rope.cos[:64, 7], longer.rope.cos[:64, 7])
        attention = yarn.layers["0"].attention.softmax_scale / model.layers["0"].attention.softmax_scale
        assert attention == pytest.approx((0.1 * math.log(4) + 1) ** 2)
    assert with_context(model, 64) is model


@pytest.mark.parametrize(("field", "values"), [
    ("checkpoint", {"checkpoint": None}), ("lengths", {"lengths": [16]}), ("depths", {"depths": [1.5]}),
    ("per_depth", {"per_depth": 0}), ("rope_scaling.scale", {"rope_scaling": {"scale": 4}}),
])
def test_bad_options_name_the_field(field: str, values: dict) -> None:
    with pytest.raises(ConfigError, match=field.replace(".", r"\.")):
        PasskeyConfig(**{"checkpoint": "x", **values}).validate()
