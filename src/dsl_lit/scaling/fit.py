"""Estimating DeepSeek LLM's power laws from your own runs.

Two studies, as in the paper (section 3):

- **hyperparameters**: at each compute budget C, a grid of batch sizes and learning rates; the
  optimum of each budget is the vertex of a quadratic fitted to loss over (log B, log lr), and
  B_opt(C), lr_opt(C) are power laws through those optima;
- **IsoFLOP**: at each budget, models of several scales M trained on D = C / M tokens; the
  optimum is the vertex of a parabola in log M, and M_opt(C), D_opt(C) = C / M_opt are power laws.

A vertex is only trusted inside the sampled range (a parabola through noisy toy losses can open
downwards or put its vertex far outside the grid); otherwise the fit falls back to the paper's
rule: the mean (in log space) of the near-optimal points, those within ``tolerance`` of the
lowest loss. Every optimum records which estimate it came from.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Sequence
from dataclasses import asdict, dataclass

import numpy as np

from dsl_lit.scaling.laws import PowerLaw

NEAR_OPTIMAL = 0.0025
"""The paper's "near-optimal": generalization error within 0.25% of the minimum."""


def fit_power_law(x: Sequence[float], y: Sequence[float]) -> PowerLaw:
    """Least squares of log y = log a + b log x (needs two distinct positive x)."""
    lx, ly = np.log(np.asarray(x, dtype=float)), np.log(np.asarray(y, dtype=float))
    if len(lx) < 2 or np.ptp(lx) == 0:
        raise ValueError(f"a power law needs at least two distinct x values, got {list(x)}")
    exponent, log_coefficient = np.polyfit(lx, ly, 1)
    return PowerLaw(float(np.exp(log_coefficient)), float(exponent))


@dataclass
class Optimum:
    """The best setting found at one compute budget."""

    budget: float
    values: dict[str, float]
    loss: float
    method: str  # "vertex" of the fitted quadratic, or "near_optimal" mean


def _near_optimal_mean(points: np.ndarray, losses: np.ndarray, tolerance: float) -> np.ndarray:
    near = losses <= losses.min() * (1 + tolerance)
    return points[near].mean(axis=0)


def _quadratic_vertex(points: np.ndarray, losses: np.ndarray) -> tuple[np.ndarray, float] | None:
    """Vertex and value of a full quadratic in ``points`` (n x k, log space), or None when the fit
    is not convex, under-determined, or its vertex lies outside the sampled box."""
    n, k = points.shape
    columns = [np.ones(n)] + [points[:, i] for i in range(k)]
    columns += [points[:, i] * points[:, j] for i in range(k) for j in range(i, k)]
    design = np.stack(columns, axis=1)
    if n < design.shape[1] or np.linalg.matrix_rank(design) < design.shape[1]:
        return None
    coef, *_ = np.linalg.lstsq(design, losses, rcond=None)
    linear = coef[1 : 1 + k]
    hessian = np.zeros((k, k))
    index = 1 + k
    for i in range(k):
        for j in range(i, k):
            hessian[i, j] += coef[index] if i != j else 2 * coef[index]
            hessian[j, i] = hessian[i, j]
            index += 1
    if np.any(np.linalg.eigvalsh(hessian) <= 0):
        return None
    vertex = np.linalg.solve(hessian, -linear)
    if np.any(vertex < points.min(axis=0)) or np.any(vertex > points.max(axis=0)):
        return None
    value = coef[0] + linear @ vertex + 0.5 * vertex @ hessian @ vertex
    return vertex, float(value)


def _optimum(budget: float, names: list[str], points: np.ndarray, losses: np.ndarray, tolerance: float) -> Optimum:
    logs = np.log(points)
    fitted = _quadratic_vertex(logs, losses)
    if fitted is not None:
        vertex, loss, method = fitted[0], fitted[1], "vertex"
    else:
        vertex, loss, method = _near_optimal_mean(logs, losses, tolerance), float(losses.min()), "near_optimal"
    return Optimum(budget, {n: float(np.exp(v)) for n, v in zip(names, vertex)}, loss, method)


def isoflop_optimum(scales: Sequence[float], losses: Sequence[float], budget: float = 0.0,
                    tolerance: float = NEAR_OPTIMAL) -> Optimum:
    """Optimal model scale M of one IsoFLOP curve (losses of models of scale M at one budget)."""
    return _optimum(budget, ["model_scale"], np.asarray(scales, float)[:, None], np.asarray(losses, float), tolerance)


def hparam_optimum(batches: Sequence[float], lrs: Sequence[float], losses: Sequence[float], budget: float = 0.0,
                   tolerance: float = NEAR_OPTIMAL) -> Optimum:
    """Optimal (batch size, learning rate) of one budget's grid."""
    points = np.stack([np.asarray(batches, float), np.asarray(lrs, float)], axis=1)
    return _optimum(budget, ["batch_tokens", "lr"], points, np.asarray(losses, float), tolerance)


def _by_budget(budgets: Sequence[float], *columns: Sequence[float]) -> dict[float, list[tuple[float, ...]]]:
    groups: dict[float, list[tuple[float, ...]]] = defaultdict(list)
    for budget, *values in zip(budgets, *columns):
        groups[float(budget)].append(tuple(values))
    return dict(sorted(groups.items()))


@dataclass
class AllocationFit:
    model_scale: PowerLaw
    data_scale: PowerLaw
    optima: list[Optimum]

    def to_dict(self) -> dict:
        return {"model_scale": self.model_scale.to_dict(), "data_scale": self.data_scale.to_dict(),
                "optima": [asdict(o) for o in self.optima]}


def fit_allocation(budgets: Sequence[float], scales: Sequence[float], losses: Sequence[float],
                   tolerance: float = NEAR_OPTIMAL) -> AllocationFit:
    """M_opt(C) and D_opt(C) = C / M_opt(C) from IsoFLOP runs (one row per run)."""
    optima = []
    for budget, rows in _by_budget(budgets, scales, losses).items():
        m, loss = zip(*rows)
        optima.append(isoflop_optimum(m, loss, budget, tolerance))
    c = [o.budget for o in optima]
    m_opt = [o.values["model_scale"] for o in optima]
    return AllocationFit(fit_power_law(c, m_opt), fit_power_law(c, [b / m for b, m in zip(c, m_opt)]), optima)


@dataclass
class HparamFit:
    batch_tokens: PowerLaw
    lr: PowerLaw
    optima: list[Optimum]

    def to_dict(self) -> dict:
        return {"batch_tokens": self.batch_tokens.to_dict(), "lr": self.lr.to_dict(),
                "optima": [asdict(o) for o in self.optima]}


def fit_hparam_laws(budgets: Sequence[float], batches: Sequence[float], lrs: Sequence[float],
                    losses: Sequence[float], tolerance: float = NEAR_OPTIMAL) -> HparamFit:
    """B_opt(C) and lr_opt(C) from lr x batch grids at several budgets (one row per run)."""
    optima = []
    for budget, rows in _by_budget(budgets, batches, lrs, losses).items():
        b, lr, loss = zip(*rows)
        optima.append(hparam_optimum(b, lr, loss, budget, tolerance))
    c = [o.budget for o in optima]
    return HparamFit(fit_power_law(c, [o.values["batch_tokens"] for o in optima]),
                     fit_power_law(c, [o.values["lr"] for o in optima]), optima)
