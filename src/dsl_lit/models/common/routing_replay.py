"""Rollout routing replay (R3) and the router-flip measurement for RL on MoE models.

The sampler (KV-cache decoding, eval mode, maybe another precision or a whole copy of a sharded
policy) and the training forward (whole rows) can route the same token to different experts: the
policy ratio is then taken between two different networks. A :class:`RouteTape` on every router
of the main stack records, during generation, the experts each token was sent to; in the training
forward it compares the router's own choice with the recorded one (the flip rate, per layer) and,
with ``enforce``, sends the token to the recorded experts instead. The gate values stay the
router's own scores of those experts, so the router keeps its gradient (as Megatron's router
replay does). Positions with nothing recorded (padding) keep the router's own choice.

Layout: :func:`recording_routes` stacks a generation's calls into ``[batch, positions, layers, k]``
(prefill's positions, then one per decode step), positions in the order the model saw them; the
training rows carry ``routed_experts`` ``[rows, seq, layers, k]`` with -1 where nothing was recorded.
A hash-routed layer (DeepSeek-V4) chooses its experts from the token id alone and has nothing to
record; only :class:`~dsl_lit.models.common.moe.TopKRouter` layers carry a tape.
"""

from __future__ import annotations

import contextlib
from collections.abc import Collection, Iterator

import torch
from torch import nn

from dsl_lit.models.common.moe import TopKRouter

UNRECORDED = -1
"""``routed_experts`` at positions the sampler never routed (padding)."""


def named_stack_routers(model: nn.Module) -> list[tuple[str, TopKRouter]]:
    """``(layer<i>, router)`` of the main stack (``model.layers``), in layer order; the MTP modules'
    routers are left out: sampling never runs them."""
    layers = getattr(model, "layers", None)
    if layers is None:
        return []
    return [(f"layer{name.split('.')[0]}", m) for name, m in layers.named_modules() if isinstance(m, TopKRouter)]


def stack_routers(model: nn.Module) -> list[TopKRouter]:
    return [router for _, router in named_stack_routers(model)]


class RouteTape:
    """One router's link to the rollout's routing: records its choices, or replays given ones."""

    def __init__(self, replay: torch.Tensor | None = None, enforce: bool = False) -> None:
        self.recorded: list[torch.Tensor] = []
        self.replay = replay
        """[tokens, k] expert ids for the next forwards (UNRECORDED: the router's own choice)."""
        self.enforce = enforce
        self.flipped = torch.zeros((), dtype=torch.long)
        """Tokens whose own top-k differed from the recorded one, counted over forwards (not
        over activation recompute's second forward)."""

    def __call__(self, indices: torch.Tensor) -> torch.Tensor:
        """The router's ``indices`` [tokens, k] -> the ones to use."""
        if self.replay is None:
            self.recorded.append(indices.detach().clone())
            return indices
        given = self.replay
        if given.shape != indices.shape:
            raise RuntimeError(f"routing replay: this forward routes {tuple(indices.shape)} (tokens, k) but "
                               f"{tuple(given.shape)} were recorded; the training rows and the forward disagree")
        known = given[:, :1] >= 0
        differs = (indices.sort(dim=-1).values != given.sort(dim=-1).values).any(dim=-1, keepdim=True) & known
        self._count(differs.sum())
        return torch.where(known, given, indices) if self.enforce else indices

    @torch.compiler.disable  # the graph task id is no tensor: the compiler cannot trace it
    def _count(self, flipped: torch.Tensor) -> None:
        if torch._C._current_graph_task_id() == -1:  # not activation recompute inside backward
            self.flipped = self.flipped.to(flipped.device) + flipped


@contextlib.contextmanager
def recording_routes(model: nn.Module, batch: int) -> Iterator[list[torch.Tensor]]:
    """While open, the main stack's routers record their choices for forwards of ``batch`` rows;
    on a clean exit the yielded list holds one ``[batch, positions, routers, k]`` tensor (each
    forward's ``[batch * seq, k]`` joined along the positions), or nothing for a model without routers."""
    routers = stack_routers(model)
    tapes = [RouteTape() for _ in routers]
    previous = [r.tape for r in routers]
    for router, tape in zip(routers, tapes):
        router.tape = tape
    out: list[torch.Tensor] = []
    try:
        yield out
    finally:
        for router, tape in zip(routers, previous):
            router.tape = tape
    if tapes and all(t.recorded for t in tapes):
        out.append(torch.stack([torch.cat([r.view(batch, -1, r.shape[-1]) for r in t.recorded], dim=1) for t in tapes],
                               dim=2))


def install_routes(model: nn.Module, routed_experts: torch.Tensor, enforce: bool,
                   layers: Collection[int] | None = None) -> list[RouteTape]:
    """Give the main stack's routers the recorded ``routed_experts`` [rows, seq, routers, k] of the
    rows the next forwards run (until :func:`remove_routes` or the next install; activation
    recompute in backward replays the tapes its forward had, :mod:`dsl_lit.memory.recompute`).
    ``layers``: only the routers of these layer ids (a pipeline stage's), the rows still carrying
    every router of ``model`` (a rank's stages). Returns the tapes (their flip counts)."""
    routers = named_stack_routers(model)
    if routed_experts.shape[2] != len(routers):
        raise RuntimeError(f"routing replay: the rows carry {routed_experts.shape[2]} routers' choices, the model "
                           f"has {len(routers)} routers")
    ids = routed_experts.long()
    chosen = [i for i, (name, _) in enumerate(routers) if layers is None or layer_of(name) in layers]
    tapes = [RouteTape(ids[:, :, i].reshape(-1, ids.shape[-1]), enforce) for i in chosen]
    for i, tape in zip(chosen, tapes):
        routers[i][1].tape = tape
    return tapes


def layer_of(router_name: str) -> int:
    """The layer id of a :func:`named_stack_routers` name (``layer<i>``)."""
    return int(router_name.removeprefix("layer"))


def flip_rates(flipped: dict[str, torch.Tensor], routed_tokens: torch.Tensor) -> dict[str, torch.Tensor]:
    """``router_flips_<layer>``: each router's flipped tokens over the sampler-routed tokens of the
    step (``flipped``: counts by router name), and ``router_flips``, their mean over routers."""
    rates = {f"router_flips_{name}": count.float() / routed_tokens for name, count in flipped.items()}
    return {"router_flips": torch.stack(list(rates.values())).mean(), **rates} if rates else {}


def mean_flip_rate(metrics: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """``router_flips`` recomputed as the mean of the per-router rates (after pipeline stages, each
    holding some routers, summed theirs)."""
    rates = [v for k, v in metrics.items() if k.startswith("router_flips_")]
    return {**metrics, "router_flips": torch.stack(rates).mean()} if rates else metrics


def remove_routes(model: nn.Module) -> None:
    for router in stack_routers(model):
        router.tape = None
