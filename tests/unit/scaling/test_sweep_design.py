"""The sweep's design, without training: grids that extend themselves until every optimum is
interior, laws with bootstrap intervals that hold the truth and say "flat" when it is, runs named
the same whatever their number, and the plan passed to the recipe as overrides it reads back."""

from __future__ import annotations

import math

import numpy as np
import pytest
import yaml

from data_contract.schema import dataclass_from_dict
from dsl_lit.scaling.bootstrap import LawSamples, bootstrap_laws
from dsl_lit.scaling.grid_edges import find_edges, grid_extensions
from dsl_lit.scaling.laws import PowerLaw
from dsl_lit.scaling.sweep import fit_results
from dsl_lit.scaling.sweep_plan import SweepConfig, plan_overrides, sweep_points, with_isoflop_hparams

SEQ = 32
BATCH_LAW = PowerLaw(0.5, 0.3)  # tokens: 0.5 C^0.3 -> 252 tokens (7.9 sequences) at 1e9 ... 717 at 3.16e10
LR_LAW = PowerLaw(3.0, -0.35)


def _loss(point, noise: float = 0.0, rng: np.random.Generator | None = None) -> float:
    """A bowl in (log batch, log lr) around the laws' optimum at the point's budget, lower at higher C;
    an IsoFLOP bowl in log M around 0.5 C^0.5 (15.8K at 1e9, 88.9K at 3.16e10)."""
    c = point.budget
    if point.study == "hparams":
        bowl = 0.3 * math.log(point.batch_tokens / BATCH_LAW(c)) ** 2 + 0.2 * math.log(point.lr / LR_LAW(c)) ** 2
    else:
        bowl = 0.3 * math.log(point.model_scale / (0.5 * c**0.5)) ** 2
    return 10 - 0.2 * math.log(c) + bowl + (rng.normal(0, noise) if rng is not None else 0.0)


def _results(points, noise: float = 0.0, seed: int = 0) -> list[dict]:
    rng = np.random.default_rng(seed)
    return [{"study": p.study, "budget": p.budget, "n_layers": p.n_layers, "d_model": p.d_model, "lr": p.lr,
             "batch_size": p.batch_size, "batch_tokens": p.batch_tokens, "model_scale": p.model_scale,
             "name": p.name, "loss": _loss(p, noise, rng)} for p in points]


def _sweep(**changes) -> SweepConfig:
    base = dict(hparam_budgets=[1e9, 3.16e9, 1e10, 3.16e10], lrs=[2e-3, 4e-3, 8e-3], batch_sizes=[1, 2, 4],
                isoflop_budgets=[1e9, 3.16e9, 1e10, 3.16e10], shapes=[[1, 16], [1, 24], [1, 32]],
                min_steps=1, max_steps=100_000)
    return SweepConfig(**{**base, **changes}).validate()


def _driven(sweep: SweepConfig, rounds: int = 6) -> tuple[SweepConfig, list[dict], list[int]]:
    """What the reproduction's scaling stage does, with the synthetic loss in place of training:
    run what is planned, extend where a best run is on an edge, until nothing is added."""
    added = []
    for _ in range(rounds):
        results = _results(sweep_points(sweep, SEQ))
        extended = grid_extensions(results, sweep, SEQ)
        added.append(len(sweep_points(extended, SEQ)) - len(sweep_points(sweep, SEQ)))
        if not added[-1]:
            break
        sweep = extended
    return sweep, _results(sweep_points(sweep, SEQ)), added


def test_a_grid_below_every_optimum_extends_itself_until_each_is_interior():
    """The grid (1-4 sequences, lr 2e-3 - 8e-3) sits below the laws' batch at every budget and on
    either side of their lr: the extension walks each budget's grid out to its optimum, then stops."""
    start = _sweep()
    assert find_edges(_results(sweep_points(start, SEQ)))  # before: optima on edges
    sweep, results, added = _driven(start)
    assert added[-1] == 0 and len(added) > 2  # it took rounds, then nothing more to add
    assert [e for e in find_edges(results) if e.side != "narrow"] == []
    fit = fit_results(results)
    for optimum in fit["hparams"]["optima"]:
        c = optimum["budget"]
        assert optimum["method"] == "vertex"
        assert optimum["values"]["batch_tokens"] == pytest.approx(BATCH_LAW(c), rel=0.02)
        assert optimum["values"]["lr"] == pytest.approx(LR_LAW(c), rel=0.02)
    assert fit["hparams"]["batch_tokens"]["exponent"] == pytest.approx(0.3, abs=0.01)
    assert fit["allocation"]["model_scale"]["exponent"] == pytest.approx(0.5, abs=0.02)
    # every run added was one step beyond an edge: no budget ran more than the 3 x 3 grid plus its walk
    assert all(b >= 1 for _, b, _ in sweep.extra_hparams)


def test_an_edge_that_cannot_move_stays_reported():
    """A best batch of one sequence cannot halve; a step outside [min_steps, max_steps] is not run."""
    sweep = _sweep(hparam_budgets=[1e9, 3.16e9], batch_sizes=[1, 2, 4], lrs=[1e-2, 2e-2, 4e-2], isoflop_budgets=[1e9, 2e9])
    results = _results(sweep_points(sweep, SEQ))
    for r in results:  # the best batch is the smallest at every budget
        if r["study"] == "hparams":
            r["loss"] = r["batch_size"] + abs(math.log(r["lr"] / 2e-2))
    extended = grid_extensions(results, sweep, SEQ, studies=("hparams",))
    assert extended.extra_hparams == []
    assert any(e.axis == "batch_tokens" and e.side == "low" for e in find_edges(results))
    capped = grid_extensions(_results(sweep_points(_sweep(max_steps=10), SEQ)), _sweep(max_steps=10), SEQ)
    assert all(p.steps <= 10 for p in sweep_points(capped, SEQ)[len(sweep_points(_sweep(max_steps=10), SEQ)):])


def test_bootstrap_intervals_hold_the_truth_and_a_flat_optimum_holds_zero():
    sweep, _, _ = _driven(_sweep())
    noisy = _results(sweep_points(sweep, SEQ), noise=0.02, seed=1)
    fit = fit_results(noisy)
    low, high = fit["hparams"]["bootstrap"]["batch_tokens"]["exponent_interval"]
    assert 0 < low < 0.3 < high  # the true exponent inside; the paper's sign beyond the interval
    lr_low, lr_high = fit["hparams"]["bootstrap"]["lr"]["exponent_interval"]
    assert lr_low < -0.35 < lr_high < 0
    # seeded: the same runs give the same interval
    assert fit_results(noisy)["hparams"]["bootstrap"]["batch_tokens"]["exponent_interval"] == [low, high]
    # an optimum that does not move with C: noise alone, and the interval says so
    flat = [{**r, "loss": r["loss"] - 0.3 * math.log(r["batch_tokens"] / BATCH_LAW(r["budget"])) ** 2
             + 0.3 * math.log(r["batch_tokens"] / 256) ** 2} for r in noisy]
    low, high = fit_results(flat)["hparams"]["bootstrap"]["batch_tokens"]["exponent_interval"]
    assert low < 0 < high


def test_a_law_samples_interval_and_its_failures():
    samples = LawSamples((PowerLaw(1.0, 0.1), PowerLaw(1.0, 0.2), PowerLaw(1.0, 0.3)), failed=2)
    assert samples.exponent_interval()[0] == pytest.approx(0.11) and samples.exponent_interval()[1] == pytest.approx(0.29)
    assert LawSamples.from_dict(samples.to_dict()) == samples
    low, high = samples.value_interval(100.0)
    assert 100**0.1 < low < high < 100**0.3

    def fails_on_one_budget(runs):
        if len({r["budget"] for r in runs}) < 2:
            raise ValueError("one budget")
        return {"law": PowerLaw(1.0, 0.0)}

    assert bootstrap_laws(fails_on_one_budget, [{"budget": 1.0}, {"budget": 2.0}], samples=10)["law"].failed == 0
    with pytest.raises(ValueError, match="every one of 10"):
        bootstrap_laws(fails_on_one_budget, [{"budget": 1.0}], samples=10)


def test_runs_keep_their_name_when_the_sweep_is_extended_or_given_isoflop_settings():
    sweep = _sweep()
    before = {p.name for p in sweep_points(sweep, SEQ)}
    extended = grid_extensions(_results(sweep_points(sweep, SEQ)), sweep, SEQ)
    after = [p.name for p in sweep_points(extended, SEQ)]
    assert before < set(after) and len(after) == len(set(after))  # every earlier run still there, none twice
    tuned = with_isoflop_hparams(sweep, BATCH_LAW, LR_LAW, SEQ)
    assert tuned.isoflop_hparams[0] == [1e9, round(BATCH_LAW(1e9) / SEQ), pytest.approx(LR_LAW(1e9))]
    iso = [p for p in sweep_points(tuned, SEQ) if p.study == "isoflop" and p.budget == 1e9]
    assert {p.batch_size for p in iso} == {8} and {p.lr for p in iso} == {tuned.isoflop_hparams[0][2]}
    assert {p.name for p in sweep_points(tuned, SEQ) if p.study == "hparams"} == {
        p.name for p in sweep_points(sweep, SEQ) if p.study == "hparams"}


def test_the_plan_reaches_the_recipe_as_overrides_it_reads_back():
    sweep = with_isoflop_hparams(grid_extensions(_results(sweep_points(_sweep(), SEQ)), _sweep(), SEQ),
                                 BATCH_LAW, LR_LAW, SEQ)
    raw = dict(vars(sweep))
    for override in plan_overrides(sweep):
        key, value = override.split("=", 1)
        raw[key.removeprefix("sweep.")] = yaml.safe_load(value)
    assert dataclass_from_dict(SweepConfig, raw, "sweep").validate() == sweep


def test_a_grid_that_follows_the_expected_law_needs_fewer_runs_to_the_same_optima():
    """``grid_exponents`` moves each budget's grid by (C / C_min)^exponent: with the laws' own
    exponents the grids start around every optimum, so fewer runs are added, and the fits agree."""
    fixed, fixed_results, _ = _driven(_sweep(batch_sizes=[4, 8, 16], lrs=[2e-2, 4e-2, 8e-2]))
    moving, moving_results, _ = _driven(_sweep(batch_sizes=[4, 8, 16], lrs=[2e-2, 4e-2, 8e-2], grid_exponents=[0.3, -0.35]))
    hparams = [len([r for r in results if r["study"] == "hparams"]) for results in (fixed_results, moving_results)]
    assert hparams[1] < hparams[0]
    for results in (fixed_results, moving_results):
        assert fit_results(results)["hparams"]["batch_tokens"]["exponent"] == pytest.approx(0.3, abs=0.01)
    grid = sweep_points(_sweep(grid_exponents=[0.3, -0.5]), SEQ)  # [1, 2, 4] x 3.16e10/1e9 = 31.6 ^ 0.3 = 2.8
    assert sorted({p.batch_size for p in grid if p.study == "hparams" and p.budget == 3.16e10}) == [3, 6, 11]
    assert sorted({p.lr for p in grid if p.study == "hparams" and p.budget == 3.16e10}) == pytest.approx(
        [2e-3 / 31.6**0.5, 4e-3 / 31.6**0.5, 8e-3 / 31.6**0.5])
