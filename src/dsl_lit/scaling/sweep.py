"""The toy scaling-law sweep behind ``recipes/scaling_laws.py``: which runs, how each one trains,
and what happens when the Hydra multirun ends.

A sweep has two studies, as DeepSeek LLM (section 3) ran them:

- ``hparams``: one small model, every (learning rate, batch size) of a grid, at each budget of
  ``sweep.hparam_budgets``;
- ``isoflop``: models of several shapes at each budget of ``sweep.isoflop_budgets``, each trained
  for D = C / M tokens at ``sweep.isoflop_lr`` / ``sweep.isoflop_batch_size``. Shapes whose run
  would be shorter than ``sweep.min_steps`` or longer than ``sweep.max_steps`` optimizer steps
  are left out of that budget (too short to learn, or longer than the toy budget allows).

Runs are numbered; the multirun sweeps ``point`` over them (``hydra.sweeper.params``, filled by the
``${scaling_points:}`` resolver from the ``sweep`` node), so Hydra's own launcher runs them one
after the other in one process. Each job trains through the pretraining recipe's objects
(``TrainConfig``, ``PretrainDataModule``, ``PretrainModule``, ``build_trainer``), measures the
held-out loss after its last step and writes ``result.json``. :class:`FitSweep`, a Hydra callback,
then collects every result, fits the laws and writes ``scaling_laws.json`` and the plots.
"""

from __future__ import annotations

import copy
import json
import logging
import math
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from hydra.experimental.callback import Callback
from omegaconf import DictConfig, OmegaConf, open_dict

from data_contract.errors import ConfigError
from data_contract.schema import dataclass_from_dict
from dsl_lit.flops import non_embedding_flops_per_token
from dsl_lit.scaling.fit import fit_allocation, fit_hparam_laws

log = logging.getLogger(__name__)
RESULT_FILE = "result.json"


@dataclass
class SweepConfig:
    """The ``sweep`` node of ``conf/scaling_laws.yaml``."""

    hparam_budgets: list[float] = field(default_factory=lambda: [1e10, 2e10])
    hparam_shape: list[int] = field(default_factory=lambda: [2, 32])
    """[n_layers, d_model] of the model the hyperparameter study trains."""
    lrs: list[float] = field(default_factory=lambda: [1e-3, 3e-3, 1e-2])
    batch_sizes: list[int] = field(default_factory=lambda: [1, 2, 4])
    """Sequences per step."""
    isoflop_budgets: list[float] = field(default_factory=lambda: [1e10, 2e10])
    shapes: list[list[int]] = field(default_factory=lambda: [[2, 8], [1, 16], [2, 16], [1, 32], [2, 32], [2, 48]])
    isoflop_lr: float = 3e-3
    isoflop_batch_size: int = 16
    head_dim: int = 8
    min_steps: int = 30
    max_steps: int = 1000
    warmup_fraction: float = 0.05
    num_threads: int | None = 1
    """torch threads per run. One: tiny models gain little from a second thread, and on a shared
    machine two spinning threads lose 10x when cores are oversubscribed (null: torch's default)."""

    def validate(self) -> SweepConfig:
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


def sweep_points(sweep: SweepConfig, seq_len: int) -> list[Point]:
    """Every run of both studies, in a fixed order (the job number is the index)."""
    points = []
    n, d = sweep.hparam_shape
    for budget in sweep.hparam_budgets:
        for batch in sweep.batch_sizes:
            for lr in sweep.lrs:
                points.append(Point("hparams", budget, n, d, lr, batch, seq_len))
    for budget in sweep.isoflop_budgets:
        for n, d in sweep.shapes:
            point = Point("isoflop", budget, n, d, sweep.isoflop_lr, sweep.isoflop_batch_size, seq_len)
            if sweep.min_steps <= point.steps <= sweep.max_steps:
                points.append(point)
    return points


def sweep_from_config(cfg: DictConfig | dict) -> tuple[SweepConfig, int]:
    raw = cfg if isinstance(cfg, dict) else OmegaConf.to_container(cfg, resolve=True)
    return dataclass_from_dict(SweepConfig, dict(raw["sweep"]), "sweep"), int(raw["data"]["seq_len"])


def register_resolver() -> None:
    """``${scaling_points:${sweep},${data.seq_len}}`` -> "0,1,...,N-1" for the multirun."""
    if OmegaConf.has_resolver("scaling_points"):
        return

    def points(sweep: DictConfig, seq_len: int) -> str:
        config = dataclass_from_dict(SweepConfig, dict(OmegaConf.to_container(sweep, resolve=True)), "sweep")
        return ",".join(str(i) for i in range(len(sweep_points(config, int(seq_len)))))

    OmegaConf.register_new_resolver("scaling_points", points)


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


def train_point(cfg: DictConfig, run_dir: str) -> dict[str, Any]:
    """Train the job's point; return (and write) its result with the held-out loss."""
    import lightning as L
    import torch

    from dsl_lit.config import TrainConfig
    from dsl_lit.data.datamodule import PretrainDataModule
    from dsl_lit.training import PretrainModule
    from dsl_lit.training.build import build_trainer, module_arguments
    from dsl_lit.training.runs import finish_run

    sweep, seq_len = sweep_from_config(cfg)
    points = sweep_points(sweep.validate(), seq_len)
    if not 0 <= cfg.point < len(points):
        raise ConfigError(f"point={cfg.point} is outside the sweep's {len(points)} runs")
    point = points[cfg.point]
    cfg = copy.deepcopy(cfg)
    with open_dict(cfg):  # the model's shape fields are not in the preset's YAML
        cfg.merge_with(point_overrides(point, sweep, int(cfg.data.tokenizer_vocab_size)))
    train = TrainConfig.from_hydra(cfg, run_dir=run_dir)
    if sweep.num_threads:
        torch.set_num_threads(sweep.num_threads)
    L.seed_everything(train.trainer.seed, workers=True)
    datamodule = PretrainDataModule(train.data)
    module = PretrainModule(**module_arguments(train))  # schedule.total_steps = point.steps
    trainer = build_trainer(train)
    trainer.fit(module, datamodule=datamodule)
    loss = float(trainer.callback_metrics["val/loss"])
    finish_run(trainer)
    result = {**asdict(point), "model_scale": point.model_scale, "batch_tokens": point.batch_tokens,
              "steps": point.steps, "tokens": point.steps * point.batch_tokens, "loss": loss}
    Path(run_dir, RESULT_FILE).write_text(json.dumps(result, indent=2))
    log.info("point %d (%s, C=%.1e, L%d d%d, lr %.1e, batch %d): loss %.4f", cfg.point, point.study, point.budget,
             point.n_layers, point.d_model, point.lr, point.batch_size, loss)
    return result


def collect_results(sweep_dir: str | Path) -> list[dict[str, Any]]:
    return [json.loads(p.read_text()) for p in sorted(Path(sweep_dir).glob(f"*/{RESULT_FILE}"))]


STUDY_AXES = {"hparams": ("batch_tokens", "lr"), "isoflop": ("model_scale",)}


def edge_optima(results: list[dict[str, Any]]) -> list[str]:
    """Budgets whose best run sits on the smallest or largest value its study swept on an axis:
    the true optimum may lie outside the grid, so the fitted optimum there is an extrapolation.
    One line per (study, budget, axis), e.g. ``"isoflop C=1e+10: model_scale at the grid's low edge"``."""
    edges = []
    for study, axes in STUDY_AXES.items():
        for budget in sorted({r["budget"] for r in results if r["study"] == study}):
            runs = [r for r in results if r["study"] == study and r["budget"] == budget]
            best = min(runs, key=lambda r: r["loss"])
            for axis in axes:
                values = sorted({r[axis] for r in runs})
                if len(values) < 3:
                    edges.append(f"{study} C={budget:.0e}: only {len(values)} values of {axis}, no interior")
                elif best[axis] in (values[0], values[-1]):
                    side = "low" if best[axis] == values[0] else "high"
                    edges.append(f"{study} C={budget:.0e}: {axis} at the grid's {side} edge ({best[axis]:.3g})")
    return edges


def fit_results(results: list[dict[str, Any]]) -> dict[str, Any]:
    """Fitted laws (JSON-ready) from the collected results; a study with under two budgets is
    skipped. ``edge_optima`` lists the budgets whose optimum is on a grid edge (see :func:`edge_optima`)."""
    fitted: dict[str, Any] = {"runs": len(results), "edge_optima": edge_optima(results)}
    hp = [r for r in results if r["study"] == "hparams"]
    iso = [r for r in results if r["study"] == "isoflop"]
    if len({r["budget"] for r in hp}) >= 2:
        fit = fit_hparam_laws([r["budget"] for r in hp], [r["batch_tokens"] for r in hp], [r["lr"] for r in hp],
                              [r["loss"] for r in hp])
        fitted["hparams"] = fit.to_dict()
    if len({r["budget"] for r in iso}) >= 2:
        fit = fit_allocation([r["budget"] for r in iso], [r["model_scale"] for r in iso], [r["loss"] for r in iso])
        fitted["allocation"] = fit.to_dict()
    return fitted


class FitSweep(Callback):
    """At the end of the multirun: collect results, fit, write ``scaling_laws.json`` and the plots."""

    def on_multirun_end(self, config: DictConfig, **kwargs: Any) -> None:
        from dsl_lit.scaling.plots import write_plots

        sweep_dir = Path(config.hydra.sweep.dir)
        results = collect_results(sweep_dir)
        fitted = fit_results(results)
        for edge in fitted["edge_optima"]:
            log.warning("optimum on a grid edge, the fit extrapolates: %s; widen sweep.* there", edge)
        (sweep_dir / "scaling_laws.json").write_text(json.dumps(fitted, indent=2))
        for path in write_plots(results, fitted, sweep_dir):
            log.info("wrote %s", path)
        log.info("fitted laws: %s", sweep_dir / "scaling_laws.json")
