"""The planner against runs whose speed was published, and against this project's own measurements.

Each run is a ``plan_experiment`` preset holding its published layout (the preset's header says
where each value comes from and what was assumed); :func:`compare` plans each one with the same
model and constants and sets the prediction beside the published figure. ``recipes/plan.py
plan.published=true`` prints the table; ``tests/unit/scaling/test_planner.py`` holds each within its tolerance.

The three published DeepSeek-V3 (671B, 37B activated) runs:

- DeepSeek's own (arXiv 2412.19437, section 1 and table 1): 2.664M H800 GPU-hours for 14.8T
  tokens, 180K per trillion; 2048 H800, FP8, DualPipe PP16, EP64 over 8 nodes, ZeRO-1;
- NVIDIA Megatron-Bridge (Megatron-Core), performance summary of the NeMo 25.09 container:
  1,297 tokens/s/GPU on 1024 H100, FP8, TP2 PP8 VP4 EP64, the all-to-all overlapped in 1F1B;
- NVIDIA NeMo AutoModel (PyTorch FSDP2), its performance summary: 1,002 tokens/s/GPU on 256 H100,
  bf16, PP4 VP8 EP64 FSDP64, every block recomputed, DeepEP not overlapped.

DeepSeek's figure is a whole production run (batch-size ramp, checkpoints, restarts included); the
two NVIDIA figures are steady-state benchmark steps with the router forced to balance. The planner
models a steady state with balanced experts for all three.

This project's single-GPU steps (issue 40's GPU check on one H200, 4 x 2048 tokens, forward,
backward and AdamW, ``torch.compile`` per block): the dense ~1B model in bf16 and FP8, and the
V3-style MoE ~0.8B. The planner models a fused, well-implemented step; the measured MoE step still
carried fixed costs it does not model (issue 40, item 4: fp32 dispatch and combine, per-step expert
weight casts, an eager cross-entropy, host syncs), so for it the comparison is a band, not +-25%.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from omegaconf import DictConfig

from dsl_lit.config.pipeline_schedules import schedule
from dsl_lit.scaling.planner.config import plan_inputs
from dsl_lit.scaling.planner.plan import Plan, make_plan

METRICS = {
    "gpu_hours_per_trillion_tokens": ("GPU-h / 1T tokens", lambda p: p.gpu_hours_per_trillion_tokens),
    "tokens_per_gpu_per_s": ("tokens / GPU / s", lambda p: p.tokens_per_gpu_per_s),
    "step_time_ms": ("ms / step", lambda p: p.step.total * 1e3),
}
"""What a run published: its label and how a plan gives it."""


@dataclass(frozen=True)
class Reference:
    """One run with a known speed: how to plan it, what it measured, where that comes from."""

    name: str
    overrides: tuple[str, ...]
    """``recipes/plan.py`` overrides that plan it (a ``plan_experiment`` and what it varies)."""
    metric: str
    """A key of :data:`METRICS`."""
    value: float
    source: str
    band: tuple[float, float] = (-0.25, 0.25)
    """The predicted / published - 1 the tests accept."""


PUBLISHED = (
    Reference("DeepSeek-V3, DeepSeek's own", ("plan_experiment=deepseek_v3_671b_h800",),
              "gpu_hours_per_trillion_tokens", 180_000.0,
              "arXiv 2412.19437 section 1: 2.664M H800 GPU-hours / 14.8T tokens"),
    Reference("DeepSeek-V3, Megatron-Bridge", ("plan_experiment=deepseek_v3_671b_megatron_h100",),
              "tokens_per_gpu_per_s", 1297.0,
              "docs.nvidia.com/nemo/megatron-bridge/latest/performance-summary.html (25.09, DGX-H100)"),
    Reference("DeepSeek-V3, NeMo AutoModel", ("plan_experiment=deepseek_v3_671b_automodel_h100",),
              "tokens_per_gpu_per_s", 1002.0,
              "github.com/NVIDIA-NeMo/Automodel docs/performance-summary.md (DGX-H100, BF16)"),
)
"""The three published DeepSeek-V3 runs, each within +-25%."""

MEASURED = (
    Reference("ours: dense ~1B, compiled", ("plan_experiment=gpu_check_dense_1b_h200",),
              "step_time_ms", 99.4, "issue 40's GPU check (50.4% MFU)"),
    Reference("ours: dense ~1B FP8, compiled", ("plan_experiment=gpu_check_dense_1b_h200", "plan.precision=fp8"),
              "step_time_ms", 88.7, "issue 40's GPU check, torchao tensorwise (the planner: blockwise casts)"),
    Reference("ours: V3-style MoE ~0.8B, compiled", ("plan_experiment=gpu_check_moe_h200",),
              "step_time_ms", 49.2, "issue 40's GPU check (18.6% MFU)", band=(-0.5, 0.0)),
)
"""This project's own single-GPU steps. The MoE band: the planner's step is faster (our step has
fixed costs it does not model) but not by more than 2x."""


@dataclass
class Comparison:
    reference: Reference
    plan: Plan

    @property
    def predicted(self) -> float:
        return METRICS[self.reference.metric][1](self.plan)

    @property
    def error(self) -> float:
        """Predicted over published, minus one (GPU-hours and ms: positive = predicted slower)."""
        return self.predicted / self.reference.value - 1

    @property
    def within(self) -> bool:
        low, high = self.reference.band
        return low <= self.error <= high

    def to_dict(self) -> dict[str, object]:
        return {"name": self.reference.name, "metric": self.reference.metric, "published": self.reference.value,
                "predicted": self.predicted, "error": self.error, "band": list(self.reference.band),
                "source": self.reference.source, "layout": self.plan.layout.to_dict(), "gpus": self.plan.layout.parallel.world_size,
                "gpu": self.plan.cluster.gpu}


def compare(compose: Callable[[list[str]], DictConfig], references: Sequence[Reference] = (*PUBLISHED, *MEASURED),
            extra: Sequence[str] = ()) -> list[Comparison]:
    """Plan each reference run; ``compose`` turns overrides into ``recipes/plan.py``'s config (Hydra's
    ``compose("plan", overrides)``), ``extra`` overrides are added to every run (e.g. an efficiency
    to try)."""
    comparisons = []
    for reference in references:
        model, layout, cluster, _ = plan_inputs(compose([*reference.overrides, *extra]))
        comparisons.append(Comparison(reference, make_plan(model, layout, cluster)))
    return comparisons


def _layout(plan: Plan) -> str:
    par, lay = plan.layout.parallel, plan.layout
    parts = [f"{par.world_size} {plan.cluster.gpu}"]
    parts += [f"{name.upper()}{value}" for name, value in (("tp", par.tp), ("pp", par.pp), ("ep", par.ep)) if value > 1]
    if par.pp > 1:
        several = schedule(par.pp_schedule).stages_per_rank is None  # the stages per rank are the layout's
        parts.append(par.pp_schedule + (f" v{par.pp_virtual_stages}" if several else ""))
    if lay.ep_overlap:
        parts.append("a2a overlapped")
    if lay.routed_nodes is not None:
        parts.append(f"{lay.routed_nodes} node/token")
    parts.append(f"DP{par.dp}")
    parts.append(lay.precision)
    if lay.recompute != "none":
        parts.append(f"recompute {lay.recompute}")
    return " ".join(parts)


def _figure(value: float) -> str:
    return f"{value:,.0f}" if value >= 1000 else f"{value:.1f}"


def comparison_table(comparisons: Sequence[Comparison]) -> str:
    """Run, layout, published figure, predicted, error and the band it must land in."""
    rows = [(c.reference.name, _layout(c.plan), METRICS[c.reference.metric][0], _figure(c.reference.value),
             _figure(c.predicted), f"{c.error:+.1%}",
             f"[{c.reference.band[0]:+.0%}, {c.reference.band[1]:+.0%}]" + ("" if c.within else " OUTSIDE"))
            for c in comparisons]
    header = ("run", "layout", "figure", "published", "predicted", "error", "band")
    widths = [max(len(r[i]) for r in (header, *rows)) for i in range(len(header))]
    right = (False, False, False, True, True, True, False)
    return "\n".join("  ".join(cell.rjust(w) if r else cell.ljust(w) for cell, w, r in zip(row, widths, right)).rstrip()
                     for row in (header, *rows))
