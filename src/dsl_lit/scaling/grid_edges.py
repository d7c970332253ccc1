"""Optima on a grid's edge, and the runs that move them inside.

A budget's best run on the smallest or largest value its study swept on an axis says the true
optimum may lie beyond the grid: the fitted optimum there is an extrapolation, and a law through
such optima measures the grid, not the model (the first reproduction's batch law: every budget's
best batch was the grid's smallest, and the fitted exponent was ~1e-16). :func:`grid_extensions`
adds one step beyond each such edge (the batch size doubled or halved, the learning rate by the
grid's own ratio, the model scale about doubled or halved), at every value of the other axis; a
driver runs the new runs and asks again, until every optimum is interior or no step can run (under
one sequence per batch, or outside ``[min_steps, max_steps]`` optimizer steps).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from dsl_lit.scaling.sweep_plan import Point, SweepConfig, isoflop_point, sweep_points

STUDY_AXES = {"hparams": ("batch_tokens", "lr"), "isoflop": ("model_scale",)}
Result = dict[str, Any]


@dataclass(frozen=True)
class Edge:
    """One budget's best run on the low or high end of one axis of its study's grid."""

    study: str
    budget: float
    axis: str
    side: str
    """"low", "high", or "narrow" (fewer than three values swept: no interior at all)."""
    value: float
    count: int = 0

    def text(self) -> str:
        if self.side == "narrow":
            return f"{self.study} C={self.budget:.0e}: only {self.count} values of {self.axis}, no interior"
        return f"{self.study} C={self.budget:.0e}: {self.axis} at the grid's {self.side} edge ({self.value:.3g})"


def _runs(results: Sequence[Result], study: str, budget: float) -> list[Result]:
    return [r for r in results if r["study"] == study and r["budget"] == budget]


def find_edges(results: Sequence[Result]) -> list[Edge]:
    """Every (study, budget, axis) whose best run is on an edge of what was swept there."""
    edges = []
    for study, axes in STUDY_AXES.items():
        for budget in sorted({r["budget"] for r in results if r["study"] == study}):
            runs = _runs(results, study, budget)
            best = min(runs, key=lambda r: r["loss"])
            for axis in axes:
                values = sorted({r[axis] for r in runs})
                if len(values) < 3:
                    edges.append(Edge(study, budget, axis, "narrow", best[axis], len(values)))
                elif best[axis] in (values[0], values[-1]):
                    edges.append(Edge(study, budget, axis, "low" if best[axis] == values[0] else "high", best[axis]))
    return edges


def _beyond(values: list[float], side: str, ratio: float) -> float:
    return values[0] / ratio if side == "low" else values[-1] * ratio


def _hparam_steps(edge: Edge, runs: list[Result]) -> list[tuple[int, float]]:
    """(batch size, lr) runs one step beyond a hyperparameter edge, at every value of the other axis."""
    batches = sorted({int(r["batch_size"]) for r in runs})
    lrs = sorted({float(r["lr"]) for r in runs})
    if edge.axis == "batch_tokens":
        batch = batches[0] // 2 if edge.side == "low" else batches[-1] * 2
        return [(batch, lr) for lr in lrs] if batch >= 1 else []
    ratio = lrs[1] / lrs[0] if len(lrs) > 1 else 2.0
    lr = _beyond(lrs, edge.side, ratio)
    return [(batch, lr) for batch in batches]


def _next_shape(edge: Edge, runs: list[Result], head_dim: int, seq_len: int) -> tuple[int, int] | None:
    """A model about half (low edge) or twice (high edge) the scale of the grid's end: the
    [n_layers, d_model] (d_model a multiple of the head dim, one layer more or fewer at most) whose
    M is nearest that target and beyond the grid."""
    end = min(runs, key=lambda r: r["model_scale"]) if edge.side == "low" else max(runs, key=lambda r: r["model_scale"])
    target = end["model_scale"] / 2 if edge.side == "low" else end["model_scale"] * 2
    layers = {max(1, end["n_layers"] + k) for k in (-1, 0, 1)}
    candidates = [(n, d) for n in layers for d in range(head_dim, 4 * end["d_model"] + head_dim, head_dim)]
    scales = {(n, d): Point("isoflop", edge.budget, n, d, 0.0, 1, seq_len).model_scale for n, d in candidates}
    beyond = [s for s in candidates
              if (scales[s] < end["model_scale"] if edge.side == "low" else scales[s] > end["model_scale"])]
    if not beyond:
        return None
    return min(beyond, key=lambda s: abs(math.log(scales[s] / target)))


def grid_extensions(results: Sequence[Result], sweep: SweepConfig, seq_len: int,
                    studies: Sequence[str] = tuple(STUDY_AXES)) -> SweepConfig:
    """``sweep`` with the runs that take each edge optimum of ``studies`` off its edge added to
    ``extra_hparams`` and ``extra_shapes`` (the same ``sweep`` when no edge can move: every optimum
    is interior, or the step beyond would be under one sequence or outside ``[min_steps,
    max_steps]``)."""
    have = {p.name for p in sweep_points(sweep, seq_len)}
    extra_hparams, extra_shapes = list(sweep.extra_hparams), list(sweep.extra_shapes)
    n, d = sweep.hparam_shape

    def fits(point: Point) -> bool:
        new = point.name not in have and sweep.min_steps <= point.steps <= sweep.max_steps
        have.add(point.name)
        return new

    for edge in find_edges(results):
        if edge.side == "narrow" or edge.study not in studies:
            continue
        runs = _runs(results, edge.study, edge.budget)
        if edge.study == "hparams":
            extra_hparams += [[edge.budget, batch, lr] for batch, lr in _hparam_steps(edge, runs)
                              if fits(Point("hparams", edge.budget, n, d, lr, batch, seq_len))]
        elif (shape := _next_shape(edge, runs, sweep.head_dim, seq_len)) is not None:
            if fits(isoflop_point(sweep, edge.budget, *shape, seq_len)):
                extra_shapes.append([edge.budget, *shape])
    return dataclasses.replace(sweep, extra_hparams=extra_hparams, extra_shapes=extra_shapes)
