"""The PNGs of a run report, drawn from ``metrics.csv`` alone (for runs that never synced W&B).

One figure per question a reader asks of a training run; a figure whose columns the run did not
log is skipped: is the loss going down (train and validation), what did the schedule do (lr), is
the optimisation stable (gradient norm), how fast is it (tokens/s, MFU), what do DeepSeek-V3's
extra objectives do (MTP and balance losses), are the experts balanced (max/mean load per MoE
layer over time), how good is the model (downstream evaluation metrics), and for RL runs (GRPO):
does the reward rise, does held-out accuracy follow, and what happens to the completions' length.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable
from pathlib import Path

import matplotlib

matplotlib.use("Agg")  # files only: no display on training machines
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402

from dsl_lit.report.metrics import Series, columns_with_prefix, read_metrics  # noqa: E402

LOAD_PREFIX = "moe/load_max_over_mean/"
EVAL_PREFIX = "eval/"


def natural_key(name: str) -> list[object]:
    """``layers.2`` before ``layers.10``; MoE blocks before MTP modules (alphabetical: layers < mtp)."""
    return [int(part) if part.isdigit() else part for part in re.split(r"(\d+)", name)]


def plot_lines(series: dict[str, Series], keys: list[str], path: Path, title: str, ylabel: str,
           log_y: bool = False) -> Path | None:
    keys = [k for k in keys if k in series]
    if not keys:
        return None
    fig, ax = plt.subplots(figsize=(7, 4))
    for key in keys:
        s = series[key]
        ax.plot(s.steps, s.values, "o-" if len(s.steps) < 20 else "-", ms=3, label=key)
    ax.set(xlabel="step", ylabel=ylabel, title=title)
    if log_y and all((series[k].values > 0).all() for k in keys):
        ax.set_yscale("log")
    ax.grid(alpha=0.3)
    ax.legend()
    return save_figure(fig, path)


def save_figure(fig: plt.Figure, path: Path) -> Path:
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def plot_loss(series: dict[str, Series], out: Path) -> Path | None:
    return plot_lines(series, ["train/loss", "val/loss"], out / "loss.png", "next-token loss", "cross-entropy (nats)")


def plot_lr(series: dict[str, Series], out: Path) -> Path | None:
    return plot_lines(series, ["train/lr"], out / "lr.png", "learning rate", "lr")


def plot_grad_norm(series: dict[str, Series], out: Path) -> Path | None:
    return plot_lines(series, ["train/grad_norm"], out / "grad_norm.png", "gradient norm (before clipping)", "norm",
                  log_y=True)


def plot_throughput(series: dict[str, Series], out: Path) -> Path | None:
    if "perf/tokens_per_s" not in series:
        return None
    fig, ax = plt.subplots(figsize=(7, 4))
    tokens = series["perf/tokens_per_s"]
    ax.plot(tokens.steps, tokens.values, "-", color="tab:blue", label="tokens/s")
    ax.set(xlabel="step", ylabel="tokens/s (all ranks)", title="throughput")
    ax.grid(alpha=0.3)
    if "perf/mfu" in series:
        mfu = series["perf/mfu"]
        right = ax.twinx()
        right.plot(mfu.steps, 100 * mfu.values, "--", color="tab:orange", label="MFU")
        right.set_ylabel("MFU (%, dashed)", color="tab:orange")
    return save_figure(fig, out / "throughput.png")


def plot_aux_losses(series: dict[str, Series], out: Path) -> Path | None:
    """DeepSeek-V3's extra terms, one panel each: they differ by orders of magnitude (the balance
    loss carries its alpha of ~1e-4)."""
    panels = [(title, [k for k in keys if k in series]) for title, keys in (
        ("MTP loss", ["train/mtp_loss", "val/mtp_loss"]), ("balance loss (x alpha)", ["train/balance_loss"]))]
    panels = [(title, keys) for title, keys in panels if keys]
    if not panels:
        return None
    fig, axes = plt.subplots(1, len(panels), figsize=(5.5 * len(panels), 4), squeeze=False)
    for ax, (title, keys) in zip(axes.flat, panels):
        for key in keys:
            ax.plot(series[key].steps, series[key].values, "o-", ms=3, label=key)
        ax.set(xlabel="step", title=title)
        ax.grid(alpha=0.3)
        ax.legend()
    return save_figure(fig, out / "aux_losses.png")


def plot_expert_load(series: dict[str, Series], out: Path) -> Path | None:
    """[MoE layer x step] heatmap of max/mean expert load (1.0: perfectly balanced)."""
    layers = sorted(columns_with_prefix(series, LOAD_PREFIX), key=natural_key)
    if not layers:
        return None
    steps = np.unique(np.concatenate([series[k].steps for k in layers]))
    grid = np.full((len(layers), len(steps)), np.nan)
    for row, key in enumerate(layers):
        grid[row, np.searchsorted(steps, series[key].steps)] = series[key].values
    fig, ax = plt.subplots(figsize=(8, 1.2 + 0.45 * len(layers)))
    image = ax.imshow(grid, aspect="auto", interpolation="nearest", cmap="magma", vmin=1.0,
                      extent=(steps[0] - 0.5, steps[-1] + 0.5, len(layers) - 0.5, -0.5))
    ax.set_yticks(range(len(layers)), [k.removeprefix(LOAD_PREFIX) for k in layers])
    ax.set(xlabel="step", title="expert load: max / mean per MoE layer (1.0 = balanced)")
    fig.colorbar(image, ax=ax, label="max / mean")
    return save_figure(fig, out / "expert_load.png")


def plot_eval(series: dict[str, Series], out: Path) -> Path | None:
    """One panel per downstream metric (``eval/<task>/<metric>``), over training steps."""
    keys = [k for k in columns_with_prefix(series, EVAL_PREFIX) if k.count("/") >= 2]
    if not keys:
        return None
    cols = min(3, len(keys))
    rows = math.ceil(len(keys) / cols)
    fig, axes = plt.subplots(rows, cols, figsize=(4.2 * cols, 3.2 * rows), squeeze=False)
    for ax, key in zip(axes.flat, keys):
        s = series[key]
        _, task, metric = key.split("/", 2)
        ax.plot(s.steps, s.values, "o-", ms=4)
        ax.set(title=f"{task}\n{metric}", xlabel="step")
        ax.grid(alpha=0.3)
    for ax in list(axes.flat)[len(keys):]:
        ax.set_visible(False)
    return save_figure(fig, out / "eval.png")


RL_REWARDS = ("reward/mean", "reward/accuracy", "reward/accuracy_pass_at_group", "reward/format")


def plot_rl(series: dict[str, Series], out: Path) -> Path | None:
    """GRPO: the sampled rewards with pass@G (what RL can sharpen pass@1 towards), held-out greedy
    accuracy (``eval/accuracy``), and the mean completion length."""
    if "reward/mean" not in series:
        return None
    panels = [("sampled rewards", RL_REWARDS), ("held-out greedy accuracy", ("eval/accuracy",)),
              ("completion length (tokens)", ("completion/length",))]
    panels = [(title, [k for k in keys if k in series]) for title, keys in panels]
    panels = [(title, keys) for title, keys in panels if keys]
    fig, axes = plt.subplots(1, len(panels), figsize=(4.6 * len(panels), 3.6), squeeze=False)
    for ax, (title, keys) in zip(axes.flat, panels):
        for key in keys:
            s = series[key]
            ax.plot(s.steps, s.values, "o-" if len(s.steps) < 20 else "-", ms=4, label=key.split("/", 1)[1])
        ax.set(title=title, xlabel="step")
        ax.grid(alpha=0.3)
        if len(keys) > 1:
            ax.legend(fontsize=8)
    return save_figure(fig, out / "rl.png")


FIGURES: tuple[Callable[[dict[str, Series], Path], Path | None], ...] = (
    plot_loss, plot_lr, plot_grad_norm, plot_throughput, plot_aux_losses, plot_expert_load, plot_eval, plot_rl,
)


def draw_report(run_dir: str | Path, out_dir: str | Path | None = None) -> list[Path]:
    """Every figure the run's metrics.csv has data for, as PNGs in ``out_dir`` (default
    ``<run dir>/report``); returns their paths."""
    series = read_metrics(run_dir)
    if not series:  # nothing to draw: no empty report directory either
        return []
    out = Path(out_dir) if out_dir is not None else Path(run_dir) / "report"
    out.mkdir(parents=True, exist_ok=True)
    return [path for figure in FIGURES if (path := figure(series, out)) is not None]
