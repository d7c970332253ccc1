"""The one place a built model is changed from outside, in the order written once here.

Why one ordered function (as torchtitan's model converters followed by its ``parallelize_fn``):
each transform assumes the ones before it. FP8 swaps whole ``nn.Linear`` s and expert modules, so
it comes before anything that wraps or shards their weights; activation recompute wraps a block's
forward, so it must see the FP8 modules inside; the pipeline cut drops the blocks a rank does not
own before tensor, expert and context parallelism shard what is left; ``torch.compile`` traces the
final block, sharded and converted, so it comes last (with the cross-entropy's chunk kernels:
the loss is not part of the model, but it is part of every step). Every transform keeps parameter
names (FQNs), so checkpoints load under any of them.

:func:`transform_model` applies :data:`TRANSFORM_ORDER`; the strategy that runs the model supplies
the layout's steps (:mod:`dsl_lit.parallel.layout_steps`: pipeline, tensor, expert, context; one
device: none), the module its :class:`TransformPlan` (FP8 recipe, recompute, compile), decided once
per run (``dsl_lit.training.run_plan``); :class:`~dsl_lit.parallel.model_setup.ModelSetup`, the
strategies' one hook, is the only caller.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from data_contract.errors import ConfigError
from dsl_lit.config.memory import MemoryConfig
from dsl_lit.config.precision import PrecisionConfig
from dsl_lit.memory.recompute import apply_recompute
from dsl_lit.ops import compile_chunk_kernels
from dsl_lit.precision.fp8 import RECIPES, apply_fp8
from dsl_lit.precision.weight_copies import keep_expert_weight_copies

log = logging.getLogger(__name__)



@dataclass(frozen=True)
class TransformPlan:
    """What a module asks for besides the layout: an FP8 recipe (None: none), activation recompute
    (``memory.recompute`` and its blocks) and per-block ``torch.compile``."""

    fp8: str | None = None
    recompute: str = "none"
    recompute_blocks: tuple[int, ...] | None = None
    compile: bool = False
    fp8_experts: bool = True
    """Whether FP8 covers the routed experts: not under expert parallelism (:meth:`of`)."""
    compile_backend: str = "inductor"
    """``trainer.compile_backend``."""
    expert_weight_copies: bool = False
    """``precision.expert_weight_copies``: the routed experts keep compute-dtype weight copies
    (after FP8 chose its modules; order-free otherwise: the copies are made at the first forward)."""

    @classmethod
    def of(cls, precision: PrecisionConfig, memory: MemoryConfig, *, compile: bool = False,
           compile_backend: str = "inductor", expert_parallel: bool = False) -> TransformPlan:
        """The plan of a run's precision and memory settings (``compile`` resolved); FP8 leaves the
        routed experts alone under expert parallelism, whose all-to-all dispatch runs the local
        experts' weights directly."""
        blocks = memory.recompute_blocks
        return cls(fp8=precision.fp8, recompute=memory.recompute,
                   recompute_blocks=tuple(blocks) if blocks is not None else None, compile=compile,
                   fp8_experts=not expert_parallel, compile_backend=compile_backend,
                   expert_weight_copies=precision.expert_weight_copies)

    def wanted(self, fitting: bool = True, *, speed_only: bool = True) -> list[str]:
        """The transforms this plan applies besides a layout's (in order); ``speed_only`` False:
        leaving out those whose absence changes nothing but speed (:attr:`ModelTransform.speed_only`)."""
        ctx = TransformContext(self, fitting, {})
        return [t.name for t in TRANSFORMS if t.wanted(ctx) and (speed_only or not t.speed_only)]


MODES_PER_KIND = 2
"""Graphs one block kind may need at one shape: training (grad on) and validation (eval, no grad)."""


def _on_cuda() -> bool:
    """Whether this process trains on a CUDA GPU (where eager FP8 is torchao's, not the reference path)."""
    return torch.cuda.is_available()


def is_fitting(trainer: Any) -> bool:
    """Whether the model is being set up to train (no trainer: built to train, as a recipe does)."""
    from lightning.pytorch.trainer.states import TrainerFn

    return trainer is None or trainer.state.fn == TrainerFn.FITTING


def block_kinds(blocks: list[nn.Module]) -> set[tuple[str, ...]]:
    """Blocks that trace to different graphs: their module types, child by child (a dense block and
    an MoE block differ; all MoE blocks are one kind: their parameters are graph inputs)."""
    return {tuple(type(m).__name__ for m in block.modules()) for block in blocks}


def compile_blocks(model: nn.Module, shapes: int = 1, backend: str = "inductor") -> int:
    """Compile each transformer block of ``model`` in place (``nn.Module.compile``: names and
    checkpoint keys stay, no ``_orig_mod.``): the main layers and the MTP modules this rank holds.
    Per block, as torchtitan does: the blocks are alike, so one graph serves them all (nn modules are
    inlined, their parameters are graph inputs) and compile time does not grow with depth.

    Static shapes (``dynamic=False``): a micro-batch has one shape per batch-ramp stage, and a graph
    specialised to it is what inductor tunes best; Dynamo's recompile limit (8 by default, shared
    by every block, since they run the same code) is raised to what the run can need, block kinds x
    ``shapes`` (the ramp's micro-batch shapes) x :data:`MODES_PER_KIND`, so no block silently falls
    back to eager. Generation runs the blocks eagerly (``inference.generation``): its shapes change
    every token."""
    import torch._dynamo

    blocks: list[nn.Module] = []
    for name in ("layers", "mtp"):
        container = getattr(model, name, None)
        if isinstance(container, nn.ModuleDict):
            blocks.extend(container.values())
    needed = len(block_kinds(blocks)) * max(1, shapes) * MODES_PER_KIND
    torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, needed)
    for block in blocks:
        block.compile(dynamic=False, backend=backend)
    return len(blocks)


@dataclass(frozen=True)
class TransformContext:
    """What every transform decides from: the module's plan, whether the run fits (trains), and the
    layout steps the strategy supplied (name -> function of nothing)."""

    plan: TransformPlan
    fitting: bool
    layout_steps: Mapping[str, Callable[[], None]]


class ModelTransform:
    """One change to a built model (torchtitan's model converters): whether this run wants it, and
    applying it. Names are what :func:`transform_model` returns and ARCHITECTURE.md lists."""

    name: str
    speed_only = False
    """Whether the model computes the same without it, only slower (nothing else is lost)."""

    def wanted(self, ctx: TransformContext) -> bool:
        raise NotImplementedError

    def apply(self, model: nn.Module, ctx: TransformContext) -> None:
        raise NotImplementedError


class Fp8Transform(ModelTransform):
    """Swap eligible Linears (and, without expert parallelism, the routed experts) for FP8 ones."""

    name = "fp8"

    def wanted(self, ctx: TransformContext) -> bool:
        return ctx.plan.fp8 is not None

    def apply(self, model: nn.Module, ctx: TransformContext) -> None:
        plan = ctx.plan
        if not apply_fp8(model, plan.fp8, include_experts=plan.fp8_experts):
            raise ConfigError(
                f"precision.fp8={plan.fp8} converts no layer of this model (a Linear qualifies when its in and out "
                f"features are multiples of {RECIPES[plan.fp8].dim_multiple} and it is not the output head): the run "
                "would train in bf16 under an FP8 name; widen the model or drop precision.fp8"
            )
        if not plan.fp8_experts:
            log.warning("%s: the routed experts stay in high precision under expert parallelism", plan.fp8)
        if ctx.fitting and not plan.compile and _on_cuda():
            log.warning("precision %s without trainer.compile=true: torchao's FP8 casts run unfused (an H200 "
                        "measured a dense ~1B step 2.7x slower than bf16 eager); set trainer.compile=true", plan.fp8)


class ExpertWeightCopiesTransform(ModelTransform):
    """``precision.expert_weight_copies``: after FP8 chose its experts (it leaves those alone)."""

    name = "expert_weight_copies"
    speed_only = True  # the same casts, made once per update instead of once per forward

    def wanted(self, ctx: TransformContext) -> bool:
        return ctx.plan.expert_weight_copies

    def apply(self, model: nn.Module, ctx: TransformContext) -> None:
        keep_expert_weight_copies(model)


class RecomputeTransform(ModelTransform):
    """Activation recompute of the blocks ``memory.recompute`` names (it wraps the FP8 modules)."""

    name = "recompute"

    def wanted(self, ctx: TransformContext) -> bool:
        return ctx.plan.recompute != "none"

    def apply(self, model: nn.Module, ctx: TransformContext) -> None:
        blocks = ctx.plan.recompute_blocks
        apply_recompute(model, ctx.plan.recompute, list(blocks) if blocks is not None else None)


class LayoutTransform(ModelTransform):
    """A parallel dimension's step, supplied by the strategy (it holds the mesh) when its degree > 1."""

    def __init__(self, name: str) -> None:
        self.name = name

    def wanted(self, ctx: TransformContext) -> bool:
        return self.name in ctx.layout_steps

    def apply(self, model: nn.Module, ctx: TransformContext) -> None:
        ctx.layout_steps[self.name]()


class CompileTransform(ModelTransform):
    """Per-block ``torch.compile`` and the cross-entropy's chunk kernels, last, when fitting (sampling's
    changing shapes would recompile every step)."""

    name = "compile"

    def wanted(self, ctx: TransformContext) -> bool:
        return ctx.plan.compile and ctx.fitting

    def apply(self, model: nn.Module, ctx: TransformContext) -> None:
        backend = ctx.plan.compile_backend
        n = compile_blocks(model, shapes=2, backend=backend)  # a ramp stage's micro-batches, a last partial one
        compile_chunk_kernels(backend)  # the loss's chunks: one fused kernel per pass
        log.info("trainer.compile: %d transformer blocks compiled (torch.compile, per block, %s), and the "
                 "cross-entropy's chunk kernels", n, backend)


TRANSFORMS: tuple[ModelTransform, ...] = (
    Fp8Transform(), ExpertWeightCopiesTransform(), RecomputeTransform(),
    *(LayoutTransform(name) for name in ("pipeline", "tensor", "expert", "context")),
    CompileTransform(),
)
"""The transforms, in the order they apply (see the module docstring); ARCHITECTURE.md states it."""
TRANSFORM_ORDER = tuple(t.name for t in TRANSFORMS)
LAYOUT_STEPS = tuple(t.name for t in TRANSFORMS if isinstance(t, LayoutTransform))
"""The transforms a strategy supplies, from its layout and mesh."""


def transform_model(
    model: nn.Module,
    plan: TransformPlan,
    layout_steps: Mapping[str, Callable[[], None]] | None = None,
    fitting: bool = True,
) -> list[str]:
    """Apply ``plan`` and the strategy's ``layout_steps`` to ``model`` in :data:`TRANSFORM_ORDER`;
    returns the names of the transforms applied. Once per model: a second call does nothing (a
    block's forward must not be wrapped twice). ``fitting`` False (predict, validate): no compile."""
    steps = dict(layout_steps or {})
    unknown = sorted(set(steps) - set(LAYOUT_STEPS))
    if unknown:
        raise ValueError(f"layout steps {unknown} are not among {LAYOUT_STEPS}")
    if getattr(model, "_dsl_lit_transformed", False):
        return []
    ctx = TransformContext(plan, fitting, steps)
    applied = []
    for transform in TRANSFORMS:
        if transform.wanted(ctx):
            transform.apply(model, ctx)
            applied.append(transform.name)
    model._dsl_lit_transformed = True
    return applied
