"""The stages of DeepSeek's method in miniature and how each feeds the next.

scaling (DeepSeek LLM's lr x batch sweep, fitted laws) -> data (the pipeline on the bundled corpus,
FIM packing; or a finished build, ``reproduce.data_build``, where the pipeline cannot run) ->
pretrain (DeepSeek-V3 tiny at the fitted lr and batch, with the batch ramp, MTP and bias
balancing) and ablations (with and without MTP, without the bias update, each over seeds);
context_base (a small DeepSeek-V3 that learns passkey retrieval at 128 tokens) -> yarn (its context
extension x4) -> passkey (retrieval by length, before and after) -> the R1
pipeline from the pretrained checkpoint: cold_start (SFT) -> grpo -> rejection_sample ->
sft_rs (SFT of the pretrained model on the kept samples) -> distill (a smaller student on the GRPO
model's verified samples) -> evaluate (lm-eval on each stage's checkpoint) -> report.

Every model stage is one of the project's recipes, run with its checkpoint directory as
``init_from``; what a stage measured is kept in its completion marker for the next stages and the
report.
"""

from __future__ import annotations

import functools
import importlib
import json
import logging
import math
import shutil
from pathlib import Path
from typing import Any

import yaml

from data_contract.errors import ConfigError
from dsl_lit.config.model import ModelConfig
from dsl_lit.config.reproduce import ReproduceConfig
from dsl_lit.config.reproduce_stages import ABLATIONS, CONTEXT_LENGTHS, EVALUATED, STAGE_ROWS, WITHOUT_MTP
from dsl_lit.report.metrics import METRICS_FILE, Series, read_metrics
from dsl_lit.reproduce.runner import (
    PROJECT_ROOT,
    Stage,
    StageContext,
    StageFailed,
    marker,
    path_override,
    write_marker,
)
from dsl_lit.tasks.held_out import read_outcomes

PIPELINE_STAGES = "[normalize,exact_dedup,near_dedup,quality_filter,language_filter,decontaminate,train_tokenizer,tokenize_pack]"
PRETRAIN_MODEL = "deepseek_v3_tiny"
V3_INIT_STD, V3_D_MODEL = 0.006, 7168


def pretrain_init_std() -> float:
    """The pretrained model's initial weights' std: DeepSeek-V3's 0.006, stated for width 7168, scaled to
    the tiny model's 256 as a fan-in init scales (std x sqrt(7168 / 256) = 0.0317), so a router's logits
    start as spread out across experts as V3's do. At 0.006 itself they start ~5x flatter: every
    ablation run's routing collapsed onto 4 of the 16 experts within 10 steps (load max/mean 3.9-4.0 of
    at most 4), and each run's loss then depended on when it left that collapse (seeds 1234-1236, 90
    steps, 2-core AMD EPYC, 2026-11-29): validation 5.32 / 5.33 / 5.53 with MTP and the bias update,
    5.81 / 5.77 / 6.03 without MTP (still collapsed at step 65), 5.17 / 5.09 / 5.88 without the bias
    update; the same run without MTP at lr 4.09e-3 instead of 3.76e-3 left the collapse by step 50 and
    ended at 5.23. So the bias's paired loss cost scattered +0.53% +- 5.70% (+1.49% +- 1.20% on a Xeon)
    and MTP's effect flipped sign between machines. At 0.0317 (same runs): 4.936 / 4.927 / 4.921 with
    both, 4.982 / 4.936 / 4.967 without MTP, 4.968 / 4.950 / 4.941 without the bias update: its cost
    -0.50% +- 0.12% (reproduced), MTP's effect +0.034 +- 0.021 (margin 0.036), the load 1.35 against 3.48,
    every run out of the collapse by step ~40; the pretraining's validation loss 4.68 (~5.0 at 0.006),
    and the R1 stages from it: cold start 76%, GRPO 100%, SFT on its samples 100%, the student 100%."""
    return round(V3_INIT_STD * (V3_D_MODEL / ModelConfig.from_name(PRETRAIN_MODEL).d_model) ** 0.5, 4)


FIM = {"rate": 0.1, "spm_rate": 0.5, "seed": 1234}
"""DeepSeek-V3's FIM rate 0.1 (PSM and SPM); the seed is data.seed's default, which the data module checks."""
R1_TASK = ("task=largest", "task.num_problems=2300", "task.eval_problems=400", "task.uniform_largest=true")
""""The largest of 6 0 4 8": a skill, held-out lists test it (conf/task/largest.yaml). The sizes are
given so that every R1 stage (distill.yaml sets its own) scores the same held-out lists. 400 of
them, not 100: with 100 the paired bootstrap's 5-95% interval of a stage's gain was ~10 points wide
(measured 2026-11-28: SFT on the kept samples minus 80% of GRPO's accuracy, +4.8 [-0.4, +10.0]),
wider than the effects the R1 claims compare; 4x the problems halve it. Lists drawn around their
largest number (``task.uniform_largest``): with every digit uniform, "9" was the answer to 36% of the
held-out lists, and GRPO's held-out gain came from answering "9" more often (measured 2026-11-28,
:func:`blind_baseline`); drawn this way the most frequent answer is right on ~22% of them, below
the shortcut rule the cold start imitates (31%), so drifting to a constant no longer pays."""

log = logging.getLogger(__name__)


def missing_module(name: str) -> str | None:
    """Why ``name`` cannot be imported (None: it can): a package a stage needs that this machine lacks."""
    try:
        importlib.import_module(name)
    except ImportError as error:
        return str(error)
    return None


# ----------------------------------------------------------------------------------------------
# What a finished run measured

def last_value(series: dict[str, Series], key: str) -> float | None:
    s = series.get(key)
    return float(s.values[-1]) if s is not None and len(s.values) else None


def tail_mean(series: dict[str, Series], key: str, share: float = 0.2) -> float | None:
    """Mean over the last ``share`` of the logged points: a smoother end value than the last one."""
    s = series.get(key)
    if s is None or not len(s.values):
        return None
    return float(s.values[-max(1, math.ceil(len(s.values) * share)):].mean())


def head_mean(series: dict[str, Series], key: str, share: float = 0.2) -> float | None:
    """Mean over the first ``share`` of the logged points."""
    s = series.get(key)
    if s is None or not len(s.values):
        return None
    return float(s.values[:max(1, math.ceil(len(s.values) * share))].mean())


def run_summary(run_dir: Path) -> dict[str, Any]:
    """End numbers of a training run from its metrics.csv (whose step column is the 0-based index
    of the optimizer step: a 90-step run's last row is step 89, which the report printed as its
    length)."""
    series = read_metrics(run_dir / METRICS_FILE)
    return {"steps": int(max(s.steps.max() for s in series.values())) + 1 if series else 0,
            "train_loss": tail_mean(series, "train/loss", 0.1), "val_loss": last_value(series, "val/loss"),
            "val_step": int(series["val/loss"].steps[-1]) + 1 if "val/loss" in series else None,
            "mtp_loss": tail_mean(series, "train/mtp_loss", 0.1),
            "load_max_over_mean": tail_mean(series, "moe/load_max_over_mean"),
            "eval_accuracy": last_value(series, "eval/accuracy"),
            "first_eval_accuracy": float(series["eval/accuracy"].values[0]) if "eval/accuracy" in series else None,
            "tokens_seen": last_value(series, "perf/tokens_seen"),
            "held_out_outcomes": read_outcomes(run_dir)}


# ----------------------------------------------------------------------------------------------
# scaling: the sweep, then the pretraining's batch and lr from the fitted laws

def model_overrides(overrides: list[str]) -> dict[str, Any]:
    """``model.<field>`` values among Hydra overrides (``+``/``++`` prefixes allowed)."""
    pairs = ((k.lstrip("+"), v) for k, v in (o.split("=", 1) for o in overrides))
    return {k[len("model."):]: yaml.safe_load(v) for k, v in pairs if k.startswith("model.")}


def pretraining_hparams(laws: dict[str, Any], cfg: ReproduceConfig) -> dict[str, Any]:
    """Batch (sequences), peak lr, batch ramp and steps of the pretraining for its budget C = M D,
    from the sweep's fitted laws (or the paper's, when the sweep fitted none), unclamped unless the
    preset names ``batch_range`` / ``lr_range`` (the smoke test): the batch is only rounded to a
    whole number of micro-batches (at least one). Beside each, the bootstrap's
    5-95% interval of the extrapolated value, which says how far a toy sweep's law can be trusted
    decades above its budgets."""
    from dsl_lit.config.data import BatchRampConfig, BatchSchedule
    from dsl_lit.scaling.bootstrap import LawSamples
    from dsl_lit.scaling.laws import PAPER_BATCH, PAPER_LR, PowerLaw, model_scale

    model = ModelConfig.from_name(PRETRAIN_MODEL, **model_overrides(cfg.overrides.get("pretrain", [])))
    m = model_scale(model, cfg.seq_len)
    c = m * cfg.pretrain_tokens
    fitted = laws.get("hparams")
    batch_law = PowerLaw(**fitted["batch_tokens"]) if fitted else PAPER_BATCH
    lr_law = PowerLaw(**fitted["lr"]) if fitted else PAPER_LR
    intervals = {}
    for name, scale in (("batch_tokens", 1.0 / cfg.seq_len), ("lr", 1.0)):
        if fitted and name in fitted.get("bootstrap", {}):
            low, high = LawSamples.from_dict(fitted["bootstrap"][name]).value_interval(c)
            intervals[name] = [low * scale, high * scale]
    micro = cfg.micro_batch_size
    batch_fit, lr_fit = batch_law(c) / cfg.seq_len, float(lr_law(c))
    fitted_batch = max(micro, round(batch_fit / micro) * micro)
    batch, lr = fitted_batch, lr_fit
    if cfg.batch_range is not None:
        batch = int(min(max(batch, cfg.batch_range[0]), cfg.batch_range[1]))
    if cfg.lr_range is not None:
        lr = float(min(max(lr, cfg.lr_range[0]), cfg.lr_range[1]))
    start = max(micro, int(batch * cfg.ramp_start_fraction) // micro * micro)
    ramp = BatchRampConfig(start=start, tokens=int(cfg.pretrain_tokens * cfg.ramp_fraction), increment=micro) \
        if start < batch and cfg.ramp_fraction > 0 else BatchRampConfig()
    schedule, consumed, steps = BatchSchedule(batch, cfg.seq_len, ramp), 0, 0
    while consumed * cfg.seq_len < cfg.pretrain_tokens:
        consumed, steps = schedule.advance(consumed, 1), steps + 1
    return {"source": "fit" if fitted else "paper (the sweep fitted no hparam law)", "model_scale_M": m,
            "compute_C": c, "tokens_D": cfg.pretrain_tokens, "batch_law": batch_law.to_dict(), "lr_law": lr_law.to_dict(),
            "batch_fit_sequences": batch_fit, "batch_interval_sequences": intervals.get("batch_tokens"),
            "lr_fit": lr_fit, "lr_interval": intervals.get("lr"), "paper_batch_sequences": PAPER_BATCH(c) / cfg.seq_len,
            "paper_lr": PAPER_LR(c), "global_batch_size": batch, "lr": lr,
            "clamped": batch != fitted_batch or lr != lr_fit, "ramp_start": ramp.start,
            "ramp_tokens": ramp.tokens, "max_steps": steps, "edge_optima": laws.get("edge_optima", [])}


def _sweep_plan(overrides: list[str]) -> tuple[Any, int]:
    """The sweep's settings as ``recipes/scaling_laws.py`` composes them with ``overrides``."""
    from hydra import compose, initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra

    from dsl_lit.config.resolvers import register_resolvers
    from dsl_lit.scaling.sweep import register_resolver, sweep_from_config

    register_resolver()
    register_resolvers()
    task = [o for o in overrides if not o.lstrip("~+").startswith("hydra.")]
    if GlobalHydra.instance().is_initialized():
        return sweep_from_config(compose("scaling_laws", overrides=task))
    with initialize_config_dir(str(PROJECT_ROOT / "conf"), version_base="1.3"):
        return sweep_from_config(compose("scaling_laws", overrides=task))


def _split(points: list[Any], indices: list[int], parts: int) -> list[list[int]]:
    """Runs shared out so each part has about the same optimizer steps (longest first, each to the
    least loaded part)."""
    loads: list[tuple[int, list[int]]] = [(0, []) for _ in range(max(1, min(parts, len(indices))))]
    for index in sorted(indices, key=lambda i: -points[i].steps):
        load, members = min(loads, key=lambda part: part[0])
        loads[loads.index((load, members))] = (load + points[index].steps, [*members, index])
    return [sorted(members) for _, members in loads if members]


def scaling(ctx: StageContext) -> dict[str, Any]:
    """DeepSeek LLM's two studies in turn, as the paper runs them: the lr x batch grid, then the
    IsoFLOP runs at the batch and lr the fitted hyperparameter laws give each budget. Each study's
    runs are shared out over ``reproduce.concurrent_runs`` processes (one core each); where a
    budget's best run sits on an edge of its grid, the runs one step beyond it follow, up to
    ``sweep.extension_rounds`` times (:func:`~dsl_lit.scaling.grid_edges.grid_extensions`); then one
    fit over every run. The sweep's tiny models read reproduce.data_build when it is given (their
    own 2048-token build of the bundled corpus would need the pipeline)."""
    from dsl_lit.scaling.grid_edges import grid_extensions
    from dsl_lit.scaling.laws import PowerLaw
    from dsl_lit.scaling.sweep import collect_results, fit_results, fit_sweep_dir
    from dsl_lit.scaling.sweep_plan import plan_overrides, sweep_points, with_isoflop_hparams

    sweep_dir = ctx.dir / "sweep"
    data = build_arguments(ctx.cfg) if ctx.cfg.data_build else []
    base = [path_override("hydra.sweep.dir", sweep_dir), "~hydra.callbacks.fit", *data,
            f"trainer.accelerator={ctx.cfg.accelerator}", *seed_arguments(ctx.cfg)]
    sweep, seq_len = _sweep_plan([*base, *ctx.cfg.overrides.get("scaling", [])])
    runs: dict[str, list[int]] = {}
    for study in ("hparams", "isoflop"):
        if study == "isoflop":
            laws = fit_results(collect_results(sweep_dir)).get("hparams")
            if laws:  # the paper's near-optimal settings for each IsoFLOP budget
                sweep = with_isoflop_hparams(sweep, PowerLaw(**laws["batch_tokens"]), PowerLaw(**laws["lr"]), seq_len)
        runs[study] = []
        for round_index in range(sweep.extension_rounds + 1):
            done = {r.get("name") for r in collect_results(sweep_dir)}
            points = sweep_points(sweep, seq_len)
            todo = [i for i, p in enumerate(points) if p.study == study and p.name not in done]
            if not todo:
                break
            parts = _split(points, todo, ctx.cfg.concurrent_runs)
            plan = plan_overrides(sweep)
            ctx.run_all([[str(PROJECT_ROOT / "recipes" / "scaling_laws.py"), *base, *plan,
                          f"hydra.sweeper.params.point=\"{','.join(map(str, part))}\""] for part in parts],
                        concurrent=len(parts),
                        log_paths=[ctx.dir / f"{study}_round{round_index}_part{k}.log" for k in range(len(parts))])
            runs[study].append(len(todo))
            sweep = grid_extensions(collect_results(sweep_dir), sweep, seq_len, studies=(study,))
    laws = fit_sweep_dir(sweep_dir)
    return {"laws": laws, "runs_per_round": runs, "isoflop_hparams": sweep.isoflop_hparams,
            **pretraining_hparams(laws, ctx.cfg)}


# ----------------------------------------------------------------------------------------------
# data and pretraining

def data(ctx: StageContext) -> dict[str, Any]:
    if ctx.cfg.data_build:
        build = carried_build(ctx.cfg.data_build)
        packed, fim = build["settings"], build["fim"]
        why = "" if missing_module("datasets") is None else "; it needs datasets, which is not installed here"
        log.info("data: the pipeline does not run (reproduce.data_build is set%s): every stage reads the build %s "
                 "(stages %s; %s documents, %s tokens; FIM %s)", why, packed["cache_dir"], ", ".join(build["stages"]),
                 f"{build['documents']:,}", f"{build['tokens']:,}", fim or "none")
        stats = Path(packed["cache_dir"]) / "stats.json"
        counts = pipeline_stats(stats) if stats.is_file() else {"documents_in": None, "documents_out": build["documents"],
                                                                 "removed": {}, "bytes_out": None}
        return {**counts, "build": packed["cache_dir"], "stages": build["stages"], "fim": fim, "tokens": build["tokens"]}
    out = data_dir(ctx)
    ctx.module("data_pipeline", [path_override("input.path", PROJECT_ROOT / "data" / "corpus"), path_override("output_dir", out),
                                 "quality_filter=bundled", "tokenizer=bundled", f"stages={PIPELINE_STAGES}",
                                 f"pack.fim_rate={FIM['rate']}", f"pack.fim_spm_rate={FIM['spm_rate']}",
                                 f"pack.fim_seed={FIM['seed']}"])
    return {**pipeline_stats(out / "stats.json"), "fim": FIM}


def pipeline_stats(path: Path) -> dict[str, Any]:
    """Documents in and out of a pipeline run and the removed ones by reason, from its stats.json."""
    stats = json.loads(path.read_text())
    removed: dict[str, int] = {}
    for stage in stats["stages"].values():
        for reason, count in stage.get("removed", {}).items():
            removed[reason.split(":")[0]] = removed.get(reason.split(":")[0], 0) + count
    return {"documents_in": stats["input"]["documents"], "documents_out": stats["output"]["documents"],
            "removed": removed, "bytes_out": stats["output"]["bytes"]}


@functools.lru_cache(maxsize=8)
def carried_build(path: str) -> dict[str, Any]:
    """reproduce.data_build checked as the recipes' data module will check it: the directory holding
    its tokenizer and shards (a data cache's links into ``builds/<fingerprint>/`` resolved) and the
    data settings it was made with, which every stage reading it must pass (or the data module would
    rebuild it, needing the pipeline). A ConfigError naming how to make one otherwise."""
    from data_contract.format import META_FILE, SHARDS_DIR, TOKENIZER_DIR
    from dsl_lit.config.data import DataConfig
    from dsl_lit.data.cache import stale_reason

    given = Path(path).expanduser()
    if not ((given / SHARDS_DIR / META_FILE).is_file() and (given / TOKENIZER_DIR / META_FILE).is_file()):
        raise ConfigError(
            f"reproduce.data_build={given} holds no finished data build (tokenizer/ and shards/ with their {META_FILE}): "
            "make one where datasets is installed (DSL_LIT_CACHE_ROOT=<dir> python recipes/pretrain.py "
            "trainer.max_steps=1 logger=csv builds <dir>/bundled_corpus_v8192) and copy it here, or set "
            "reproduce.data_build=null to run the data pipeline")
    build = (given / SHARDS_DIR).resolve().parent
    packed = json.loads((build / SHARDS_DIR / META_FILE).read_text())
    tokenizer = json.loads((build / TOKENIZER_DIR / META_FILE).read_text())
    fim = packed.get("fim") if (packed.get("fim") or {}).get("rate") else None
    stages = list(packed.get("stages") or [])
    settings = {"cache_dir": str(build), "tokenizer_vocab_size": tokenizer.get("requested_vocab_size", tokenizer["vocab_size"]),
                "tokenizer_max_bytes": tokenizer.get("max_bytes"), "decontaminate": "decontaminate" in stages,
                "fim_rate": fim["rate"] if fim else 0.0, "fim_spm_rate": fim["spm_rate"] if fim else 0.0,
                "seed": fim["seed"] if fim else FIM["seed"]}
    reason = stale_reason(DataConfig(corpus_dir=str(PROJECT_ROOT / "data" / "corpus"), **settings))
    if reason is not None:
        raise ConfigError(f"reproduce.data_build={given} cannot feed the stages: {reason}")
    return {"settings": settings, "fim": fim, "stages": stages, "documents": packed["num_documents"],
            "tokens": packed["num_tokens"]}


def build_arguments(cfg: ReproduceConfig) -> list[str]:
    """The overrides that make a recipe's data module read reproduce.data_build as it is."""
    settings = carried_build(cfg.data_build)["settings"]

    def value(v: Any) -> str:
        return "null" if v is None else str(v).lower() if isinstance(v, bool) else str(v)
    return [path_override("data.cache_dir", settings["cache_dir"]),
            *(f"data.{key}={value(v)}" for key, v in settings.items() if key != "cache_dir")]


def data_dir(ctx: StageContext) -> Path:
    """The pipeline's output directory (its own: the pipeline writes only into a directory it owns)."""
    return ctx.dir_of("data") / "pipeline"


def data_arguments(ctx: StageContext) -> list[str]:
    """The pipeline's shards and tokenizer, with the FIM settings they were packed with (or
    reproduce.data_build's, with its own settings)."""
    if ctx.cfg.data_build:
        return build_arguments(ctx.cfg)
    return [path_override("data.cache_dir", data_dir(ctx)), f"data.fim_rate={FIM['rate']}", f"data.fim_spm_rate={FIM['spm_rate']}",
            f"data.seed={FIM['seed']}"]


def seed_arguments(cfg: ReproduceConfig, offset: int = 0) -> list[str]:
    """``trainer.seed`` of a training stage (``reproduce.seed``, plus ``offset`` for an ablation's
    further seeds); none when the preset leaves the recipes their own."""
    if cfg.seed is None and offset == 0:
        return []
    return [f"trainer.seed={(1234 if cfg.seed is None else cfg.seed) + offset}"]


def pretrain_arguments(ctx: StageContext) -> list[str]:
    hp, cfg = ctx.results("scaling"), ctx.cfg
    ramp = ([f"data.batch_ramp.start={hp['ramp_start']}", f"data.batch_ramp.tokens={hp['ramp_tokens']}",
             f"data.batch_ramp.increment={cfg.micro_batch_size}"] if hp["ramp_start"] else [])
    return [f"model={PRETRAIN_MODEL}", f"++model.init_std={pretrain_init_std()}", *data_arguments(ctx), f"data.seq_len={cfg.seq_len}",
            f"data.global_batch_size={hp['global_batch_size']}", f"data.micro_batch_size={cfg.micro_batch_size}",
            *ramp, f"optim.lr={hp['lr']}", f"trainer.max_steps={hp['max_steps']}", "logger=csv",
            "trainer.progress_bar=false", f"trainer.accelerator={ctx.cfg.accelerator}", *seed_arguments(ctx.cfg)]


def pretrain(ctx: StageContext) -> dict[str, Any]:
    ctx.recipe("pretrain.py", pretrain_arguments(ctx))
    return run_summary(ctx.dir)


def ablation_runs(ctx: StageContext) -> dict[str, list[Path]]:
    """Variant -> its run directories, one per seed (``<variant>/seed<k>``)."""
    return {name: [ctx.dir / name / f"seed{k}" for k in range(ctx.cfg.ablation_seeds)] for name, _ in ABLATIONS}


def ablations(ctx: StageContext) -> dict[str, Any]:
    """DeepSeek-V3's ablations in miniature: every variant of :data:`ABLATIONS` (with and without MTP,
    without the bias update) from the pretraining's settings over ``reproduce.ablation_seeds`` seeds
    (seed k: ``reproduce.seed + k`` for every variant, paired; the data order is ``data.seed``'s, the
    same for all; with and without the bias update start from the same weights, while building the
    MTP module draws from the generator first, so MTP's pairs share the seed, not the weights), each
    ``reproduce.ablation_fraction`` of its steps, ``reproduce.concurrent_runs`` at a time, validated
    once, after its last step. One seed of each was the earlier design: MTP's measured effect (val
    4.82 vs 4.81) was inside a seed spread nobody had measured. Validating every 50 steps, as the
    pretraining does, was the next: a 90-step run's last validation came at step 50, at the peak lr,
    where the seeds scattered 2.04% (sd of the paired relative cost) against 1.19% at the end."""
    hp, cfg = ctx.results("scaling"), ctx.cfg
    steps = max(1, round(hp["max_steps"] * cfg.ablation_fraction))
    ramp = [f"data.batch_ramp.tokens={round(hp['ramp_tokens'] * cfg.ablation_fraction)}"] if hp["ramp_start"] else []
    base = [a for a in pretrain_arguments(ctx)
            if not a.startswith(("trainer.seed=", "trainer.max_steps=", "data.batch_ramp.tokens="))]
    runs = ablation_runs(ctx)
    commands, logs, todo = [], [], []
    # the runs without the MTP module (~30% less per step) last: the last wave's lone run, which
    # leaves a core idle, is then a short one (runs are independent: the order changes no number)
    for name, arguments in sorted(ABLATIONS, key=lambda variant: WITHOUT_MTP in variant[1]):
        for k, run_dir in enumerate(runs[name]):
            if marker(run_dir) is not None:  # finished before an interruption
                continue
            run_dir.mkdir(parents=True, exist_ok=True)
            commands.append([str(PROJECT_ROOT / "recipes" / "pretrain.py"), path_override("hydra.run.dir", run_dir),
                             *base, *ramp, f"trainer.max_steps={steps}", f"trainer.val_every_n_steps={steps}",
                             *seed_arguments(cfg, k), *arguments])
            logs.append(run_dir / "stage.log")
            todo.append(run_dir)
    ctx.run_all(commands, concurrent=cfg.concurrent_runs, log_paths=logs)
    for run_dir in todo:
        write_marker(run_dir, {"results": run_summary(run_dir)})
    variants = {name: [marker(d)["results"] for d in dirs] for name, dirs in runs.items()}
    return {"steps": steps, "seeds": [(1234 if cfg.seed is None else cfg.seed) + k for k in range(cfg.ablation_seeds)],
            "variants": variants}


CONTEXT_BASE_STOP_AT = 0.7
"""The context base trains until its in-training probe (``eval.passkey``: 40 prompts of 128 tokens
of its own seed, not the passkey stage's) retrieves this share, checked every
``CONTEXT_BASE_PROBE_EVERY`` steps, capped by ``experiment=cpu_context_128``'s 2,500 steps (its
cosine schedule spans the cap). A tiny model learns retrieval abruptly, at a step that moves with
the seed: measured (probes every 100 steps, 2-core AMD EPYC, 2026-11-29), seed 1234 0% at step 900,
40% at 1,100, 70% at 1,200, 80% from 1,500; seed 1 at most 2% until 1,400, 18% at 1,500, 55% at
1,600, 75% at 1,700, 95%+ from 1,800. A fixed 1,500 steps (cosine to zero by then) gave seed 1234 a
base retrieving 82% and seed 1 one retrieving 0%, with nothing for YaRN to extend."""
CONTEXT_BASE_PROBE_EVERY = 50


def context_base(ctx: StageContext) -> dict[str, Any]:
    """The base that YaRN extends: a small DeepSeek-V3 pretrained on passkey documents until it
    retrieves at its own length (128 tokens; :data:`CONTEXT_BASE_STOP_AT`). The DeepSeek-V3 tiny of
    ``pretrain`` is not that base: it retrieves nothing at any length after its 178 steps of the
    bundled corpus (retrieval appears after ~1,000-1,600 steps even on the passkey documents alone),
    so extending it measured nothing."""
    ctx.recipe("pretrain.py", ["experiment=cpu_context_128", f"eval.passkey.every_n_steps={CONTEXT_BASE_PROBE_EVERY}",
                               f"eval.passkey.length={CONTEXT_LENGTHS[0]}", f"eval.passkey.stop_at={CONTEXT_BASE_STOP_AT}",
                               "checkpoint.keep_last=1",  # every 250 steps (a stopped chain resumes), the last kept
                               "logger=csv", "trainer.progress_bar=false", f"trainer.accelerator={ctx.cfg.accelerator}",
                               *seed_arguments(ctx.cfg)])
    summary = run_summary(ctx.dir)
    probes = read_metrics(ctx.dir / METRICS_FILE).get(f"eval/passkey/{CONTEXT_LENGTHS[0]}")
    summary["probe"] = [] if probes is None else [[int(step) + 1, float(share)]
                                                   for step, share in zip(probes.steps, probes.values, strict=True)]
    summary["stop_at"] = CONTEXT_BASE_STOP_AT
    return summary


def yarn(ctx: StageContext) -> dict[str, Any]:
    """V3's context extension (section 4.3) of the context base: YaRN (factor 4, its beta_fast 32,
    beta_slow 1, mscale 1) at 4x the base's length, trained on longer passkey documents at the
    base's final lr (``experiment=cpu_context_512``: 150 steps of 4 x 512 tokens), tokenized by the
    base's own tokenizer (the copy its run directory keeps)."""
    base = ctx.dir_of("context_base")
    ctx.recipe("pretrain.py", ["experiment=cpu_context_512", path_override("init_from", base),
                               path_override("data.tokenizer_dir", base / "tokenizer"),
                               "logger=csv", "trainer.progress_bar=false", f"trainer.accelerator={ctx.cfg.accelerator}",
                               *seed_arguments(ctx.cfg)])
    return run_summary(ctx.dir)


PASSKEY_MODELS = ("context_base", "yarn")
"""The checkpoints the passkey stage scores: before and after the extension."""


def passkey(ctx: StageContext) -> dict[str, Any]:
    """Retrieval by context length of the context base and of its YaRN extension, on the same
    prompts (each model's prompt-by-prompt outcomes kept: the claim pairs them), and the two
    models' trained lengths."""
    lengths = "[" + ",".join(str(n) for n in ctx.cfg.passkey_lengths) + "]"
    accuracy, retrieved, trained = {}, {}, {}
    for model in PASSKEY_MODELS:
        out = ctx.dir / model
        if not (out / "passkey.json").is_file():
            ctx.recipe("passkey.py", [path_override("checkpoint", ctx.dir_of(model)), f"lengths={lengths}", f"device={ctx.cfg.device}"],
                       run_dir=out)
        scored = json.loads((out / "passkey.json").read_text())
        accuracy[model] = {n: sum(row.values()) / len(row) for n, row in scored["accuracy"].items()}
        retrieved[model] = {n: [hit for hits in row.values() for hit in hits] for n, row in scored["retrieved"].items()}
        trained[model] = scored["checkpoint"]["max_seq_len"]
    return {"accuracy": accuracy, "retrieved": retrieved, "trained_length": trained}


# ----------------------------------------------------------------------------------------------
# R1: cold start, GRPO, rejection sampling + SFT, distillation; each from a checkpoint

def posttrain_arguments(ctx: StageContext, init_from: str | None) -> list[str]:
    start = [path_override("init_from", ctx.dir_of(init_from))] if init_from else []
    return [*start, *data_arguments(ctx), *R1_TASK, "logger=csv", "trainer.progress_bar=false",
            f"trainer.accelerator={ctx.cfg.accelerator}", *seed_arguments(ctx.cfg)]


COPYING_STEPS = 300
"""SFT steps the pretrained V3 tiny needs to read the list it is asked about. Measured (2-core Xeon,
100 held-out lists): after 60 steps at lr 3e-3 (the earlier setting) it answered "9" to every list
(its reasoning copied "6 6 6 6" whatever the list: 31%, the share of lists holding a 9, which the
report took for the shortcut's score); after 60 steps at lr 1e-3, 6%; after 150 steps at lr 3e-3 it
copied the list and answered by the shortcut it was shown (27.5%), the imperfect cold start R1
needs, from a base at val loss 4.80; from the bases of 2026-11-28 (val 4.97 and 5.24, pretrained at
the fit's unclamped lr 4.1e-3 / 4.4e-3) 150 steps left "9" for every list again (31% both), while
300 steps from the first copy the list and answer by the shortcut (held-out 17%, 78% of the answers
the shortcut's), from which GRPO (:data:`GRPO_SETTINGS`) rose to 34% (29% at steps 30-50).
The dense 2-layer model of the GRPO demo, from random weights, learns the copying in 60."""


COPYING_SFT = (f"trainer.max_steps={COPYING_STEPS}", "data.global_batch_size=8", "data.micro_batch_size=8",
               "optim.lr=2e-3", "schedule.warmup_steps=30")
"""The settings of both SFTs of the pretrained model (the cold start, the SFT on rejection samples):
copying the list is learned abruptly (the reply loss sits at ~0.57, the list not copied, then falls
to ~0.06), and when it happens is chaotic: it moves with the base, the data and even the thread
count. Measured (2-core Xeon, two threads, cold start of :func:`cold_start`; the step where the loss
leaves the plateau; held-out greedy accuracy at step 300): at lr 3e-3 with 10 warmup steps (the
earlier setting) seed 1234's base ~75 (44%), seed 1's never (24.5%: loss 0.57 to the end, after a
grad-norm spike of 130 at step 94; at one thread, ~150), so GRPO had nothing to raise and the chain
stopped at rejection sampling; at lr 2e-3 with 30 warmup steps, seed 1234 ~140 (45%), seed 1 ~110
(51%), and seed 1's base on two other draws of the task (``task.seed`` 2, 3) ~110 and ~175-275 (loss
0.27 at 300). Tried on seed 1's base and not adopted: lr 1.5e-3 (partial: 0.45, 38.5%); lr 3e-3 with
50 warmup steps (~125, 33%; over 400 steps, partial); lr 5e-3 (stuck, spikes; task seed 3: ~175);
rows of 128 tokens for 600 steps (~300, 28.5%: the transition counts conversations, not steps)."""


SHORTCUT_SHARE = 0.5
"""The share of cold-start replies that answer by the shortcut (the list's last number). Measured
(held-out greedy accuracy, 400 lists, 2-core Xeon, seeds 1234 / 1 of 2026-11-29): at 0.8, the earlier
share, both cold starts answered by the shortcut alone (right on 100% / 81% of the lists whose last
number is the largest, on 1.1% / 0% of the others: 32% / 25%), and GRPO, whose samples then rarely
held the right answer, found it on 13.8% / 1.8% of those lists (40% / 26%: seed 1's gain inside its
noise); at 0.5 the cold starts read the list in part (24% / 48% of those lists right: 48% / 60%
held-out) and GRPO gained +6.8 [+4.0, +9.5] / +3.8 [+0.5, +7.0] points on both seeds. At 0.6 (seed
1) the cold start was 16.5%."""


def cold_start(ctx: StageContext) -> dict[str, Any]:
    """R1's cold start: SFT of the pretrained model on the task's R1-format replies, a
    :data:`SHORTCUT_SHARE` of them answering by a shortcut (an imperfect start that RL can improve
    on, as the paper's readable but unpolished cold-start data), with :data:`COPYING_SFT`."""
    ctx.recipe("sft.py", [*posttrain_arguments(ctx, "pretrain"), f"sft.shortcut_share={SHORTCUT_SHARE}", *COPYING_SFT])
    return {**run_summary(ctx.dir), "shortcut_accuracy": shortcut_accuracy(ctx.dir), "blind": blind_baseline(ctx.dir)}


def _task_split(run_dir: Path) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """The run's own (training, held-out) problems, from its resolved config."""
    from dsl_lit.config.posttrain import TaskConfig
    from dsl_lit.tasks import arithmetic

    task = yaml.safe_load((run_dir / "resolved_config.yaml").read_text())["task"]
    return arithmetic.split(TaskConfig(**task).validate())


def shortcut_accuracy(run_dir: Path) -> float:
    """Held-out accuracy of answering every problem by the shortcut rule the cold start imitates in
    part (``arithmetic.shortcut_answer``), on the run's own held-out problems: the baseline an R1
    model must beat to have learned the task rather than the shortcut."""
    from dsl_lit.tasks import arithmetic

    _, held_out = _task_split(run_dir)
    return sum(arithmetic.shortcut_answer(p) == p["answer"] for p in held_out) / len(held_out)


def blind_baseline(run_dir: Path) -> dict[str, Any]:
    """The best answer that does not read the list: one constant for every problem, the training
    problems' most frequent answer (for ``largest`` of four digits, "9": right whenever the list
    holds a 9, ~34% of lists), scored on each held-out problem. Measured 2026-11-28: GRPO's held-out
    gain came mostly from answering "9" more often (269 and 280 of 400 lists, 39% against the
    constant's 36%), and both models trained on its samples answered "9" to every list yet kept
    "80% of GRPO's accuracy"; so an R1 claim also asks its models to beat this answer, list by list."""
    from collections import Counter

    train, held_out = _task_split(run_dir)
    answer = Counter(p["answer"] for p in train).most_common(1)[0][0]
    outcomes = [float(p["answer"] == answer) for p in held_out]
    return {"answer": answer, "accuracy": sum(outcomes) / len(outcomes), "outcomes": outcomes}


GRPO_SETTINGS = ("optim.lr=1e-4", "trainer.max_steps=80", "grpo.beta=0.04", "+grpo.rewards.restatement=0.25")
"""Measured from the 150-step cold start (held-out greedy accuracy every 10 steps, 2-core Xeon):
29 -> 38, 41, 41 at step 80 for seeds 1, 2, 3 (+11 +- 1.7; seed 3 dipped to 29 at step 50), where
the recipe's lr 2e-4 for 40 steps and KL 0.001 ended at 31 (seed 1) and drifted to "9".

The restatement reward (weight 0.25 beside accuracy 1.0 and format 0.5) is R1's readability reward
in miniature (its second RL stage adds a language-consistency reward for the same reason): without
it the reasoning drifts where only the answer is rewarded, and rejection sampling, which keeps only
samples that restate the question, keeps too few. Measured (two threads, 2026-11-29, the cold starts
of :data:`COPYING_SFT`): seed 1 without it 51% -> 63%, but 1,421 of 7,600 samples accepted (657
prompts kept; at temperature 0.6, 580), and the SFT on them 42% (below 80% of GRPO's 63%); with it
51% -> 66% (+15.0 [+11.5, +19.0]), 4,127 accepted (1,341 kept), the SFT on them 74%, the student 98%.
Seed 1234 without it: 45% -> 67%, 1,453 kept. The steps take ~15% longer (completions keep the
restated list)."""


def grpo(ctx: StageContext) -> dict[str, Any]:
    """GRPO from the cold start with :data:`GRPO_SETTINGS` (the recipe's own: lr 2e-4, 40 steps). Measured on this
    4-layer MoE at lr 5e-4 for 60 steps: sampled accuracy 8% -> 37% while held-out greedy accuracy
    stayed at 31% and the reasoning degenerated (a kept sample: "<think>the largarg7 8 of 9 8 2
    9</think><answer>9</answer>"), so rejection sampling accepted 1.6% of samples, not 23%; at 1e-3
    accuracy collapsed to 0. Those runs started from a cold start that answered "9" to every list
    (:data:`COPYING_STEPS`). From one that copies the list and answers by the shortcut (held-out greedy
    accuracy at steps 0/10/20/30/40, 2-core Xeon, one seed each unless said): the recipe's settings
    29/43/32/31/31, drifting to "9" for every list (right on the 34% of lists that hold a 9, a better
    constant than the shortcut's 26%); KL weight 0.04: 29/35/37/39/32; 0.1: 29/35/37/39/37 and, seed
    2, 29/28/30/33/34; lists of 3 numbers (no constant that good; the cold start reaches 57%):
    57/59/26/39/72 and, seed 2, 57/39/69/63/57; lr 1e-4 for 80 steps with KL 0.04 (every 10 steps):
    29/35/39/39/39/36/38/40/38, the steadiest. Sampled accuracy on the training prompts rises in every
    run (20% -> 25-37%). Seeds 2 and 3 of that last setting confirmed it: :data:`GRPO_SETTINGS`."""
    ctx.recipe("grpo.py", [*posttrain_arguments(ctx, "cold_start"), *GRPO_SETTINGS, "checkpoint.every_n_steps=20",
                            "grpo.eval_every_n_steps=20"])  # greedy, so no RNG drawn: the run is the same; ~35 s saved
    series = read_metrics(ctx.dir / METRICS_FILE)
    return {**run_summary(ctx.dir), "sampled_accuracy_first": head_mean(series, "reward/accuracy"),
            "sampled_accuracy_last": tail_mean(series, "reward/accuracy")}


REJECTION_SETTINGS = ("rejection.num_prompts=1900", "rejection.samples_per_prompt=4",
                      "rejection.rewards.format=0.25", "rejection.rewards.restatement=0.25")
"""Every training prompt (2300 - 400 held out), 4 samples each, one sample kept per prompt among
those right, well formed and whose reasoning restates the question (``rejection.min_reward`` 1.0:
all three; :mod:`dsl_lit.posttrain.rewards.restatement`, R1's readability filter in miniature): the
data of R1's second SFT and of its distilled student. Measured from the GRPO models of 2026-11-29
(GRPO 55% / 63% for seeds 1234 / 1; the SFT of the pretrained model on the kept samples, packed, 300
steps; held-out greedy accuracy, 400 lists, 2-core Xeon): the earlier 168 prompts x 8, right and well
formed, kept 120 / 115 samples: 41% / 21% (unpacked, then the default); 800 x 8: 90% / 26%; 1900 x 4:
28% / 70% (1,217 / 1,358 samples, 52% / 76% of them restating the question; where the SFT stayed low
its loss sat at 0.5 for all 300 steps: it never learned to copy the list); the same samples filtered
afterwards to the restating ones: 83% / 64% (630 / 1,038); these settings, the rule applied while
sampling (893 / 1,212 kept): 99% / 79%, both seeds learning to copy by step ~100 (one thread each;
the fresh clone's two-thread run: 1,539 kept, 80%). Sampling at temperature 0.6 instead of 1.0
(session 31, seed 1's GRPO model trained without the restatement reward) kept fewer (580 against
657) and its SFT learned less (loss 0.27 at step 300 against 0.19): the fix was GRPO's own reward
(:data:`GRPO_SETTINGS`)."""


def rejection_sample(ctx: StageContext) -> dict[str, Any]:
    """R1's rejection sampling: the GRPO model's verified samples of :data:`REJECTION_SETTINGS`."""
    ctx.recipe("rejection_sample.py", [*posttrain_arguments(ctx, "grpo"), *REJECTION_SETTINGS])
    stats = json.loads((ctx.dir / "rejection_stats.json").read_text())
    if not stats["kept"]:  # sft_rs would train on nothing: stop here, saying why
        raise StageFailed(f"stage rejection_sample: none of {stats['samples']} samples of the GRPO model was "
                          "accepted (finished with end-of-sentence and, verifying, rewarded); train the earlier "
                          "stages longer, or pass rejection.min_reward / rejection.verify=false in "
                          "reproduce.overrides.rejection_sample")
    return stats


def _lines(path: Path) -> int:
    return sum(1 for line in path.open() if line.strip()) if path.is_file() else 0


def rs_samples(ctx: StageContext) -> Path:
    return ctx.dir_of("rejection_sample") / "samples.jsonl"


def sft_rs(ctx: StageContext) -> dict[str, Any]:
    """R1's second SFT: the pretrained model on the RL model's verified samples, as long as the cold
    start (:data:`COPYING_SFT`; :data:`COPYING_STEPS`: at 60 steps and lr 1e-3, the earlier setting, the pretrained model
    does not yet read the list; measured 6% held-out), packed as the cold start's replies are (one
    sample a row, the earlier setting, gave it 8 samples a step: see :data:`REJECTION_SETTINGS`)."""
    ctx.recipe("sft.py", [*posttrain_arguments(ctx, "pretrain"), path_override("sft.dataset", rs_samples(ctx)),
                          *COPYING_SFT])
    return run_summary(ctx.dir)


DISTILL_SETTINGS = ("model=deepseek_llm_tiny", "student.n_layers=2", f"trainer.max_steps={COPYING_STEPS}",
                    "sft.packing=null")
"""A 2-layer dense student from random weights, :data:`COPYING_STEPS` steps on the rejection
sampling stage's verified samples (R1 distils from the same curated data as its second SFT; until
2026-11-29 the student's recipe drew its own, 800 prompts x 4), packed (the recipe's default is a
sample a row). Measured on the samples of :data:`REJECTION_SETTINGS` (893 / 1,212 for seeds 1234 /
1, 2026-11-29): a sample a row 70% / 38% (seed 1's loss still 0.2 at step 300), packed 99.8% / 99.5%
(copying learned by step ~65; 144 s, as long as unpacked). Earlier, measured from the GRPO models of 2026-11-28 (held-out greedy
accuracy, 400 lists, 2-core Xeon): the earlier 1 layer, 150 steps, 168 prompts (80 kept samples)
gave 17% (seed 1234: answers 5 or 6) and 42% (seed 1); 1 layer, 150 steps, 800 prompts (431 kept)
2%; 2 layers, 300 steps, 800 prompts 96% (seed 1234, teacher 40%) and 38% (seed 1, teacher 26%).
A 2-layer student can copy the list it is asked about (an induction step); one layer did not learn it
in these budgets. R1's students are pretrained models; this one learns the task from the samples alone."""


def distill(ctx: StageContext) -> dict[str, Any]:
    """R1-Distill: a smaller dense student SFT-ed on the GRPO model's verified samples
    (:data:`DISTILL_SETTINGS`)."""
    ctx.recipe("distill.py", [*posttrain_arguments(ctx, None), path_override("teacher_samples", rs_samples(ctx)),
                              *DISTILL_SETTINGS])
    return {**run_summary(ctx.dir), "teacher_samples": _lines(rs_samples(ctx))}


# ----------------------------------------------------------------------------------------------
# lm-eval on every checkpoint, and the report

def evaluate(ctx: StageContext) -> dict[str, Any]:
    """lm-eval on each checkpoint; skipped, saying why, where lm-eval is not installed (the runner
    prints the reason, the report shows it, and the next run that has lm-eval runs this stage)."""
    missing = missing_module("lm_eval")
    if missing is not None:
        return {"skipped": f"lm_eval cannot be imported ({missing}): the checkpoints are not scored; "
                           "pip install lm-eval and rerun to score them"}
    limit = [f"limit={ctx.cfg.eval_limit}"] if ctx.cfg.eval_limit else []
    todo = [model for model in EVALUATED if scored(ctx.dir / model) is None]
    if todo:  # one process scores them all (a Hydra multirun): lm-eval's start-up paid once, not per model
        sweep = ctx.dir / "sweep"
        checkpoints = ",".join(path_override("checkpoint", ctx.dir_of(model)).split("=", 1)[1] for model in todo)
        ctx.run([str(PROJECT_ROOT / "recipes" / "evaluate.py"), "-m", f"checkpoint={checkpoints}",
                 path_override("hydra.sweep.dir", sweep), "hydra.sweep.subdir=${hydra.job.num}", *limit,
                 "bootstrap_iters=0", f"device={ctx.cfg.device}"])
        for number, model in enumerate(todo):  # job N scored the N-th checkpoint named
            if (sweep / str(number)).is_dir():
                if (ctx.dir / model).exists():
                    shutil.rmtree(ctx.dir / model)  # an earlier scoring of ours, cut off
                (sweep / str(number)).rename(ctx.dir / model)
        shutil.rmtree(sweep, ignore_errors=True)
    scores = {}
    for model in EVALUATED:
        out = ctx.dir / model
        results = scored(out)
        if results is None:
            raise ConfigError(f"stage evaluate: {out / 'results.json'} is still unreadable after scoring {model} again")
        scores[model] = {task: {k.split(",")[0]: v for k, v in metrics.items()
                                if isinstance(v, (int, float)) and "stderr" not in k}
                         for task, metrics in results.items()}
    return {"scores": scores}


def scored(out: Path) -> dict[str, Any] | None:
    """The ``results`` of ``out/results.json`` that an earlier evaluation left (None: none yet, or one
    cut off or not ours, which is said and scored again rather than a traceback)."""
    path = out / "results.json"
    if not path.is_file():
        return None
    try:
        results = json.loads(path.read_text()).get("results")
    except (json.JSONDecodeError, UnicodeDecodeError, AttributeError):
        results = None
    if not isinstance(results, dict):
        log.warning("%s is not a complete lm-eval results file (cut off?): scoring this checkpoint again", path)
        return None
    return results


def report(ctx: StageContext) -> dict[str, Any]:
    from dsl_lit.reproduce.report import write_report

    path = write_report(ctx.run_dir, ctx.dir, ctx.cfg)
    return {"report": str(path)}


STAGE_TABLE = tuple(Stage.from_row(row, globals()[row.run]) for row in STAGE_ROWS)
"""The rows of :data:`dsl_lit.config.reproduce_stages.STAGE_ROWS`, each with the function its ``run`` names."""
