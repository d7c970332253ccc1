"""The cluster planner: a model, a parallel layout and a cluster in; per-GPU memory, step time,
tokens/s, MFU and GPU-hours per trillion tokens out, from first principles (no run needed).

- :mod:`.cluster`: the hardware and the efficiency assumptions, each a documented config value;
- :mod:`.layout`: the layout being planned (dp/tp/pp/ep, ZeRO-1, schedule, micro-batches,
  recompute, precision) and its checks;
- :mod:`.memory`: weights, gradients, optimizer state, activations, logits, MoE buffers per GPU;
- :mod:`.step_time`: compute, TP / EP / PP / DP communication, overlap and pipeline bubbles;
- :mod:`.plan`: the two together, the report, and the search for the fastest layout that fits.
"""

from dsl_lit.scaling.planner.cluster import ClusterConfig, EfficiencyConfig
from dsl_lit.scaling.planner.layout import PlanLayout
from dsl_lit.scaling.planner.memory import MemoryEstimate, estimate_memory
from dsl_lit.scaling.planner.plan import Plan, make_plan, search_layouts
from dsl_lit.scaling.planner.step_time import StepTime, estimate_step_time

__all__ = [
    "ClusterConfig", "EfficiencyConfig", "MemoryEstimate", "Plan", "PlanLayout", "StepTime", "estimate_memory",
    "estimate_step_time", "make_plan", "search_layouts",
]
