"""DAPO's rollout-side pieces (arXiv 2503.14476): the soft overlong punishment, overlong
filtering, dynamic sampling (which groups are dropped, how many draws, how a batch is filled at the
cap) inside ``GRPOModule``'s rollout with a real model and generator, their config validation and
the ``grpo=dapo`` preset. TRL's values for the same penalty and filtering:
tests/unit/posttrain/test_grpo_trl_reference.py; the preset's recipe run: tests/e2e/recipes/test_posttrain_recipes.py."""

from __future__ import annotations

import zlib

import pytest
import torch
from omegaconf import OmegaConf
from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers

from data_contract.errors import ConfigError
from data_contract.format import ASSISTANT_TOKEN, BOS_TOKEN, EOS_TOKEN, PAD_TOKEN, USER_TOKEN
from dsl_lit.config.optim import OptimConfig, ScheduleConfig
from dsl_lit.config.posttrain import (
    DynamicSamplingConfig,
    GRPOConfig,
    PostTrainConfig,
    SamplingConfig,
    TaskConfig,
)
from dsl_lit.models import ModelConfig
from dsl_lit.posttrain import GRPOModule
from dsl_lit.posttrain.chat.tokenizer import ChatTokenizer
from dsl_lit.posttrain.grpo.dapo import GroupSelection, informative_groups, overlong_penalty
from dsl_lit.posttrain.grpo.data import prompt_rows
from dsl_lit.posttrain.grpo.rollout import Rollouts, training_rows
from dsl_lit.posttrain.rewards import WeightedRewards
from dsl_lit.tasks import arithmetic
from tests.conftest import compose_config


def test_soft_overlong_penalty_values():
    """L_max 24, L_cache 5: nothing up to 19 tokens, then -1/5 per token, -1 from 24 on."""
    lengths = torch.tensor([1, 19, 20, 22, 24, 30])
    assert overlong_penalty(lengths, 24, 5).tolist() == pytest.approx([0, 0, -0.2, -0.6, -1, -1])
    assert overlong_penalty(lengths, 24, 0).tolist() == [0.0] * 6  # cache 0: off
    assert overlong_penalty(lengths, 24, 24).tolist() == pytest.approx([-1 / 24, -19 / 24, -20 / 24, -22 / 24, -1, -1])


def _rollouts(draw: int, rewards: list[float], penalty: list[float] | None = None, group_size: int = 2) -> Rollouts:
    """A draw whose completions name it: completion ``[draw, group, i]``."""
    n = len(rewards)
    penalty = torch.tensor(penalty) if penalty is not None else torch.zeros(n)
    return Rollouts([[7]] * n, [[draw, i // group_size, i % group_size] for i in range(n)], torch.tensor(rewards),
                    penalty, {"accuracy": torch.tensor(rewards)}, group_size)


def _groups(rollouts: Rollouts) -> list[tuple[int, int]]:
    """(draw, group) of each group, in order."""
    return [tuple(c[:2]) for c in rollouts.completions[:: rollouts.group_size]]


def test_groups_with_equal_rewards_are_dropped_until_the_batch_is_full():
    assert informative_groups(torch.tensor([1.0, 1.0, 0.0, 1.0, 0.5, 0.5]), 2).tolist() == [False, True, False]
    # draw 0's first group differs only by its length penalty: no signal about the task, dropped
    draws = [_rollouts(0, [1, 1, 0, 1, 0.5, 0.5], penalty=[0, -0.5, 0, 0, 0, 0]), _rollouts(1, [0, 0, 1, 0, 1, 1]),
             _rollouts(2, [2, 0, 3, 1, 0, 0], penalty=[0, 0, 0, 0, -0.2, -1])]
    selection = GroupSelection(num_groups=3)
    for k, draw in enumerate(draws):
        selection.add(draw)
        assert selection.full == (k == 2)  # one informative group in each of the first two draws, two in the third
    batch, counts = selection.batch()
    assert _groups(batch) == [(0, 1), (1, 1), (2, 0)]  # informative groups in sampling order; (2, 1) is not needed
    assert batch.rewards.tolist() == [0, 1, 1, 0, 2, 0] and batch.parts["accuracy"].tolist() == [0, 1, 1, 0, 2, 0]
    assert batch.penalty.tolist() == [0] * 6
    assert counts == {"grpo/draws": 3, "grpo/dropped_groups": 5, "grpo/filled_groups": 0}


def test_at_the_draw_cap_dropped_groups_fill_the_batch():
    selection = GroupSelection(num_groups=3)
    for draw in (_rollouts(0, [1, 1, 0, 1, 0.5, 0.5]), _rollouts(1, [0, 0, 1, 0, 1, 1])):
        selection.add(draw)
    batch, counts = selection.batch()
    assert _groups(batch) == [(0, 1), (1, 1), (0, 0)]  # the first dropped group fills the third place
    assert counts == {"grpo/draws": 2, "grpo/dropped_groups": 4, "grpo/filled_groups": 1}
    rows, _ = training_rows(batch, pad_id=0, eos_id=1)
    assert rows["advantages"][4:].tolist() == [0.0, 0.0]  # a filler adds no policy gradient


def test_overlong_filtering_masks_truncated_completions():
    eos = 1
    rollouts = Rollouts([[5, 6], [5, 6], [9], [9]], [[3, eos], [3, 4, 4, 4], [eos], [8, 8, eos]],
                        torch.tensor([1.0, 0.0, 0.0, 1.0]), torch.tensor([0.0, -0.5, 0.0, 0.0]), {}, 2)
    rows, truncated = training_rows(rollouts, pad_id=0, eos_id=eos, filter_overlong=True)
    assert truncated.tolist() == [False, True, False, False]
    targets = rows["labels"][:, -4:] != -100
    assert targets.tolist() == [[True, True, False, False], [False] * 4, [True, False, False, False], [True, True, True, False]]
    plain, _ = training_rows(rollouts, pad_id=0, eos_id=eos)
    assert plain["labels"][1, -4:].tolist() == [3, 4, 4, 4]  # without the filter it is trained on
    assert torch.equal(rows["advantages"], plain["advantages"])  # its reward still counts in its group
    # advantages of the rewards plus the length penalty: group 1 is (1, -0.5), unbiased std 1.5 / sqrt(2)
    assert rows["advantages"][:2].tolist() == pytest.approx([0.75 / (1.5 / 2**0.5 + 1e-4), -0.75 / (1.5 / 2**0.5 + 1e-4)])


def _char_tokenizer() -> ChatTokenizer:
    """A real tokenizer with one token per printable character and DeepSeek's chat tokens."""
    specials = [BOS_TOKEN, EOS_TOKEN, PAD_TOKEN, USER_TOKEN, ASSISTANT_TOKEN]
    vocab = {token: i for i, token in enumerate(specials + [chr(c) for c in range(32, 127)])}
    backend = Tokenizer(models.WordLevel(vocab, unk_token=PAD_TOKEN))
    backend.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    backend.decoder = decoders.Fuse()
    backend.add_special_tokens(specials)
    meta = {"bos_id": 0, "eos_id": 1, "pad_id": 2, "vocab_size": len(vocab)}
    return ChatTokenizer(backend, meta, {"bos_token": BOS_TOKEN, "eos_token": EOS_TOKEN, "pad_token": PAD_TOKEN})


def _spread(text: str, sample: dict) -> float:
    """0 for a problem with an even answer (its group is always dropped), else a value of the text
    (four different completions of one prompt get four different values)."""
    return 0.0 if int(sample["answer"]) % 2 == 0 else zlib.crc32(text.encode()) / 2**32


def _module(problems: list[dict], max_draws: int) -> GRPOModule:
    tokenizer = _char_tokenizer()
    grpo = GRPOConfig(group_size=4, beta=0.0, sampling=SamplingConfig(max_new_tokens=6),
                      dynamic_sampling=DynamicSamplingConfig(enabled=True, max_draws=max_draws)).validate()
    torch.manual_seed(0)
    model = ModelConfig.from_name("deepseek_llm_tiny", vocab_size=tokenizer.vocab_size, n_layers=1, d_model=32,
                                  n_heads=2, n_kv_heads=2, ffn_hidden=64)
    module = GRPOModule(model, OptimConfig(lr=1e-3), ScheduleConfig(name="constant", warmup_steps=0), micro_batch_size=8,
                        total_steps=1, grpo=grpo, rewards=WeightedRewards({"spread": 1.0}, {"spread": _spread}),
                        problems=problems, tokenizer=tokenizer, seed=3)
    module.configure_model()  # what Lightning calls before training
    return module


def _answers(module: GRPOModule, rollouts: Rollouts) -> list[int]:
    """The answer of each group's problem, read back from its prompt."""
    by_question = {p["question"]: int(p["answer"]) for p in module.problems}
    prompts = rollouts.prompts[:: rollouts.group_size]
    return [by_question[module.tokenizer.decode(p).split("What is ")[1].split("?")[0]] for p in prompts]


def test_dynamic_sampling_in_the_module_draws_until_the_batch_is_informative():
    """Sampling with a real model: groups of even-answer problems are dropped, more training
    problems are drawn (with the step's seeded generator) until 4 odd-answer groups are held."""
    train, _ = arithmetic.split(TaskConfig(max_operand=9, num_problems=60, eval_problems=0))
    batch_problems = [p for p in train if int(p["answer"]) % 2 == 0][:2] + [p for p in train if int(p["answer"]) % 2][:2]
    module = _module(train, max_draws=8)
    batch = prompt_rows(batch_problems, module.tokenizer)
    batch["index"] = torch.tensor([train.index(p) for p in batch_problems])
    chosen, sampled, counts = module.sample_batch(batch)
    assert chosen.num_groups == 4 and sampled.num_groups == 4 * counts["grpo/draws"]
    answers = _answers(module, sampled)
    assert answers[:4] == [int(p["answer"]) for p in batch_problems]  # the data's batch comes first
    assert counts["grpo/dropped_groups"] == sum(a % 2 == 0 for a in answers) >= 2
    assert counts["grpo/filled_groups"] == 0 and 2 <= counts["grpo/draws"] <= 8
    odd = [g for g, a in enumerate(answers) if a % 2]
    assert _answers(module, chosen) == [answers[g] for g in odd[:4]]  # the first informative groups, in order
    assert chosen.completions == sampled.select(odd[:4]).completions
    assert sum(a % 2 for a in answers[:-4]) < 4  # no more draws than needed
    again, _, _ = module.sample_batch(batch)  # the same step draws the same prompts and completions (resume)
    assert again.completions == chosen.completions
    rows, _ = training_rows(chosen, pad_id=module.tokenizer.pad_id, eos_id=module.tokenizer.eos_id)
    assert rows["input_ids"].shape[0] == 16 and (rows["advantages"].view(4, 4).abs().sum(1) > 0).all()


def test_dynamic_sampling_cap_on_a_batch_of_uninformative_problems():
    train, _ = arithmetic.split(TaskConfig(max_operand=9, num_problems=60, eval_problems=0))
    even = [p for p in train if int(p["answer"]) % 2 == 0]
    module = _module(even, max_draws=3)  # every problem's group is dropped
    batch = prompt_rows(even[:4], module.tokenizer)
    batch["index"] = torch.arange(4)
    chosen, sampled, counts = module.sample_batch(batch)
    assert counts == {"grpo/draws": 3, "grpo/dropped_groups": 12, "grpo/filled_groups": 4}
    assert chosen.completions == sampled.completions[:16]  # the first draw's groups fill the batch


def _grpo_section(*overrides: str) -> GRPOConfig:
    raw = OmegaConf.to_container(compose_config("grpo", list(overrides)), resolve=True)
    return PostTrainConfig.from_raw(raw).grpo


def test_dapo_preset_and_the_default():
    default, dapo = _grpo_section(), _grpo_section("grpo=dapo")
    assert (default.eps_high, default.beta, default.loss_type) == (0.2, 0.001, "grpo")
    assert not default.dynamic_sampling.enabled and not default.overlong.filter and default.overlong.penalty_cache == 0
    assert (dapo.eps_low, dapo.eps_high, dapo.beta, dapo.loss_type) == (0.2, 0.28, 0.0, "dapo")
    assert dapo.dynamic_sampling.enabled and dapo.overlong.filter and dapo.overlong.penalty_cache == 5
    assert dapo.overlong_max_length == 32 and dapo.group_size == default.group_size  # the rest is the default's
    assert _grpo_section("grpo=dapo", "grpo.dynamic_sampling.max_draws=2").dynamic_sampling.max_draws == 2


@pytest.mark.parametrize("override, field", [
    ("grpo.dynamic_sampling.max_draws=0", "grpo.dynamic_sampling.max_draws=0"),
    ("grpo.overlong.penalty_cache=-1", "grpo.overlong.penalty_cache=-1"),
    ("grpo.overlong.max_length=0", "grpo.overlong.max_length=0"),
    ("grpo.overlong.penalty_cache=40", "grpo.overlong.penalty_cache=40 must be <= L_max = grpo.sampling.max_new_tokens=32"),
    ("+grpo.dynamic_sampling.cap=3", "grpo.dynamic_sampling.cap is not a known field"),
    ("grpo.overlong.filter=maybe", "grpo.overlong.filter='maybe' has the wrong type"),
])
def test_bad_dapo_settings_fail_naming_the_field(override, field):
    with pytest.raises(ConfigError, match=field.replace(".", r"\.")):
        _grpo_section("grpo=dapo", override)
    assert _grpo_section("grpo=dapo", "grpo.overlong.penalty_cache=40", "grpo.overlong.max_length=48").overlong_max_length == 48
