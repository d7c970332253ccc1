"""A training run that cannot fit is refused before anything is allocated.

Why: ``model=deepseek_v3_671b`` on a CPU (or a huge ``n_layers``, ``d_model``, ``vocab_size``) used
to build the model until the process hit the memory limit and died with a traceback. The planner's
memory model (:func:`~dsl_lit.scaling.planner.memory.estimate_memory`: weights, gradients, optimizer
state, activations and logits of the busiest rank under the run's layout, the bare tensors) is asked
first, and a run that needs more than the machine has is a one-line error naming what to change.
"""

from __future__ import annotations

from data_contract.errors import ConfigError
from dsl_lit.config import TrainConfig
from dsl_lit.memory.host import available_bytes
from dsl_lit.scaling.planner.cluster import GIB
from dsl_lit.scaling.planner.layout import RECOMPUTE_MODES, PlanLayout
from dsl_lit.scaling.planner.memory import estimate_memory

HEADROOM = 1.0
"""The estimate counts the bare tensors; a run is refused only when even those exceed the memory."""


def plan_layout_of(cfg: TrainConfig) -> PlanLayout:
    """The planner's view of a training config: its layout, batch, sequence, recompute and precision."""
    precision = "fp8" if cfg.precision.fp8 else cfg.precision.name
    recompute = cfg.memory.recompute if cfg.memory.recompute in RECOMPUTE_MODES else "none"
    return PlanLayout(parallel=cfg.layout, micro_batch_size=cfg.data.micro_batch_size,
                      global_batch_size=cfg.data.global_batch_size, seq_len=cfg.data.seq_len,
                      recompute=recompute, precision=precision if precision != "auto" else "bf16",
                      moments_dtype=cfg.optim.moments_dtype, optimizer=cfg.optim.name)


def refuse_what_cannot_fit(cfg: TrainConfig, available: int | None = None) -> None:
    """ConfigError (one line) when the run's busiest process needs more memory than it can have.
    ``available``: bytes per process (None: asked of this machine, :func:`available_bytes`)."""
    if cfg.layout is None:
        return
    device = "cuda" if cfg.trainer.accelerator in ("gpu", "cuda") else "cpu"
    local = cfg.trainer.devices if device == "cpu" else 1  # processes sharing this host's memory
    if available is None:
        available = available_bytes(device, local)
    if available is None:
        return
    estimate = estimate_memory(cfg.model, plan_layout_of(cfg))
    if estimate.total <= HEADROOM * available:
        return
    parts = ", ".join(f"{k} {v:.1f}" for k, v in estimate.gib().items() if k != "total" and v >= 0.05)
    raise ConfigError(
        f"model.name={cfg.model.name} needs ~{estimate.total / GIB:.1f} GiB per process ({parts}; the planner's "
        f"estimate for this layout) but a process here has {available / GIB:.1f} GiB: pick a smaller model, a "
        "shorter data.seq_len or data.micro_batch_size, or split it (parallel.tp/pp/ep, parallel.zero1, more devices)"
    )
