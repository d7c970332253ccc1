"""Muon for the hidden matrices, AdamW for the rest, as the Muon papers train LLMs.

Muon (Jordan et al. 2024; Moonlight, Liu et al. 2025) replaces each weight matrix's update by the
orthogonalised momentum: a few Newton-Schulz iterations push the momentum's singular values towards
1, so every direction of the matrix moves at the same rate. Embeddings, the output head and 1-D
parameters (norm scales, biases) keep AdamW: they are lookups or vectors, not linear maps of the
hidden state. With ``lr_adjust="match_rms_adamw"`` (Moonlight's rule, the default) a matrix's step
is scaled by ``0.2 * sqrt(max(rows, cols))`` so its update RMS matches AdamW's, and one ``optim.lr``,
weight decay and schedule serve both kinds of parameters.

The update of a 2-D matrix is ``torch.optim.Muon``'s operation for operation (tests compare them bit
for bit). Routed experts are stored stacked, ``[experts, rows, cols]``: each expert's matrix is
orthogonalised on its own (one batched iteration). A tensor-parallel DTensor whose matrix dimensions
are sharded is gathered, orthogonalised whole on every rank of its mesh and cut back to the local
shard; an expert-parallel stack (sharded over experts only) holds whole matrices and stays local.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn
from torch.distributed.tensor import DTensor, Shard, distribute_tensor

from dsl_lit.optim.adamw import AdamW, param_groups

NS_COEFFICIENTS = (3.4445, -4.7750, 2.0315)
"""The quintic Newton-Schulz coefficients of Keller Jordan's Muon (and ``torch.optim.Muon``)."""
NS_EPS = 1e-7
LR_ADJUSTMENTS = ("match_rms_adamw", "original")

ADAMW_MODULES = ("tok_embeddings", "output")
"""Modules (whole FQN components, as in :data:`dsl_lit.precision.fp8.DEFAULT_FP8_FILTER_FQNS`) whose
matrices stay with AdamW: the embedding and the output head. Any ``nn.Embedding`` does too."""


def newton_schulz(matrix: torch.Tensor, steps: int = 5, coefficients: tuple[float, float, float] = NS_COEFFICIENTS,
                  eps: float = NS_EPS) -> torch.Tensor:
    """The orthogonalised ``matrix`` (2-D) or of each matrix of a stack (3-D), in bf16: ``torch.optim.Muon``'s
    iteration (bf16, the wide side last, the Frobenius norm scaled to 1), batched over a stack."""
    if matrix.ndim not in (2, 3):
        raise ValueError(f"Newton-Schulz orthogonalises matrices or stacks of them, not a {matrix.ndim}-D tensor")
    a, b, c = coefficients
    x = matrix.bfloat16()
    tall = matrix.size(-2) > matrix.size(-1)
    if tall:
        x = x.mT
    if x.ndim == 2:
        x.div_(x.norm().clamp(min=eps))
        multiply_add = torch.addmm
    else:
        x = x / torch.linalg.vector_norm(x, dim=(-2, -1), keepdim=True).clamp(min=eps)
        multiply_add = torch.baddbmm
    for _ in range(steps):
        gram = x @ x.mT
        gram_update = multiply_add(gram, gram, gram, beta=b, alpha=c)
        x = multiply_add(x, gram_update, x, beta=a)
    return x.mT if tall else x


def lr_ratio(shape: torch.Size, rule: str) -> float:
    """The step of a ``rows x cols`` matrix (the last two dims) relative to ``lr``: Moonlight's
    ``0.2 sqrt(max(rows, cols))`` (AdamW's update RMS) or the original ``sqrt(max(1, rows / cols))``."""
    rows, cols = shape[-2], shape[-1]
    if rule == "match_rms_adamw":
        return 0.2 * math.sqrt(max(rows, cols))
    if rule == "original":
        return math.sqrt(max(1.0, rows / cols))
    raise ValueError(f"Muon lr adjustment {rule!r} is not one of {LR_ADJUSTMENTS}")


def orthogonalised(update: torch.Tensor, steps: int, coefficients: tuple[float, float, float], eps: float) -> torch.Tensor:
    """:func:`newton_schulz` of a plain tensor or a DTensor, as a tensor like ``update`` (same
    placements, fp32): local where no placement cuts a matrix dimension (expert-parallel stacks),
    otherwise gathered whole (tensor-parallel matrices) and sliced back without communication."""
    if not isinstance(update, DTensor):
        return newton_schulz(update, steps, coefficients, eps).to(update.dtype)
    matrix_dims = (update.ndim - 2, update.ndim - 1)
    cut = any(isinstance(p, Shard) and p.dim % update.ndim in matrix_dims for p in update.placements)
    if not cut:
        local = newton_schulz(update.to_local(), steps, coefficients, eps).to(update.dtype)
        return DTensor.from_local(local, update.device_mesh, update.placements, run_check=False,
                                  shape=update.shape, stride=update.stride())
    whole = newton_schulz(update.full_tensor(), steps, coefficients, eps).to(update.dtype)
    return distribute_tensor(whole, update.device_mesh, update.placements, src_data_rank=None)


def is_muon_matrix(name: str, param: nn.Parameter, embedding_params: set[int]) -> bool:
    """A matrix (or a stack of expert matrices) outside the embeddings and the output head."""
    components = name.split(".")
    return param.ndim >= 2 and id(param) not in embedding_params and not any(m in components for m in ADAMW_MODULES)


def muon_param_groups(model: nn.Module, weight_decay: float) -> list[dict]:
    """Three groups: the hidden matrices (Muon, decayed), then :func:`param_groups`' two for the
    rest (AdamW: embeddings and head decayed, 1-D parameters not)."""
    embedding_params = {id(p) for m in model.modules() if isinstance(m, nn.Embedding) for p in m.parameters()}
    matrices = [p for n, p in model.named_parameters() if p.requires_grad and is_muon_matrix(n, p, embedding_params)]
    rest = param_groups(model, weight_decay, exclude=frozenset(id(p) for p in matrices))
    return [{"params": matrices, "weight_decay": weight_decay, "muon": True}, *rest]


class Muon(AdamW):
    """AdamW whose groups marked ``muon`` step by Muon (momentum, Nesterov, Newton-Schulz).

    The other groups are :class:`AdamW`'s, state and kernels included, so a checkpoint's AdamW
    entries keep their layout; a Muon parameter's state is ``torch.optim.Muon``'s
    (``momentum_buffer``, held in ``moments_dtype`` like AdamW's moments) and a ``step`` count, as
    every state of torch's Adam family has (its ``load_state_dict`` reads one)."""

    def __init__(self, params: list[dict], *, momentum: float = 0.95, nesterov: bool = True, ns_steps: int = 5,
                 lr_adjust: str = "match_rms_adamw", **adamw: Any) -> None:
        if lr_adjust not in LR_ADJUSTMENTS:
            raise ValueError(f"Muon lr adjustment {lr_adjust!r} is not one of {LR_ADJUSTMENTS}")
        if adamw.get("fused"):
            raise ValueError("Muon's matrices have no fused kernel; build it with fused=False")
        muon = {"momentum": momentum, "nesterov": nesterov, "ns_steps": ns_steps, "lr_adjust": lr_adjust}
        groups = [{**muon, **g} if g.get("muon") else {**g, "muon": False} for g in params]
        super().__init__(groups, **adamw)

    @torch.no_grad()
    def step(self, closure: Any = None) -> Any:
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        every_group = self.param_groups
        try:  # AdamW's step over its own groups (it walks self.param_groups)
            self.param_groups = [g for g in every_group if not g["muon"]]
            super().step()
        finally:
            self.param_groups = every_group
        for group in every_group:
            if group["muon"]:
                self._muon_step(group)
        return loss

    def _muon_step(self, group: dict) -> None:
        lr, decay, beta = group["lr"], group["weight_decay"], group["momentum"]
        for p, state in self.stepped(group):
            grad = p.grad
            if self.moments_dtype == torch.float32:
                buffer = state["momentum_buffer"].lerp_(grad, 1 - beta)
            else:  # the running average in fp32, stored rounded
                buffer = state["momentum_buffer"].float().lerp_(grad.float(), 1 - beta)
                state["momentum_buffer"].copy_(buffer)
            update = grad.lerp(buffer, beta) if group["nesterov"] else buffer
            update = orthogonalised(update, group["ns_steps"], NS_COEFFICIENTS, NS_EPS)
            p.mul_(1 - lr * decay)
            p.add_(update, alpha=-lr * lr_ratio(p.shape, group["lr_adjust"]))

    def state_template(self, param: torch.Tensor) -> dict[str, torch.Tensor]:
        """Zeroed state shaped like ``param``'s (what a checkpoint is read into): Muon's momentum
        for a matrix of a ``muon`` group, AdamW's moments otherwise."""
        if any(p is param for g in self.param_groups if g["muon"] for p in g["params"]):
            return {"step": torch.zeros((), dtype=torch.float32),
                    "momentum_buffer": torch.zeros_like(param, dtype=self.moments_dtype)}
        return super().state_template(param)
