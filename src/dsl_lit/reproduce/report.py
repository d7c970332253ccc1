"""One report of a reproduction: ``report.md`` with its PNGs beside it (readable on GitHub),
drawn from the stages' completion markers and metrics.csv files alone.

Per stage the curves a reader of the papers knows (loss with and without MTP, expert load with
and without the bias update, with the ablations' spread over seeds, the batch ramp, passkey accuracy by length before and after YaRN,
GRPO reward and held-out accuracy, the R1 models' accuracy), lm-eval on every checkpoint, and the
papers' statements beside what was measured (:mod:`dsl_lit.reproduce.claims`).
"""

from __future__ import annotations

import json
import shutil
import statistics
from pathlib import Path
from typing import Any

import matplotlib.pyplot as plt

from dsl_lit.config.reproduce import ReproduceConfig
from dsl_lit.config.reproduce_stages import ABLATIONS, CONTEXT_LENGTHS, STAGE_ROWS
from dsl_lit.report.figures import plot_lines, save_figure
from dsl_lit.report.metrics import METRICS_FILE, Series, read_metrics
from dsl_lit.reproduce.claims import claims_table
from dsl_lit.reproduce.runner import marker, skipped
from dsl_lit.tasks.passkey import KEY_WORDS
from dsl_lit.utils.machine import machine_description

R1_MODELS = ("cold_start", "grpo", "sft_rs", "distill")
EVAL_METRICS = ("acc", "acc_norm", "exact_match", "bits_per_byte")
"""The bundled tasks' metrics the lm-eval table shows (not sample counts or derived perplexities)."""


def _series(run_dir: Path, stage: str) -> dict[str, Series]:
    path = run_dir / stage / METRICS_FILE
    return read_metrics(path) if path.is_file() else {}


def _plot(out: Path, name: str, title: str, ylabel: str, curves: list[tuple[str, Series | None]]) -> str | None:
    """Lines of several runs in one figure (the run report's line plot, one series per label)."""
    series = {label: s for label, s in curves if s is not None and len(s.steps)}
    path = plot_lines(series, list(series), out / name, title, ylabel)
    return path.name if path else None


def _bars(out: Path, name: str, title: str, ylabel: str, groups: dict[str, dict[str, float]]) -> str | None:
    """Grouped bars: one group per x label, one bar per series."""
    if not groups:
        return None
    labels = list(dict.fromkeys(x for g in groups.values() for x in g))  # as given (the R1 models in pipeline order)
    if all(x.isdigit() for x in labels):
        labels.sort(key=int)  # context lengths
    width = 0.8 / len(groups)
    fig, ax = plt.subplots(figsize=(6.4, 3.6))
    for i, (series, values) in enumerate(groups.items()):
        xs = [j + i * width for j in range(len(labels))]
        bars = ax.bar(xs, [values.get(x, 0.0) for x in labels], width, label=series)
        ax.bar_label(bars, [f"{values[x]:.0%}" if x in values else "n/a" for x in labels], fontsize=8)  # 0% shows too
    ax.set_xticks([j + width * (len(groups) - 1) / 2 for j in range(len(labels))], labels)
    ax.set(ylabel=ylabel, title=title, ylim=(0, 1.1))
    ax.grid(alpha=0.3, axis="y")
    ax.legend()
    return save_figure(fig, out / name).name


def _image(name: str | None, alt: str) -> str:
    return f"![{alt}]({name})\n" if name else f"_{alt}: not drawn (the stage did not run or logged nothing)_\n"


def _table(header: list[str], rows: list[list[Any]]) -> str:
    def cell(v: Any) -> str:
        return f"{v:.4g}" if isinstance(v, float) else str(v)
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(cell(v) for v in row) + " |" for row in rows]
    return "\n".join(lines) + "\n"


def _spread(values: list[float | None]) -> str:
    """``mean +- sd`` over seeds (sd of one value: none)."""
    known = [v for v in values if v is not None]
    if not known:
        return "-"
    sd = f" +- {statistics.stdev(known):.3g}" if len(known) > 1 else ""
    return f"{statistics.fmean(known):.4g}{sd}"


def _minutes(seconds: float) -> str:
    return f"{int(seconds // 60)} min {int(seconds % 60):02d} s"


def write_report(run_dir: Path, out: Path, cfg: ReproduceConfig) -> Path:
    out.mkdir(parents=True, exist_ok=True)
    results_of = [row.name for row in STAGE_ROWS if not row.redrawn]  # the stages with results (not the report)
    done = {s: m for s in results_of if (m := marker(run_dir / s)) is not None}
    r = {s: m["results"] for s, m in done.items()}
    skipped_here = [s for s in done if skipped(r[s])]
    md = [f"# DeepSeek in miniature: `reproduce={cfg.name}`\n",
          f"Machine: {machine_description()}.\n",
          f"Stages finished: {len(done) - len(skipped_here)} of {len(results_of)} (the report is the last)"
          + (f", skipped here: {', '.join(skipped_here)}" if skipped_here else "") + "; their time: "
          f"{_minutes(sum(m['seconds'] for m in done.values()))} in all.\n"]
    md.append(_table(["stage", "seconds"], [[s, "skipped" if s in skipped_here else done[s]["seconds"] if s in done else "not run"]
                                            for s in results_of]))

    md.append("\n## What the papers say, and what this run measured\n")
    md.append(_table(["statement", "paper", "measured here", "verdict"],
                     [list(row) for row in claims_table(done)]))

    md.append("\n## 1. Scaling laws (DeepSeek LLM)\n")
    if "scaling" in r:
        hp = r["scaling"]
        for png in ("hparam_landscape.png", "optima.png", "isoflop.png"):
            source = run_dir / "scaling" / "sweep" / png
            if source.is_file():
                shutil.copyfile(source, out / f"scaling_{png}")
                md.append(_image(f"scaling_{png}", png))
        def interval(key: str) -> str:
            low_high = hp.get(key)
            return f"[{low_high[0]:.3g}, {low_high[1]:.3g}]" if low_high else "-"

        used = "used (clamped to the preset's ranges)" if hp.get("clamped") else "used (the fit's, unclamped)"
        md.append(_table(["", "batch (sequences)", "peak lr"], [
            ["fitted law at C = M D", hp["batch_fit_sequences"], hp["lr_fit"]],
            ["its 5-95% bootstrap interval", interval("batch_interval_sequences"), interval("lr_interval")],
            ["the paper's law at the same C", hp["paper_batch_sequences"], hp["paper_lr"]],
            [used, hp["global_batch_size"], hp["lr"]]]))
        rounds = hp.get("runs_per_round", {})
        md.append(f"\nC = M D = {hp['model_scale_M']:.3g} FLOPs/token x {hp['tokens_D']:,} tokens = {hp['compute_C']:.3g} "
                  f"FLOPs; laws from: {hp['source']}; {hp['max_steps']} steps with the ramp "
                  f"{hp['ramp_start']} -> {hp['global_batch_size']} sequences over {hp['ramp_tokens']:,} tokens.\n")
        if rounds:
            settings = "; ".join(f"C={c:.3g}: {int(b)} sequence(s), lr {lr:.3g}" for c, b, lr in hp.get("isoflop_hparams", []))
            md.append("\nDesign: the lr x batch grid at each budget, extended one step beyond any edge its best run sat "
                      "on (runs per round: " + ", ".join(f"{study} {rounds[study]}" for study in rounds) + "); then "
                      f"the IsoFLOP models at the batch and lr the fitted laws give each budget ({settings}). Each "
                      "law's interval: 200 refits on the runs resampled with replacement within each budget. An "
                      "optimum left on its grid's edge (below) is a bound on the true one: a law is judged only where "
                      "no such bound could reverse its verdict (a low edge below the budgets' mean log C can only "
                      "steepen a growing law, one above it could flatten it).\n")
        for edge in hp.get("edge_optima", []):
            md.append(f"- grid edge left: {edge}\n")

    md.append("\n## 2. Data pipeline\n")
    if "data" in r:
        d = r["data"]
        fim = d.get("fim", {"rate": 0.1, "spm_rate": 0.5})  # (markers written before the key: the pipeline's)
        source = (f"The pipeline did not run (`reproduce.data_build`): every stage read the build `{d['build']}`, "
                  f"made by the stages {', '.join(d['stages'])}. ") if d.get("build") else ""
        counts = f"{d['documents_in']:,} documents in, " if d.get("documents_in") is not None else ""
        md.append(f"{source}{counts}{d['documents_out']:,} kept; removed by reason: "
                  + (", ".join(f"{k} {v}" for k, v in sorted(d["removed"].items())) or "none")
                  + (f". FIM rate {fim['rate']:g} ({fim['spm_rate']:.0%} of it SPM).\n" if fim else ". No FIM.\n"))

    md.append("\n## 3. Pretraining (DeepSeek-V3 tiny) and its ablations\n")
    pre = _series(run_dir, "pretrain")
    first = {name: _series(run_dir, f"ablations/{name}/seed0") for name, _ in ABLATIONS}
    md.append(_image(_plot(out, "pretrain_loss.png", "ablations, first seed: main-token loss by step, with and without MTP",
                           "cross-entropy (nats)",
                           [("train, MTP", first["baseline"].get("train/loss")),
                            ("train, no MTP", first["no_mtp"].get("train/loss")),
                            ("val, MTP", first["baseline"].get("val/loss")), ("val, no MTP", first["no_mtp"].get("val/loss"))]),
                     "loss"))
    md.append(_image(_plot(out, "expert_load.png", "ablations, first seed: expert load by step (max/mean over experts, "
                           "mean over MoE layers)", "max / mean (1 = even)",
                           [("bias update", first["baseline"].get("moe/load_max_over_mean")),
                            ("bias update, no MTP", first["no_mtp"].get("moe/load_max_over_mean")),
                            ("no bias update", first["no_bias"].get("moe/load_max_over_mean"))]), "expert load"))
    md.append(_image(_plot(out, "batch_ramp.png", "pretraining: global batch by step", "sequences per step",
                           [("global batch", pre.get("train/global_batch_size"))]), "batch ramp"))
    rows = [[s, r[s].get("steps"), r[s].get("train_loss"), r[s].get("val_loss"), r[s].get("val_step"),
             r[s].get("load_max_over_mean")] for s in ("pretrain",) if s in r]
    md.append(_table(["run", "steps", "train loss (last 10%)", "val loss (last validation)", "validated after step",
                      "load max/mean (last 20%)"], rows))
    if "ablations" in r:
        ab = r["ablations"]
        md.append(f"\nAblations: {len(ab['seeds'])} seeds ({', '.join(map(str, ab['seeds']))}) per variant, "
                  f"{ab['steps']} steps each (the pretraining's schedule, shortened); mean +- sample sd over seeds:\n")
        md.append(_table(["variant", "val loss", "train loss (last 10%)", "load max/mean (last 20%)"],
                         [[name, *(_spread([run[key] for run in ab["variants"][name]])
                                   for key in ("val_loss", "train_loss", "load_max_over_mean"))]
                          for name, _ in ABLATIONS if name in ab["variants"]]))

    md.append("\n## 4. Context extension (YaRN) and passkey retrieval\n")
    rows = [[s, r[s].get("steps"), r[s].get("train_loss")] for s in ("context_base", "yarn") if s in r]
    if rows:
        md.append("Design: YaRN extends a base that retrieves at its own length. The pretrained DeepSeek-V3 tiny "
                  "above does not (a tiny model learns retrieval abruptly, after ~1,000-1,600 steps of passkey "
                  "documents, the step moving with the seed), so a small DeepSeek-V3 (2 layers of width 128) is "
                  "pretrained on passkey documents at 128 tokens (`experiment=cpu_context_128`) until an "
                  "in-training probe (its own prompts, not the ones scored below) retrieves the share set in "
                  "advance (`eval.passkey.stop_at`, capped at the experiment's steps), then extended x4 with YaRN "
                  "and trained briefly at 512 tokens (`experiment=cpu_context_512`), as DeepSeek-V3 extends "
                  "4K -> 32K; steps below.\n")
        base = r.get("context_base", {})
        if base.get("probe"):
            step, share = base["probe"][-1]
            reached = base.get("stop_at") is not None and share >= base["stop_at"]
            md.append(f"The base's probe retrieved {share:.0%} at step {step} "
                      f"({'its stop' if reached else 'the cap, below its stop'} at {base.get('stop_at', 0):.0%}; "
                      f"its probes below, a guess being right on 1 prompt in {len(KEY_WORDS)}).\n")
            probe = _series(run_dir, "context_base").get(f"eval/passkey/{CONTEXT_LENGTHS[0]}")
            md.append(_image(_plot(out, "context_base_probe.png",
                                   f"context base: passkey retrieval at {CONTEXT_LENGTHS[0]} tokens while training",
                                   "share retrieved (probe prompts)", [("probe", probe)]), "context base probe"))
        md.append(_table(["run", "steps", "train loss (last 10%)"], rows))
    if "passkey" in r:
        acc = r["passkey"]["accuracy"]
        before, after = acc["context_base"], acc["yarn"]
        md.append(_image(_bars(out, "passkey.png", "passkey retrieval by prompt length (tokens), same prompts",
                               "accuracy (share retrieved)", {"base, plain RoPE": before, "after YaRN x4": after}),
                         "passkey"))
        md.append(_table(["prompt length (tokens)", "base (plain RoPE past its length)", "after YaRN"],
                         [[n, before.get(n), after.get(n)] for n in sorted(after, key=int)]))

    md.append("\n## 5. The R1 pipeline\n")
    grpo = _series(run_dir, "grpo")
    md.append(_image(_plot(out, "grpo.png", "GRPO: reward and held-out accuracy by step", "reward / share correct",
                           [("reward/mean", grpo.get("reward/mean")), ("reward/accuracy", grpo.get("reward/accuracy")),
                            ("held-out accuracy", grpo.get("eval/accuracy"))]), "GRPO"))
    accuracy = {s: r[s]["eval_accuracy"] for s in R1_MODELS if s in r and r[s].get("eval_accuracy") is not None}
    shortcut, blind = r.get("cold_start", {}).get("shortcut_accuracy"), r.get("cold_start", {}).get("blind")
    if accuracy and shortcut is not None:  # the rule a model that learned only the shortcut would score
        accuracy = {"shortcut rule": shortcut, **accuracy}
    if accuracy and blind:  # and one answer for every list, reading none
        accuracy = {f"always \"{blind['answer']}\"": blind["accuracy"], **accuracy}
    md.append(_image(_bars(out, "r1_accuracy.png", "held-out greedy accuracy, in pipeline order",
                           "accuracy (share correct)", {"accuracy": accuracy}), "R1 accuracy"))
    md.append(_table(["model", "held-out accuracy"], [[s, a] for s, a in accuracy.items()]))
    if "rejection_sample" in r:
        rs = r["rejection_sample"]
        md.append(f"\nRejection sampling kept {rs.get('kept')} of {rs.get('sampled', rs.get('samples'))} samples.\n")

    md.append("\n## 6. lm-eval on each checkpoint\n")
    if "evaluate" in r and skipped(r["evaluate"]):
        md.append(f"_Not run on this machine: {r['evaluate']['skipped']}._\n")
    elif "evaluate" in r:
        scores = r["evaluate"]["scores"]
        columns = sorted({(t, m) for s in scores.values() for t, ms in s.items() for m in ms if m in EVAL_METRICS})
        md.append(_table(["checkpoint", *[f"{t} {m}" for t, m in columns]],
                         [[s, *[scores[s].get(t, {}).get(m, "") for t, m in columns]] for s in scores]))
    path = out / "report.md"
    path.write_text("\n".join(md))
    (out / "results.json").write_text(json.dumps(r, indent=2, default=str))
    return path
