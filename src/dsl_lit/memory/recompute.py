"""Activation recompute, applied to a built model from outside, per block.

- ``none``: keep every activation.
- ``selective`` (DeepSeek-V3 section 3.2.3: recompute RMSNorm and MLA up-projections in
  backward): each block runs under ``torch.utils.checkpoint`` with a selective policy that
  *saves* the outputs of the expensive operators (matmuls, grouped expert matmuls, attention,
  collectives) and *recomputes* everything cheap (norms, activations, rotary, elementwise), so
  backward repeats no GEMM; norm outputs and other elementwise activations are not kept.
- ``full``: each chosen block keeps only its input and recomputes its whole forward in backward.

``blocks`` picks the block indices (None: all), so a run can recompute only where memory peaks
(e.g. the first pipeline stage's blocks, which hold the most in-flight micro-batches). The
block's ``forward`` is wrapped on the instance, so parameter and module names do not change
(checkpoints, tensor-parallel plans and pipeline splits address the same names). A block whose
routers hold RL's routing tapes (:mod:`dsl_lit.models.common.routing_replay`) recomputes with the
tapes its forward had, whatever was installed since (compiled blocks: the tapes installed then).
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

from data_contract.errors import ConfigError
from dsl_lit.config.memory import MODES

_aten = torch.ops.aten
SAVED_OPS = {
    _aten.mm.default,
    _aten.addmm.default,
    _aten.bmm.default,
    _aten.linear.default,
    _aten._scaled_dot_product_efficient_attention.default,
    _aten._scaled_dot_product_flash_attention.default,
    _aten._scaled_dot_product_flash_attention_for_cpu.default,
}
if hasattr(_aten, "_grouped_mm"):
    SAVED_OPS.add(_aten._grouped_mm.default)
for _name in ("all_gather_into_tensor", "reduce_scatter_tensor", "all_reduce", "all_to_all_single"):
    if hasattr(torch.ops, "_c10d_functional") and hasattr(torch.ops._c10d_functional, _name):
        SAVED_OPS.add(getattr(torch.ops._c10d_functional, _name).default)


def _policy(ctx: Any, op: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
    return CheckpointPolicy.MUST_SAVE if op in SAVED_OPS else CheckpointPolicy.PREFER_RECOMPUTE


class _TapesInstalled:
    """Puts the forward's routing tapes back on the routers while a recompute runs (re-enterable:
    a schedule that splits backward into input and weight gradients recomputes twice)."""

    def __init__(self, routers: list[nn.Module], tapes: list[Any], inner: Any) -> None:
        self.routers, self.tapes, self.inner = routers, tapes, inner
        self.current: list[list[Any]] = []

    def __enter__(self) -> None:
        self.current.append([router.tape for router in self.routers])
        for router, tape in zip(self.routers, self.tapes):
            router.tape = tape
        self.inner.__enter__()

    def __exit__(self, *exc: Any) -> None:
        try:
            self.inner.__exit__(*exc)
        finally:
            for router, tape in zip(self.routers, self.current.pop()):
                router.tape = tape


def _with_forward_tapes(routers: list[nn.Module], selective: Callable[[], tuple[Any, Any]] | None) -> tuple[Any, Any]:
    """A ``context_fn``: the recompute runs with the routing tapes the forward had. A pipeline
    schedule runs later micro-batches' forwards (installing their tapes) before this one's backward."""
    forward_ctx, recompute_ctx = selective() if selective is not None else (contextlib.nullcontext(),
                                                                           contextlib.nullcontext())
    return forward_ctx, _TapesInstalled(routers, [router.tape for router in routers], recompute_ctx)


def _checkpointed(forward: Callable[..., torch.Tensor], block: nn.Module, mode: str) -> Callable[..., torch.Tensor]:
    selective = functools.partial(create_selective_checkpoint_contexts, _policy) if mode == "selective" else None
    routers = [m for m in block.modules() if hasattr(m, "tape")]  # RL's routing tapes (routing_replay)

    @functools.wraps(forward)
    def run(*args: Any, **kwargs: Any) -> torch.Tensor:
        if not (block.training and torch.is_grad_enabled()):  # evaluation and cached decoding
            return forward(*args, **kwargs)
        context_fn = selective
        if any(router.tape is not None for router in routers) and not torch.compiler.is_compiling():
            context_fn = functools.partial(_with_forward_tapes, routers, selective)
        extra = {"context_fn": context_fn} if context_fn is not None else {}
        return checkpoint(forward, *args, use_reentrant=False, **extra, **kwargs)

    return run


def apply_recompute(model: nn.Module, mode: str, blocks: list[int] | None = None) -> int:
    """Wrap the chosen blocks of ``model.layers`` (and the MTP blocks when ``blocks`` is None);
    returns how many were wrapped."""
    if mode not in MODES:
        raise ConfigError(f"memory.recompute={mode!r} is unknown; choose one of {list(MODES)}")
    if mode == "none":
        return 0
    chosen = [block for name, block in model.layers.items() if blocks is None or int(name) in blocks]
    if blocks is None:
        chosen += [module.block for module in model.mtp.values()]
    for block in chosen:
        block.forward = _checkpointed(block.forward, block, mode)
        for module in block.modules():  # routers count expert loads once, not again in backward
            if hasattr(module, "recomputed"):
                module.recomputed = True
    return len(chosen)
