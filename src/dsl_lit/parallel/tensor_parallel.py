"""Tensor parallelism: a family's declarative plan turned into torch ``ParallelStyle`` objects.

Each family declares its plan as data in its folder (module FQN -> style name, see
:mod:`dsl_lit.models.common.tp_plan`, which also explains the Megatron layout and sequence
parallelism); :func:`tensor_parallel_plan` maps every name to one ``ParallelStyle`` and
:func:`apply_tensor_parallel` shards a model with it. The model code knows nothing of either,
and nothing here knows which family it shards.

- The embedding is row-parallel over the vocabulary; the output head is column-parallel over the
  vocabulary and its logits stay sharded: the cross-entropy runs vocab-parallel (``loss_parallel``),
  never gathering [tokens, vocab]. Tied embeddings stay tied (both are sharded on the vocabulary).
- Under sequence parallelism the residual stream is a DTensor, not its local shard, because
  ``Transformer.hidden_states`` sizes the rotary tables from the embedding's output: the global
  shape gives the full-sequence tables, and the blocks see the full sequence wherever RoPE is
  applied.
- Norm weights under SP are replicated DTensors whose gradients come out as partial sums (each
  rank saw its own positions); a gradient hook all-reduces them, so after backward every gradient
  is a plain tensor or a DTensor that is ``Shard`` or ``Replicate`` (never ``Partial``).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Partial, Placement, Replicate, Shard, distribute_tensor
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    ParallelStyle,
    PrepareModuleInput,
    PrepareModuleInputOutput,
    PrepareModuleOutput,
    RowwiseParallel,
    SequenceParallel,
    parallelize_module,
)

from dsl_lit.config.model import ModelConfig
from dsl_lit.models import spec_of
from dsl_lit.models.common import tp_plan as styles

SEQ = Shard(1)
"""Sequence shards of [batch, seq, d_model] activations (sequence parallelism)."""

_BLOCK_ARGS = 4
"""Blocks call their attention with (x, rope, cache, key_valid), all positional."""


def _gathered(local: bool, n_args: int = 1, **output: Any) -> ParallelStyle:
    """All-gather the first input (sequence shards) to a replicated DTensor, or its local tensor
    when ``local``; other inputs pass as they are. ``output``: PrepareModuleOutput's arguments."""
    rest = (None,) * (n_args - 1)
    inputs = dict(input_layouts=(SEQ, *rest), desired_input_layouts=(Replicate(), *rest))
    if output:
        return PrepareModuleInputOutput(**inputs, use_local_input=local, **output)
    return PrepareModuleInput(**inputs, use_local_output=local)


_STYLES: dict[str, Callable[[ModelConfig], ParallelStyle]] = {
    styles.COLWISE: lambda cfg: ColwiseParallel(),
    styles.ROWWISE: lambda cfg: RowwiseParallel(),
    styles.ROWWISE_TO_SEQUENCE: lambda cfg: RowwiseParallel(output_layouts=SEQ, use_local_output=False),
    styles.KV_HEAD_PER_RANK: lambda cfg: KVHeadPerRank(cfg.kv_heads, cfg.head_dim),
    styles.VOCAB_EMBEDDING: lambda cfg: RowwiseParallel(input_layouts=Replicate(), output_layouts=Replicate()),
    styles.VOCAB_EMBEDDING_TO_SEQUENCE: lambda cfg: RowwiseParallel(
        input_layouts=Replicate(), output_layouts=SEQ, use_local_output=False
    ),
    styles.VOCAB_HEAD: lambda cfg: ColwiseParallel(input_layouts=Replicate(), use_local_output=False),
    styles.VOCAB_HEAD_FROM_SEQUENCE: lambda cfg: ColwiseParallel(input_layouts=SEQ, use_local_output=False),
    styles.SEQUENCE_PARALLEL: lambda cfg: SequenceParallel(),
    styles.GATHER_ATTENTION_INPUT: lambda cfg: _gathered(local=False, n_args=_BLOCK_ARGS),
    styles.GATHER_ATTENTION_INPUT_LOCAL: lambda cfg: _gathered(local=True, n_args=_BLOCK_ARGS),
    styles.GATHER_FFN_INPUT: lambda cfg: _gathered(local=False),
    # router and routed experts are plain replicated modules: a plain full-sequence input; the
    # output (complete on every rank) goes back to sequence shards without communication
    styles.GATHER_MOE_INPUT: lambda cfg: _gathered(
        local=True, output_layouts=Replicate(), desired_output_layouts=SEQ, use_local_output=False
    ),
    styles.FULL_SEQUENCE_INPUTS: lambda cfg: FullSequenceInputs(),
    styles.REPLICATED_OUTPUT: lambda cfg: PrepareModuleOutput(
        output_layouts=Replicate(), desired_output_layouts=Replicate(), use_local_output=False
    ),
}
"""Style name -> the ParallelStyle it means; the styles in ``_HOOKS`` are applied by
:func:`apply_tensor_parallel` itself (gradient hooks for ``SHARED_ROPE_KEY`` and ``SHARED_BY_HEADS``,
a sharded parameter for ``HEAD_SHARDED``)."""
_HOOKS = frozenset({styles.SHARED_ROPE_KEY, styles.SHARED_BY_HEADS, styles.HEAD_SHARDED})


def declared_plan(cfg: ModelConfig, tp: int, sequence_parallel: bool = False) -> dict[str, str]:
    """The family's plan, module FQN -> style name; ValueError for a name no style is known for."""
    spec = spec_of(cfg)
    if spec.tp_plan is None:  # TrainConfig.validate refuses the layout before any process starts
        raise ValueError(f"the {spec.name} family has no tensor-parallel plan")
    plan = spec.tp_plan(cfg, tp, sequence_parallel)
    unknown = sorted(set(plan.values()) - set(_STYLES) - _HOOKS)
    if unknown:
        raise ValueError(f"the {cfg.family} tensor-parallel plan names unknown style(s) {unknown}")
    return plan


def tensor_parallel_plan(
    cfg: ModelConfig, tp: int, sequence_parallel: bool = False
) -> dict[str, ParallelStyle]:
    """Module FQN -> parallel style for the whole model (names as in ``Transformer``) over ``tp``
    ranks (the hook-only entries of the declared plan left out)."""
    return {
        name: _STYLES[style](cfg)
        for name, style in declared_plan(cfg, tp, sequence_parallel).items()
        if style not in _HOOKS
    }


class FullSequenceInputs(ParallelStyle):
    """Turn every DTensor positional input into the full, replicated local tensor; plain inputs
    (already full) pass as they are.

    For MTP modules under sequence parallelism: they receive the main model's hidden states and
    the shifted embeddings as DTensors of whatever layout the slicing left (``Replicate`` or
    uneven ``Shard(1)``) and run their block without SP. The gradient handed back is complete and
    the same on every rank (their parallel layers reduce it), as ``Replicate`` claims.
    """

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        def gather(_module: nn.Module, args: tuple[Any, ...]) -> tuple[Any, ...]:
            return tuple(
                a.redistribute(a.device_mesh, [Replicate()] * a.device_mesh.ndim).to_local()
                if isinstance(a, DTensor) else a
                for a in args
            )

        module.register_forward_pre_hook(gather)
        return module


class _KVHeadLinear(nn.Linear):
    """An ``nn.Linear`` whose weight is replicated over tp but whose forward uses only the rows of
    this rank's kv head (``head_rows``).

    Both the weight's and the input's gradients are this rank's partial sums (other ranks' query
    heads use the other rows, or the same head with other queries): they are handed back as
    ``Partial`` DTensors, so the input's gradient is all-reduced (or reduce-scattered with the
    other projections' under SP) and the weight's is summed by the gradient hook of
    :func:`apply_tensor_parallel` into a replicated gradient of the full matrix.
    """

    head_rows: slice

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        mesh = self.weight.device_mesh
        replicated = [Replicate()] * mesh.ndim
        if not isinstance(x, DTensor):
            x = DTensor.from_local(x, mesh, replicated, run_check=False)
        partial = [Partial()] * mesh.ndim
        x = x.redistribute(mesh, replicated).to_local(grad_placements=partial)
        weight = self.weight.to_local(grad_placements=partial)[self.head_rows]
        bias = self.bias.to_local(grad_placements=partial)[self.head_rows] if self.bias is not None else None
        return F.linear(x, weight, bias)


class KVHeadPerRank(ParallelStyle):
    """wk / wv of grouped-query attention when tp > n_kv_heads (tp a multiple of it): rank ``r``
    holds query heads ``r * n_heads / tp ...``, which all use kv head ``r * n_kv_heads // tp``;
    the weight stays whole (a replicated DTensor: checkpoints, optimizer state and the gradient
    norm see one full matrix under its usual name) and the rank computes that head only."""

    def __init__(self, n_kv_heads: int, head_dim: int) -> None:
        super().__init__()
        self.n_kv_heads, self.head_dim = n_kv_heads, head_dim

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        if type(module) is not nn.Linear:
            raise TypeError(f"KVHeadPerRank shards nn.Linear projections, got {type(module).__name__}")
        tp = device_mesh.size()
        if tp % self.n_kv_heads:
            raise ValueError(f"tp={tp} must be a multiple of n_kv_heads={self.n_kv_heads} to replicate them")
        head = device_mesh.get_local_rank() * self.n_kv_heads // tp
        for name, param in list(module.named_parameters(recurse=False)):
            replicated = distribute_tensor(param.detach(), device_mesh, [Replicate()])
            module.register_parameter(name, nn.Parameter(replicated, requires_grad=param.requires_grad))
        module.__class__ = _KVHeadLinear  # same state, names and isinstance(nn.Linear); new forward
        module.head_rows = slice(head * self.head_dim, (head + 1) * self.head_dim)
        return module


class _SumGradOfTail(torch.autograd.Function):
    """Identity forward; backward all-reduces the gradient of the last features (from ``start``:
    all of them at 0) over tp.

    MLA's shared rotary key leaves the replicated ``wkv_a`` beside the latent and is used by every
    rank's *own* heads, so each rank holds only part of its gradient (Megatron's "f" operator).
    The latent's gradient is already complete: it went through the column-parallel ``wkv_b``.
    Under sequence parallelism the attention still runs on the full sequence, so nothing changes.
    """

    @staticmethod
    def forward(ctx, x: torch.Tensor, start: int, group: dist.ProcessGroup) -> torch.Tensor:
        ctx.start, ctx.group = start, group
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        grad = grad.clone()
        tail = grad[..., ctx.start :].contiguous()
        dist.all_reduce(tail, group=ctx.group)
        grad[..., ctx.start :] = tail
        return grad, None, None


def _placed_like(grad: torch.Tensor, placements: Sequence[Placement]) -> torch.Tensor:
    """A DTensor gradient in its parameter's placements (``Partial`` sums are all-reduced)."""
    if isinstance(grad, DTensor) and tuple(grad.placements) != tuple(placements):
        return grad.redistribute(grad.device_mesh, placements)
    return grad


def place_gradients_like_parameters(model: nn.Module) -> None:
    """Make every DTensor parameter's gradient arrive in its parameter's placements.

    Partial sums are all-reduced, and a Replicate gradient of a Shard parameter (the
    vocab-parallel embedding's backward gives one) is sliced, so ``.grad.to_local()`` lines up with
    the parameter's shard for the DP reducer and ZeRO-1 buckets. Hooks hang on the tensors: a
    model sharded on the meta device gets them once its tensors are allocated."""
    for param in model.parameters():
        if isinstance(param, DTensor) and param.requires_grad:
            param.register_hook(lambda grad, placements=param.placements: _placed_like(grad, placements))


def apply_tensor_parallel(
    model: nn.Module, cfg: ModelConfig, tp_mesh: DeviceMesh, sequence_parallel: bool = False,
    hook_gradients: bool = True,
) -> nn.Module:
    """Shard ``model`` in place over ``tp_mesh`` (modules a pipeline stage dropped are skipped).

    With ``sequence_parallel`` the activations between blocks are sequence shards: the input
    length must be divisible by tp, and ``hidden_states`` returns a ``Shard(1)`` DTensor (which
    ``head`` and ``mtp_logits`` accept). Logits are vocab-sharded DTensors either way.
    ``hook_gradients=False`` leaves :func:`place_gradients_like_parameters` to the caller (a model
    on the meta device, allocated later).
    """
    modules = dict(model.named_modules())
    parameters = dict(model.named_parameters())
    declared = {name: style for name, style in declared_plan(cfg, tp_mesh.size(), sequence_parallel).items()
                if name in modules or (style == styles.HEAD_SHARDED and name in parameters)}
    for name, style in declared.items():
        if style == styles.HEAD_SHARDED:  # a per-head parameter: the rank's heads' entries
            owner, _, attribute = name.rpartition(".")
            setattr(modules[owner], attribute, nn.Parameter(distribute_tensor(parameters[name].data, tp_mesh, [Shard(0)])))
    plan = {name: _STYLES[style](cfg) for name, style in declared.items() if style not in _HOOKS}
    parallelize_module(model, tp_mesh, plan)
    embedding, output = getattr(model, "tok_embeddings", None), getattr(model, "output", None)
    if cfg.tie_embeddings and embedding is not None and output is not None:
        output.weight = embedding.weight  # both vocab-sharded Shard(0): re-tie the two DTensors
    if hook_gradients:
        place_gradients_like_parameters(model)
    group = tp_mesh.get_group()
    for name, style in declared.items():
        if style == styles.SHARED_ROPE_KEY:  # the last rope_dim features are the shared rotary key
            modules[name].register_forward_hook(
                lambda _m, _i, out: _SumGradOfTail.apply(out, out.shape[-1] - cfg.rope_dim, group)
            )
        elif style == styles.SHARED_BY_HEADS:  # every feature is read by every rank's own heads
            modules[name].register_forward_hook(lambda _m, _i, out: _SumGradOfTail.apply(out, 0, group))
    for module in modules.values():
        if hasattr(module, "sum_over_head_ranks"):  # an attention whose indexer's target averages all heads (V3.2, V4)
            module.sum_over_head_ranks = functools.partial(_summed_over, group=group)
    return model


@torch.no_grad()
def _summed_over(tensor: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    """``tensor`` summed over ``group`` (a copy; no gradient: an attention target)."""
    total = tensor.clone()
    dist.all_reduce(total, group=group)
    return total
