"""Rule-based rewards on crafted completions."""

from __future__ import annotations

import pytest

from dsl_lit.posttrain.rewards import (
    WeightedRewards,
    accuracy_reward,
    extract_answer,
    extract_boxed,
    format_reward,
    language_consistency_reward,
    restatement_reward,
    target_language_share,
)
from dsl_lit.tasks import arithmetic


@pytest.mark.parametrize(
    ("text", "reward"),
    [
        ("<think>3 + 4 = 7</think><answer>7</answer>", 1.0),
        ("  <think>\nadd them\n</think>\n<answer> 7 </answer>\n", 1.0),
        ("<think>x</think>", 0.0),  # no answer
        ("<answer>7</answer>", 0.0),  # no reasoning
        ("Sure! <think>x</think><answer>7</answer>", 0.0),  # text before
        ("<think>x</think><answer>7</answer> done", 0.0),  # text after
        ("<answer>7</answer><think>x</think>", 0.0),  # wrong order
        ("<think>a<think>b</think><answer>7</answer>", 0.0),  # nested tag
        ("<think>x</think><answer>7</answer><answer>8</answer>", 0.0),  # two answers
    ],
)
def test_format_reward(text, reward):
    assert format_reward(text) == reward


def test_extract_answer_and_boxed():
    assert extract_boxed(r"so \boxed{\frac{1}{2}} then \boxed{42}") == "42"
    assert extract_boxed(r"\boxed{\frac{1}{2}}") == r"\frac{1}{2}"
    assert extract_boxed(r"\boxed{unclosed") is None
    assert extract_answer("<answer>1</answer> <answer> 12 </answer>") == "12"
    assert extract_answer(r"<answer>it is \boxed{5}</answer>") == "5"
    assert extract_answer(r"the answer is \boxed{-3}") == "-3"
    assert extract_answer("no answer here") is None


@pytest.mark.parametrize(
    ("completion", "answer", "checker", "reward"),
    [
        ("<think>12+7</think><answer>19</answer>", "19", "numeric", 1.0),
        ("<think>12+7</think><answer>19.0</answer>", "19", "numeric", 1.0),
        ("<think></think><answer>1,234</answer>", "1234", "numeric", 1.0),
        ("<think></think><answer>7/2</answer>", "3.5", "numeric", 1.0),
        (r"<think></think><answer>\frac{7}{2}</answer>", "3.5", "numeric", 1.0),
        ("<think></think><answer>18</answer>", "19", "numeric", 0.0),
        ("<think></think><answer>nineteen</answer>", "19", "numeric", 0.0),
        ("<think>19</think>", "19", "numeric", 0.0),  # the reasoning is not the answer
        ("<answer>Paris</answer>", "Paris", "exact", 1.0),
        ("<answer>paris</answer>", "Paris", "exact", 0.0),
        (r"the total is \boxed{19}", "19", "boxed", 1.0),
        ("<answer>19</answer>", "19", "boxed", 0.0),  # boxed checker wants \boxed{}
    ],
)
def test_accuracy_reward(completion, answer, checker, reward):
    assert accuracy_reward(completion, {"answer": answer}, checker=checker) == reward


def test_accuracy_checker_from_sample():
    assert accuracy_reward("<answer>Paris</answer>", {"answer": "Paris", "checker": "exact"}) == 1.0
    with pytest.raises(ValueError, match="checker"):
        accuracy_reward("<answer>1</answer>", {"answer": "1"}, checker="fuzzy")


def test_language_consistency():
    assert target_language_share("add the two numbers", "en") == 1.0
    assert target_language_share("add 两个 numbers", "en") == pytest.approx(2 / 4)  # 两 and 个 are words
    assert target_language_share("两个数相加", "zh") == 1.0
    assert target_language_share("12 + 7 = 19", "en") == 0.0  # no words at all
    # only the reasoning counts, and the sample names the language
    completion = "<think>сложим числа then add it</think><answer>English words here</answer>"
    assert language_consistency_reward(completion, {"language": "en"}) == pytest.approx(3 / 5)
    assert language_consistency_reward(completion, {"language": "ru"}) == pytest.approx(2 / 5)


def test_weighted_rewards():
    rewards = WeightedRewards({"accuracy": 1.0, "format": 0.5})
    completions = ["<think>a</think><answer>3</answer>", "<answer>3</answer>", "<think>a</think><answer>4</answer>"]
    total, parts = rewards(completions, [{"answer": "3"}] * 3)
    assert total.tolist() == [1.5, 1.0, 0.5]
    assert parts["accuracy"].tolist() == [1.0, 1.0, 0.0] and parts["format"].tolist() == [1.0, 0.0, 1.0]
    with pytest.raises(ValueError, match="unknown reward"):
        WeightedRewards({"length": 1.0})


LIST = {"question": "the largest of 6 0 4 8", "answer": "8"}


@pytest.mark.parametrize(
    ("completion", "reward"),
    [
        ("<think>the largest of 6 0 4 8 = 8</think><answer>8</answer>", 1.0),
        ("<think> the largest of 6 0 4 8  = 8</think><answer>8</answer>", 1.0),  # spacing around the question
        ("<think>the largest of 6 6 4 8 = 8</think><answer>8</answer>", 0.0),  # misquoted, right by luck
        ("<think>the largest of 6 0 4 8 9 = 9</think><answer>9</answer>", 0.0),  # a number added
        ("<think>the largest of 6 0 4 = 6</think><answer>8</answer>", 0.0),  # a number dropped
        ("<think>largest: 8</think><answer>8</answer>", 0.0),  # no restatement
        ("<answer>8</answer>", 0.0),  # no reasoning
    ],
)
def test_restatement_reward(completion, reward):
    assert restatement_reward(completion, LIST) == reward
    assert restatement_reward(completion, {"answer": "8"}) == 0.0  # a sample without its question


def test_every_generated_reference_reply_restates_its_question():
    """The rule holds for the generated tasks' own reference replies (every operation)."""
    from dsl_lit.config.posttrain import TaskConfig

    for task in (TaskConfig(), TaskConfig(operations=["largest"], list_length=4)):
        for problem in arithmetic.problems(task.validate())[:50]:
            assert restatement_reward(arithmetic.reply(problem), problem) == 1.0, problem
            assert restatement_reward(arithmetic.reply(problem, "x"), problem) == 1.0  # the answer is another rule's
