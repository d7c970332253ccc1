"""Tensor-parallel plans: which of a model's modules are split across the ``tp`` mesh dimension.

Megatron-style: a column-parallel projection splits its output features (heads, FFN hidden) so
each rank computes its own heads; the row-parallel projection after it splits its input features
and all-reduces the output. The model code is unchanged because it reshapes with ``-1`` heads.
Each family declares a plan here (model code knows nothing of it); the strategy applies it.

- DeepSeek LLM: wq / wk / wv column, wo row; SwiGLU w1 / w3 column, w2 row. When tp exceeds
  ``n_kv_heads`` (tp a multiple of it), wk / wv stay whole (replicated DTensors, so checkpoints and
  the optimizer see the full matrices) and each rank computes only the kv head its query heads
  use; the weight gradient is summed over tp (every rank contributes to its head's rows only).
- DeepSeek-V3 MLA: the low-rank down-projections (wq_a, wkv_a) and their norms stay replicated,
  the up-projections (wq_b or wq, wkv_b) are column-parallel, wo row-parallel, and the shared
  rotary key's gradient is summed over tp (each rank's heads use it); dense FFNs and the
  shared experts as SwiGLU; the router and the routed experts stay replicated (experts shard
  with expert parallelism instead). MTP blocks get the same plan; eh_proj is replicated.
- The embedding is row-parallel over the vocabulary (each rank looks up its vocab slice, the
  partial rows are summed); the output head is column-parallel over the vocabulary and its logits
  stay sharded: the cross-entropy runs vocab-parallel (``loss_parallel``), never gathering
  [tokens, vocab]. Tied embeddings stay tied (both are sharded on the vocabulary).

Sequence parallelism (``sequence_parallel=True``, Megatron-SP): between blocks the residual stream
is a DTensor sharded on the sequence (``Shard(1)``), so norms, residual adds and their activations
cost 1/tp. The embedding reduce-scatters onto sequence shards; a block's norms run on the shard,
its attention and FFN inputs are all-gathered, and the row-parallel outputs reduce-scatter back
(the all-reduce of plain TP split in two, same volume). The stream is a DTensor, not its local
shard, because ``Transformer.hidden_states`` sizes the rotary tables from the embedding's output:
the global shape gives the full-sequence tables, and the blocks see the full sequence wherever
RoPE is applied. Per family:

- MLA's attention gets the full sequence as a plain tensor (its replicated projections and the
  rotary key need every position, identically on all ranks); GQA's gets a replicated DTensor so
  the three projections' input gradients add up before one reduce-scatter.
- An MoE layer gathers the sequence at its input and takes its (replicated) output back to the
  shard: router and routed experts see every token on every tp rank, as without SP, and the
  shared experts are column / row parallel inside.
- The final norm works on the shard and the head gathers the sequence (still vocab-sharded).
- MTP modules run without SP: their sequences are 1..D tokens shorter (not divisible by tp), and
  they are one block each. Their inputs (the main hidden states and the shifted embeddings) are
  gathered to full replicated tensors; their norm hands the shared head a replicated DTensor.

Norm weights under SP are replicated DTensors whose gradients come out as partial sums (each rank
saw its own positions); a gradient hook all-reduces them, so after backward every gradient is a
plain tensor or a DTensor that is ``Shard`` or ``Replicate`` (never ``Partial``).
"""

from __future__ import annotations

from collections.abc import Sequence
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

SEQ = Shard(1)
"""Sequence shards of [batch, seq, d_model] activations (sequence parallelism)."""

_BLOCK_ARGS = 4
"""Blocks call their attention with (x, rope, cache, key_valid), all positional."""


def _row(sequence_parallel: bool) -> RowwiseParallel:
    """Row-parallel projection back to the residual stream: all-reduced, or reduce-scattered
    onto sequence shards (kept a DTensor: the stream is one under SP)."""
    if sequence_parallel:
        return RowwiseParallel(output_layouts=SEQ, use_local_output=False)
    return RowwiseParallel()


def _swiglu(prefix: str, sequence_parallel: bool) -> dict[str, ParallelStyle]:
    w2 = _row(sequence_parallel)
    return {f"{prefix}.w1": ColwiseParallel(), f"{prefix}.w3": ColwiseParallel(), f"{prefix}.w2": w2}


def _gathered(local: bool, n_args: int = 1, **output: Any) -> ParallelStyle:
    """All-gather the first input (sequence shards) to a replicated DTensor, or its local tensor
    when ``local``; other inputs pass as they are. ``output``: PrepareModuleOutput's arguments."""
    rest = (None,) * (n_args - 1)
    inputs = dict(input_layouts=(SEQ, *rest), desired_input_layouts=(Replicate(), *rest))
    if output:
        return PrepareModuleInputOutput(**inputs, use_local_input=local, **output)
    return PrepareModuleInput(**inputs, use_local_output=local)


def _block_plan(
    cfg: ModelConfig, layer_id: int, prefix: str, tp: int, sequence_parallel: bool
) -> dict[str, ParallelStyle]:
    sp = sequence_parallel
    plan: dict[str, ParallelStyle] = {}
    attention = f"{prefix}.attention"
    if sp:
        plan[f"{prefix}.attention_norm"] = SequenceParallel()
        plan[f"{prefix}.ffn_norm"] = SequenceParallel()
        # MLA's replicated wq_a / wkv_a are plain modules: they need a plain (local) input.
        plan[attention] = _gathered(local=cfg.family == "deepseek_v3", n_args=_BLOCK_ARGS)
    if cfg.family == "deepseek_v3":
        up = ["wq_b", "wkv_b"] if cfg.q_lora_rank is not None else ["wq", "wkv_b"]
        plan.update({f"{attention}.{name}": ColwiseParallel() for name in up})
    else:
        plan[f"{attention}.wq"] = ColwiseParallel()
        for name in ("wk", "wv"):
            plan[f"{attention}.{name}"] = (
                ColwiseParallel() if cfg.n_kv_heads % tp == 0 else KVHeadPerRank(cfg.n_kv_heads, cfg.head_dim)
            )
    plan[f"{attention}.wo"] = _row(sp)
    ffn = f"{prefix}.feed_forward"
    if not cfg.is_moe_layer(layer_id):
        if sp:
            plan[ffn] = _gathered(local=False)
        plan.update(_swiglu(ffn, sp))
        return plan
    if sp:
        # Router and routed experts are plain replicated modules: a plain full-sequence input; the
        # output (complete on every rank) goes back to sequence shards without communication.
        plan[ffn] = _gathered(
            local=True, output_layouts=Replicate(), desired_output_layouts=SEQ, use_local_output=False
        )
    if cfg.n_shared_experts:
        plan.update(_swiglu(f"{ffn}.shared_experts", sequence_parallel=False))
    return plan


def tensor_parallel_plan(
    cfg: ModelConfig, tp: int, sequence_parallel: bool = False
) -> dict[str, ParallelStyle]:
    """Module FQN -> parallel style for the whole model (names as in ``Transformer``) over ``tp``
    ranks."""
    sp = sequence_parallel
    plan: dict[str, ParallelStyle] = {
        "tok_embeddings": RowwiseParallel(
            input_layouts=Replicate(), output_layouts=SEQ if sp else Replicate(), use_local_output=not sp
        ),
    }
    for i in range(cfg.n_layers):
        plan.update(_block_plan(cfg, i, f"layers.{i}", tp, sp))
    depth = cfg.mtp_depth if cfg.family == "deepseek_v3" else 0
    for k in range(depth):
        plan.update(_block_plan(cfg, cfg.n_layers + k, f"mtp.{k}.block", tp, sequence_parallel=False))
        if sp:
            plan[f"mtp.{k}"] = FullSequenceInputs()
            # the head below expects sequence shards unless it is handed a DTensor that says otherwise
            plan[f"mtp.{k}.norm"] = PrepareModuleOutput(
                output_layouts=Replicate(), desired_output_layouts=Replicate(), use_local_output=False
            )
    if sp:
        plan["norm"] = SequenceParallel()
    # logits stay a vocab-sharded DTensor for the vocab-parallel loss
    plan["output"] = ColwiseParallel(input_layouts=SEQ if sp else Replicate(), use_local_output=False)
    return plan


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
    """Identity forward; backward all-reduces the gradient of the last features over tp.

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


def apply_tensor_parallel(
    model: nn.Module, cfg: ModelConfig, tp_mesh: DeviceMesh, sequence_parallel: bool = False
) -> nn.Module:
    """Shard ``model`` in place over ``tp_mesh`` (modules a pipeline stage dropped are skipped).

    With ``sequence_parallel`` the activations between blocks are sequence shards: the input
    length must be divisible by tp, and ``hidden_states`` returns a ``Shard(1)`` DTensor (which
    ``head`` and ``mtp_logits`` accept). Logits are vocab-sharded DTensors either way.
    """
    present = {name for name, _ in model.named_modules()}
    plan = {
        name: style
        for name, style in tensor_parallel_plan(cfg, tp_mesh.size(), sequence_parallel).items()
        if name in present
    }
    parallelize_module(model, tp_mesh, plan)
    embedding, output = getattr(model, "tok_embeddings", None), getattr(model, "output", None)
    if cfg.tie_embeddings and embedding is not None and output is not None:
        output.weight = embedding.weight  # both vocab-sharded Shard(0): re-tie the two DTensors
    for param in model.parameters():
        # Every gradient in its parameter's placements before it accumulates: Partial sums are
        # all-reduced, and a Replicate gradient of a Shard parameter (the vocab-parallel embedding's
        # backward gives one) is sliced, so .grad.to_local() lines up with the parameter's shard
        # for the DP reducer and ZeRO-1 buckets.
        if isinstance(param, DTensor) and param.requires_grad:
            param.register_hook(lambda grad, placements=param.placements: _placed_like(grad, placements))
    if cfg.family == "deepseek_v3":
        group = tp_mesh.get_group()
        for name, module in model.named_modules():
            if name.endswith("attention.wkv_a"):
                module.register_forward_hook(
                    lambda _m, _i, out: _SumGradOfTail.apply(out, cfg.kv_lora_rank, group)
                )
    return model
