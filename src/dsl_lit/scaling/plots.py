"""PNG plots of a scaling sweep: IsoFLOP curves, fitted optima against the paper's laws, and the
learning-rate x batch-size loss landscape of each budget."""

from __future__ import annotations

from collections import defaultdict
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")  # files only: no display on training machines
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402
from matplotlib.ticker import NullFormatter  # noqa: E402

from dsl_lit.scaling.bootstrap import LawSamples  # noqa: E402
from dsl_lit.scaling.laws import PAPER_BATCH, PAPER_DATA_SCALE, PAPER_LR, PAPER_MODEL_SCALE, PowerLaw  # noqa: E402


def _law(values: dict[str, float]) -> PowerLaw:
    return PowerLaw(values["coefficient"], values["exponent"])


def _by_budget(results: list[dict[str, Any]], study: str) -> dict[float, list[dict[str, Any]]]:
    groups: dict[float, list[dict[str, Any]]] = defaultdict(list)
    for r in results:
        if r["study"] == study:
            groups[r["budget"]].append(r)
    return dict(sorted(groups.items()))


def plot_isoflop(results: list[dict[str, Any]], fitted: dict[str, Any], path: Path) -> Path | None:
    groups = _by_budget(results, "isoflop")
    if not groups:
        return None
    optima = {o["budget"]: o for o in fitted.get("allocation", {}).get("optima", [])}
    fig, ax = plt.subplots(figsize=(6, 4.5))
    for budget, runs in groups.items():
        runs = sorted(runs, key=lambda r: r["model_scale"])
        m, loss = [r["model_scale"] for r in runs], [r["loss"] for r in runs]
        (line,) = ax.plot(m, loss, "o", label=f"C = {budget:.1e} FLOPs")
        coef = np.polyfit(np.log(m), loss, 2) if len(runs) >= 3 else None
        if coef is not None:
            grid = np.geomspace(min(m), max(m), 50)
            ax.plot(grid, np.polyval(coef, np.log(grid)), "-", color=line.get_color(), alpha=0.6)
        if budget in optima:
            # the optimum is a model scale: drawn where the curve is at that scale (a "near_optimal"
            # estimate pairs the mean scale of the near-best runs with the best loss, which sits
            # below any curve through them)
            m_opt = optima[budget]["values"]["model_scale"]
            y = float(np.polyval(coef, np.log(m_opt))) if coef is not None else float(np.interp(m_opt, m, loss))
            ax.plot(m_opt, y, "*", ms=14, color=line.get_color())
    ax.set(xscale="log", xlabel="model scale M (non-embedding FLOPs / token)", ylabel="held-out loss (nats)",
           title="IsoFLOP curves (star: the fitted optimal M, on its curve)")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def plot_optima(fitted: dict[str, Any], path: Path) -> Path | None:
    panels = []
    if "allocation" in fitted:
        a = fitted["allocation"]
        c = [o["budget"] for o in a["optima"]]
        panels += [("M_opt (FLOPs / token)", c, [o["values"]["model_scale"] for o in a["optima"]],
                    _law(a["model_scale"]), PAPER_MODEL_SCALE, a.get("bootstrap", {}).get("model_scale")),
                   ("D_opt (tokens)", c, [b / o["values"]["model_scale"] for b, o in zip(c, a["optima"])],
                    _law(a["data_scale"]), PAPER_DATA_SCALE, a.get("bootstrap", {}).get("data_scale"))]
    if "hparams" in fitted:
        h = fitted["hparams"]
        c = [o["budget"] for o in h["optima"]]
        panels += [("B_opt (tokens)", c, [o["values"]["batch_tokens"] for o in h["optima"]],
                    _law(h["batch_tokens"]), PAPER_BATCH, h.get("bootstrap", {}).get("batch_tokens")),
                   ("lr_opt", c, [o["values"]["lr"] for o in h["optima"]], _law(h["lr"]), PAPER_LR,
                    h.get("bootstrap", {}).get("lr"))]
    if not panels:
        return None
    fig, axes = plt.subplots(1, len(panels), figsize=(4.2 * len(panels), 3.8), squeeze=False)
    for ax, (label, c, values, law, paper, samples) in zip(axes[0], panels):
        grid = np.geomspace(min(c) / 2, max(c) * 2, 50)
        ax.plot(c, values, "o", label="sweep optima")
        if samples:  # the band the bootstrap's refits span (5-95% at each C)
            band = LawSamples.from_dict(samples)
            low, high = zip(*(band.value_interval(x) for x in grid))
            ax.fill_between(grid, low, high, alpha=0.2, label="5-95% bootstrap band")
        ax.plot(grid, [law(x) for x in grid], "-", label=f"fit {law.coefficient:.3g} C^{law.exponent:.3f}")
        ax.plot(grid, [paper(x) for x in grid], "--", label=f"paper {paper.coefficient:.4g} C^{paper.exponent:.4f}")
        ax.set(xscale="log", yscale="log", xlabel="compute C = M D (FLOPs)", ylabel=label,
               title=f"{label.split(' (')[0]} against compute")
        for axis in (ax.xaxis, ax.yaxis):  # minor-tick labels of a short log range overlap
            axis.set_minor_formatter(NullFormatter())
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def plot_hparam_landscape(results: list[dict[str, Any]], fitted: dict[str, Any], path: Path) -> Path | None:
    groups = _by_budget(results, "hparams")
    if not groups:
        return None
    optima = {o["budget"]: o for o in fitted.get("hparams", {}).get("optima", [])}
    fig, axes = plt.subplots(1, len(groups), figsize=(4.5 * len(groups), 3.8), squeeze=False)
    for ax, (budget, runs) in zip(axes[0], groups.items()):
        batches = sorted({r["batch_tokens"] for r in runs})
        lrs = sorted({r["lr"] for r in runs})
        grid = np.full((len(lrs), len(batches)), np.nan)
        for r in runs:
            grid[lrs.index(r["lr"]), batches.index(r["batch_tokens"])] = r["loss"]
        image = ax.pcolormesh(np.arange(len(batches) + 1) - 0.5, np.arange(len(lrs) + 1) - 0.5, grid, cmap="viridis_r")
        for (i, j), value in np.ndenumerate(grid):
            ax.text(j, i, f"{value:.3f}", ha="center", va="center", fontsize=7, color="w")
        if budget in optima:  # the optimum in grid coordinates (log-interpolated)
            o = optima[budget]["values"]
            x = np.interp(np.log(o["batch_tokens"]), np.log(batches), np.arange(len(batches)))
            y = np.interp(np.log(o["lr"]), np.log(lrs), np.arange(len(lrs)))
            ax.plot(x, y, "r*", ms=14)
        ax.set_xticks(range(len(batches)), [str(b) for b in batches])
        ax.set_yticks(range(len(lrs)), [f"{lr:.0e}" for lr in lrs])
        ax.set(xlabel="batch (tokens)", ylabel="peak lr", title=f"held-out loss at C = {budget:.1e} FLOPs (star: optimum)")
        fig.colorbar(image, ax=ax, label="held-out loss (nats)")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def write_plots(results: list[dict[str, Any]], fitted: dict[str, Any], out_dir: Path) -> list[Path]:
    """Write whichever plots the results support; return their paths."""
    out_dir = Path(out_dir)
    written = [plot_isoflop(results, fitted, out_dir / "isoflop.png"), plot_optima(fitted, out_dir / "optima.png"),
               plot_hparam_landscape(results, fitted, out_dir / "hparam_landscape.png")]
    return [p for p in written if p is not None]
