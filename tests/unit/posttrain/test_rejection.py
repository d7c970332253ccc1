"""Rejection sampling keeps exactly the completions the rules accept, and writes SFT conversations."""

from __future__ import annotations

import torch

from dsl_lit.config.posttrain import RejectionConfig, SamplingConfig, TaskConfig
from dsl_lit.models import ModelConfig, build_model
from dsl_lit.posttrain.rejection.data import RejectionStats, rejection_sample, select
from dsl_lit.posttrain.rewards import WeightedRewards
from dsl_lit.tasks import arithmetic
from tests.unit.posttrain.test_sft import tokenizer  # noqa: F401  (fixture)

GOOD, WRONG, UNFORMATTED = "<think>2 + 3 = 5</think><answer>5</answer>", "<think>2 + 3 = 6</think><answer>6</answer>", "5"


def test_select_keeps_verified_finished_distinct_samples():
    problems = [{"question": "2 + 3", "answer": "5"}, {"question": "1 + 1", "answer": "2"}]
    texts = [GOOD, WRONG, GOOD, UNFORMATTED,  # problem 0: two good (same text), one unfinished below
             "<think>1 + 1 = 2</think><answer>2</answer>", WRONG, UNFORMATTED, "<think>1+1</think><answer>2</answer>"]
    ended = [True, True, True, True, False, True, True, True]
    rewards = WeightedRewards({"accuracy": 0.5, "format": 0.5})
    stats = RejectionStats()
    kept = select(texts, ended, problems, rewards, RejectionConfig(keep_per_prompt=2), stats)
    assert kept[0] == [(GOOD, 1.0), (GOOD, 1.0)]  # both accepted; no other distinct text to prefer
    assert kept[1] == [("<think>1+1</think><answer>2</answer>", 1.0)]  # the unfinished correct one is dropped
    assert stats.accepted_samples == 3 and stats.prompts_with_a_kept_sample == 2
    # distinct texts first: with keep 1 of [GOOD, GOOD] only one copy; without verification anything finished
    loose = select(texts, ended, problems, rewards, RejectionConfig(keep_per_prompt=3, verify=False), RejectionStats())
    assert [t for t, _ in loose[0]] == [GOOD, WRONG, UNFORMATTED]
    assert [r for _, r in loose[0]] == [1.0, 0.5, 0.0]


def test_rejection_sample_with_a_model(tokenizer):  # noqa: F811
    torch.manual_seed(0)
    model = build_model(ModelConfig.from_name("deepseek_llm_tiny", n_layers=1)).eval()
    problems = arithmetic.problems(TaskConfig(num_problems=3, eval_problems=0))
    cfg = RejectionConfig(samples_per_prompt=3, sampling=SamplingConfig(max_new_tokens=6))
    records, stats = rejection_sample(model, tokenizer, problems, arithmetic.prompt, cfg)
    assert stats.samples == 9 and stats.prompts == 3
    assert records == [] and stats.accepted_samples == 0  # a random model never answers in the format
