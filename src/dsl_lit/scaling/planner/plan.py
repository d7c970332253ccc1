"""A plan: memory and step time of one layout on one cluster, the derived throughput figures,
and the search for the fastest layout that fits."""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import Any

from data_contract.errors import ConfigError
from dsl_lit.config.model import ModelConfig
from dsl_lit.config.parallel import ParallelLayout
from dsl_lit.config.pipeline_schedules import schedule as schedule_row
from dsl_lit.flops import training_flops_per_token
from dsl_lit.scaling.planner.cluster import GIB, ClusterConfig
from dsl_lit.scaling.planner.layout import PlanLayout
from dsl_lit.scaling.planner.memory import MemoryEstimate, estimate_memory
from dsl_lit.scaling.planner.step_time import StepTime, estimate_step_time


@dataclass
class Plan:
    model: ModelConfig
    layout: PlanLayout
    cluster: ClusterConfig
    memory: MemoryEstimate
    step: StepTime

    @property
    def memory_per_gpu_gib(self) -> float:
        return self.memory.total / GIB

    @property
    def fits(self) -> bool:
        return self.memory_per_gpu_gib <= self.cluster.memory_gib

    @property
    def tokens_per_gpu_per_s(self) -> float:
        tokens = self.layout.global_batch_size * self.layout.seq_len
        return tokens / self.step.total / self.layout.parallel.world_size

    @property
    def mfu(self) -> float:
        """Model FLOPs (``dsl_lit.flops``, as the trainer logs them) over the dense bf16 peak
        (fp32 runs: the TF32 peak), whatever precision the GEMMs run in."""
        peak = self.cluster.peak_flops("fp32" if self.layout.precision == "fp32" else "bf16")
        return self.tokens_per_gpu_per_s * training_flops_per_token(self.model, self.layout.seq_len) / peak

    @property
    def gpu_hours_per_trillion_tokens(self) -> float:
        return 1e12 / self.tokens_per_gpu_per_s / 3600

    def to_dict(self) -> dict[str, Any]:
        return {
            "model": self.model.name,
            "cluster": self.cluster.name,
            "gpus": self.layout.parallel.world_size,
            "layout": self.layout.to_dict(),
            "runtime_issue": self.layout.runtime_issue(self.model),
            "memory_per_gpu_gib": self.memory_per_gpu_gib,
            "memory_breakdown_gib": self.memory.gib(),
            "fits": self.fits,
            "step_time_s": self.step.total,
            "step_time_breakdown_s": self.step.to_dict(),
            "tokens_per_gpu_per_s": self.tokens_per_gpu_per_s,
            "mfu": self.mfu,
            "gpu_hours_per_trillion_tokens": self.gpu_hours_per_trillion_tokens,
        }

    def table(self) -> str:
        """A human-readable summary: layout, memory and time breakdowns, headline figures."""
        lay = self.layout
        par = lay.parallel
        lines = [
            f"{self.model.name} on {par.world_size} x {self.cluster.gpu} ({self.cluster.name})",
            f"layout: dp {par.dp} x tp {par.tp} x pp {par.pp} (ep {par.ep}), {par.pp_schedule}, zero1={par.zero1}, "
            f"{lay.micro_batches} micro-batches of {lay.micro_batch_size} x {lay.seq_len}, recompute {lay.recompute}, "
            f"{lay.precision}",
        ]
        issue = lay.runtime_issue(self.model)
        if issue:
            lines.append(f"(dsl-lit's runtime cannot run this layout yet: {issue})")
        lines.append(f"{'memory per GPU':<28}{'GiB':>10}")
        for name, value in self.memory.gib().items():
            lines.append(f"  {name:<26}{value:>10.2f}")
        lines.append(f"  {'capacity':<26}{self.cluster.memory_gib:>10.2f}  {'fits' if self.fits else 'DOES NOT FIT'}")
        lines.append(f"{'step time':<28}{'s':>10}")
        for name, value in self.step.to_dict().items():
            lines.append(f"  {name:<26}{value:>10.3f}")
        lines += [
            f"{'tokens / GPU / s':<28}{self.tokens_per_gpu_per_s:>10.0f}",
            f"{'MFU':<28}{self.mfu:>10.1%}",
            f"{'GPU-hours / 1T tokens':<28}{self.gpu_hours_per_trillion_tokens:>10.0f}",
        ]
        return "\n".join(lines)


def make_plan(model: ModelConfig, layout: PlanLayout, cluster: ClusterConfig) -> Plan:
    """Validate, then estimate memory and step time of ``layout`` on the whole ``cluster``."""
    layout.validate(model, cluster.world_size)
    return Plan(model, layout, cluster, estimate_memory(model, layout, cluster), estimate_step_time(model, layout, cluster))


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def search_layouts(model: ModelConfig, base: PlanLayout, cluster: ClusterConfig, *,
                   schedules: tuple[str, ...] = ("1F1B", "Interleaved1F1B", "DualPipeV"),
                   recomputes: tuple[str, ...] = ("none", "selective", "full"),
                   micro_batch_sizes: tuple[int, ...] = (1, 2, 4), max_pp: int = 16,
                   runnable_only: bool = False) -> list[Plan]:
    """Every layout of ``cluster`` (tp within a node, pp up to ``max_pp``, ep over dp ranks) that
    fits in memory, fastest first. ``base`` gives the batch, sequence length, precision and ZeRO-1."""
    world = cluster.world_size
    plans = []
    tps = [t for t in _divisors(cluster.gpus_per_node) if model.n_heads % t == 0]
    pps = [p for p in _divisors(world) if p <= max_pp]
    for tp, pp, schedule, recompute, micro in itertools.product(tps, pps, schedules, recomputes, micro_batch_sizes):
        if world % (tp * pp) or (pp == 1 and schedule != schedules[0]):
            continue
        dp = ParallelLayout.derive_dp(world, tp, pp)
        eps = [e for e in _divisors(dp) if model.is_moe and model.n_routed_experts % e == 0] or [1]
        for ep in eps:
            layout = base.replace(dp=dp, tp=tp, pp=pp, ep=ep, pp_schedule=schedule, recompute=recompute,
                                  micro_batch_size=micro,
                                  pp_virtual_stages=schedule_row(schedule).stages_per_rank or 2)
            try:
                plan = make_plan(model, layout, cluster)
            except (ConfigError, ValueError):
                continue
            if plan.fits and not (runnable_only and layout.runtime_issue(model)):
                plans.append(plan)
    return sorted(plans, key=lambda p: p.step.total)
