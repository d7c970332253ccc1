"""The papers' statements a reproduction can check, each beside what this run measured.

A claim reads the finished stages' results (their completion markers) and says "reproduced",
"not reproduced at this scale", "inconclusive: effect within its noise" or "not measured" (a stage
that did not run). The comparisons are the papers' own (with vs without MTP at equal steps, with vs
without the bias update, before vs after a stage); the thresholds are written in each claim's text,
fixed before the runs, so a reader can disagree with one. Effects measured over seeds (the
ablations) are judged by their paired differences against the spread of those differences
(:func:`paired`), never by one draw; the R1 stages, each evaluated on the same held-out problems,
by a paired bootstrap over those problems (:func:`problem_gain`).
"""

from __future__ import annotations

import math
import random
import statistics
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from dsl_lit.scaling.laws import PAPER_BATCH, PAPER_LR, PAPER_MODEL_SCALE

REPRODUCED, NOT_REPRODUCED, NOT_MEASURED = "reproduced", "not reproduced at this scale", "not measured"
INCONCLUSIVE = "inconclusive: effect within its noise"
"""Within the spread the measurement states: over seeds (the ablations), over the sweep's runs
(the laws' bootstrap), or over the held-out problems (the R1 stages' paired bootstrap)."""
Results = dict[str, dict[str, Any]]


@dataclass(frozen=True)
class Claim:
    statement: str
    source: str
    check: Callable[[Results], tuple[str, bool | None]]
    """From the stages' results: (what was measured, whether it agrees with the statement; None:
    the effect is within its seed spread, neither way)."""

    def verdict(self, results: Results) -> tuple[str, str]:
        try:
            measured, agrees = self.check(results)
        except (KeyError, TypeError, ZeroDivisionError, IndexError):  # a stage it reads did not run or logged nothing
            return "-", NOT_MEASURED
        return measured, INCONCLUSIVE if agrees is None else REPRODUCED if agrees else NOT_REPRODUCED


T_95 = {1: 6.314, 2: 2.920, 3: 2.353, 4: 2.132, 5: 2.015, 6: 1.943, 7: 1.895, 8: 1.860, 9: 1.833}
"""One-sided 95% Student t quantiles by degrees of freedom (seeds - 1)."""
MOST_SEEDS = 100
"""Past this many seeds an effect is called out of reach at its spread (no number is given)."""


def t_95(dof: int) -> float:
    """The one-sided 95% Student t quantile: the table, then the normal's 1.645 with the first
    Cornish-Fisher correction (within 0.02 of the exact value from 10 degrees of freedom on)."""
    z = 1.645
    return T_95.get(dof, z + (z**3 + z) / (4 * dof))


@dataclass(frozen=True)
class Paired:
    """Paired differences over seeds (each seed the same data order and initial draw for both arms)."""

    differences: tuple[float, ...]

    @property
    def mean(self) -> float:
        return statistics.fmean(self.differences)

    @property
    def spread(self) -> float:
        """Sample standard deviation of the differences (0 for one seed)."""
        return statistics.stdev(self.differences) if len(self.differences) > 1 else 0.0

    @property
    def margin(self) -> float:
        """Half-width of the one-sided 95% bound on the mean difference (inf for one seed: no spread known)."""
        n = len(self.differences)
        return t_95(n - 1) * self.spread / math.sqrt(n) if n > 1 else math.inf

    def seeds_to_resolve(self, threshold: float) -> int | None:
        """How many paired seeds would put a mean this far from ``threshold`` beyond its margin, were
        the spread what these seeds measured: the reason an inconclusive effect is one, in seeds
        (None: no spread measured, or more than :data:`MOST_SEEDS`)."""
        distance = abs(self.mean - threshold)
        if self.spread == 0 or distance == 0:
            return None
        return next((n for n in range(2, MOST_SEEDS + 1) if t_95(n - 1) * self.spread / math.sqrt(n) < distance), None)

    def unresolved(self, threshold: float) -> str:
        """What an inconclusive verdict would need, for its text."""
        n = self.seeds_to_resolve(threshold)
        return (f"; at this spread ~{n} paired seeds would resolve it" if n is not None else
                f"; at this spread over {MOST_SEEDS} paired seeds would not resolve it" if self.spread else "")

    def above(self, threshold: float) -> bool | None:
        """True if the mean difference is above ``threshold`` beyond its margin, False if below it
        beyond its margin, None (inconclusive) in between."""
        if self.mean - self.margin > threshold:
            return True
        if self.mean + self.margin < threshold:
            return False
        return None

    def text(self, fmt: str = ".3f") -> str:
        return (f"{self.mean:+{fmt}} +- {self.spread:{fmt}} (mean +- sd of {len(self.differences)} paired seeds; "
                f"95% margin {self.margin:{fmt}})")


def paired(r: Results, key: str, better: str, worse: str, relative: bool = False) -> Paired:
    """``key`` of ablation variant ``worse`` minus ``better``, seed by seed (relative: divided by ``better``'s)."""
    variants = r["ablations"]["results"]["variants"]
    pairs = list(zip(variants[better], variants[worse], strict=True))
    if not pairs:
        raise KeyError("no seeds")
    return Paired(tuple((w[key] - b[key]) / (b[key] if relative else 1.0) for b, w in pairs))


def _mean(r: Results, variant: str, key: str) -> float:
    return statistics.fmean(run[key] for run in r["ablations"]["results"]["variants"][variant])


def _fmt(x: float) -> str:
    return f"{x:.3g}"


def _exponent(x: float) -> str:
    """A fitted exponent as a reader takes it: one that rounds to 0 at three decimals is flat (a
    sweep whose optimum never moved fits ~1e-16), not ``C^1.52e-16``."""
    return f"{x:.3f}" if abs(x) >= 5e-4 else "0 (flat: the optimum did not move between budgets)"


def _edge_bounds(law: dict[str, Any], name: str, sign: int) -> tuple[list[str], list[str]]:
    """The budgets whose optimum of ``name`` sat on an edge of the grid swept there, split by what
    that can do to the fitted exponent's sign. An optimum on an edge is only a bound (the true one
    lies at it or beyond); the least-squares slope through (log C, log optimum) moves by
    (log C_i - the budgets' mean log C) times a shift of point i, so a low edge below the mean budget
    can only steepen the slope and one above it only flatten it (a high edge the other way round).
    Returns (edges that could move the exponent against ``sign``, edges that could only move it
    further toward ``sign``); one with under three values swept ("narrow") could do either. A fit
    that did not record its edges (a sweep older than the records) is not judged: KeyError."""
    edges = [e for e in law["edges"] if e["axis"] == name]
    if not edges:
        return [], []
    centre = statistics.fmean(math.log(o["budget"]) for o in law["optima"])
    against, toward = [], []
    for edge in edges:
        where = f"C={edge['budget']:.3g} ({edge['side']} edge, {edge['value']:.3g})"
        if edge["side"] == "narrow":
            against.append(where)
            toward.append(where)
            continue
        effect = (1 if edge["side"] == "high" else -1) * (math.log(edge["budget"]) - centre) * sign
        if effect < 0:
            against.append(where)
        elif effect > 0:
            toward.append(where)
    return against, toward


def _law(law: dict[str, Any], name: str, sign: int) -> tuple[str, bool | None]:
    """A fitted exponent with its bootstrap interval over the sweep's runs (5-95%), judged as the
    seed margins are: the paper's sign beyond the interval (``sign`` > 0: its lower end above 0),
    the other sign beyond it, or the interval holding 0 (inconclusive). An optimum on its grid's
    edge that could move the exponent against the verdict (:func:`_edge_bounds`) leaves it
    inconclusive: the fit extrapolated there, and the grid did not measure that optimum."""
    exponent = law[name]["exponent"]
    low, high = law["bootstrap"][name]["exponent_interval"]
    if (low > 0 if sign > 0 else high < 0):
        agrees: bool | None = True
    elif (high < 0 if sign > 0 else low > 0):
        agrees = False
    else:
        agrees = None
    against, toward = _edge_bounds(law, name, sign)
    text = f"C^{_exponent(exponent)} [{low:.3f}, {high:.3f}]"
    undone = against if agrees is True else toward if agrees is False else []
    if undone:
        return f"{text}, but its optimum sat on the grid's edge at {', '.join(undone)}: a bound that could " \
               "reverse the verdict", None
    if against or toward:
        text += f" (optimum on the grid's edge at {', '.join(dict.fromkeys(against + toward))}" + \
                ("" if agrees is None else ": a bound that can only strengthen the verdict") + ")"
    return text, agrees


def _both(*verdicts: bool | None) -> bool | None:
    return False if False in verdicts else None if None in verdicts else True


INTERVAL = ("[the 5-95% bootstrap interval over the sweep's runs]; criterion: the paper's sign at both ends "
            "of the interval")


def _scaling_exponents(r: Results) -> tuple[str, bool | None]:
    laws = r["scaling"]["results"]["laws"]["hparams"]
    batch, batch_ok = _law(laws, "batch_tokens", +1)
    lr, lr_ok = _law(laws, "lr", -1)
    return (f"B_opt ~ {batch}, lr_opt ~ {lr} (paper: C^{PAPER_BATCH.exponent}, C^{PAPER_LR.exponent}; {INTERVAL})",
            _both(batch_ok, lr_ok))


def _allocation(r: Results) -> tuple[str, bool | None]:
    scale, agrees = _law(r["scaling"]["results"]["laws"]["allocation"], "model_scale", +1)
    return f"M_opt ~ {scale} (paper: C^{PAPER_MODEL_SCALE.exponent}; {INTERVAL})", agrees


def _mtp(r: Results) -> tuple[str, bool | None]:
    """Criterion: validation loss without MTP minus with it, paired by seed, above 0 beyond its 95%
    margin (below it beyond the margin: MTP hurt; in between: inconclusive). Both arms balance their
    experts with the bias update; where their expert load differs beyond its own margin, the loss
    difference is no verdict on MTP either way: it may measure the routing instead. Measured
    2026-11-29 (2-core AMD EPYC, fresh clone, seeds 1234-1236): every run's routing collapsed onto
    4 of the 16 experts within 10 steps (load max/mean 3.9-4.0 of at most 4); with MTP the bias update
    brought it to ~2.5 by step 50, without MTP the runs stayed collapsed on a loss plateau (~6.3)
    until step ~65 and ended at load 2.7-3.1 against 1.5-1.7 and 0.48 higher in validation loss,
    which the loss alone called "reproduced"; on the 2-core Xeon of 2026-11-28 the arms ended equally
    balanced and MTP's effect was -0.135 +- 0.133."""
    gain = paired(r, "val_loss", "baseline", "no_mtp")
    verdict = gain.above(0.0)
    text = (f"validation loss {_fmt(_mean(r, 'baseline', 'val_loss'))} with MTP, {_fmt(_mean(r, 'no_mtp', 'val_loss'))} "
            f"without; without - with: {gain.text()} (criterion: above 0 beyond the margin)")
    balance = paired(r, "load_max_over_mean", "baseline", "no_mtp")
    if verdict is not None and balance.above(0.0) is not None:
        return (f"{text}; but the arms' routing differs: expert load max/mean {_fmt(_mean(r, 'no_mtp', 'load_max_over_mean'))} "
                f"without MTP, {_fmt(_mean(r, 'baseline', 'load_max_over_mean'))} with it (without - with: "
                f"{balance.text()}), so the loss difference may measure the routing's balance, not MTP"), None
    return f"{text}{gain.unresolved(0.0) if verdict is None else ''}", verdict


def _bias(r: Results) -> tuple[str, bool | None]:
    """Criterion: expert load max/mean without the bias update minus with it above 0 beyond its margin."""
    gain = paired(r, "load_max_over_mean", "baseline", "no_bias")
    return (f"expert load max/mean {_fmt(_mean(r, 'baseline', 'load_max_over_mean'))} with the bias update, "
            f"{_fmt(_mean(r, 'no_bias', 'load_max_over_mean'))} without (last 20% of steps; 1.0 is perfect); "
            f"without - with: {gain.text()}", gain.above(0.0))


LOSS_COST = 0.02
"""The bias update's loss cost a reproduction accepts as "no worse": 2% of the validation loss."""


def _bias_loss(r: Results) -> tuple[str, bool | None]:
    """Balancing *without hurting the model*: only a claim where the balancing happened, and the
    relative loss cost (with / without - 1, paired by seed) below :data:`LOSS_COST` beyond its
    margin (above it beyond the margin: hurt; in between: inconclusive)."""
    description, balanced = _bias(r)
    cost = paired(r, "val_loss", "no_bias", "baseline", relative=True)
    within = cost.above(LOSS_COST)
    verdict = None if within is None else not within
    text = (f"validation loss {_fmt(_mean(r, 'baseline', 'val_loss'))} with the bias update, "
            f"{_fmt(_mean(r, 'no_bias', 'val_loss'))} without; relative cost {cost.text('.2%')} "
            f"(criterion: below {LOSS_COST:.0%} beyond the margin){cost.unresolved(LOSS_COST) if verdict is None else ''}")
    if balanced is not True:
        return text + "; but the bias update did not balance the load, so nothing was balanced for free", \
            False if balanced is False else None
    return text, verdict


def _passkey(r: Results) -> tuple[str, bool | None]:
    """Criterion: at the extended length (the YaRN model's), retrieval after YaRN minus before (the
    context base, plain RoPE past its length), prompt by prompt on the same prompts, above 0 at
    both ends of its interval (below at both: not; else inconclusive). Only a claim where the base
    retrieves at its own length: a base that retrieves nothing there had nothing to extend."""
    p = r["passkey"]["results"]
    acc, trained = p["accuracy"], p["trained_length"]
    own, longer = str(trained["context_base"]), str(trained["yarn"])
    if longer not in acc["yarn"] or own not in acc["context_base"]:
        raise KeyError(f"passkey: no accuracy at the trained lengths {own} and {longer} (reproduce.passkey_lengths)")
    before, after = acc["context_base"][longer], acc["yarn"][longer]
    gain = problem_gain(p["retrieved"]["yarn"][longer], p["retrieved"]["context_base"][longer], unit="passkey prompts")
    retrieves = acc["context_base"][own] > 0
    text = (f"passkey accuracy at {longer} tokens: {before:.0%} before, {after:.0%} after YaRN; gain {gain.text()}; "
            f"the base retrieves {acc['context_base'][own]:.0%} at its own length ({own} tokens)"
            f"{'' if retrieves else ', so there was nothing to extend'} (criterion: above 0 at both ends)")
    return text, gain.verdict() if retrieves else False


BOOTSTRAP_SAMPLES = 2000


@dataclass(frozen=True)
class ProblemGain:
    """Mean over the same held-out problems of ``after - scale * before`` (per-problem rewards),
    with its 5-95% interval from resampling the problems (paired: one problem's two outcomes stay
    together, so the problems' own difficulty cancels)."""

    mean: float
    low: float
    high: float
    problems: int
    unit: str = "held-out problems"

    def verdict(self) -> bool | None:
        """Above 0 at both ends of the interval, below 0 at both, or inconclusive."""
        return True if self.low > 0 else False if self.high < 0 else None

    def text(self) -> str:
        return (f"{self.mean * 100:+.1f} points [{self.low * 100:+.1f}, {self.high * 100:+.1f}] (5-95%, paired "
                f"bootstrap over the {self.problems} {self.unit})")


def problem_gain(after: list[float], before: list[float], scale: float = 1.0, seed: int = 0,
                 unit: str = "held-out problems") -> ProblemGain:
    differences = [a - scale * b for a, b in zip(after, before, strict=True)]
    n = len(differences)
    if not n:
        raise KeyError(f"no {unit}")
    rng = random.Random(seed)
    means = sorted(sum(differences[rng.randrange(n)] for _ in range(n)) / n for _ in range(BOOTSTRAP_SAMPLES))
    return ProblemGain(statistics.fmean(differences), means[int(0.05 * BOOTSTRAP_SAMPLES)],
                       means[int(0.95 * BOOTSTRAP_SAMPLES) - 1], n, unit)


def _outcomes(r: Results, stage: str) -> list[float]:
    outcomes = r[stage]["results"]["held_out_outcomes"]
    if outcomes is None:  # a run from before per-problem outcomes were kept: not judged by accuracies alone
        raise KeyError(f"{stage}: no held-out outcomes")
    return outcomes


def _blind(r: Results) -> dict[str, Any]:
    """The best answer that reads no list (``reproduce.stages.blind_baseline``): every R1 model must
    beat it list by list, or its accuracy is a constant's, not a skill."""
    return r["cold_start"]["results"]["blind"]


def _above_blind(r: Results, stage: str) -> ProblemGain:
    return problem_gain(_outcomes(r, stage), _blind(r)["outcomes"])


def _rl_gain(r: Results) -> bool | None:
    """GRPO's gain established: above its cold start and above the blind answer, list by list."""
    return _both(problem_gain(_outcomes(r, "grpo"), _outcomes(r, "cold_start")).verdict(),
                 _above_blind(r, "grpo").verdict())


def _grpo(r: Results) -> tuple[str, bool | None]:
    """Criterion: held-out greedy accuracy after GRPO minus after the cold start, and minus the
    blind answer's (:func:`_blind`), each above 0 at both ends of its interval (either below at
    both: not; else inconclusive). The sampled accuracy on the training prompts (the reward's own)
    is shown beside it, since it moves first."""
    cold, rl = r["cold_start"]["results"]["eval_accuracy"], r["grpo"]["results"]["eval_accuracy"]
    first, last = r["grpo"]["results"].get("sampled_accuracy_first"), r["grpo"]["results"].get("sampled_accuracy_last")
    sampled = f"; sampled accuracy on training prompts {first:.0%} -> {last:.0%} (first/last 20% of steps)" \
        if first is not None and last is not None else ""
    gain, blind = problem_gain(_outcomes(r, "grpo"), _outcomes(r, "cold_start")), _above_blind(r, "grpo")
    constant = _blind(r)
    return (f"held-out greedy accuracy {cold:.0%} after the cold start, {rl:.0%} after GRPO: gain {gain.text()}; "
            f"over answering \"{constant['answer']}\" to every list ({constant['accuracy']:.0%}): {blind.text()}"
            f"{sampled} (criterion: both above 0 at both ends)", _both(gain.verdict(), blind.verdict()))


CARRIED = 0.8
"""The share of the GRPO model's held-out accuracy a model trained on its samples must keep."""


def _keeps_grpo_skill(stage: str, learner: str, reference: str, no_gain: str) -> Callable[[Results], tuple[str, bool | None]]:
    """Held-out accuracy of ``stage``, trained on the GRPO model's samples, against :data:`CARRIED`
    of the GRPO model's, problem by problem: above at both ends of the interval, below at both, or
    inconclusive. Only a skill RL added can be carried: a GRPO gain that is not established (not
    reproduced, or inconclusive) makes this claim the same."""
    def check(r: Results) -> tuple[str, bool | None]:
        cold = r["cold_start"]["results"]["eval_accuracy"]
        rl, learned = r["grpo"]["results"]["eval_accuracy"], r[stage]["results"]["eval_accuracy"]
        kept, blind = problem_gain(_outcomes(r, stage), _outcomes(r, "grpo"), scale=CARRIED), _above_blind(r, stage)
        rl_gain = _rl_gain(r)
        gained = "" if rl_gain else "; " + no_gain.format(cold=f"{cold:.0%}")
        return (f"held-out accuracy {learned:.0%} for {learner}, {rl:.0%} for {reference}; {learner} minus "
                f"{CARRIED:.0%} of it: {kept.text()}; minus answering \"{_blind(r)['answer']}\" to every list: "
                f"{blind.text()} (criterion: both above 0 at both ends){gained}",
                _both(rl_gain, kept.verdict(), blind.verdict()))
    return check


_rejection_sft = _keeps_grpo_skill("sft_rs", "SFT on the kept samples", "the GRPO model",
                                   "GRPO's gain (over its cold start, {cold}, and over the blind answer) is not "
                                   "established, so there is no skill to carry")
_distill = _keeps_grpo_skill("distill", "the smaller student", "its teacher",
                             "the teacher's gain (over its cold start, {cold}, and over the blind answer) is "
                             "not established")


CLAIMS = (
    Claim("Optimal batch size grows and optimal learning rate shrinks with compute, as power laws",
          "DeepSeek LLM, sec. 3.1", _scaling_exponents),
    Claim("The compute-optimal model scale grows with compute", "DeepSeek LLM, sec. 3.2", _allocation),
    Claim("Multi-token prediction improves the main model at equal training steps", "DeepSeek-V3, sec. 4.5.1 (Table 4)",
          _mtp),
    Claim("Auxiliary-loss-free balancing (the bias update) keeps expert load balanced", "DeepSeek-V3, sec. 2.1.2 / 4.5.2",
          _bias),
    Claim("... without hurting the model (no worse loss)", "DeepSeek-V3, sec. 4.5.2 (Table 5)", _bias_loss),
    Claim("YaRN extension makes retrieval work at the longer context", "DeepSeek-V3, sec. 4.3 (Figure 8)", _passkey),
    Claim("RL with rule-based rewards raises accuracy over the cold-start model", "DeepSeek-R1, sec. 2.3", _grpo),
    Claim("SFT on rejection-sampled, verified RL outputs carries the RL model's skill", "DeepSeek-R1, sec. 2.3.3",
          _rejection_sft),
    Claim("A distilled smaller student keeps most of the teacher's accuracy", "DeepSeek-R1, sec. 2.4 / 4.1",
          _distill),
)


def claims_table(results: Results) -> list[tuple[str, str, str, str]]:
    """(statement, source, measured, verdict) per claim."""
    return [(c.statement, c.source, *c.verdict(results)) for c in CLAIMS]
