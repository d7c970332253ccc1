"""DeepSeekMoE: shared experts plus fine-grained routed experts, with auxiliary-loss-free balancing.

Routing (DeepSeek-V3 section 2.1.2), all in fp32 whatever the activation dtype:

1. affinities ``s = sigmoid(x W^T)`` (or softmax, as V2; ``sqrt(softplus(.))``, as V4);
2. selection uses ``s + b``, where ``b`` is the per-expert ``expert_bias`` buffer: it has no
   gradient and never enters the gate values, it only changes *which* experts are picked;
3. node-limited routing: experts form ``n_expert_groups`` groups; a token keeps the
   ``n_limited_groups`` groups with the highest sum of their two best biased scores and picks its
   top-k experts inside them (:meth:`TopKRouter.group_scores`; DeepSeek-V2's router ranks a group
   by its best expert instead);
4. the gate values are the *unbiased* ``s`` of the chosen experts, normalised to sum to one (V3),
   times ``route_scale``.

After each optimizer step the training loop calls :meth:`TopKRouter.update_bias` with the expert
loads of the whole step: ``b += gamma * sign(mean_load - load)`` (overloaded experts get less
attractive). Every token goes to its k experts: there is no capacity limit and no token dropping.

Experts run on tokens sorted by expert, as one grouped matmul per projection
(``torch._grouped_mm``) or one matmul per expert over contiguous slices; the naive loop that masks
all tokens for every expert is kept only as a reference for tests and benchmarks.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Protocol

import torch
import torch.nn.functional as F
from torch import nn

from dsl_lit.config.model import ModelConfig
from dsl_lit.models.common.compute_copies import ComputeCopies, autocast_dtype, local_tensor
from dsl_lit.models.common.layers import SwiGLU, gated_silu
from dsl_lit.models.common.token_padding import align_token_groups, call_with_padded_tokens

log = logging.getLogger(__name__)
_warned: set[str] = set()


class ExpertLoad(nn.Module):
    """Tokens routed to each expert since the last bias update (a buffer, so it follows ``.to()``).

    Kept in its own parameter-less module so that it can be re-created after meta-device loading.
    """

    def __init__(self, n_experts: int) -> None:
        super().__init__()
        self.register_buffer("counts", torch.zeros(n_experts, dtype=torch.float32), persistent=False)

    def reset_parameters(self) -> None:
        self.counts.zero_()


def affinities(logits: torch.Tensor, score_func: str) -> torch.Tensor:
    """Token-to-expert affinities from the router logits (fp32)."""
    if score_func == "sigmoid":
        return logits.sigmoid()
    if score_func == "softmax":
        return logits.softmax(dim=-1)
    if score_func == "sqrtsoftplus":  # DeepSeek-V4
        return F.softplus(logits).sqrt()
    raise ValueError(f"unknown score_func {score_func!r}")


def gate_values(scores: torch.Tensor, indices: torch.Tensor, normalise: bool, scale: float) -> torch.Tensor:
    """The chosen experts' unbiased affinities, normalised to sum to one if asked, times ``scale``."""
    weights = scores.gather(1, indices)
    if normalise:
        weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
    return weights * scale


class Router(nn.Module):
    """What every router has: the tokens it sent to each expert since the last bias update or
    reset (``load``, counted in training, once per token even under activation recompute)."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.n_experts = cfg.n_routed_experts
        self.top_k = cfg.n_activated_experts
        self.score_func = cfg.score_func
        self.route_scale = cfg.route_scale
        self.norm_topk_prob = cfg.norm_topk_prob
        self.weight = nn.Parameter(torch.empty(cfg.n_routed_experts, cfg.d_model))
        self.load = ExpertLoad(cfg.n_routed_experts)

    def affinities(self, x: torch.Tensor) -> torch.Tensor:
        """[tokens, E] fp32 token-to-expert affinities of ``x`` [tokens, d_model]."""
        with torch.autocast(x.device.type, enabled=False):  # bf16 autocast must not reach the gate
            logits = F.linear(x.float(), self.weight.float())
        return affinities(logits, self.score_func)

    recomputed: bool = False
    """Set by activation recompute (``memory.recompute``): this forward re-runs in backward, where
    its tokens must not be counted again."""

    def count(self, indices: torch.Tensor, counted: torch.Tensor | None) -> None:
        """Add the chosen experts ``indices`` [tokens, k] of the ``counted`` tokens to ``load``."""
        with torch.no_grad():
            chosen = indices if counted is None else indices[counted]
            counts = expert_counts(chosen.flatten(), self.load.counts.shape[0]).float()
            if self.recomputed:
                self._count_outside_backward(counts)
            else:
                self.load.counts += counts

    @torch.compiler.disable  # the graph task id is no tensor: the compiler cannot trace it
    def _count_outside_backward(self, counts: torch.Tensor) -> None:
        if torch._C._current_graph_task_id() == -1:  # -1: not inside a backward pass
            self.load.counts += counts


class TopKRouter(Router):
    """The gate: scores, node-limited top-k selection with the balancing bias, and gate values."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__(cfg)
        self.n_groups = cfg.n_expert_groups
        self.n_limited_groups = cfg.n_limited_groups
        self.register_buffer("expert_bias", torch.zeros(cfg.n_routed_experts, dtype=torch.float32))

    def forward(self, x: torch.Tensor, counted: torch.Tensor | None = None, token_ids: torch.Tensor | None = None,
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``x`` [tokens, d_model] -> (scores [tokens, E] fp32, gate values [tokens, k] fp32,
        expert ids [tokens, k]). ``counted`` [tokens] bool: the tokens the expert loads count
        (None: all). ``token_ids``: read by the hash router only."""
        scores = self.affinities(x)
        with torch.no_grad():
            choice = scores + self.expert_bias
            if self.n_limited_groups < self.n_groups:
                grouped = choice.view(x.shape[0], self.n_groups, -1)
                group_scores = self.group_scores(grouped)
                keep = group_scores.topk(self.n_limited_groups, dim=-1).indices
                group_mask = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, keep, True)
                choice = choice.masked_fill(~group_mask.repeat_interleave(grouped.shape[-1], dim=1), float("-inf"))
            indices = choice.topk(self.top_k, dim=-1).indices
            if self.tape is not None:  # rollout routing: recorded, compared, or replayed
                indices = self.tape(indices)
        weights = gate_values(scores, indices, self.norm_topk_prob, self.route_scale)
        if self.training:
            self.count(indices, counted)
        return scores, weights, indices

    tape: Callable[[torch.Tensor], torch.Tensor] | None = None
    """Set by RL (:mod:`~dsl_lit.models.common.routing_replay`): maps the chosen expert ids to the ones
    to use, recording them in the sampler and replaying them in the training forward."""

    @staticmethod
    def group_scores(grouped: torch.Tensor) -> torch.Tensor:
        """[tokens, groups, experts per group] biased scores -> [tokens, groups] group ranking:
        the sum of each group's two best (DeepSeek-V3); a family may rank groups otherwise."""
        return grouped.topk(min(2, grouped.shape[-1]), dim=-1).values.sum(dim=-1)

    @torch.no_grad()
    def update_bias(self, load: torch.Tensor, rate: float) -> None:
        """``b += rate * sign(mean_load - load)``; ``load`` counts tokens over the whole step."""
        load = load.float()
        self.expert_bias += rate * torch.sign(load.mean() - load)


class HashRouter(Router):
    """DeepSeek-V4's hash routing (its first MoE layers): each token id's experts are fixed by a
    table ``tid2eid`` [vocab, k] (a buffer, read from the checkpoint; no gradient, no balancing
    bias), while the learned ``weight`` still scores them for the gate values. Not a
    :class:`TopKRouter`: no bias update, and rollout routing replay has nothing to record here (the
    choice is a function of the token alone, the same in every forward)."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__(cfg)
        self.register_buffer("tid2eid", torch.zeros(cfg.vocab_size, cfg.n_activated_experts, dtype=torch.long))

    def reset_parameters(self) -> None:
        """A table a fresh model can train with: token ``t``'s experts ``t*k, t*k+1, ...`` modulo the
        expert count (every expert gets the same share of the vocabulary); a checkpoint's replaces it."""
        ids = torch.arange(self.tid2eid.shape[0], device=self.tid2eid.device).unsqueeze(1) * self.top_k
        self.tid2eid.copy_((ids + torch.arange(self.top_k, device=ids.device)) % self.n_experts)

    def forward(self, x: torch.Tensor, counted: torch.Tensor | None = None, token_ids: torch.Tensor | None = None,
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """As :meth:`TopKRouter.forward`, the experts looked up from ``token_ids`` [tokens]."""
        if token_ids is None:
            raise ValueError("a hash-routed MoE layer needs the token ids of its tokens (DeepSeek-V4's first layers)")
        scores = self.affinities(x)
        indices = self.tid2eid.index_select(0, token_ids.reshape(-1))
        if self.training:
            self.count(indices, counted)
        return scores, gate_values(scores, indices, self.norm_topk_prob, self.route_scale), indices


def expert_counts(ids: torch.Tensor, n_experts: int) -> torch.Tensor:
    """[n_experts] int64 tokens per expert of the flat expert ids ``ids``. Not ``torch.bincount``:
    its output length depends on the data, which makes CUDA wait for the device (a host sync every
    MoE layer) and ``torch.compile`` break the graph; a scatter-add into ``n_experts`` slots does neither."""
    return torch.zeros(n_experts, dtype=torch.long, device=ids.device).scatter_add_(0, ids, torch.ones_like(ids))


def _grouped_mm_usable(x: torch.Tensor) -> bool:
    if not hasattr(torch, "_grouped_mm"):
        return False
    if x.device.type == "cuda":  # the CUDA kernel needs bf16 and Hopper or newer
        return x.dtype == torch.bfloat16 and torch.cuda.get_device_capability(x.device) >= (9, 0)
    if torch.compiler.is_compiling():  # its meta function (what the compiler traces) takes bf16 only
        return x.device.type == "cpu" and x.dtype == torch.bfloat16
    return x.device.type == "cpu"


def expert_weight(w: torch.Tensor, e: int) -> torch.Tensor:
    """``w[e]`` as a slice and a view: torchao's FP8 expert-weight wrapper survives those, while
    indexing unwraps it and the expert would silently run in high precision."""
    return w[e : e + 1].view(w.shape[1:])


BF16_GROUP_MULTIPLE = 8
"""Every expert's token group handed to ``torch._grouped_mm`` in bf16 starts at, and spans, a multiple
of this many rows, and none is empty: the CUDA kernel's operands need 16-byte-aligned group offsets
(8 bf16 rows), which the weight-gradient GEMM (the groups along its contraction dim) and compiled
graphs rely on; an empty group gives that GEMM a zero-length contraction. torchtitan aligns to 8
for bf16 too (16 for FP8, which ``GroupedExperts.token_group_multiple`` already gives)."""


def in_expert_dtype(x: torch.Tensor) -> torch.Tensor:
    """``x`` in the dtype the experts compute (and answer) in: autocast's when it is on. Expert
    parallelism's ranks must agree on it even where no token arrived (an all-to-all allocates its
    output in its input's dtype, and gloo does not check that the senders' match)."""
    if torch.is_autocast_enabled(x.device.type):
        return x.to(torch.get_autocast_dtype(x.device.type))
    return x


def grouped_swiglu(
    x: torch.Tensor, counts: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor, w3: torch.Tensor, backend: str,
    groups_aligned_to: int = 1, limit: float | None = None,
) -> torch.Tensor:
    """SwiGLU experts on tokens sorted by expert: ``x`` [tokens, dim], ``counts`` [experts] tokens
    per expert, weights stacked [experts, out, in]. A function of the weights (not of a module) so
    that expert parallelism can run it on the experts this rank holds.

    Under autocast the experts compute in its dtype on every backend: autocast casts ``F.linear``
    (the split path) but not ``torch._grouped_mm``, which ran in fp32 on CPU and, on CUDA (whose
    kernel takes bf16 only), fell back to the per-expert loop.

    ``groups_aligned_to``: the multiple the caller already laid the groups out to (each at least that
    long); the grouped GEMM pads them to :data:`BF16_GROUP_MULTIPLE` itself otherwise (exact:
    zero rows, cropped). ``limit``: DeepSeek-V4's clamp of the pre-activations (:func:`gated_silu`)."""
    x = in_expert_dtype(x)
    if backend == "grouped_mm" and not _grouped_mm_usable(x):
        message = (
            f"expert_backend=grouped_mm is not available for device={x.device.type}, dtype={x.dtype} "
            "(needs torch._grouped_mm: CPU (bf16 under torch.compile), or CUDA with bf16 on sm90+); using expert_backend=split"
        )
        if message not in _warned and not torch.compiler.is_compiling():  # (a log call in a traced
            _warned.add(message)  # region is a graph break, and a recompile when the set changes)
            log.warning(message)
        backend = "split"
    if backend == "grouped_mm":
        if groups_aligned_to % BF16_GROUP_MULTIPLE:
            padded, padded_counts, positions = align_token_groups(x, counts, BF16_GROUP_MULTIPLE)
            out = grouped_swiglu(padded, padded_counts, w1, w2, w3, backend, BF16_GROUP_MULTIPLE, limit)
            return out.index_select(0, positions)
        offsets = counts.cumsum(0).to(torch.int32)

        def mm(a: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
            return torch._grouped_mm(a, w.to(a.dtype).transpose(-2, -1), offs=offsets)

        return mm(gated_silu(mm(x, w1), mm(x, w3), limit), w2)
    return _split_swiglu(x, counts, w1, w2, w3, limit)


@torch.compiler.disable
def _split_swiglu(
    x: torch.Tensor, counts: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor, w3: torch.Tensor,
    limit: float | None = None,
) -> torch.Tensor:
    """One matmul per expert slice. Left to eager under ``torch.compile``: the slice sizes are data,
    so a compiled graph would be specialised on, and recompiled for, every step's counts."""
    outputs = []
    for e, chunk in enumerate(x.split(counts.tolist())):
        if chunk.shape[0]:
            a, b, c = (expert_weight(w, e).to(chunk.dtype) for w in (w1, w2, w3))
            outputs.append(F.linear(gated_silu(F.linear(chunk, a), F.linear(chunk, c), limit), b))
    return torch.cat(outputs) if outputs else x.new_zeros(0, x.shape[-1])


def combine_expert_outputs(
    sorted_out: torch.Tensor, weights: torch.Tensor, order: torch.Tensor, out: torch.Tensor
) -> torch.Tensor:
    """``sorted_out`` [tokens x k, dim], the expert outputs of the token copies in expert order
    (copy ``order[i]`` at row i) -> ``out`` (zeros [tokens, dim], the residual's dtype) plus each
    token's k outputs weighted by its gate values ``weights`` [tokens, k]. One function for the
    model's experts and expert parallelism's.

    Kept in the residual's dtype (fp32 under autocast): a bf16 dispatch (whose backward is a bf16
    index_add with k copies per row) and a bf16 combine measured slower on an H200 (V3-style MoE
    ~0.8B, eager step 69.0 -> 83.9-85.8 ms, 2026-11-27)."""
    token_of = order // weights.shape[1]
    scaled = sorted_out * weights.flatten().index_select(0, order).unsqueeze(1).to(sorted_out.dtype)
    return out.index_add_(0, token_of, scaled.to(out.dtype))


class GroupedExperts(nn.Module):
    """``n`` SwiGLU experts with weights stacked as [experts, out, in] (each slice an nn.Linear
    weight), applied to tokens already sorted by expert."""

    token_group_multiple: int = 1
    """Each expert's token group is zero-padded to a multiple of this (and to at least this) before
    the expert matmuls: FP8 grouped GEMMs need 16 (set by ``precision.fp8.apply_fp8``)."""
    compute_copies: ComputeCopies | None = None
    """Compute-dtype copies of the weights kept between forwards (``precision.expert_weight_copies``,
    set by :mod:`dsl_lit.precision.weight_copies`); None: cast by every forward."""

    def __init__(self, n_experts: int, dim: int, hidden: int, backend: str = "grouped_mm",
                 limit: float | None = None) -> None:
        super().__init__()
        self.n_experts = n_experts
        self.backend = backend
        self.limit = limit
        self.w1 = nn.Parameter(torch.empty(n_experts, hidden, dim))
        self.w2 = nn.Parameter(torch.empty(n_experts, dim, hidden))
        self.w3 = nn.Parameter(torch.empty(n_experts, hidden, dim))

    def forward(self, x: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        """``x`` [tokens, dim] sorted by expert; ``counts`` [experts] tokens per expert."""
        if self.token_group_multiple > 1:
            padded, padded_counts, positions = align_token_groups(x, counts, self.token_group_multiple)
            return self.run_groups(padded, padded_counts, self.token_group_multiple).index_select(0, positions)
        return self.run_groups(x, counts)

    def run_groups(self, x: torch.Tensor, counts: torch.Tensor, aligned_to: int = 1) -> torch.Tensor:
        """The experts on ``x`` sorted by expert, groups laid out to multiples of ``aligned_to``."""
        return grouped_swiglu(x, counts, *self.stacked_weights(), self.backend, aligned_to, self.limit)

    def stacked_weights(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(w1, w2, w3) as the experts compute with them (a DTensor's local shard under expert
        parallelism): the kept compute-dtype copies under autocast when there are any (refreshed
        here in eager; a compiled forward's by :func:`refresh_compute_copies` before it), else the
        weights."""
        weights = tuple(local_tensor(w) for w in (self.w1, self.w2, self.w3))
        copies = self.compute_copies
        if copies is None:
            return weights
        dtype = autocast_dtype(weights[0].device)
        if not copies.applies(weights, dtype):
            return weights
        if not torch.compiler.is_compiling():
            copies.refresh(weights, dtype)
        elif copies.tensors is None or copies.tensors[0].dtype != dtype:
            return weights  # nothing refreshed before this compiled forward: cast as usual
        return copies.reuse(weights)

    @torch.compiler.disable
    def forward_reference(self, x: torch.Tensor, weights: torch.Tensor, indices: torch.Tensor) -> torch.Tensor:
        """The naive per-expert loop over unsorted tokens (masking all tokens for every expert;
        eager under ``torch.compile``: its shapes are data)."""
        out = torch.zeros_like(x)
        for e in range(self.n_experts):
            token, slot = torch.where(indices == e)
            if token.numel():
                y = call_with_padded_tokens(lambda h, e=e: self.expert(h, e), x[token], self.token_group_multiple)
                out.index_add_(0, token, y * weights[token, slot, None].to(y.dtype))
        return out

    def expert(self, h: torch.Tensor, e: int) -> torch.Tensor:
        """Expert ``e`` on its tokens ``h`` [tokens, dim]."""
        w1, w2, w3 = (expert_weight(w, e) for w in (self.w1, self.w2, self.w3))
        return F.linear(gated_silu(F.linear(h, w1), F.linear(h, w3), self.limit), w2)


class SequenceView(Protocol):
    """What an MoE layer needs when a forward holds only some positions of its rows (context
    parallelism; ``dsl_lit.parallel.context_parallel.MoESequenceView``)."""

    def gather(self, local: torch.Tensor) -> torch.Tensor:
        """[batch, local seq, ...] -> [batch, seq, ...]: the positions that count, of whole rows."""

    def counted(self, batch: int, local_seq: int, device: torch.device) -> torch.Tensor | None:
        """[batch * local seq] bool: this forward's tokens that count in expert loads (None: all)."""


class MoE(nn.Module):
    """Shared experts (always on) plus routed experts; ``forward(x[batch, seq, d]) -> same shape``.

    In training it also leaves ``balance_loss`` (a scalar with gradient, already times its alpha,
    averaged over the sequences of this forward) for the objective to add, and counts the expert
    loads for the bias update.
    """

    def __init__(self, cfg: ModelConfig, router: type[Router] = TopKRouter) -> None:
        super().__init__()
        self.n_experts = cfg.n_routed_experts
        self.top_k = cfg.n_activated_experts
        self.seq_balance_alpha = cfg.seq_balance_alpha
        self.batch_balance_alpha = cfg.batch_balance_alpha
        self.gate = router(cfg)
        limit = cfg.swiglu_limit or None
        self.experts = GroupedExperts(cfg.n_routed_experts, cfg.d_model, cfg.moe_ffn_hidden, cfg.expert_backend, limit)
        self.shared_experts = (
            SwiGLU(cfg.d_model, cfg.n_shared_experts * cfg.moe_ffn_hidden, limit) if cfg.n_shared_experts else None
        )
        self.balance_loss: torch.Tensor | None = None
        self.sequence: SequenceView | None = None
        """Set under context parallelism: this layer's view of whole rows, so that routing
        statistics cover whole sequences (None: every forward holds its whole rows)."""

    def forward(self, x: torch.Tensor, token_ids: torch.Tensor | None = None) -> torch.Tensor:
        """``token_ids`` [batch, seq]: what a hash router routes by (other routers ignore them)."""
        batch, seq, dim = x.shape
        flat = x.reshape(-1, dim)
        counted = self.sequence.counted(batch, seq, x.device) if self.sequence is not None else None
        scores, weights, indices = self.gate(flat, counted, token_ids)
        if self.experts.backend == "loop":
            routed = self.experts.forward_reference(flat, weights, indices)
        else:
            routed = self._dispatch(flat, weights, indices)
        out = routed.view(batch, seq, dim)
        if self.shared_experts is not None:
            out = out + self.shared_experts(x)
        self.balance_loss = self._balance_loss(scores, indices, batch) if self.training else None
        return out

    def _dispatch(self, flat: torch.Tensor, weights: torch.Tensor, indices: torch.Tensor) -> torch.Tensor:
        """Sort token copies by expert, run the experts, scale by the gate, scatter-add back."""
        flat_ids = indices.flatten()
        order = flat_ids.argsort(stable=True)
        counts = expert_counts(flat_ids, self.n_experts)
        token_of = order // self.top_k
        # index_select, not flat[token_of]: its backward is an index_add, ~20% faster on CPU
        expert_out = self.experts(flat.index_select(0, token_of), counts)
        return combine_expert_outputs(expert_out, weights, order, torch.zeros_like(flat))

    def _balance_loss(self, scores: torch.Tensor, indices: torch.Tensor, batch: int) -> torch.Tensor | None:
        """Sequence-wise (V3 eq. 17-20) and/or batch-wise balance loss: alpha * sum_i f_i P_i with
        f_i = E/(k T) * (tokens choosing i), P_i = mean normalised affinity of expert i."""
        if not (self.seq_balance_alpha or self.batch_balance_alpha):
            return None
        E, k = self.n_experts, self.top_k
        probs = scores / scores.sum(dim=-1, keepdim=True)  # sigmoid scores normalised per token
        chosen = torch.zeros_like(probs).scatter_(1, indices, 1.0)
        if self.sequence is not None:  # every cp rank computes its rows' whole-sequence loss
            probs, chosen = (self.sequence.gather(t.view(batch, -1, E)).flatten(0, 1) for t in (probs, chosen))
        loss = scores.new_zeros(())
        if self.seq_balance_alpha:
            per_seq_f = chosen.view(batch, -1, E).mean(dim=1) * E / k
            per_seq_p = probs.view(batch, -1, E).mean(dim=1)
            loss = loss + self.seq_balance_alpha * (per_seq_f * per_seq_p).sum(dim=-1).mean()
        if self.batch_balance_alpha:
            loss = loss + self.batch_balance_alpha * (chosen.mean(dim=0) * E / k * probs.mean(dim=0)).sum()
        return loss
