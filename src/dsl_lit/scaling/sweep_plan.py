"""The plan of a scaling sweep: its ``sweep`` settings, the runs they make (:class:`Point`, numbered
by :func:`sweep_points`) and what each run sets on the composed training config. No torch, no
Hydra: the reproduction's preflight and the grid's self-extension read it without training."""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import Any

from data_contract.errors import ConfigError
from dsl_lit.flops import non_embedding_flops_per_token
from dsl_lit.scaling.laws import PowerLaw


@dataclass
class SweepConfig:
    """The ``sweep`` node of ``conf/scaling_laws.yaml``."""

    hparam_budgets: list[float] = field(default_factory=lambda: [1e10, 2e10])
    hparam_shape: list[int] = field(default_factory=lambda: [2, 32])
    """[n_layers, d_model] of the model the hyperparameter study trains."""
    lrs: list[float] = field(default_factory=lambda: [1e-3, 3e-3, 1e-2])
    batch_sizes: list[int] = field(default_factory=lambda: [1, 2, 4])
    """Sequences per step."""
    grid_exponents: list[float] = field(default_factory=lambda: [0.0, 0.0])
    """[batch, lr]: each budget's grid is ``batch_sizes`` and ``lrs`` times (C / the smallest
    budget) to these powers, so the grid follows where the optimum is expected to move (e.g. the
    paper's [0.3271, -0.125]) instead of spending runs far from it at the largest budgets; [0, 0]:
    the same grid at every budget. Only a starting place: the grid's extension finds the optimum."""
    isoflop_budgets: list[float] = field(default_factory=lambda: [1e10, 2e10])
    shapes: list[list[int]] = field(default_factory=lambda: [[2, 8], [1, 16], [2, 16], [1, 32], [2, 32], [2, 48]])
    isoflop_lr: float = 3e-3
    isoflop_batch_size: int = 16
    head_dim: int = 8
    min_steps: int = 30
    max_steps: int = 1000
    warmup_fraction: float = 0.05
    isoflop_hparams: list[list[float]] = field(default_factory=list)
    """``[budget, batch_size, lr]`` of the IsoFLOP runs at that budget, as the paper runs them: the
    near-optimal settings the hyperparameter study fitted (the reproduction's scaling stage fills it
    in); a budget not listed trains at ``isoflop_batch_size`` and ``isoflop_lr``."""
    extra_hparams: list[list[float]] = field(default_factory=list)
    """``[budget, batch_size, lr]`` runs of the hyperparameter study beyond its grid: what
    :func:`~dsl_lit.scaling.grid_edges.grid_extensions` adds where a budget's best run sits on an
    edge of its grid."""
    extra_shapes: list[list[float]] = field(default_factory=list)
    """``[budget, n_layers, d_model]`` IsoFLOP runs beyond ``shapes``."""
    extension_rounds: int = 3
    """How many times a driver (the reproduction's scaling stage) extends the grids before fitting."""
    num_threads: int | None = 1
    """torch threads per run. One: tiny models gain little from a second thread, and on a shared
    machine two spinning threads lose 10x when cores are oversubscribed (null: torch's default)."""

    def validate(self) -> SweepConfig:
        if len(self.grid_exponents) != 2:
            raise ConfigError(f"sweep.grid_exponents={self.grid_exponents} must be [batch exponent, lr exponent]")
        for name in ("hparam_budgets", "isoflop_budgets", "lrs", "batch_sizes"):
            values = getattr(self, name)
            if not values or any(not v > 0 for v in values):
                raise ConfigError(f"sweep.{name}={values} must be a non-empty list of positive numbers")
        for shape in [self.hparam_shape, *self.shapes]:
            if len(shape) != 2 or shape[0] < 1 or shape[1] % self.head_dim:
                raise ConfigError(f"sweep shape {shape} must be [n_layers >= 1, d_model a multiple of "
                                  f"sweep.head_dim={self.head_dim}]")
        if not 1 <= self.min_steps <= self.max_steps:
            raise ConfigError(f"sweep.min_steps={self.min_steps} must be in [1, sweep.max_steps={self.max_steps}]")
        if not 0 <= self.warmup_fraction < 1:
            raise ConfigError(f"sweep.warmup_fraction={self.warmup_fraction} must be in [0, 1)")
        for name, fields in (("isoflop_hparams", "batch_size, lr"), ("extra_hparams", "batch_size, lr"),
                             ("extra_shapes", "n_layers, d_model")):
            rows = getattr(self, name)
            if any(len(row) != 3 or not all(v > 0 for v in row) for row in rows):
                raise ConfigError(f"sweep.{name}={rows} must list [budget, {fields}] triples of positive numbers")
        if self.extension_rounds < 0:
            raise ConfigError(f"sweep.extension_rounds={self.extension_rounds} must be >= 0")
        return self


@dataclass
class Point:
    """One training run of the sweep."""

    study: str
    budget: float
    n_layers: int
    d_model: int
    lr: float
    batch_size: int
    seq_len: int

    @property
    def model_scale(self) -> float:
        return float(non_embedding_flops_per_token(self.n_layers, self.d_model, self.seq_len))

    @property
    def batch_tokens(self) -> int:
        return self.batch_size * self.seq_len

    @property
    def steps(self) -> int:
        """Optimizer steps that spend the budget: D = C / M tokens."""
        return max(1, round(self.budget / self.model_scale / self.batch_tokens))

    @property
    def name(self) -> str:
        """What the run is, as a directory name: the same run has the same name in every sweep that
        holds it, however the sweep's runs are numbered (an extended sweep, a rerun)."""
        return (f"{self.study}_C{self.budget:.4g}_L{self.n_layers}_d{self.d_model}_b{self.batch_size}"
                f"_lr{self.lr:.4g}_s{self.seq_len}")


def hparam_grid(sweep: SweepConfig, budget: float) -> tuple[list[int], list[float]]:
    """The batch sizes and lrs of ``budget``'s grid (``grid_exponents``)."""
    ratio = budget / min(sweep.hparam_budgets)
    growth, decay = ratio ** sweep.grid_exponents[0], ratio ** sweep.grid_exponents[1]
    return sorted({max(1, round(b * growth)) for b in sweep.batch_sizes}), [lr * decay for lr in sweep.lrs]


def isoflop_point(sweep: SweepConfig, budget: float, n_layers: int, d_model: int, seq_len: int) -> Point:
    """The IsoFLOP run of a shape at a budget, at that budget's settings (``isoflop_hparams``)."""
    settings = {float(c): (int(b), float(lr)) for c, b, lr in sweep.isoflop_hparams}
    batch, lr = settings.get(float(budget), (sweep.isoflop_batch_size, sweep.isoflop_lr))
    return Point("isoflop", float(budget), int(n_layers), int(d_model), lr, batch, seq_len)


def with_isoflop_hparams(sweep: SweepConfig, batch_tokens: PowerLaw, lr: PowerLaw, seq_len: int) -> SweepConfig:
    """The IsoFLOP study at the batch and lr the hyperparameter laws give each of its budgets (as
    DeepSeek LLM runs it), the batch rounded to whole sequences (at least one)."""
    rows = [[float(c), max(1, round(batch_tokens(c) / seq_len)), float(lr(c))] for c in sweep.isoflop_budgets]
    return dataclasses.replace(sweep, isoflop_hparams=rows)


def plan_overrides(sweep: SweepConfig) -> list[str]:
    """The Hydra overrides that give a sweep the runs its YAML does not list (its extra runs and
    IsoFLOP settings, every one so far): what a driver passes on to ``recipes/scaling_laws.py``."""
    def rows(values: list[list[float]]) -> str:
        return "[" + ",".join("[" + ",".join(repr(v) for v in row) + "]" for row in values) + "]"

    return [f"sweep.{name}={rows(getattr(sweep, name))}" for name in ("extra_hparams", "extra_shapes", "isoflop_hparams")]


def sweep_points(sweep: SweepConfig, seq_len: int) -> list[Point]:
    """Every run of both studies, in a fixed order (the job number is the index): the grids, then
    the extra runs in the order they were added. A run's directory is its :attr:`Point.name`, so
    a renumbered run (a sweep extended or given new IsoFLOP settings) keeps its results."""
    points = []
    n, d = sweep.hparam_shape
    for budget in sweep.hparam_budgets:
        batches, lrs = hparam_grid(sweep, budget)
        points += [Point("hparams", budget, n, d, lr, batch, seq_len) for batch in batches for lr in lrs]
    for budget, batch, lr in sweep.extra_hparams:
        points.append(Point("hparams", float(budget), n, d, float(lr), int(batch), seq_len))
    for budget in sweep.isoflop_budgets:
        for n_layers, d_model in sweep.shapes:
            point = isoflop_point(sweep, budget, n_layers, d_model, seq_len)
            if sweep.min_steps <= point.steps <= sweep.max_steps:
                points.append(point)
    points += [isoflop_point(sweep, budget, int(n_layers), int(d_model), seq_len)
               for budget, n_layers, d_model in sweep.extra_shapes]
    return points


def point_overrides(point: Point, sweep: SweepConfig, vocab_size: int) -> dict[str, Any]:
    """Values the job sets on the composed config: the model's shape, lr, batch and length."""
    n_heads = point.d_model // sweep.head_dim
    ffn = 8 * math.ceil(8 * point.d_model / 3 / 8)  # SwiGLU at 8/3 d, so M's 72 n d^2 holds
    warmup = max(1, round(sweep.warmup_fraction * point.steps))
    return {
        "model": {"n_layers": point.n_layers, "d_model": point.d_model, "n_heads": n_heads, "n_kv_heads": n_heads,
                  "ffn_hidden": ffn, "vocab_size": vocab_size, "max_seq_len": point.seq_len},
        "optim": {"lr": point.lr},
        "data": {"global_batch_size": point.batch_size, "micro_batch_size": point.batch_size},
        "schedule": {"warmup_steps": warmup, "total_steps": point.steps},
        "trainer": {"max_steps": point.steps, "val_every_n_steps": point.steps},
    }
