"""DPO: the objective through the module (reference log-probs cached vs a frozen reference model).
The recipe itself (loss falls, margin rises, and the same under pipeline parallelism) is tested in
tests/e2e/recipes/test_posttrain_recipes.py."""

from __future__ import annotations

import math

import pytest
import torch

from dsl_lit.config.optim import OptimConfig, ScheduleConfig
from dsl_lit.config.posttrain import DPOConfig, TaskConfig
from dsl_lit.models import ModelConfig
from dsl_lit.posttrain import DPOModule
from dsl_lit.posttrain.dpo.data import collate_pairs, preference_rows, task_pairs
from tests.numerics import assert_close_fp32, fp32_tolerance
from tests.unit.posttrain.test_sft import tokenizer  # noqa: F401  (fixture)


def test_pairs_are_interleaved_and_masked(tokenizer):  # noqa: F811
    pairs = task_pairs(TaskConfig(num_problems=40, eval_problems=4), 4)
    rows = preference_rows(pairs, tokenizer, seq_len=48)
    batch = collate_pairs([{k: v[i] for k, v in rows.items()} for i in range(4)])
    assert batch["input_ids"].shape == (8, 48)
    chosen, rejected = batch["labels"][0], batch["labels"][1]
    decode = tokenizer.decode
    assert decode(chosen[chosen != -100].tolist()) == pairs[0]["chosen"]
    assert decode(rejected[rejected != -100].tolist()) == pairs[0]["rejected"]
    assert torch.equal(batch["input_ids"][0, :5], batch["input_ids"][1, :5])  # same prompt


def test_cached_and_model_reference_agree_at_the_start(tokenizer):  # noqa: F811
    """At the start the policy is the reference: every pair's loss is log 2, whichever way the
    reference log-probs come (precomputed once and cached in the rows, or a frozen copy run each step)."""
    torch.manual_seed(0)
    cfg = ModelConfig.from_name("deepseek_llm_tiny", n_layers=1)
    module = DPOModule(cfg, OptimConfig(), ScheduleConfig(name="constant", warmup_steps=0), micro_batch_size=4,
                       total_steps=1, dpo=DPOConfig(reference="model"))
    module.configure_model()  # starting weights, then the frozen reference copy
    rows = preference_rows(task_pairs(TaskConfig(num_problems=40, eval_problems=4), 6), tokenizer, seq_len=48)
    rows["ref_logps"] = module.reference_logps(rows)
    assert rows["ref_logps"].shape == (6, 2) and (rows["ref_logps"] < 0).all()
    cached = collate_pairs([{k: v[i] for k, v in rows.items()} for i in range(6)])
    live = {k: v for k, v in cached.items() if k != "ref_logps"}
    results = [module.micro_batch_objective(b, module.loss_normalizers(b)) for b in (cached, live)]
    for loss, metrics in results:
        # beta x differences of the same log-probs (sums over <= 48 tokens): zero up to their rounding
        bound = fp32_tolerance(rows["ref_logps"], 48)["atol"] * module.dpo.beta
        assert abs(metrics["rewards/margin"].item()) < bound
        assert loss.item() == pytest.approx(math.log(2), abs=bound)
    # the gradient of the first step agrees too
    grads = []
    for loss, _ in results:
        module.model.zero_grad()
        loss.backward()
        grads.append(module.model.output.weight.grad.clone())
    assert_close_fp32(grads[0], grads[1], 12 * 48)  # summed over the 12 rows' positions


def test_a_pairs_file_in_trls_format_gives_the_rows_of_the_same_pairs(tokenizer, tmp_path, caplog):  # noqa: F811
    """``dpo.dataset=<jsonl>``: TRL's preference rows, replies as strings or as message lists, become
    the rows the generated pairs would; a line that is neither is set aside with its number; a
    missing file is one line at start-up."""
    import json
    import logging

    from data_contract.errors import ConfigError
    from dsl_lit.posttrain.dpo.data import load_pairs, read_pairs

    task = TaskConfig(num_problems=40, eval_problems=4)
    pairs = task_pairs(task, 3)
    lines = [json.dumps({"prompt": p["prompt"], "chosen": p["chosen"], "rejected": p["rejected"]}) for p in pairs[:2]]
    lines.append(json.dumps({"prompt": pairs[2]["prompt"], "chosen": [{"role": "assistant", "content": pairs[2]["chosen"]}],
                             "rejected": [{"role": "assistant", "content": pairs[2]["rejected"]}]}))
    lines += ["{oops", json.dumps({"prompt": "q", "chosen": "a"})]
    path = tmp_path / "pairs.jsonl"
    path.write_text("\n".join(lines) + "\n")
    with caplog.at_level(logging.WARNING):
        read = load_pairs(str(path), task, 99)
    assert "pairs.jsonl: 2 line(s) set aside: 4 (not JSON); 5 (not prompt/chosen/rejected" in caplog.text
    ours, theirs = preference_rows(read, tokenizer, seq_len=48), preference_rows(pairs, tokenizer, seq_len=48)
    assert all(torch.equal(ours[k], theirs[k]) for k in theirs)
    # a plain-string prompt is the user's turn
    (tmp_path / "plain.jsonl").write_text(json.dumps({"prompt": "2+2?", "chosen": "4", "rejected": "5"}) + "\n")
    assert read_pairs(tmp_path / "plain.jsonl")[0]["prompt"] == [{"role": "user", "content": "2+2?"}]
    (tmp_path / "none.jsonl").write_text("[1]\n")
    with pytest.raises(ConfigError, match=r"^dpo\.dataset=.*none\.jsonl holds no preference pair .*; 1 record\(s\) set aside$"):
        read_pairs(tmp_path / "none.jsonl")
    # the same pairs as a datasets save_to_disk directory: the same rows
    import datasets

    datasets.Dataset.from_list([{k: p[k] for k in ("prompt", "chosen", "rejected")} for p in pairs[:2]]).save_to_disk(
        str(tmp_path / "pairs"))
    DPOConfig(dataset=str(tmp_path / "pairs")).validate()
    assert read_pairs(tmp_path / "pairs") == read[:2]
    with pytest.raises(ConfigError, match=r"^dpo\.dataset=.*missing\.jsonl: no such file"):
        DPOConfig(dataset=str(tmp_path / "missing.jsonl")).validate()
