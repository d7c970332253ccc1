"""What the post-training modules (SFT, DPO, GRPO) share on top of ``CausalLMModule``: starting
weights, batches with more than token ids (per-document or left-padded positions and masks), a
frozen reference model, per-token log-probabilities, and the held-out greedy accuracy on a
verifiable task (``eval/accuracy``), which every stage of the R1 pipeline logs so the stages compare.

Only the main next-token head is trained here: DeepSeek-V3's MTP modules are left as they are
(post-training in the V3 report is on the main model).

Objectives are written as ``loss_from_outputs(outputs, micro_batch, normalizers)`` over the main
logits, so a pipeline's last stage computes them as one process does; the per-row inputs the
policy needs (positions, attention mask) come from :meth:`model_inputs` and reach every stage.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from dsl_lit.inference.generation import generate, positions_from_mask
from dsl_lit.models import build_model
from dsl_lit.parallel.pipeline_inference import PipelinedInference
from dsl_lit.posttrain.chat.rows import document_mask
from dsl_lit.posttrain.chat.tokenizer import ChatTokenizer
from dsl_lit.posttrain.logps import token_logps
from dsl_lit.posttrain.rewards import accuracy_reward
from dsl_lit.tasks.held_out import write_outcomes
from dsl_lit.training.causal_lm import Batch, CausalLMModule


def shifted_completion(sequences: torch.Tensor, valid: torch.Tensor, prompt_length: int) -> Batch:
    """A training batch of generated ``sequences`` [N, P + T] (left-padded prompt + completion):
    ``input_ids`` = all but the last token, ``labels`` = the completion tokens (-100 elsewhere),
    ``attention_mask`` = which inputs are real tokens. The labels' last T columns align with the
    completion, so ``logps[:, -T:]`` are the completion's log-probs."""
    labels = sequences[:, 1:].clone()
    target_valid = valid[:, 1:].clone()
    target_valid[:, : prompt_length - 1] = False  # prompt tokens are never targets
    labels[~target_valid] = -100
    return {"input_ids": sequences[:, :-1], "labels": labels, "attention_mask": valid[:, :-1]}


@dataclass
class InferenceCopy:
    """A whole, frozen copy of the policy (not a submodule: never trained or checkpointed) and the
    optimizer step its weights are from."""

    model: nn.Module
    step: int


class PostTrainModule(CausalLMModule):
    """``tokenizer``, ``eval_set`` (held-out (prompt ids, problem) pairs of the task) and
    ``eval_max_new_tokens``: what :meth:`evaluate` needs; without an ``eval_set`` nothing is evaluated."""

    def __init__(self, *args: Any, tokenizer: ChatTokenizer | None = None,
                 eval_set: Sequence[tuple[list[int], dict]] = (), eval_max_new_tokens: int = 32, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.reference: nn.Module | None = None
        self._inference: InferenceCopy | None = None
        self.tokenizer, self.eval_set, self.eval_max_new_tokens = tokenizer, list(eval_set), eval_max_new_tokens
        self.eval_outcomes: list[float] = []
        """The last :meth:`evaluate`'s reward per held-out problem (1.0: right)."""

    @torch.no_grad()
    def evaluate(self, batch_size: int = 64) -> float:
        """Greedy accuracy on the held-out ``eval_set`` (NaN without one). Collective under sharded
        layouts (:meth:`inference_model`): every rank calls it at the same point."""
        if not self.eval_set:
            return float("nan")
        model, outcomes = self.inference_model(), []
        for i in range(0, len(self.eval_set), batch_size):
            chunk = self.eval_set[i : i + batch_size]
            out = generate(model, [p for p, _ in chunk], self.eval_max_new_tokens,
                           eos_token_id=self.tokenizer.eos_id, pad_token_id=self.tokenizer.pad_id,
                           all_finished=self.all_finished())
            outcomes += [accuracy_reward(self.tokenizer.decode(c), p) for c, (_, p) in zip(out.completions, chunk)]
        self.eval_outcomes = outcomes
        return sum(outcomes) / len(self.eval_set)

    def final_evaluation(self) -> float:
        """The held-out accuracy at the end of training: logged, and written per problem to the run
        dir (rank 0, :mod:`dsl_lit.tasks.held_out`) so stages can be compared problem by problem."""
        accuracy = self.evaluate()
        self.log_eval_accuracy(accuracy)
        if self.eval_set and self.trainer.is_global_zero:
            write_outcomes(self.trainer.default_root_dir, self.trainer.global_step, self.eval_outcomes)
        return accuracy

    def log_eval_accuracy(self, accuracy: float) -> None:
        """``eval/accuracy`` to the loggers at this step only (``self.log`` would repeat the value
        on every later row)."""
        for logger in self.loggers:
            logger.log_metrics({"eval/accuracy": accuracy}, step=self.trainer.global_step)
            logger.save()

    def make_reference(self) -> None:
        """A frozen copy of the current policy, saved in checkpoints (``reference.*``) so a resumed
        run compares against the same reference."""
        self.reference = copy.deepcopy(self.model).requires_grad_(False)

    @torch.no_grad()
    def refresh_reference(self) -> None:
        """The reference becomes the current policy (R1 refreshes it every 400 steps): shard by shard
        when the strategy sharded it with the policy (``frozen_copies``), else from the whole policy."""
        alike = laid_out_alike(self.reference, self.model)
        self.reference.load_state_dict(self.model.state_dict() if alike else self.full_policy_state())

    def full_policy_state(self) -> dict[str, torch.Tensor]:
        """The policy's single-device state dict, gathered from its shards when the layout splits
        it (a collective then: every rank calls it at the same point)."""
        return self.runner.full_state_dict(self.model)

    @property
    def sampling_group(self) -> dist.ProcessGroup | None:
        """The ranks that sample from the policy's shards together (tensor, expert or pipeline
        parallel), or None: this rank holds the whole policy, or samples from a whole copy of it."""
        return self.runner.generation_group()

    def all_finished(self) -> Callable[[bool], bool] | None:
        """For :func:`generate` on the policy's shards: every rank of :attr:`sampling_group` is done
        (an all-reduce after every decoding step, so they run the same forwards); None otherwise."""
        group = self.sampling_group
        if group is None:
            return None

        def decide(done_here: bool) -> bool:
            flag = torch.tensor([int(done_here)], device=self.device)
            dist.all_reduce(flag, op=dist.ReduceOp.MIN, group=group)
            return bool(flag.item())

        return decide

    def inference_model(self) -> nn.Module:
        """The policy for sampling and frozen log-probs under any layout: the model itself when this
        rank holds all of it; its shards when the layout samples from them (:attr:`sampling_group`:
        tensor and expert parallelism, the KV cache sharded with the heads; pipeline stages chained
        through the pp ranks, :class:`~dsl_lit.parallel.pipeline_inference.PipelinedInference`);
        otherwise a single-device copy (eval mode) refreshed from the shards once per optimizer step
        (context or sequence parallelism; expert parallelism under GRPO's dynamic sampling).
        Collective under sharded layouts (refreshing the copy; sampling from the shards)."""
        if not self.runner.shards_model:
            return self.model
        if self.sampling_group is not None:
            return self.runner.inference_view(self.model)
        step = self.trainer.global_step
        if self._inference is None:
            with torch.random.fork_rng(devices=[]):  # its throwaway init must not move the run's RNG
                copy_ = build_model(self.model_config).to(self.device).eval().requires_grad_(False)
            self._inference = InferenceCopy(copy_, -1)
        if self._inference.step != step:
            self._inference.model.load_state_dict(self.full_policy_state())
            self._inference.step = step
        return self._inference.model

    @property
    def trains_mtp(self) -> bool:
        return False

    def model_inputs(self, batch: Batch) -> dict[str, torch.Tensor]:
        """Packed rows (``positions`` + ``doc_ids``: attention within each document), left-padded
        generations (``attention_mask``: positions count real tokens only), or plain rows."""
        if "doc_ids" in batch:
            return {"positions": batch["positions"], "key_valid": document_mask(batch["doc_ids"])}
        if "attention_mask" in batch:
            key_valid = batch["attention_mask"].bool()
            return {"positions": positions_from_mask(key_valid), "key_valid": key_valid}
        return {}

    def logits(self, batch: Batch, model: nn.Module | None = None) -> torch.Tensor:
        """Main-head logits of a batch under ``model`` (default: the policy, unpipelined)."""
        model = model if model is not None else self.model
        inputs = self.model_inputs(batch)
        return model.head(model.hidden_states(batch["input_ids"], inputs.get("positions"), inputs.get("key_valid")))

    def token_logps(self, batch: Batch, model: nn.Module | None = None, temperature: float = 1.0) -> torch.Tensor:
        """[rows, seq] log-probs of the batch's labels (0 at ignored positions)."""
        return token_logps(self.logits(batch, model), batch["labels"], temperature)

    @torch.no_grad()
    def frozen_token_logps(self, batch: Batch, model: nn.Module, micro_batch_size: int,
                           temperature: float = 1.0) -> torch.Tensor:
        """Log-probs without gradient, micro-batch by micro-batch, in eval mode (MoE routers do not
        count these tokens as training load). A model cut to this rank's pipeline stages runs
        through them; the last stage's log-probs reach every pp rank."""
        model = self.runner.inference_view(model)
        was_training = model.training
        model.eval()
        try:
            rows = batch["input_ids"].shape[0]
            parts = [self._frozen_logps({k: v[i : i + micro_batch_size] for k, v in batch.items()}, model, temperature)
                     for i in range(0, rows, micro_batch_size)]
        finally:
            model.train(was_training)
        return torch.cat(parts)

    def _frozen_logps(self, batch: Batch, model: nn.Module | PipelinedInference, temperature: float) -> torch.Tensor:
        if not isinstance(model, PipelinedInference):
            return self.token_logps(batch, model, temperature)
        inputs = self.model_inputs(batch)
        return model.token_values(batch["input_ids"], inputs.get("positions"), inputs.get("key_valid"),
                                  lambda logits: token_logps(logits, batch["labels"], temperature))


def laid_out_alike(a: nn.Module, b: nn.Module) -> bool:
    """Same parameter names, each a DTensor in both or in neither: ``b``'s state dict loads into
    ``a`` shard by shard (a reference cut and sharded like the policy, or two whole models)."""
    pa, pb = dict(a.named_parameters()), dict(b.named_parameters())
    return pa.keys() == pb.keys() and all(isinstance(pa[n], DTensor) == isinstance(pb[n], DTensor) for n in pa)
