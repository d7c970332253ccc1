"""The post-training objectives against values computed by hand (plain Python math, TRL's formulas)."""

from __future__ import annotations

import math

import pytest
import torch

from dsl_lit.posttrain.dpo.loss import dpo_loss
from dsl_lit.posttrain.grpo.loss import group_advantages, grpo_loss, k3_kl
from dsl_lit.posttrain.logps import sequence_logps, token_logps
from tests.numerics import assert_close_fp32


def logsig(x: float) -> float:
    return -math.log1p(math.exp(-x))


# policy chosen/rejected, reference chosen/rejected, for two pairs
PC, PR, RC, RR = [-4.0, -6.0], [-7.0, -5.0], [-5.0, -6.5], [-6.0, -5.5]


def _dpo(loss_type: str, beta: float = 0.1, eps: float = 0.0):
    t = [torch.tensor(v) for v in (PC, PR, RC, RR)]
    return dpo_loss(*t, beta=beta, loss_type=loss_type, label_smoothing=eps)


def test_dpo_sigmoid_hand_computed():
    # pair 0: h = (-4 + 7) - (-5 + 6) = 2; pair 1: h = (-6 + 5) - (-6.5 + 5.5) = 0
    out = _dpo("sigmoid", beta=0.1)
    assert out.losses.tolist() == pytest.approx([-logsig(0.2), math.log(2)], rel=1e-6)
    assert out.chosen_rewards.tolist() == pytest.approx([0.1, 0.05])
    assert out.rejected_rewards.tolist() == pytest.approx([-0.1, 0.05])


def test_dpo_variants_hand_computed():
    beta, eps = 0.5, 0.1
    smoothed = _dpo("sigmoid", beta, eps).losses[0].item()
    assert smoothed == pytest.approx(-0.9 * logsig(1.0) - 0.1 * logsig(-1.0), rel=1e-6)
    robust = _dpo("robust", beta, eps).losses[0].item()
    assert robust == pytest.approx((-0.9 * logsig(1.0) + 0.1 * logsig(-1.0)) / 0.8, rel=1e-6)
    assert _dpo("hinge", beta).losses.tolist() == pytest.approx([0.0, 1.0])  # relu(1 - 0.5 * [2, 0])
    assert _dpo("ipo", beta).losses.tolist() == pytest.approx([1.0, 1.0])  # (h - 1)^2 with 1/(2 beta) = 1


def test_dpo_gradient_pushes_chosen_up():
    pc = torch.tensor([-4.0], requires_grad=True)
    pr = torch.tensor([-7.0], requires_grad=True)
    dpo_loss(pc, pr, torch.tensor([-5.0]), torch.tensor([-6.0]), beta=0.1).losses.sum().backward()
    assert pc.grad.item() < 0 < pr.grad.item()  # descending the loss raises chosen, lowers rejected
    # d/dpc of -log s(beta h) = -beta (1 - s(beta h)) with beta h = 0.2
    assert pc.grad.item() == pytest.approx(-0.1 * (1 - 1 / (1 + math.exp(-0.2))), rel=1e-6)


def test_dpo_rejects_bad_arguments():
    with pytest.raises(ValueError, match="loss_type"):
        _dpo("kto")
    with pytest.raises(ValueError, match="beta"):
        _dpo("sigmoid", beta=0.0)


def test_group_advantages_hand_computed():
    rewards = torch.tensor([1.0, 0.0, 0.0, 0.0, 2.0, 4.0])
    # group 1: mean 1/3, unbiased std sqrt(1/3); group 2: mean 2, std 2
    adv = group_advantages(rewards, 3, "group")
    s1 = math.sqrt(1 / 3)
    expected = [(2 / 3) / (s1 + 1e-4), (-1 / 3) / (s1 + 1e-4), (-1 / 3) / (s1 + 1e-4), -2 / 2.0001, 0.0, 2 / 2.0001]
    assert adv.tolist() == pytest.approx(expected, rel=1e-5)
    batch_std = torch.tensor([1.0, 0, 0, 0, 2, 4]).std().item()
    assert group_advantages(rewards, 3, "batch").tolist() == pytest.approx(
        [v / (batch_std + 1e-4) for v in [2 / 3, -1 / 3, -1 / 3, -2, 0, 2]], rel=1e-5)
    assert group_advantages(rewards, 3, "none").tolist() == pytest.approx([2 / 3, -1 / 3, -1 / 3, -2, 0, 2])
    # equal rewards: zero advantage, no NaN
    assert group_advantages(torch.ones(4), 2).tolist() == [0.0] * 4
    with pytest.raises(ValueError):
        group_advantages(rewards, 4)


def _grpo_inputs():
    logps = torch.tensor([[-1.0, -2.0, -0.5], [-1.5, -0.2, -3.0]])
    old = torch.tensor([[-1.0, -2.5, -0.5], [-1.0, -0.2, -3.0]])
    ref = torch.tensor([[-1.2, -2.0, -0.4], [-1.5, -0.3, -3.0]])
    adv = torch.tensor([1.0, -2.0])
    mask = torch.tensor([[1, 1, 0], [1, 1, 1]], dtype=torch.bool)
    return logps, old, ref, adv, mask


def _hand_token_losses(eps_low: float, eps_high: float, beta: float) -> list[list[float]]:
    logps, old, ref, adv, _ = (t.tolist() for t in _grpo_inputs())
    out = []
    for i in range(2):
        row = []
        for t in range(3):
            ratio = math.exp(logps[i][t] - old[i][t])
            clipped = min(max(ratio, 1 - eps_low), 1 + eps_high)
            d = ref[i][t] - logps[i][t]
            row.append(-min(ratio * adv[i], clipped * adv[i]) + beta * (math.exp(d) - d - 1))
        out.append(row)
    return out


@pytest.mark.parametrize("loss_type", ["grpo", "bnpo", "dr_grpo", "dapo"])
def test_grpo_loss_hand_computed(loss_type):
    eps_low, eps_high, beta = 0.2, 0.28, 0.04
    tl = _hand_token_losses(eps_low, eps_high, beta)
    mask = [[1, 1, 0], [1, 1, 1]]
    masked = [[v * m for v, m in zip(r, mr)] for r, mr in zip(tl, mask)]
    expected = {
        "grpo": (sum(masked[0]) / 2 + sum(masked[1]) / 3) / 2,
        # one batch on one process: both are the mean over all its completion tokens (DAPO eq. 8); they
        # differ in what a data-parallel rank divides by (tests/e2e/parallel/test_grpo_data_parallel.py)
        "bnpo": (sum(masked[0]) + sum(masked[1])) / 5,
        "dapo": (sum(masked[0]) + sum(masked[1])) / 5,
        "dr_grpo": (sum(masked[0]) + sum(masked[1])) / (2 * 3),
    }[loss_type]
    out = grpo_loss(*_grpo_inputs(), eps_low=eps_low, eps_high=eps_high, beta=beta, loss_type=loss_type)
    assert out.loss.item() == pytest.approx(expected, rel=1e-6)
    # token (0, 1): ratio e^0.5 > 1.28 with A > 0 is clipped high; (1, 0): ratio e^-0.5 < 0.8 with A < 0 low
    assert out.high_clipped.tolist() == [[False, True, False], [False, False, False]]
    assert out.low_clipped.tolist() == [[False, False, False], [True, False, False]]
    assert out.kl[0, 2].item() == 0.0 and out.kl[0, 0].item() == pytest.approx(math.exp(-0.2) + 0.2 - 1)


def test_cispo_hand_computed():
    """CISPO: -sg(min(ratio, 1 + eps_high)) A logp per token, summed over the masked tokens / their
    count (as dapo); the gradient wrt logp is the capped ratio times -A / tokens, never 0."""
    logps, old, ref, adv, mask = _grpo_inputs()
    leaf = logps.clone().requires_grad_()
    out = grpo_loss(leaf, old, ref, adv, mask, eps_low=0.2, eps_high=0.28, beta=0.0, loss_type="cispo")
    weights = [[min(math.exp(a - b), 1.28) for a, b in zip(r, o)] for r, o in zip(logps.tolist(), old.tolist())]
    expected = sum(-weights[i][t] * adv[i].item() * logps[i, t].item() for i in range(2) for t in range(3) if mask[i, t]) / 5
    assert out.loss.item() == pytest.approx(expected, rel=1e-6)
    out.loss.backward()
    grad = [[-weights[i][t] * adv[i].item() / 5 * mask[i, t].item() for t in range(3)] for i in range(2)]
    assert leaf.grad.tolist() == [pytest.approx(row, rel=1e-6) for row in grad]
    # token (0, 1) (ratio e^0.5) is capped; PPO's clip would have zeroed its gradient, CISPO keeps 1.28 of it
    assert out.high_clipped.tolist() == [[False, True, False], [False, False, False]] and not out.low_clipped.any()
    assert leaf.grad[0, 1].item() == pytest.approx(-1.28 / 5)


def test_gspo_hand_computed():
    """GSPO: one ratio per completion, exp(mean of its masked tokens' log-ratios), clipped as a whole,
    then the grpo loss type (mean over the completion's tokens, then over completions)."""
    logps, old, ref, adv, mask = _grpo_inputs()
    leaf = logps.clone().requires_grad_()
    out = grpo_loss(leaf, old, ref, adv, mask, eps_low=0.2, eps_high=0.28, beta=0.0, importance_sampling="sequence")
    s0, s1 = math.exp((0.0 + 0.5) / 2), math.exp((-0.5 + 0.0 + 0.0) / 3)  # 1.284 (> 1.28, A > 0); 0.846
    loss0 = -min(s0 * 1.0, 1.28 * 1.0)
    loss1 = -min(s1 * -2.0, max(s1, 0.8) * -2.0)
    assert out.loss.item() == pytest.approx((loss0 + loss1) / 2, rel=1e-6)
    assert out.high_clipped.tolist() == [[True, True, False], [False, False, False]]  # the whole completion
    out.loss.backward()
    # completion 0 is clipped: no gradient; completion 1: d/dlogp_t of -s1 A / 1 over its 3 tokens' mean
    assert leaf.grad[0].abs().max() == 0
    assert leaf.grad[1].tolist() == pytest.approx([-s1 * -2.0 / 3 / 2] * 3, rel=1e-6)


@pytest.mark.parametrize("loss_type, importance_sampling", [
    ("grpo", "token"), ("bnpo", "token"), ("dr_grpo", "token"), ("dapo", "token"), ("cispo", "token"),
    ("grpo", "sequence")], ids=["grpo", "bnpo", "dr_grpo", "dapo", "cispo", "gspo"])
def test_every_loss_learns_a_bandit(loss_type, importance_sampling):
    """A policy of 4 token logits, completions of 4 sampled tokens, reward = the share of token 2:
    30 steps of 8 completions, 2 optimizer steps per batch (so the ratio leaves 1 and the clip and
    the caps act) take p(token 2) from 0.25 to over 0.9 under every loss (GSPO with its clip range)."""
    torch.manual_seed(0)
    logits = torch.zeros(4, requires_grad=True)
    optimizer = torch.optim.Adam([logits], lr=0.1)
    eps_low, eps_high = (3e-4, 4e-4) if importance_sampling == "sequence" else (0.2, 0.28)
    for _ in range(30):
        with torch.no_grad():
            tokens = torch.multinomial(torch.softmax(logits, -1), 8 * 4, replacement=True).view(8, 4)
            rewards = (tokens == 2).float().mean(-1)
            old = torch.log_softmax(logits, -1)[tokens]
        advantages = group_advantages(rewards, 8)
        for _ in range(2):
            logps = torch.log_softmax(logits, -1)[tokens]
            loss = grpo_loss(logps, old, None, advantages, torch.ones(8, 4, dtype=torch.bool), eps_low, eps_high,
                             loss_type=loss_type, importance_sampling=importance_sampling).loss
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
    assert torch.softmax(logits, -1)[2].item() > 0.9


def test_rollout_correction_hand_computed():
    """r = p_train / p_rollout per token: TIS caps it at token_cap, MIS masks a completion whose
    product of r leaves [lo, hi]; the gap |log r| and k3 = r - 1 - log r are measured either way."""
    from dsl_lit.posttrain.grpo.rollout_correction import rollout_correction

    train = torch.tensor([[-1.0, -2.0, -0.5], [-1.5, -0.2, -3.0], [-0.4, -0.4, -0.4]])
    rollout = torch.tensor([[-1.0, -3.0, -9.0], [-1.4, -0.3, -3.0], [-0.1, -0.1, -0.4]])
    mask = torch.tensor([[1, 1, 0], [1, 1, 1], [1, 1, 1]], dtype=torch.bool)
    plain = rollout_correction(train, rollout, mask)
    assert plain.weights is None and not plain.token_capped.any() and not plain.sequence_masked.any()
    log_r = [[0.0, 1.0, 0.0], [-0.1, 0.1, 0.0], [-0.3, -0.3, 0.0]]
    assert plain.abs_gap.tolist() == [pytest.approx([abs(v) for v in row], abs=1e-6) for row in log_r]
    assert plain.kl.tolist() == [pytest.approx([math.exp(v) - 1 - v for v in row], abs=1e-6) for row in log_r]
    capped = rollout_correction(train, rollout, mask, token_cap=2.0)
    assert capped.weights.tolist() == [pytest.approx([1.0, 2.0, 0.0], abs=1e-6),  # e^1 = 2.72 -> 2; the pad 0
                                       pytest.approx([math.exp(-0.1), math.exp(0.1), 1.0], abs=1e-6),
                                       pytest.approx([math.exp(-0.3), math.exp(-0.3), 1.0], abs=1e-6)]
    assert capped.token_capped.tolist() == [[False, True, False], [False] * 3, [False] * 3]
    # sequence ratios e^1 = 2.72, e^0 = 1, e^-0.6 = 0.55: [0.6, 2.0] masks the first and the last
    masked = rollout_correction(train, rollout, mask, sequence_bounds=(0.6, 2.0))
    assert masked.sequence_masked.tolist() == [True, False, True]
    assert masked.weights.tolist() == [[0.0] * 3, [1.0] * 3, [0.0] * 3]
    both = rollout_correction(train, rollout, mask, token_cap=2.0, sequence_bounds=(0.5, 3.0))
    assert torch.equal(both.weights, capped.weights)  # nothing masked at [0.5, 3]: the caps alone


def test_rollout_weights_scale_the_policy_loss_not_the_kl():
    logps, old, ref, adv, mask = _grpo_inputs()
    weights = torch.tensor([[0.5, 2.0, 1.0], [0.0, 1.0, 1.0]])
    plain = grpo_loss(logps, old, ref, adv, mask, beta=0.04, loss_type="dapo")
    weighted = grpo_loss(logps, old, ref, adv, mask, beta=0.04, loss_type="dapo", rollout_weights=weights)
    policy = plain.per_token - 0.04 * k3_kl(logps, ref)
    assert weighted.per_token.tolist() == [pytest.approx(r, rel=1e-6) for r in
                                          (policy * weights + 0.04 * k3_kl(logps, ref)).tolist()]


def test_grpo_micro_batches_sum_to_the_step_loss():
    logps, old, ref, adv, mask = _grpo_inputs()
    for loss_type in ("grpo", "bnpo", "dr_grpo"):
        full = grpo_loss(logps, old, ref, adv, mask, beta=0.04, loss_type=loss_type).loss
        parts = sum(
            grpo_loss(logps[i : i + 1], old[i : i + 1], ref[i : i + 1], adv[i : i + 1], mask[i : i + 1], beta=0.04,
                      loss_type=loss_type, num_sequences=2, num_tokens=mask.sum(), max_completion_length=3).loss
            for i in range(2)
        )
        assert parts.item() == pytest.approx(full.item(), rel=1e-6)


def test_grpo_on_policy_gradient_is_advantage_weighted():
    """At ratio 1 (old = current) the gradient wrt logp is -A / |o| per token (grpo, beta 0)."""
    logps = torch.tensor([[-1.0, -2.0], [-0.5, -0.7]], requires_grad=True)
    adv = torch.tensor([1.5, -0.5])
    grpo_loss(logps, logps.detach(), None, adv, torch.ones(2, 2, dtype=torch.bool)).loss.backward()
    assert logps.grad.flatten().tolist() == pytest.approx([-1.5 / 4, -1.5 / 4, 0.5 / 4, 0.5 / 4])


def test_k3_kl_is_nonnegative_and_zero_at_equality():
    a, b = torch.randn(100), torch.randn(100)
    assert (k3_kl(a, b) >= 0).all() and k3_kl(a, a).abs().max() == 0


def test_token_logps_match_log_softmax():
    torch.manual_seed(0)
    logits = torch.randn(2, 5, 11)
    labels = torch.randint(0, 11, (2, 5))
    labels[0, :2] = -100
    expected = logits.log_softmax(-1).gather(-1, labels.clamp_min(0)[..., None])[..., 0] * (labels != -100)
    assert_close_fp32(token_logps(logits.clone(), labels), expected, 11)  # log-sum-exp over the 11 logits
    assert_close_fp32(token_logps(logits.clone(), labels, temperature=0.5),
                      (logits / 0.5).log_softmax(-1).gather(-1, labels.clamp_min(0)[..., None])[..., 0]
                      * (labels != -100), 11)
    assert_close_fp32(sequence_logps(logits.clone(), labels, average=True), expected.sum(-1) / torch.tensor([3, 5]),
                      11 * 5)


@pytest.mark.parametrize("values, message", [
    ({"importance_sampling": "tokens"}, r"^grpo\.importance_sampling='tokens' is unknown; choose one of \('token', 'sequence'\)"),
    ({"loss_type": "gspo"}, r"^grpo\.loss_type='gspo' is unknown"),
    ({"rollout_correction": {"token_cap": 0.5}}, r"^grpo\.rollout_correction\.token_cap=0\.5 must be >= 1"),
    ({"rollout_correction": {"sequence_bounds": [2.0, 0.5]}}, r"^grpo\.rollout_correction\.sequence_bounds=\[2\.0, 0\.5\] must be \[lo, hi\]"),
])
def test_grpo_variant_settings_are_checked(values, message):
    from data_contract.errors import ConfigError
    from data_contract.schema import dataclass_from_dict
    from dsl_lit.config.posttrain import GRPOConfig, RolloutCorrectionConfig

    with pytest.raises(ConfigError, match=message):
        dataclass_from_dict(GRPOConfig, values, "grpo").validate()
    assert isinstance(GRPOConfig().rollout_correction, RolloutCorrectionConfig)
