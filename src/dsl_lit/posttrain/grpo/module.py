"""GRPO (DeepSeekMath / DeepSeek-R1): sample, score with rules, and push towards the group's best.

One training step takes a batch of prompts and

1. samples G completions per prompt with the KV-cache generator (the policy in eval mode);
2. scores them with the weighted rule rewards and turns the rewards into group advantages;
3. computes the reference's log-probs (when beta > 0) and, for mu > 1, the sampling policy's;
4. takes mu optimizer steps on that batch with the clipped objective + k3 KL
   (``CausalLMModule.training_step``: micro-batches, gradient reduction, clipping, logging);
5. replaces the reference by the current policy every ``ref_refresh_steps`` optimizer steps.

Logged per step: reward mean and std and each reward component, KL, clip fractions, completion
length, and the seconds spent generating vs training. Sampling is seeded by (seed, step, dp rank),
so a resumed run draws the same completions. Each data-parallel rank samples its own prompts; under
tensor, pipeline or expert parallelism the ranks of a replica sample the same completions with a
whole copy of the current policy (:meth:`PostTrainModule.inference_model`), then train the
sharded policy on them.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from typing import Any

import torch

from dsl_lit.config.posttrain import GRPOConfig, SamplingConfig
from dsl_lit.data.chat import ChatTokenizer
from dsl_lit.inference.generation import generate
from dsl_lit.posttrain.grpo.data import prompts_of
from dsl_lit.posttrain.grpo.loss import group_advantages, grpo_loss
from dsl_lit.posttrain.logps import token_logps
from dsl_lit.posttrain.module import PostTrainModule, shifted_completion
from dsl_lit.posttrain.rewards import WeightedRewards, accuracy_reward
from dsl_lit.training.causal_lm import Batch, Metrics

log = logging.getLogger(__name__)


class GRPOModule(PostTrainModule):
    def __init__(self, *args: Any, grpo: GRPOConfig, rewards: WeightedRewards, problems: Sequence[dict],
                 tokenizer: ChatTokenizer, eval_set: Sequence[tuple[list[int], dict]] = (), seed: int = 0,
                 **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.grpo, self.rewards, self.problems, self.tokenizer = grpo, rewards, list(problems), tokenizer
        self.eval_set, self.seed = list(eval_set), seed
        self.sampling: SamplingConfig = grpo.sampling
        self.reward_history: list[float] = []
        self.rollout_tokens = 0

    @property
    def whole_model_at_start(self) -> bool:
        return bool(self.grpo.beta)  # the KL reference is a copy of the whole starting model

    def on_initial_weights(self) -> None:
        if self.grpo.beta:
            self.make_reference()

    @property
    def temperature(self) -> float:
        return self.sampling.temperature or 1.0

    # -- sampling ------------------------------------------------------------------------------
    def _generator(self) -> torch.Generator:
        rank = self.runner.dp_rank
        return torch.Generator(self.device).manual_seed(self.seed + 1_000_003 * self.trainer.global_step + 7919 * rank)

    def rollout(self, batch: Batch) -> tuple[Batch, dict[str, float]]:
        """Sample, score and prepare the training rows of one batch of prompts."""
        g = self.grpo.group_size
        start = time.perf_counter()
        prompts = [p for p in prompts_of(batch) for _ in range(g)]
        samples = [self.problems[i] for i in batch["index"].tolist() for _ in range(g)]
        s = self.sampling
        policy = self.inference_model()
        out = generate(policy, prompts, s.max_new_tokens, temperature=s.temperature, top_p=s.top_p, top_k=s.top_k,
                       eos_token_id=self.tokenizer.eos_id, pad_token_id=self.tokenizer.pad_id,
                       generator=self._generator())
        texts = [self.tokenizer.decode(c) for c in out.completions]
        rewards, parts = self.rewards(texts, samples)
        rollout = shifted_completion(out.sequences, out.attention_mask, out.prompt_length)
        rollout["advantages"] = group_advantages(rewards, g, self.grpo.advantage_scale).to(self.device)
        if self.grpo.beta:
            rollout["ref_logps"] = self.frozen_token_logps(rollout, self.reference, self.micro_batch_size, self.temperature)
        if self.grpo.iterations > 1:
            rollout["old_logps"] = self.frozen_token_logps(rollout, policy, self.micro_batch_size, self.temperature)
        lengths = out.completion_mask.sum(-1).float()
        stats = {"reward/mean": rewards.mean().item(), "reward/std": rewards.std().item(),
                 "completion/length": lengths.mean().item(),
                 "completion/ended": sum(bool(c) and c[-1] == self.tokenizer.eos_id for c in out.completions) / len(texts),
                 "perf/generation_s": time.perf_counter() - start}
        stats.update({f"reward/{name}": value.mean().item() for name, value in parts.items()})
        return rollout, stats

    # -- the loss ------------------------------------------------------------------------------
    def loss_normalizers(self, batch: Batch) -> dict[str, torch.Tensor]:
        """``dapo`` divides by the completion tokens of the global batch (``targets``: all replicas);
        ``bnpo`` by this replica's own (TRL's per-process batch)."""
        normalizers = super().loss_normalizers(batch)
        local = (batch["labels"] != -100).sum().clamp_min(1).float()
        normalizers["tokens"] = local if self.grpo.loss_type == "bnpo" else normalizers["targets"]
        return normalizers

    def loss_from_outputs(
        self, outputs: tuple[torch.Tensor, ...], micro_batch: Batch, normalizers: dict[str, torch.Tensor]
    ) -> tuple[torch.Tensor, Metrics]:
        logps = token_logps(outputs[0], micro_batch["labels"], self.temperature)
        old = micro_batch.get("old_logps")
        mask = micro_batch["labels"] != -100
        out = grpo_loss(
            logps, logps.detach() if old is None else old, micro_batch.get("ref_logps"), micro_batch["advantages"],
            mask, self.grpo.eps_low, self.grpo.eps_high, self.grpo.beta, self.grpo.loss_type,
            num_sequences=normalizers["sequences"], num_tokens=normalizers["tokens"],
            max_completion_length=self.sampling.max_new_tokens,
        )
        targets = normalizers["targets"]
        metrics = {"loss": out.loss.detach(), "clip_low": out.low_clipped.sum() / targets,
                   "clip_high": out.high_clipped.sum() / targets,
                   "clip_fraction": (out.low_clipped | out.high_clipped).sum() / targets}
        if out.kl is not None:
            metrics["kl"] = out.kl.sum() / targets
        return out.loss, metrics

    def tokens_in_batch(self, batch: Batch) -> int:
        """Tokens of the completions trained on (a prompt batch counts its rollout's)."""
        return batch["input_ids"].numel() if "input_ids" in batch else self.rollout_tokens

    # -- one step: rollout, then mu optimizer steps ---------------------------------------------
    def training_step(self, batch: Batch, batch_idx: int) -> torch.Tensor:
        if self.grpo.eval_every_n_steps and self.trainer.global_step % self.grpo.eval_every_n_steps == 0:
            self.log("eval/accuracy", self.evaluate())
        rollout, stats = self.rollout(batch)
        self.rollout_tokens = rollout["input_ids"].numel()
        start = time.perf_counter()
        for _ in range(self.grpo.iterations):
            loss = super().training_step(rollout, batch_idx)
            refresh = self.grpo.ref_refresh_steps
            if self.reference is not None and refresh and self.trainer.global_step % refresh == 0:
                self.refresh_reference()
        stats["perf/training_s"] = time.perf_counter() - start
        self.log_dict(stats, sync_dist=self.trainer.world_size > 1)
        self.reward_history.append(stats["reward/mean"])
        return loss

    def on_train_end(self) -> None:
        """Final held-out accuracy (to the loggers too) and the reward's start and end."""
        accuracy = self.evaluate()
        for logger in self.loggers:
            logger.log_metrics({"eval/accuracy": accuracy}, step=self.trainer.global_step)
            logger.save()
        h = self.reward_history
        if h:
            k = max(1, min(5, len(h) // 4))
            log.info("grpo: mean reward %.3f over the first %d steps -> %.3f over the last %d; held-out greedy "
                     "accuracy %.3f", sum(h[:k]) / k, k, sum(h[-k:]) / k, k, accuracy)

    @torch.no_grad()
    def evaluate(self, batch_size: int = 64) -> float:
        """Greedy accuracy on the held-out ``eval_set`` of (prompt ids, problem)."""
        if not self.eval_set:
            return float("nan")
        correct = 0.0
        for i in range(0, len(self.eval_set), batch_size):
            chunk = self.eval_set[i : i + batch_size]
            out = generate(self.inference_model(), [p for p, _ in chunk], self.sampling.max_new_tokens,
                           eos_token_id=self.tokenizer.eos_id, pad_token_id=self.tokenizer.pad_id)
            correct += sum(accuracy_reward(self.tokenizer.decode(c), p) for c, (_, p) in zip(out.completions, chunk))
        return correct / len(self.eval_set)
