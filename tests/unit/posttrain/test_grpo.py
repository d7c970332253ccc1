"""GRPO's rollout rows: the training pass scores exactly the tokens that were sampled.

A rollout is left-padded prompts followed by completions (pad after the end-of-sequence token);
``shifted_completion`` turns it into (inputs, labels on the completion only, attention mask), and the
policy's forward with the mask's positions must give the sampler's own log-probabilities. If the
labels were shifted by one, or padding leaked into positions, the clipped objective would credit
other tokens than the rewarded ones while every loss-level test still passed.
The recipe end to end: tests/e2e/recipes/test_posttrain_recipes.py."""

from __future__ import annotations

import pytest
import torch

from dsl_lit.inference.generation import generate, positions_from_mask
from dsl_lit.models import ModelConfig, build_model
from dsl_lit.posttrain.grpo.rollout import rollout_sequences
from dsl_lit.posttrain.logps import token_logps
from dsl_lit.posttrain.module import shifted_completion
from tests.numerics import assert_close_fp32


@pytest.mark.parametrize("family", ["deepseek_llm_tiny", "deepseek_v3_tiny"])
def test_rollout_rows_score_the_sampled_tokens(family):
    torch.manual_seed(0)
    model = build_model(ModelConfig.from_name(family, n_layers=2)).eval()
    prompts = [[5, 9, 14], [7, 3, 3, 8, 21, 4], [11], [7, 3, 3, 8, 21, 4]]  # different lengths: left padding
    out = generate(model, prompts, 12, temperature=1.0, eos_token_id=2, pad_token_id=0,
                   generator=torch.Generator().manual_seed(3))
    rows = shifted_completion(out.sequences, out.attention_mask, out.prompt_length)
    # the rows GRPO trains on are rebuilt from the completion lists (so groups of several generate
    # calls can be joined): they are the sampler's own sequences
    sequences, valid, prompt_length = rollout_sequences(prompts, out.completions, 0)
    assert torch.equal(sequences, out.sequences) and torch.equal(valid, out.attention_mask)
    assert prompt_length == out.prompt_length
    completion = out.completion_mask
    labels = rows["labels"][:, -completion.shape[1]:]
    assert torch.equal(labels != -100, completion)  # exactly the sampled tokens are targets
    assert torch.equal(labels[completion], out.completion_ids[completion])
    assert (rows["labels"][:, : out.prompt_length - 1] == -100).all()  # never a prompt token
    valid = rows["attention_mask"].bool()
    with torch.no_grad():
        logits = model.head(model.hidden_states(rows["input_ids"], positions_from_mask(valid), valid))
    logps = token_logps(logits, rows["labels"])[:, -completion.shape[1]:]
    cfg = model.config  # the training forward vs the cached sampler: the same sums in another order
    assert_close_fp32(logps[completion], out.logprobs[completion], cfg.d_model * cfg.n_layers * out.sequences.shape[1])


@pytest.mark.parametrize("family", ["deepseek_llm_tiny", "deepseek_v3_tiny"])
def test_the_samplers_log_probs_reach_the_rows_aligned_with_the_labels(family):
    """GRPO's sampler records each token's log-prob at the sampling temperature (``rollout_logps``);
    in the rows they sit under the token they score, and one process in fp32 gives the training
    forward's own values to rounding: the mismatch the rollout correction measures is then ~0."""
    from dsl_lit.posttrain.grpo.rollout import Rollouts, training_rows
    from dsl_lit.posttrain.grpo.rollout_correction import rollout_correction

    torch.manual_seed(0)
    model = build_model(ModelConfig.from_name(family, n_layers=2)).eval()
    prompts = [[5, 9, 14], [5, 9, 14], [7, 3, 3, 8, 21, 4], [7, 3, 3, 8, 21, 4]]
    out = generate(model, prompts, 10, temperature=0.7, eos_token_id=2, pad_token_id=0,
                   generator=torch.Generator().manual_seed(3), logprob_temperature=0.7)
    logprobs = [row[: len(c)].tolist() for row, c in zip(out.logprobs, out.completions)]
    rollouts = Rollouts(prompts, out.completions, torch.tensor([1.0, 0.0, 0.0, 1.0]), torch.zeros(4), {}, 2, logprobs)
    rows, _ = training_rows(rollouts.select([1, 0]), pad_id=0, eos_id=2)  # selection keeps each row's own
    mask = rows["labels"] != -100
    assert torch.equal(rows["rollout_logps"] != 0, mask)
    valid = rows["attention_mask"].bool()
    with torch.no_grad():
        logits = model.head(model.hidden_states(rows["input_ids"], positions_from_mask(valid), valid))
    train = token_logps(logits, rows["labels"], 0.7)
    cfg = model.config
    assert_close_fp32(train[mask], rows["rollout_logps"][mask], cfg.d_model * cfg.n_layers * rows["input_ids"].shape[1])
    # at temperature 1 they would differ by far more than rounding: the temperature is the sampler's
    assert (token_logps(logits, rows["labels"])[mask] - rows["rollout_logps"][mask]).abs().max() > 1e-3
    gap = rollout_correction(train, rows["rollout_logps"], mask).abs_gap
    assert gap[mask].max() < 1e-4


def test_a_prompts_file_gives_problems_the_rewards_check(tmp_path, caplog):
    """``grpo.dataset=<jsonl>``: prompts (strings or messages) with reference answers and optional
    checkers; a line without them is set aside with its number; a missing file, or a cold start
    from the generated task's replies, is one line at start-up."""
    import json
    import logging

    from data_contract.errors import ConfigError
    from dsl_lit.config.posttrain import GRPOConfig
    from dsl_lit.posttrain.grpo.data import problem_prompt, read_problems
    from dsl_lit.posttrain.rewards.accuracy import accuracy_reward

    path = tmp_path / "prompts.jsonl"
    path.write_text("\n".join([json.dumps({"prompt": "What is 6 x 7?", "answer": 42}),
                               json.dumps({"prompt": [{"role": "system", "content": "Be brief."},
                                                      {"role": "user", "content": "Name it."}],
                                           "answer": "Paris", "checker": "exact"}),
                               json.dumps({"prompt": "no answer"}),
                               json.dumps({"prompt": "x", "answer": "1", "checker": "fuzzy"})]) + "\n")
    with caplog.at_level(logging.WARNING):
        problems = read_problems(path)
    assert "prompts.jsonl: 2 line(s) set aside: 3 (needs 'prompt'" in caplog.text and "; 4 (needs" in caplog.text
    assert problem_prompt(problems[0]) == [{"role": "user", "content": "What is 6 x 7?"}]
    assert problem_prompt(problems[1])[0]["role"] == "system"
    assert accuracy_reward("<think>6 x 7</think><answer>42</answer>", problems[0]) == 1.0
    assert accuracy_reward("<answer>paris</answer>", problems[1]) == 0.0  # the exact checker it asked for
    assert accuracy_reward("<answer>Paris</answer>", problems[1]) == 1.0
    # the same rows as a datasets save_to_disk directory: the same problems (ints of a mixed column as strings)
    import datasets

    rows = [json.loads(line) for line in path.read_text().splitlines()[:1]]
    datasets.Dataset.from_list([{"prompt": r["prompt"], "answer": str(r["answer"])} for r in rows]).save_to_disk(
        str(tmp_path / "prompts"))
    GRPOConfig(dataset=str(tmp_path / "prompts"), cold_start_steps=0).validate()
    assert read_problems(tmp_path / "prompts") == problems[:1]
    with pytest.raises(ConfigError, match=r"^grpo\.dataset=.*missing\.jsonl: no such file"):
        GRPOConfig(dataset=str(tmp_path / "missing.jsonl"), cold_start_steps=0).validate()
    with pytest.raises(ConfigError, match=r"^grpo\.dataset=.* with grpo\.cold_start_steps=60: the cold start trains"):
        GRPOConfig(dataset=str(path), cold_start_steps=60).validate()
