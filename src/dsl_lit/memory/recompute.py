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
(checkpoints, tensor-parallel plans and pipeline splits address the same names).
"""

from __future__ import annotations

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


def _checkpointed(forward: Callable[..., torch.Tensor], block: nn.Module, mode: str) -> Callable[..., torch.Tensor]:
    context_fn = functools.partial(create_selective_checkpoint_contexts, _policy) if mode == "selective" else None

    @functools.wraps(forward)
    def run(*args: Any, **kwargs: Any) -> torch.Tensor:
        if not (block.training and torch.is_grad_enabled()):  # evaluation and cached decoding
            return forward(*args, **kwargs)
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
