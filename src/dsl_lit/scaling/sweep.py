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
from collections.abc import Callable, Sequence
from dataclasses import asdict
from pathlib import Path
from typing import Any

from hydra.experimental.callback import Callback
from omegaconf import DictConfig, OmegaConf, open_dict

from data_contract.errors import ConfigError
from data_contract.schema import dataclass_from_dict
from dsl_lit.scaling.bootstrap import bootstrap_laws
from dsl_lit.scaling.fit import AllocationFit, HparamFit, fit_allocation, fit_hparam_laws
from dsl_lit.scaling.grid_edges import find_edges, grid_extensions
from dsl_lit.scaling.laws import PowerLaw
from dsl_lit.scaling.sweep_plan import Point, SweepConfig, plan_overrides, point_overrides, sweep_points

log = logging.getLogger(__name__)
RESULT_FILE = "result.json"


def sweep_from_config(cfg: DictConfig | dict) -> tuple[SweepConfig, int]:
    """The ``sweep`` node and ``data.seq_len`` of a composed config (only those are resolved)."""
    sweep = cfg["sweep"] if isinstance(cfg, dict) else OmegaConf.to_container(cfg.sweep, resolve=True)
    return dataclass_from_dict(SweepConfig, dict(sweep), "sweep"), int(cfg["data"]["seq_len"])


def register_resolver() -> None:
    """``${scaling_points:${sweep},${data.seq_len}}`` -> "0,1,...,N-1" for the multirun, and
    ``${scaling_point_dir:${sweep},${data.seq_len},${point}}`` -> the run's :attr:`Point.name`, its
    directory in the sweep (the same run keeps its directory when a sweep is extended)."""
    if OmegaConf.has_resolver("scaling_points"):
        return

    def plan(sweep: DictConfig, seq_len: int) -> list[Point]:
        config = dataclass_from_dict(SweepConfig, dict(OmegaConf.to_container(sweep, resolve=True)), "sweep")
        return sweep_points(config, int(seq_len))

    def point_dir(sweep: DictConfig, seq_len: int, point: int) -> str:
        points = plan(sweep, seq_len)
        return points[int(point)].name if 0 <= int(point) < len(points) else f"point_{point}"

    OmegaConf.register_new_resolver("scaling_points", lambda sweep, seq_len: ",".join(
        str(i) for i in range(len(plan(sweep, seq_len)))))
    OmegaConf.register_new_resolver("scaling_point_dir", point_dir)


def train_point(cfg: DictConfig, run_dir: str) -> dict[str, Any]:
    """Train the job's point; return (and write) its result with the held-out loss. A run whose
    directory already holds the result of this point at this seed (a sweep extended, or rerun after
    a stop) is not trained again."""
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
    seed = int(cfg.trainer.seed)
    done = Path(run_dir, RESULT_FILE)
    if done.is_file():
        earlier = json.loads(done.read_text())
        if {k: earlier.get(k) for k in (*asdict(point), "seed")} == {**asdict(point), "seed": seed}:
            log.info("point %d (%s): finished earlier, loss %.4f", cfg.point, point.name, earlier["loss"])
            return earlier
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
    result = {**asdict(point), "name": point.name, "seed": seed, "model_scale": point.model_scale, "batch_tokens": point.batch_tokens,
              "steps": point.steps, "tokens": point.steps * point.batch_tokens, "loss": loss}
    partial = done.with_suffix(".partial")  # a reader of the sweep dir never sees half a file
    partial.write_text(json.dumps(result, indent=2))
    partial.replace(done)
    log.info("point %d (%s, C=%.1e, L%d d%d, lr %.1e, batch %d): loss %.4f", cfg.point, point.study, point.budget,
             point.n_layers, point.d_model, point.lr, point.batch_size, loss)
    return result


def collect_results(sweep_dir: str | Path) -> list[dict[str, Any]]:
    return [json.loads(p.read_text()) for p in sorted(Path(sweep_dir).glob(f"*/{RESULT_FILE}"))]


def _fit_hparams(runs: Sequence[dict[str, Any]]) -> HparamFit:
    return fit_hparam_laws([r["budget"] for r in runs], [r["batch_tokens"] for r in runs], [r["lr"] for r in runs],
                           [r["loss"] for r in runs])


def _fit_allocation(runs: Sequence[dict[str, Any]]) -> AllocationFit:
    return fit_allocation([r["budget"] for r in runs], [r["model_scale"] for r in runs], [r["loss"] for r in runs])


STUDIES: dict[str, tuple[str, Callable[[Sequence[dict[str, Any]]], Any], tuple[str, str]]] = {
    "hparams": ("hparams", _fit_hparams, ("batch_tokens", "lr")),
    "allocation": ("isoflop", _fit_allocation, ("model_scale", "data_scale")),
}
"""Fitted entry of scaling_laws.json -> (the study whose runs it reads, its fit, the laws it holds)."""


def fit_results(results: list[dict[str, Any]]) -> dict[str, Any]:
    """Fitted laws (JSON-ready) from the collected results, each with its bootstrap over the runs
    (``bootstrap``: per law, the exponent's 5-95% interval and the resampled laws); a study with
    under two budgets is skipped. ``edge_optima`` lists the budgets whose optimum is on a grid edge
    (see :func:`~dsl_lit.scaling.grid_edges.find_edges`); each study's entry holds its own as
    records (``edges``: study, budget, axis, side, value), which the reproduction's claims read."""
    edges = find_edges(results)
    fitted: dict[str, Any] = {"runs": len(results), "edge_optima": [edge.text() for edge in edges]}
    for entry, (study, fit, names) in STUDIES.items():
        runs = [r for r in results if r["study"] == study]
        if len({r["budget"] for r in runs}) < 2:
            continue

        def laws(resample: Sequence[dict[str, Any]], fit: Any = fit, names: tuple[str, str] = names) -> dict[str, PowerLaw]:
            fitted_laws = fit(resample)
            return {name: getattr(fitted_laws, name) for name in names}

        samples = bootstrap_laws(laws, runs)
        fitted[entry] = {**fit(runs).to_dict(), "bootstrap": {name: s.to_dict() for name, s in samples.items()},
                         "edges": [asdict(e) for e in edges if e.study == study]}
    return fitted


def fit_sweep_dir(sweep_dir: str | Path) -> dict[str, Any]:
    """Collect a sweep directory's results, fit, write ``scaling_laws.json`` and the plots there;
    warn about each edge optimum. Returns the fitted laws."""
    from dsl_lit.scaling.plots import write_plots

    sweep_dir = Path(sweep_dir)
    results = collect_results(sweep_dir)
    fitted = fit_results(results)
    for edge in fitted["edge_optima"]:
        log.warning("optimum on a grid edge, the fit extrapolates: %s", edge)
    (sweep_dir / "scaling_laws.json").write_text(json.dumps(fitted, indent=2))
    for path in write_plots(results, fitted, sweep_dir):
        log.info("wrote %s", path)
    log.info("fitted laws: %s", sweep_dir / "scaling_laws.json")
    return fitted


class FitSweep(Callback):
    """At the end of the multirun: collect results, fit, write ``scaling_laws.json`` and the plots;
    where an optimum sits on a grid edge, log the overrides whose runs would move it inside."""

    def on_multirun_end(self, config: DictConfig, **kwargs: Any) -> None:
        sweep_dir = Path(config.hydra.sweep.dir)
        fit_sweep_dir(sweep_dir)
        if "sweep" not in config:  # a bare config (tests): nothing to extend
            return
        sweep, seq_len = sweep_from_config(config)
        planned = len(sweep_points(sweep, seq_len))
        extended = grid_extensions(collect_results(sweep_dir), sweep, seq_len)
        added = len(sweep_points(extended, seq_len)) - planned
        if added:
            log.warning("%d runs one step beyond would move the edge optima inside their grids; rerun into the same "
                        "hydra.sweep.dir (finished runs are not trained again) with: %s", added,
                        " ".join(f"'{o}'" for o in plan_overrides(extended)))
