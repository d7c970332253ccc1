"""GRPO against TRL's ``GRPOTrainer`` (trl 1.x) on identical rollouts: the same prompts,
completions, rule rewards, old and reference log-probs and the same tiny Llama, for the ``grpo``,
``bnpo``, ``dr_grpo``, ``dapo`` and ``cispo`` loss types, and GSPO (TRL's
``importance_sampling_level="sequence"``).

TRL runs its own code end to end: a real ``GRPOTrainer`` built from a local model directory scores
the rollouts in ``_generate_and_score_completions`` (the completions come through its public
``rollout_func``, the rewards through reward functions, DAPO's soft overlong punishment through
``trl.rewards.get_soft_overlong_punishment``, truncated completions masked by
``mask_truncated_completions``) and computes the loss in ``_compute_loss`` with its fused LM head,
one call per gradient-accumulation micro-batch. Ours: ``Rollouts`` -> ``training_rows`` and
``GRPOModule.loss_normalizers`` / ``loss_from_outputs`` on the logits of the same model, and
``grpo_loss`` for the per-token view. Only the old and reference log-probs are set by the test (TRL
would take both from the unchanged policy, so every ratio would be 1 and the KL 0): the same
perturbed values go to both.

The one documented difference (``dsl_lit.posttrain.grpo.loss``): ``bnpo`` divides by the tokens of
the whole step's batch on this replica, TRL by each micro-batch's, then averages the micro-batches.
"""

from __future__ import annotations

import os

import pytest
import torch
from datasets import Dataset
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast
from trl import GRPOConfig as TRLConfig
from trl import GRPOTrainer
from trl.rewards import get_soft_overlong_punishment
from trl.trainer.utils import split_tensor_dict

from dsl_lit.config.optim import OptimConfig, ScheduleConfig
from dsl_lit.config.posttrain import GRPOConfig, OverlongConfig, SamplingConfig
from dsl_lit.posttrain import GRPOModule
from dsl_lit.posttrain.grpo.dapo import overlong_penalty
from dsl_lit.posttrain.grpo.loss import grpo_loss
from dsl_lit.posttrain.grpo.rollout import Rollouts, training_rows
from dsl_lit.posttrain.logps import token_logps
from dsl_lit.posttrain.rewards import WeightedRewards
from tests.conftest import scratch_dir
from tests.numerics import assert_close_fp32
from tests.unit.training.test_pretrain_module import _llm

PAD, EOS, VOCAB = 0, 1, 32
G, MAX_LEN, CACHE, TEMPERATURE = 4, 6, 3, 0.7
EPS_LOW, EPS_HIGH, BETA = 0.2, 0.28, 0.04
PROMPTS = [[3, 4, 5], [6, 7]]  # different lengths: the second is left-padded
COMPLETIONS = [
    [8, 9, EOS], [10, 11, 12], [14, EOS], [15, 16, EOS],  # the 2nd is truncated (no eos); lengths <= L_max - L_cache
    [18, EOS], [19, 20, 21, 22, 23], [23, 24, 25, EOS], [24, 25, EOS],  # truncated, 5 and 4 tokens: penalised
]
RULE_REWARDS = [0.25, 0.25, 0.25, 0.375, 1.0, 0.0, 1.0, 0.0]
"""Group 1's spread (unbiased std 0.0625, exact in fp32) shows the 1e-4 added to the std."""
WIDTH = max(map(len, COMPLETIONS))  # 5 < MAX_LEN: dr_grpo divides by the configured maximum, not the width


@pytest.fixture(scope="module")
def model_dir(request: pytest.FixtureRequest):
    """A tiny random Llama and a word-level tokenizer, saved where TRL loads them from (no network)."""
    directory = scratch_dir(request, "tiny_llama")
    vocab = {"<pad>": PAD, "<eos>": EOS, **{f"t{i}": i for i in range(2, VOCAB)}}
    backend = Tokenizer(models.WordLevel(vocab, unk_token="<pad>"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    PreTrainedTokenizerFast(tokenizer_object=backend, pad_token="<pad>", eos_token="<eos>").save_pretrained(directory)
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32,
                         pad_token_id=PAD, eos_token_id=EOS, bos_token_id=EOS)
    LlamaForCausalLM(config).save_pretrained(directory)
    return directory


def rule_rewards(prompts, completions, completion_ids, **kwargs):
    return RULE_REWARDS[: len(completion_ids)]


def rollout_func(prompts, trainer):
    """TRL's hook for custom generation: hands it our completions (prompts arrive repeated G times)."""
    return {"prompt_ids": [PROMPTS[i // G] for i in range(len(prompts))], "completion_ids": COMPLETIONS,
            "logprobs": [[0.0] * len(c) for c in COMPLETIONS]}


def trl_trainer(model_dir, tmp_path, loss_type: str, micro_batches: int, kl_ratio: bool = False,
                importance_sampling: str = "token") -> GRPOTrainer:
    """A GRPOTrainer whose optimizer step is ``micro_batches`` accumulated micro-batches of one
    generation. ``kl_ratio``: TRL's default ``use_bias_correction_kl=True`` (DeepSeek-V3.2's KL
    weighted by the ratio); off, the KL term is DeepSeek-R1's k3, as ours. TRL's ``epsilon_high``
    is CISPO's cap itself, ours ``1 + eps_high``."""
    os.environ["TRL_EXPERIMENTAL_SILENCE"] = "1"  # rollout_func is marked experimental
    epsilon_high = 1 + EPS_HIGH if loss_type == "cispo" else EPS_HIGH
    args = TRLConfig(output_dir=str(tmp_path / loss_type), per_device_train_batch_size=len(COMPLETIONS) // micro_batches,
                     gradient_accumulation_steps=micro_batches, num_generations=G, max_completion_length=MAX_LEN,
                     temperature=TEMPERATURE, beta=BETA, epsilon=EPS_LOW, epsilon_high=epsilon_high, loss_type=loss_type,
                     importance_sampling_level=importance_sampling,
                     scale_rewards="group", mask_truncated_completions=True, use_bias_correction_kl=kl_ratio,
                     report_to="none", use_cpu=True, bf16=False)
    trainer = GRPOTrainer(model=str(model_dir), reward_funcs=[rule_rewards, get_soft_overlong_punishment(MAX_LEN, CACHE)],
                          args=args, train_dataset=Dataset.from_dict({"prompt": ["t2 t3", "t4"]}),
                          processing_class=PreTrainedTokenizerFast.from_pretrained(model_dir), rollout_func=rollout_func)
    trainer.model.train()
    trainer.current_gradient_accumulation_steps = micro_batches  # what Trainer's loop sets for each window
    return trainer


def perturbed_logps(trainer) -> dict[str, torch.Tensor]:
    """TRL's scored batch with old and reference log-probs moved off the policy's by up to +-0.5
    (ratios exp(-0.5)..exp(0.5): both clip bounds are hit)."""
    batch = trainer._generate_and_score_completions([{"prompt": "t2"}] * len(COMPLETIONS))
    generator = torch.Generator().manual_seed(0)
    policy = batch["ref_per_token_logps"]  # TRL's reference model has the policy's weights
    for key in ("old_per_token_logps", "ref_per_token_logps"):
        batch[key] = policy + torch.rand(policy.shape, generator=generator) - 0.5
    return batch


def our_rows(trl_batch) -> dict[str, torch.Tensor]:
    """Our rows of the same rollouts, with TRL's old/reference log-probs in our layout (the labels'
    last WIDTH columns are the completions)."""
    lengths = torch.tensor([float(len(c)) for c in COMPLETIONS])
    rollouts = Rollouts([PROMPTS[i // G] for i in range(len(COMPLETIONS))], COMPLETIONS, torch.tensor(RULE_REWARDS),
                        overlong_penalty(lengths, MAX_LEN, CACHE), {}, G)
    rows, _ = training_rows(rollouts, pad_id=PAD, eos_id=EOS, filter_overlong=True)
    for ours, theirs in (("old_logps", "old_per_token_logps"), ("ref_logps", "ref_per_token_logps")):
        rows[ours] = torch.zeros(rows["labels"].shape)
        rows[ours][:, -WIDTH:] = trl_batch[theirs]
    return rows


def our_module(loss_type: str, importance_sampling: str = "token") -> GRPOModule:
    grpo = GRPOConfig(group_size=G, eps_low=EPS_LOW, eps_high=EPS_HIGH, beta=BETA, loss_type=loss_type,
                      importance_sampling=importance_sampling,
                      sampling=SamplingConfig(max_new_tokens=MAX_LEN, temperature=TEMPERATURE),
                      overlong=OverlongConfig(filter=True, penalty_cache=CACHE)).validate()
    return GRPOModule(_llm(), OptimConfig(lr=1e-3), ScheduleConfig(name="constant", warmup_steps=0), micro_batch_size=G,
                      total_steps=1, grpo=grpo, rewards=WeightedRewards({"accuracy": 1.0}), problems=[], tokenizer=None)


def completion_logps(model: LlamaForCausalLM, rows) -> tuple[torch.Tensor, torch.Tensor]:
    """(logits of our rows under the Hugging Face model, our token log-probs [N, WIDTH] of the completions)."""
    logits = model(input_ids=rows["input_ids"], attention_mask=rows["attention_mask"].long()).logits
    return logits, token_logps(logits, rows["labels"], TEMPERATURE)[:, -WIDTH:]


def test_scoring_matches_trl(model_dir, tmp_path):
    """Rewards with the soft overlong punishment, group advantages (the std's 1e-4), the mask of
    overlong filtering and the token count of the dapo normaliser."""
    batch = perturbed_logps(trl_trainer(model_dir, tmp_path, "dapo", 1))
    lengths = torch.tensor([float(len(c)) for c in COMPLETIONS])
    penalty = overlong_penalty(lengths, MAX_LEN, CACHE)
    assert penalty.tolist() == pytest.approx([0, 0, 0, 0, 0, -2 / 3, -1 / 3, 0])
    assert penalty.tolist() == pytest.approx(get_soft_overlong_punishment(MAX_LEN, CACHE)(COMPLETIONS), abs=1e-7)
    rows = our_rows(batch)
    assert rows["advantages"].tolist() == pytest.approx(batch["advantages"].tolist(), rel=1e-6, abs=1e-6)
    assert rows["advantages"][3].item() == pytest.approx(0.09375 / (0.0625 + 1e-4), rel=1e-6)  # not 1.5: the std + 1e-4
    assert torch.equal(rows["labels"][:, -WIDTH:] != -100, batch["completion_mask"].bool())  # rows 1 and 5 masked
    assert batch["completion_mask"][[1, 5]].sum() == 0
    assert our_module("dapo").loss_normalizers(rows)["tokens"].item() == batch["num_items_in_batch"].item() == 3 + 2 + 3 + 2 + 4 + 3


def test_token_losses_and_log_probs_match_trl(model_dir, tmp_path):
    """Our per-token losses against TRL's: TRL's dapo loss over a loss mask (``tool_mask``) holding
    one token, divided by a token count of 1, is that token's loss."""
    trainer = trl_trainer(model_dir, tmp_path, "dapo", 1)
    batch = perturbed_logps(trainer)
    rows = our_rows(batch)
    _, logps = completion_logps(LlamaForCausalLM.from_pretrained(model_dir), rows)
    mask = batch["completion_mask"].bool()
    ours = grpo_loss(logps, rows["old_logps"][:, -WIDTH:], rows["ref_logps"][:, -WIDTH:], rows["advantages"], mask,
                     EPS_LOW, EPS_HIGH, BETA, "dapo")
    assert ours.low_clipped.any() and ours.high_clipped.any()  # the clip bounds are exercised
    with torch.no_grad():
        trl_logps, _, _ = trainer._get_per_token_logps_and_entropies(
            trainer.model, torch.cat([batch["prompt_ids"], batch["completion_ids"]], 1),
            torch.cat([batch["prompt_mask"], batch["completion_mask"]], 1), WIDTH)
    assert_close_fp32(logps[mask], trl_logps[mask], VOCAB)  # the same tokens scored, at the same temperature
    assert_close_fp32(ours.per_token.detach()[mask], _trl_token_losses(trainer, batch), VOCAB)
    # TRL's default KL term is weighted by the ratio (DeepSeek-V3.2), ours is R1's k3: they differ off-policy
    ratio_weighted = _trl_token_losses(trl_trainer(model_dir, tmp_path, "dapo", 1, kl_ratio=True), batch)
    assert (ratio_weighted - ours.per_token.detach()[mask]).abs().max() > 1e-3


def _trl_token_losses(trainer, batch) -> torch.Tensor:
    """TRL's loss of each completion token (in ``completion_mask`` order)."""
    mask = batch["completion_mask"].bool()
    losses = []
    with torch.no_grad():
        for i, t in mask.nonzero().tolist():
            one = torch.zeros(mask.shape, dtype=torch.long)
            one[i, t] = 1
            losses.append(trainer._compute_loss(trainer.model, {**batch, "tool_mask": one,
                                                                "num_items_in_batch": torch.tensor(1.0)}))
    return torch.stack(losses)


def _trl_step(trainer, batch, micro_batches: int):
    """TRL's loss of one optimizer step (the micro-batches' losses summed, as accumulated), the
    gradients w.r.t. its log-probs [N, WIDTH] and the model's parameter gradients."""
    captured = []

    def keep_log_probs(module, args, output) -> None:
        output.log_probs.retain_grad()
        captured.append(output.log_probs)

    hook = trainer.model.register_forward_hook(keep_log_probs)
    trainer.model.zero_grad()
    loss = 0.0
    for part in split_tensor_dict(batch, micro_batches):
        part_loss = trainer._compute_loss(trainer.model, part)
        part_loss.backward()
        loss += part_loss.item()
    hook.remove()
    logp_grads = torch.cat([c.grad[:, -WIDTH:] for c in captured])
    return loss, logp_grads, {n: p.grad.clone() for n, p in trainer.model.named_parameters()}


def _our_step(model_dir, rows, loss_type: str, micro_batches: int, importance_sampling: str = "token"):
    """Our loss of the same step through ``GRPOModule`` (step normalisers, one ``loss_from_outputs``
    per micro-batch), the gradients w.r.t. our log-probs, and the parameter gradients."""
    module, model = our_module(loss_type, importance_sampling), LlamaForCausalLM.from_pretrained(model_dir)
    normalizers = module.loss_normalizers(rows)
    size = len(COMPLETIONS) // micro_batches
    loss, logp_grads = 0.0, []
    for start in range(0, len(COMPLETIONS), size):
        part = {k: v[start : start + size] for k, v in rows.items()}
        logits, logps = completion_logps(model, part)
        part_loss, _ = module.loss_from_outputs((logits,), part, normalizers)
        part_loss.backward()
        loss += part_loss.item()
        # the same micro-batch through the loss function alone, for the gradient w.r.t. the log-probs
        leaf = logps.detach().requires_grad_()
        grpo_loss(leaf, part["old_logps"][:, -WIDTH:], part["ref_logps"][:, -WIDTH:], part["advantages"],
                  part["labels"][:, -WIDTH:] != -100, EPS_LOW, EPS_HIGH, BETA, loss_type,
                  num_sequences=normalizers["sequences"], num_tokens=normalizers["tokens"],
                  max_completion_length=MAX_LEN, importance_sampling=importance_sampling).loss.backward()
        logp_grads.append(leaf.grad)
    return loss, torch.cat(logp_grads), {n: p.grad.clone() for n, p in model.named_parameters()}


@pytest.mark.parametrize("loss_type, importance_sampling", [
    ("grpo", "token"), ("bnpo", "token"), ("dr_grpo", "token"), ("dapo", "token"), ("cispo", "token"),
    ("grpo", "sequence"), ("dapo", "sequence")], ids=["grpo", "bnpo", "dr_grpo", "dapo", "cispo", "gspo", "gspo-dapo"])
def test_loss_and_gradients_match_trl(model_dir, tmp_path, loss_type, importance_sampling):
    """One optimizer step of two micro-batches (one prompt group each, 8 and 9 completion tokens)."""
    micro_batches = 2
    trainer = trl_trainer(model_dir, tmp_path, loss_type, micro_batches, importance_sampling=importance_sampling)
    batch = perturbed_logps(trainer)
    loss, logp_grads, grads = _our_step(model_dir, our_rows(batch), loss_type, micro_batches, importance_sampling)
    reference = trainer
    if loss_type == "bnpo":
        # TRL's bnpo divides each micro-batch by its own tokens: with 8 and 9 that is another loss
        split_loss, _, _ = _trl_step(trainer, batch, micro_batches)
        assert abs(split_loss - loss) > 1e-3 * abs(loss)
        reference = trl_trainer(model_dir, tmp_path, loss_type, 1)  # ours is TRL's with the step as one micro-batch
    if loss_type == "cispo":  # the cap is exercised: some ratios pass 1 + eps_high, on both signs of advantage
        rows = our_rows(batch)
        _, logps = completion_logps(LlamaForCausalLM.from_pretrained(model_dir), rows)
        mask = rows["labels"][:, -WIDTH:] != -100
        capped = grpo_loss(logps.detach(), rows["old_logps"][:, -WIDTH:], None, rows["advantages"], mask,
                           EPS_LOW, EPS_HIGH, 0.0, "cispo").high_clipped
        assert {bool(a > 0) for a in rows["advantages"][capped.any(-1)]} == {True, False}
    trl_loss, trl_logp_grads, trl_grads = _trl_step(reference, batch, reference.args.gradient_accumulation_steps)
    assert loss == pytest.approx(trl_loss, rel=1e-6, abs=1e-7)
    assert_close_fp32(logp_grads, trl_logp_grads, len(COMPLETIONS) * WIDTH)
    assert sorted(grads) == sorted(trl_grads)
    for name, grad in grads.items():  # the lm head's and the whole backbone's
        assert_close_fp32(grad, trl_grads[name], VOCAB * len(COMPLETIONS) * WIDTH, msg=name)
