"""GRPO (DeepSeekMath / DeepSeek-R1): sample, score with rules, and push towards the group's best.

One training step takes a batch of prompts and

1. samples G completions per prompt with the KV-cache generator (the policy in eval mode);
2. scores them with the weighted rule rewards (plus DAPO's soft overlong penalty when
   ``grpo.overlong.penalty_cache`` > 0); with ``grpo.dynamic_sampling`` it drops the groups whose
   rule rewards are all equal and samples more prompts until the batch is full (:mod:`.dapo`);
3. turns the rewards into group advantages (masking truncated completions with ``grpo.overlong.filter``);
4. computes the reference's log-probs (when beta > 0) and, for mu > 1, the sampling policy's;
5. takes mu optimizer steps on that batch with the clipped objective + k3 KL
   (``CausalLMModule.training_step``: micro-batches, gradient reduction, clipping, logging);
6. replaces the reference by the current policy every ``ref_refresh_steps`` optimizer steps.

Logged per step: reward mean and std and each reward component, completion length (all over every
completion sampled in the step), KL, clip fractions, the seconds spent generating vs training, and
with DAPO's options the draws, dropped and filled groups and masked completions (``grpo/*``).
Sampling, and the extra prompts dynamic sampling draws from the training problems, are seeded by
(seed, step, dp rank), so a resumed run draws the same completions. Each data-parallel rank samples
its own prompts (and draws as often as it needs: the batch it trains on always has the same shape);
under tensor or expert parallelism the ranks sample from the sharded policy itself, decoding in
lockstep (the ranks of a replica draw the same completions), under pipeline parallelism through
the stages (the last stage samples and tells the others), under context or sequence parallelism
(and expert parallelism with dynamic sampling, whose replicas draw different numbers of batches)
from a whole copy of the current policy (:meth:`PostTrainModule.inference_model`), then train the
sharded policy on them. The KL reference is cut and sharded like the policy under tensor, expert
and pipeline parallelism (dynamic sampling included) and scored on its shards.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from typing import Any

import torch

from dsl_lit.config.posttrain import GRPOConfig, SamplingConfig
from dsl_lit.inference.generation import generate
from dsl_lit.models.common.routing_replay import (
    flip_rates,
    install_routes,
    named_stack_routers,
    recording_routes,
    remove_routes,
)
from dsl_lit.parallel.grad_sync import local
from dsl_lit.parallel.pipeline_inference import PipelinedInference
from dsl_lit.posttrain.chat.tokenizer import ChatTokenizer
from dsl_lit.posttrain.grpo.dapo import GroupSelection, overlong_penalty
from dsl_lit.posttrain.grpo.data import encode_prompts, prompts_of
from dsl_lit.posttrain.grpo.loss import grpo_loss
from dsl_lit.posttrain.grpo.rollout import Rollouts, training_rows
from dsl_lit.posttrain.grpo.rollout_correction import rollout_correction
from dsl_lit.posttrain.logps import token_logps
from dsl_lit.posttrain.module import PostTrainModule, laid_out_alike
from dsl_lit.posttrain.rewards import WeightedRewards
from dsl_lit.training.causal_lm import Batch, Metrics

log = logging.getLogger(__name__)


def _held_mib(model: torch.nn.Module) -> float:
    """MiB of ``model``'s parameters on this rank (its shards under a sharded layout)."""
    return sum(local(p).nbytes for p in model.parameters()) / 2**20


class GRPOModule(PostTrainModule):
    def __init__(self, *args: Any, grpo: GRPOConfig, rewards: WeightedRewards, problems: Sequence[dict],
                 tokenizer: ChatTokenizer, eval_set: Sequence[tuple[list[int], dict]] = (), seed: int = 0,
                 **kwargs: Any) -> None:
        super().__init__(*args, tokenizer=tokenizer, eval_set=eval_set,
                         eval_max_new_tokens=grpo.sampling.max_new_tokens, **kwargs)
        self.grpo, self.rewards, self.problems, self.seed = grpo, rewards, list(problems), seed
        self.sampling: SamplingConfig = grpo.sampling
        self.reward_history: list[float] = []
        self.rollout_tokens = 0

    @property
    def whole_model_at_start(self) -> bool:
        return bool(self.grpo.beta)  # the KL reference is a copy of the whole starting model

    def on_initial_weights(self) -> None:
        if self.grpo.beta:
            self.make_reference()

    def frozen_copies(self) -> list[torch.nn.Module]:
        return [self.reference] if self.reference is not None else []

    def on_train_start(self) -> None:
        """Say where sampling and the reference run, with the weights this rank holds for each."""
        if not self.runner.shards_model:
            return
        where = "a whole copy of the policy"
        if self.sampling_group is not None:
            pipelined = isinstance(self.inference_model(), PipelinedInference)
            where = "the policy's pipeline stages" if pipelined else "the policy's shards, in lockstep"
        reference = "none"
        if self.reference is not None:
            sharded = laid_out_alike(self.reference, self.model)  # the policy is sharded here
            reference = f"{'sharded like the policy' if sharded else 'whole'}, {_held_mib(self.reference):.1f} MiB here"
        log.info("grpo: sampling from %s; policy %.1f MiB here; reference %s", where, _held_mib(self.model), reference)

    @property
    def sampling_group(self) -> torch.distributed.ProcessGroup | None:
        # dynamic sampling draws as often as each replica needs, so replicas cannot decode in
        # lockstep: expert-parallel layouts (whose ep ranks are replicas) then sample from a whole copy
        return self.runner.generation_group(same_calls_on_every_replica=not self.grpo.dynamic_sampling.enabled)

    @property
    def temperature(self) -> float:
        return self.sampling.temperature or 1.0

    # -- sampling ------------------------------------------------------------------------------
    def _generator(self) -> torch.Generator:
        rank = self.runner.dp_rank
        return torch.Generator(self.device).manual_seed(self.seed + 1_000_003 * self.global_step + 7919 * rank)

    def sample(self, prompts: list[list[int]], problems: list[dict], generator: torch.Generator) -> Rollouts:
        """G completions of each prompt, scored: the weighted rule rewards plus the soft overlong penalty."""
        g, s = self.grpo.group_size, self.sampling
        prompts = [p for p in prompts for _ in range(g)]
        samples = [p for p in problems for _ in range(g)]
        sampler = self.inference_model()
        with recording_routes(sampler, len(prompts)) as recorded:  # MoE: each token's experts, for R3 and flips
            out = generate(sampler, prompts, s.max_new_tokens, temperature=s.temperature, top_p=s.top_p,
                           top_k=s.top_k, eos_token_id=self.tokenizer.eos_id, pad_token_id=self.tokenizer.pad_id,
                           generator=generator, all_finished=self.all_finished(), logprob_temperature=self.temperature)
        rewards, parts = self.rewards([self.tokenizer.decode(c) for c in out.completions], samples)
        logprobs = [row[:len(c)].tolist() for row, c in zip(out.logprobs.cpu(), out.completions)]
        routes = None
        if recorded:  # positions P - len(prompt) .. P + len(completion) - 2 of this call's left-padded rows
            by_row, width = recorded[0].to("cpu", torch.int16), out.prompt_length
            routes = [r[width - len(p) : width + len(c) - 1] for r, p, c in zip(by_row, prompts, out.completions)]
        rollouts = Rollouts(prompts, out.completions, rewards, torch.zeros_like(rewards), parts, g, logprobs, routes)
        if self.grpo.overlong.penalty_cache:
            rollouts.penalty = overlong_penalty(rollouts.lengths(), self.grpo.overlong_max_length,
                                                self.grpo.overlong.penalty_cache)
            parts["overlong"] = rollouts.penalty
        return rollouts

    def sample_batch(self, batch: Batch) -> tuple[Rollouts, Rollouts, dict[str, float]]:
        """(the groups to train on, every group sampled this step, counts). With dynamic sampling,
        groups with all-equal rule rewards are dropped and batches of training problems drawn at random
        are sampled until the batch is full or ``max_draws`` batches were sampled."""
        generator = self._generator()
        problems = [self.problems[i] for i in batch["index"].tolist()]
        first = self.sample(prompts_of(batch), problems, generator)
        dynamic = self.grpo.dynamic_sampling
        if not dynamic.enabled:
            return first, first, {}
        selection = GroupSelection(len(problems))
        selection.add(first)
        sampled = [first]
        while not selection.full and selection.draws < dynamic.max_draws:
            index = torch.randperm(len(self.problems), generator=generator, device=generator.device)[: len(problems)]
            drawn = [self.problems[i] for i in index.tolist()]
            sampled.append(self.sample(encode_prompts(drawn, self.tokenizer), drawn, generator))
            selection.add(sampled[-1])
        chosen, counts = selection.batch()
        return chosen, Rollouts.cat(sampled), counts

    def rollout(self, batch: Batch) -> tuple[Batch, dict[str, float]]:
        """Sample, score and prepare the training rows of one batch of prompts."""
        start = time.perf_counter()
        chosen, sampled, stats = self.sample_batch(batch)
        rollout, truncated = training_rows(chosen, pad_id=self.tokenizer.pad_id, eos_id=self.tokenizer.eos_id,
                                           advantage_scale=self.grpo.advantage_scale,
                                           filter_overlong=self.grpo.overlong.filter)
        rollout = {k: v.to(self.device) for k, v in rollout.items()}
        if self.grpo.overlong.filter:
            stats["grpo/masked_completions"] = float(truncated.sum())
        if self.grpo.beta:
            rollout["ref_logps"] = self.frozen_token_logps(rollout, self.reference, self.micro_batch_size, self.temperature)
        if self.grpo.iterations > 1:
            rollout["old_logps"] = self.frozen_token_logps(rollout, self.inference_model(), self.micro_batch_size,
                                                           self.temperature)
        rewards, ended = sampled.total, ~sampled.truncated(self.tokenizer.eos_id)
        stats.update({"reward/mean": rewards.mean().item(), "reward/std": rewards.std().item(),
                      "completion/length": sampled.lengths().mean().item(),
                      "completion/ended": ended.sum().item() / len(ended),
                      "perf/generation_s": time.perf_counter() - start})
        stats.update({f"reward/{name}": value.mean().item() for name, value in sampled.parts.items()})
        if "accuracy" in sampled.parts:  # pass@G: what RL can sharpen pass@1 towards
            solved = sampled.parts["accuracy"].view(sampled.num_groups, sampled.group_size).amax(1) > 0
            stats["reward/accuracy_pass_at_group"] = solved.float().mean().item()
        return rollout, stats

    # -- the loss ------------------------------------------------------------------------------
    def loss_normalizers(self, batch: Batch) -> dict[str, torch.Tensor]:
        """``dapo`` divides by the completion tokens of the global batch (``targets``: all replicas);
        ``bnpo`` by this replica's own, over all its micro-batches (TRL: each micro-batch's own, see
        :mod:`.loss`)."""
        normalizers = super().loss_normalizers(batch)
        local = (batch["labels"] != -100).sum().clamp_min(1).float()
        normalizers["tokens"] = local if self.grpo.loss_type == "bnpo" else normalizers["targets"]  # dapo, cispo
        if "routed_experts" in batch:  # this rank's positions the sampler routed (the flip rates' denominator)
            normalizers["routed_tokens"] = (batch["routed_experts"][:, :, 0, 0] >= 0).sum().clamp_min(1).float()
        return normalizers

    def micro_batch_objective(self, micro_batch: Batch, normalizers: dict[str, torch.Tensor]) -> tuple[torch.Tensor, Metrics]:
        """With the sampler's routing recorded: the routers compare their choices with it (the flip
        rate, per router) and, with ``grpo.routing_replay``, use it (R3). The routes stay installed
        through this micro-batch's backward (activation recompute replays them too)."""
        if "routed_experts" not in micro_batch:
            return super().micro_batch_objective(micro_batch, normalizers)
        tapes = install_routes(self.model, micro_batch["routed_experts"], enforce=self.grpo.routing_replay)
        objective, metrics = super().micro_batch_objective(micro_batch, normalizers)
        flipped = {name: tape.flipped for (name, _), tape in zip(named_stack_routers(self.model), tapes)}
        return objective, {**metrics, **flip_rates(flipped, normalizers["routed_tokens"])}

    @property
    def routing_replay(self) -> bool:
        """Whether the training forwards replay the sampler's routes (a pipeline's stages read it)."""
        return self.grpo.routing_replay

    def model_inputs(self, batch: Batch) -> dict[str, torch.Tensor]:
        """Plus the sampler's ``routed_experts``: a pipeline's stages install their routers' share
        (one process installs them in :meth:`micro_batch_objective`; the model ignores the input)."""
        inputs = super().model_inputs(batch)
        if "routed_experts" in batch:
            inputs["routed_experts"] = batch["routed_experts"]
        return inputs

    def _frozen_logps(self, batch: Batch, model: torch.nn.Module | PipelinedInference, temperature: float) -> torch.Tensor:
        """The sampling policy's log-probs (mu > 1) replay the rollout's routing too; the reference's
        route by its own router."""
        replay = self.grpo.routing_replay and "routed_experts" in batch and model is not self.reference
        if replay:
            install_routes(model, batch["routed_experts"], enforce=True)
        try:
            return super()._frozen_logps(batch, model, temperature)
        finally:
            if replay:
                remove_routes(model)

    def loss_from_outputs(
        self, outputs: tuple[torch.Tensor, ...], micro_batch: Batch, normalizers: dict[str, torch.Tensor]
    ) -> tuple[torch.Tensor, Metrics]:
        logps = token_logps(outputs[0], micro_batch["labels"], self.temperature)
        old = micro_batch.get("old_logps")
        old = logps.detach() if old is None else old
        mask = micro_batch["labels"] != -100
        correction = None
        if "rollout_logps" in micro_batch:  # the sampler's own log-probs: measure (and correct) the mismatch
            fix = self.grpo.rollout_correction
            correction = rollout_correction(old, micro_batch["rollout_logps"], mask, fix.token_cap,
                                            tuple(fix.sequence_bounds) if fix.sequence_bounds else None)
        out = grpo_loss(
            logps, old, micro_batch.get("ref_logps"), micro_batch["advantages"],
            mask, self.grpo.eps_low, self.grpo.eps_high, self.grpo.beta, self.grpo.loss_type,
            num_sequences=normalizers["sequences"], num_tokens=normalizers["tokens"],
            max_completion_length=self.sampling.max_new_tokens, importance_sampling=self.grpo.importance_sampling,
            rollout_weights=correction.weights if correction is not None else None,
        )
        targets = normalizers["targets"]
        metrics = {"loss": out.loss.detach(), "clip_low": out.low_clipped.sum() / targets,
                   "clip_high": out.high_clipped.sum() / targets,
                   "clip_fraction": (out.low_clipped | out.high_clipped).sum() / targets}
        if correction is not None:  # sums over the step's targets / sequences: the micro-batches add up to means
            metrics.update({"rollout_logp_gap": correction.abs_gap.sum() / targets, "rollout_kl": correction.kl.sum() / targets,
                            "rollout_token_capped": correction.token_capped.sum() / targets,
                            "rollout_sequences_masked": correction.sequence_masked.sum() / normalizers["sequences"]})
        if out.kl is not None:
            metrics["kl"] = out.kl.sum() / targets
        return out.loss, metrics

    def tokens_in_batch(self, batch: Batch) -> int:
        """Tokens of the completions trained on (a prompt batch counts its rollout's)."""
        return batch["input_ids"].numel() if "input_ids" in batch else self.rollout_tokens

    # -- one step: rollout, then mu optimizer steps ---------------------------------------------
    def training_step(self, batch: Batch, batch_idx: int) -> torch.Tensor:
        every, step = self.grpo.eval_every_n_steps, self.trainer.global_step
        if step == 0 or (every and step % every == 0):  # the start, every N steps, and the end (on_train_end)
            self.log_eval_accuracy(self.evaluate())
        rollout, stats = self.rollout(batch)
        self.rollout_tokens = rollout["input_ids"].numel()
        start = time.perf_counter()
        try:
            for _ in range(self.grpo.iterations):
                loss = super().training_step(rollout, batch_idx)
                refresh = self.grpo.ref_refresh_steps
                if self.reference is not None and refresh and self.trainer.global_step % refresh == 0:
                    self.refresh_reference()
        finally:
            remove_routes(self.model)
        stats["perf/training_s"] = time.perf_counter() - start
        for name, value in stats.items():
            self.log_step(name, value, sync_dist=self.trainer.world_size > 1)
        self.reward_history.append(stats["reward/mean"])
        return loss

    def on_train_end(self) -> None:
        """Final held-out accuracy (to the loggers too) and the reward's start and end."""
        accuracy = self.final_evaluation()
        h = self.reward_history
        if h:
            k = max(1, min(5, len(h) // 4))
            log.info("grpo: mean reward %.3f over the first %d steps -> %.3f over the last %d; held-out greedy "
                     "accuracy %.3f", sum(h[:k]) / k, k, sum(h[-k:]) / k, k, accuracy)

