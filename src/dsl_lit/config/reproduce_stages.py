"""The stages of ``recipes/reproduce.py`` as one torch-free table: validation (``reproduce.stages``,
preset overrides) and the runner read the same rows, and what the runner does with a stage follows
from its row's fields, never from its name.

A new stage is one row here (its place in the tuple is its place in the chain) and its function in
:mod:`dsl_lit.reproduce.stages` (``run`` names it); ``conf/reproduce/*.yaml`` may then give it
overrides and a time estimate.
"""

from __future__ import annotations

from dataclasses import dataclass

HPARAMS = ("pretrain_tokens", "seq_len", "batch_range", "lr_range", "micro_batch_size", "ramp_fraction",
           "ramp_start_fraction", "overrides.pretrain", "device", "seed")
"""What the scaling stage's batch and lr for the pretraining depend on (the pretrained model's size too)."""
TRAINS = ("seq_len", "micro_batch_size", "device", "seed")
R1 = ("device", "seed")
WITHOUT_MTP = "++model.mtp_depth=0"
"""The ablation's override that drops the MTP module (its runs are the cheapest: the stage starts them last)."""
ABLATIONS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("baseline", ()),
    ("no_mtp", (WITHOUT_MTP,)),
    ("no_bias", ("objective.bias_update_rate=[0.0,0.0]",)),
)
"""The ablation study's variants (name, recipe overrides on the pretraining's), each trained over
``reproduce.ablation_seeds`` seeds: DeepSeek-V3's comparisons (Tables 4 and 5), with vs without MTP
and with vs without the bias update, at equal steps and data."""
EVALUATED = ("pretrain", "cold_start", "grpo", "sft_rs", "distill")
"""The stages whose checkpoints lm-eval scores (the bundled corpus's tokenizer: not the context base's
and its extension's, which read passkey documents only)."""
YARN_FACTOR = 4
"""DeepSeek-V3's context extension multiplies the length by 4 per stage (4K -> 32K -> 128K)."""
CONTEXT_LENGTHS = (128, 128 * YARN_FACTOR)
"""The context base's trained length and its YaRN extension's (``experiment=cpu_context_128`` and
``cpu_context_512``): the passkey claim compares the two models at both."""


@dataclass(frozen=True)
class StageRow:
    name: str
    needs: tuple[str, ...]
    """Earlier stages whose results or checkpoints it reads."""
    run: str
    """The function of :mod:`dsl_lit.reproduce.stages` that does the work (``name(ctx) -> results``)."""
    description: str
    reads: tuple[str, ...] = ()
    """The preset's fields it uses (``ReproduceConfig``; ``overrides.<stage>`` for another stage's
    overrides): with its own overrides and its inputs' fingerprints, what decides whether a finished
    stage still stands."""
    trains: bool = True
    """Runs a training recipe whose command the start-up check composes and validates (not the data
    pipeline, passkey, lm-eval or the report)."""
    redrawn: bool = False
    """Runs every time (the report: it summarises whatever has finished, and is not counted as a result)."""
    requires: tuple[str, ...] = ()
    """Packages it cannot run without, checked at start-up (the data pipeline: ``datasets``)."""
    unless: str | None = None
    """A preset field that, set, spares it those packages (``data_build``: a carried build is read instead)."""


STAGE_ROWS: tuple[StageRow, ...] = (
    StageRow("scaling", (), "scaling", "lr x batch sweep, fitted laws -> the pretraining's lr and batch",
             (*HPARAMS, "data_build")),
    StageRow("data", (), "data", "dedup, filters, decontamination, BBPE, FIM packing of the bundled corpus",
             ("data_build",), trains=False, requires=("datasets",), unless="data_build"),
    StageRow("pretrain", ("scaling", "data"), "pretrain", "DeepSeek-V3 tiny: batch ramp, MTP, bias balancing", TRAINS),
    StageRow("ablations", ("scaling", "data"), "ablations", "with and without MTP, without the bias update, over seeds",
             (*TRAINS, "ablation_seeds", "ablation_fraction")),
    StageRow("context_base", (), "context_base", "a small DeepSeek-V3 learns passkey retrieval at 128 tokens",
             ("device", "seed")),
    StageRow("yarn", ("context_base",), "yarn", f"YaRN context extension x{YARN_FACTOR} of the context base",
             ("device", "seed")),
    StageRow("passkey", ("context_base", "yarn"), "passkey", "passkey retrieval by length, before and after YaRN",
             ("passkey_lengths", "device"), trains=False),
    StageRow("cold_start", ("data", "pretrain"), "cold_start", "R1 cold-start SFT from the pretrained checkpoint", R1),
    StageRow("grpo", ("data", "cold_start"), "grpo", "GRPO with rule rewards", R1),
    StageRow("rejection_sample", ("data", "grpo"), "rejection_sample", "rejection sampling from the GRPO model", R1),
    StageRow("sft_rs", ("data", "pretrain", "rejection_sample"), "sft_rs",
             "SFT of the pretrained model on the kept samples", R1),
    StageRow("distill", ("data", "rejection_sample"), "distill", "distillation into a smaller dense student", R1),
    StageRow("evaluate", EVALUATED, "evaluate", "lm-eval on each stage's checkpoint", ("eval_limit", "device"),
             trains=False),
    StageRow("report", (), "report", "report.md and figures", trains=False, redrawn=True),
)

STAGES = tuple(row.name for row in STAGE_ROWS)
"""Every stage in the order it runs."""
