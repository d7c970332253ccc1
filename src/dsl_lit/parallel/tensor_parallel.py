"""Tensor-parallel plans: which of a model's modules are split across the ``tp`` mesh dimension.

Megatron-style: a column-parallel projection splits its output features (heads, FFN hidden) so
each rank computes its own heads; the row-parallel projection after it splits its input features
and all-reduces the output. The model code is unchanged because it reshapes with ``-1`` heads.
Each family declares a plan here (model code knows nothing of it); the strategy applies it.

- DeepSeek LLM: wq / wk / wv column, wo row; SwiGLU w1 / w3 column, w2 row.
- DeepSeek-V3 MLA: the low-rank down-projections (wq_a, wkv_a) and their norms stay replicated,
  the up-projections (wq_b or wq, wkv_b) are column-parallel, wo row-parallel, and the shared
  rotary key's gradient is summed over tp (each rank's heads use it); dense FFNs and the
  shared experts as SwiGLU; the router and the routed experts stay replicated (experts shard
  with expert parallelism instead). MTP blocks get the same plan; eh_proj is replicated.
- The output head is column-parallel over the vocabulary and its logits stay sharded: the
  cross-entropy runs vocab-parallel (``loss_parallel``), never gathering [tokens, vocab];
  embeddings and norms are replicated.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    ParallelStyle,
    RowwiseParallel,
    parallelize_module,
)

from dsl_lit.models.config import ModelConfig

SWIGLU = {"w1": ColwiseParallel(), "w3": ColwiseParallel(), "w2": RowwiseParallel()}


def _block_plan(cfg: ModelConfig, layer_id: int, prefix: str) -> dict[str, ParallelStyle]:
    plan: dict[str, ParallelStyle] = {}
    if cfg.family == "deepseek_v3":
        up = ["wq_b", "wkv_b"] if cfg.q_lora_rank is not None else ["wq", "wkv_b"]
        plan.update({f"{prefix}.attention.{name}": ColwiseParallel() for name in up})
        plan[f"{prefix}.attention.wo"] = RowwiseParallel()
    else:
        plan.update({f"{prefix}.attention.{name}": ColwiseParallel() for name in ("wq", "wk", "wv")})
        plan[f"{prefix}.attention.wo"] = RowwiseParallel()
    ffn = f"{prefix}.feed_forward.shared_experts" if cfg.is_moe_layer(layer_id) else f"{prefix}.feed_forward"
    if not cfg.is_moe_layer(layer_id) or cfg.n_shared_experts:
        plan.update({f"{ffn}.{name}": style for name, style in SWIGLU.items()})
    return plan


def tensor_parallel_plan(cfg: ModelConfig) -> dict[str, ParallelStyle]:
    """Module FQN -> parallel style for the whole model (names as in ``Transformer``)."""
    plan: dict[str, ParallelStyle] = {}
    for i in range(cfg.n_layers):
        plan.update(_block_plan(cfg, i, f"layers.{i}"))
    depth = cfg.mtp_depth if cfg.family == "deepseek_v3" else 0
    for k in range(depth):
        plan.update(_block_plan(cfg, cfg.n_layers + k, f"mtp.{k}.block"))
    plan["output"] = ColwiseParallel(use_local_output=False)  # logits stay a vocab-sharded DTensor
    return plan


class _SumGradOfTail(torch.autograd.Function):
    """Identity forward; backward all-reduces the gradient of the last features over tp.

    MLA's shared rotary key leaves the replicated ``wkv_a`` beside the latent and is used by every
    rank's *own* heads, so each rank holds only part of its gradient (Megatron's "f" operator).
    The latent's gradient is already complete: it went through the column-parallel ``wkv_b``.
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


def apply_tensor_parallel(model: nn.Module, cfg: ModelConfig, tp_mesh: DeviceMesh) -> nn.Module:
    """Shard ``model`` in place over ``tp_mesh`` (modules a pipeline stage dropped are skipped)."""
    present = {name for name, _ in model.named_modules()}
    plan = {name: style for name, style in tensor_parallel_plan(cfg).items() if name in present}
    parallelize_module(model, tp_mesh, plan)
    if cfg.family == "deepseek_v3":
        group = tp_mesh.get_group()
        for name, module in model.named_modules():
            if name.endswith("attention.wkv_a"):
                module.register_forward_hook(
                    lambda _m, _i, out: _SumGradOfTail.apply(out, cfg.kv_lora_rank, group)
                )
    return model
