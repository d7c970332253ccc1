"""The training objectives against references written here, not with our ops.

The parity tests compare a module with itself under another layout, so a bug every layout shares
passes them (issue 23: dropping the MTP term or the balance loss from what is backpropagated, or
skipping the fp16 unscale, left every PretrainModule test green). Here the module trains under a
real Trainer and what reaches the optimizer is compared with independent references:

- pretraining: the gradients of ``main + lambda(t) * mean_k(MTP_k) + balance`` by autograd on a
  copy of the model, with ``torch.nn.functional.cross_entropy`` and the sequence-wise balance loss
  written out from the routers' outputs, on both sides of the MTP weight's boundary;
- fp16 with loss scaling: the first step's gradient norm and update equal fp32's with clipping
  configured (a skipped unscale reports a norm 65536x too large and clips an unclipped update);
- DPO: the policy's sequence log-probs equal a hand gather of ``log_softmax`` over the completion
  tokens, for a policy perturbed away from the reference (at the start both are equal and every
  loss is log 2 whatever the log-probs are).
"""

from __future__ import annotations

import copy

import lightning as L
import pytest
import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader

from dsl_lit.config.objective import ObjectiveConfig
from dsl_lit.config.optim import OptimConfig, ScheduleConfig
from dsl_lit.config.posttrain import DPOConfig
from dsl_lit.config.precision import PrecisionConfig
from dsl_lit.models import build_model
from dsl_lit.models.common.moe import MoE
from dsl_lit.parallel.strategy import DeepSeekStrategy
from dsl_lit.posttrain import DPOModule
from dsl_lit.precision.plugin import AutocastPrecision
from dsl_lit.training import PretrainModule
from tests.numerics import EPS32, assert_close_fp32, relative_error
from tests.unit.training.test_pretrain_module import _batch, _llm, _v3


class StepRecorder(L.Callback):
    """Per optimizer step: an independent copy of the model before it (built anew, holding the
    module's weights and expert biases), the gradients the optimizer is handed (reduced, unscaled,
    clipped) and the parameters after it."""

    def __init__(self) -> None:
        self.models: list[torch.nn.Module] = []
        self.grads: list[dict[str, torch.Tensor]] = []
        self.after: list[dict[str, torch.Tensor]] = []

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        with torch.random.fork_rng(devices=[]):
            model = build_model(pl_module.model_config)
        model.load_state_dict(pl_module.model.state_dict())
        self.models.append(model)

    def on_before_optimizer_step(self, trainer, pl_module, optimizer):
        self.grads.append({n: p.grad.detach().clone() for n, p in pl_module.model.named_parameters()
                           if p.grad is not None})

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.after.append({n: p.detach().clone() for n, p in pl_module.model.named_parameters()})


def _train(module: L.LightningModule, batches: list[dict[str, torch.Tensor]], precision: str = "fp32"
           ) -> tuple[StepRecorder, L.Trainer]:
    recorder = StepRecorder()
    trainer = L.Trainer(accelerator="cpu", strategy=DeepSeekStrategy(), max_steps=len(batches), logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False, use_distributed_sampler=False,
                        plugins=[AutocastPrecision(precision, "cpu")], callbacks=[recorder])
    trainer.fit(module, train_dataloaders=DataLoader(batches, batch_size=None))
    return recorder, trainer


# -- pretraining: main + lambda(t) * mean(MTP) + balance ------------------------------------------------
def _sequence_balance(scores: torch.Tensor, indices: torch.Tensor, rows: int, alpha: float) -> torch.Tensor:
    """DeepSeek-V3 eq. 17-20 for one MoE layer: alpha * mean over sequences of sum_i f_i P_i, with
    f_i = E / (K T) * (tokens of the sequence choosing expert i), P_i = mean over the sequence of
    the affinity of expert i normalised over all experts."""
    experts, k = scores.shape[-1], indices.shape[-1]
    chosen = F.one_hot(indices, experts).sum(dim=1).float().view(rows, -1, experts)  # [rows, T, E]
    f = chosen.sum(dim=1) * experts / (k * chosen.shape[1])
    p = (scores / scores.sum(dim=-1, keepdim=True)).view(rows, -1, experts).mean(dim=1)
    return alpha * (f * p).sum(dim=-1).mean()


def _reference_terms(model: torch.nn.Module, batch: dict[str, torch.Tensor], alpha: float
                     ) -> dict[str, dict[str, torch.Tensor]]:
    """Gradients of each term of the V3 pretraining objective on the whole batch (main next-token
    cross-entropy, mean MTP cross-entropy over depths, sequence-wise balance loss of every MoE
    layer), by autograd on a copy of ``model``, from its outputs only."""
    model = copy.deepcopy(model).train()
    routes: list[tuple[torch.Tensor, torch.Tensor]] = []
    hooks = [m.gate.register_forward_hook(lambda _m, _i, out: routes.append((out[0], out[2])))
             for m in model.modules() if isinstance(m, MoE)]
    try:
        inputs, labels = batch["input_ids"], batch["labels"]
        hidden = model.hidden_states(inputs)
        main = F.cross_entropy(model.head(hidden).flatten(0, 1), labels.flatten(), ignore_index=-100)
        mtp = torch.stack([F.cross_entropy(logits.flatten(0, 1), labels[:, k:].flatten(), ignore_index=-100)
                           for k, logits in enumerate(model.mtp_logits(hidden, inputs), start=1)]).mean()
    finally:
        for hook in hooks:
            hook.remove()
    balance = sum(_sequence_balance(scores, indices, inputs.shape[0], alpha) for scores, indices in routes)
    names, params = zip(*model.named_parameters())
    terms = {}
    for term, value in (("main", main), ("mtp", mtp), ("balance", balance)):
        grads = torch.autograd.grad(value, params, retain_graph=True, allow_unused=True)
        terms[term] = {n: g if g is not None else torch.zeros_like(p) for n, p, g in zip(names, params, grads)}
    return terms


def _combine(terms: dict[str, dict[str, torch.Tensor]], weights: dict[str, float]) -> dict[str, torch.Tensor]:
    return {n: sum(w * terms[t][n] for t, w in weights.items()) for n in terms["main"]}


TOKENS = 8 * 32  # rows x sequence length of _batch: the longest sum behind every gradient entry


def test_pretrain_gradients_equal_autograd_of_the_v3_objective_across_the_mtp_weight_boundary():
    """Two steps with lambda 0.3 then 0.1 (boundary at half of training); 4 micro-batches each."""
    cfg, alpha = _v3(), 0.1
    objective = ObjectiveConfig(mtp_weight=[0.3, 0.1], mtp_weight_boundaries=[0.5])
    batches = [_batch(5), _batch(6)]
    torch.manual_seed(0)
    module = PretrainModule(cfg, OptimConfig(lr=1e-2, grad_clip=0.0), ScheduleConfig(name="constant", warmup_steps=0),
                            micro_batch_size=2, total_steps=2, objective=objective)
    recorder, _ = _train(module, batches)
    for step, mtp_weight in enumerate((0.3, 0.1)):
        grads = recorder.grads[step]
        terms = _reference_terms(recorder.models[step], batches[step], alpha)
        expected = _combine(terms, {"main": 1.0, "mtp": mtp_weight, "balance": 1.0})
        assert grads.keys() <= expected.keys() and all(expected[n].abs().sum() == 0 for n in expected.keys() - grads)
        for name, grad in grads.items():
            assert_close_fp32(grad, expected[name], TOKENS, msg=f"step {step} {name}")
        # not vacuous: a missing term (or the other phase's lambda) moves some tensor by >10% (>1e4 tolerances)
        for wrong in ({"main": 1.0, "balance": 1.0}, {"main": 1.0, "mtp": mtp_weight},
                      {"main": 1.0, "mtp": 0.4 - mtp_weight, "balance": 1.0}):
            moved = _combine(terms, wrong)
            assert max(relative_error(grads[n], moved[n]) for n in grads) > 0.1, (step, wrong)


# -- fp16: loss scaling is undone before clipping and the update ------------------------------------------
FP16_EPS = 2.0**-11  # fp16's unit roundoff (10 mantissa bits)


def _first_step(precision: str, grad_clip: float) -> tuple[StepRecorder, L.Trainer, PretrainModule]:
    torch.manual_seed(0)
    # lr=1, eps=1: the first AdamW update is -g / (|g| + 1), linear in small gradients, so a
    # gradient 65536x too large (clipped back to grad_clip) moves the weights differently
    module = PretrainModule(_llm(), OptimConfig(lr=1.0, eps=1.0, grad_clip=grad_clip, weight_decay=0.0),
                            ScheduleConfig(name="constant", warmup_steps=0), micro_batch_size=4, total_steps=1,
                            precision=PrecisionConfig(name=precision).validate())
    recorder, trainer = _train(module, [_batch(7)], precision)
    return recorder, trainer, module


def test_fp16_step_matches_fp32_with_clipping_configured():
    """Clipping at 4x the true gradient norm: fp32 and a correct fp16 step are not clipped, a step
    whose gradients were left scaled by 2^16 would report a norm 65536x too large and be clipped to
    4x the true gradient (an update ~4x too large)."""
    _, ref_trainer, _ = _first_step("fp32", grad_clip=1e9)
    true_norm = float(ref_trainer.callback_metrics["train/grad_norm"])
    fp32, fp32_trainer, _ = _first_step("fp32", grad_clip=4 * true_norm)
    fp16, fp16_trainer, module = _first_step("fp16", grad_clip=4 * true_norm)
    assert module.loss_scaler.scale == 2.0**16 and module.loss_scaler.skipped_steps == 0  # scaled, not skipped
    norm16, norm32 = (float(t.callback_metrics["train/grad_norm"]) for t in (fp16_trainer, fp32_trainer))
    assert norm32 == pytest.approx(true_norm, rel=1e-6)
    # fp16 rounds each matmul to 2^-11 relative; measured 2e-5 here
    assert norm16 == pytest.approx(norm32, rel=4 * FP16_EPS)
    before = {n: p.detach() for n, p in fp32.models[0].named_parameters()}
    errors = {}
    for name, after in fp32.after[0].items():
        update32, update16 = after - before[name], fp16.after[0][name] - before[name]
        # not vacuous: the first update is -lr g / (|g| + 1), so it scales with the gradient (up to
        # the rounding of the weight it is added to)
        grad = fp32.grads[0][name]
        torch.testing.assert_close(update32, -grad / (grad.abs() + 1), rtol=1e-5,
                                   atol=EPS32 * before[name].abs().max().item(), msg=name)
        errors[name] = relative_error(update16, update32)
    # fp16 gradients, then the fp32 rounding of small updates to weights near 1 (the norms): measured 4e-3
    assert max(errors.values()) < 20 * FP16_EPS, errors


# -- DPO: sequence log-probs are the completion tokens' log_softmax, gathered by hand -------------------
def _preference_batch() -> dict[str, torch.Tensor]:
    """2 (chosen, rejected) pairs interleaved, prompts masked, replies of different lengths."""
    batch = _batch(8, rows=4)
    batch["input_ids"][1::2, :10] = batch["input_ids"][0::2, :10]
    batch["labels"][:, :9] = -100
    batch["labels"][1, 25:] = -100  # a shorter rejected reply
    return batch


@pytest.mark.parametrize("loss_type", ["sigmoid", "ipo"])
def test_dpo_logps_are_a_hand_gather_over_the_completion_tokens(loss_type):
    torch.manual_seed(0)
    module = DPOModule(_llm(), OptimConfig(), ScheduleConfig(name="constant", warmup_steps=0), micro_batch_size=4,
                       total_steps=1, dpo=DPOConfig(reference="model", beta=0.1, loss_type=loss_type).validate())
    module.configure_model()
    with torch.no_grad():  # the policy moves away from the frozen reference
        for p in module.model.parameters():
            p.add_(0.05 * torch.randn_like(p))
    batch = _preference_batch()
    loss, metrics = module.micro_batch_objective(batch, module.loss_normalizers(batch))

    def hand_logps(model: torch.nn.Module) -> torch.Tensor:
        with torch.no_grad():
            log_probs = model(batch["input_ids"]).double().log_softmax(-1)
        per_row = []
        for row, labels in zip(log_probs, batch["labels"]):
            positions = [t for t in range(labels.shape[0]) if labels[t] != -100]
            total = sum(row[t, labels[t]] for t in positions)
            per_row.append(total / len(positions) if loss_type == "ipo" else total)
        return torch.stack(per_row)

    policy, reference = hand_logps(module.model), hand_logps(module.reference.eval())
    assert (policy - reference).abs().min() > 1e-2  # perturbed: the log-probs differ on every row
    assert metrics["logps/chosen"].item() == pytest.approx(policy[0::2].mean().item(), rel=1e-5)
    assert metrics["logps/rejected"].item() == pytest.approx(policy[1::2].mean().item(), rel=1e-5)
    h = (policy[0::2] - reference[0::2]) - (policy[1::2] - reference[1::2])
    expected = -F.logsigmoid(0.1 * h) if loss_type == "sigmoid" else (h - 1 / (2 * 0.1)) ** 2
    assert loss.item() == pytest.approx(expected.mean().item(), rel=1e-5)
    chosen_rewards = 0.1 * (policy[0::2] - reference[0::2])
    assert metrics["rewards/chosen"].item() == pytest.approx(chosen_rewards.mean().item(), rel=1e-5)
