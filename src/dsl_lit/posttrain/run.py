"""What every post-training recipe does before building its module: validate both config halves,
prepare the tokenizer, and resolve the starting weights (whose model config then replaces the
``model`` group, so the run's checkpoints rebuild the right architecture, and whose recorded
tokenizer replaces the default ``tokenizer_dir``: :mod:`dsl_lit.training.run_tokenizer`)."""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch
from omegaconf import DictConfig, OmegaConf

from data_contract.errors import ConfigError
from dsl_lit.config import ParallelConfig, TrainConfig
from dsl_lit.config.posttrain import PostTrainConfig
from dsl_lit.data.datamodule import PretrainDataModule
from dsl_lit.posttrain.chat.tokenizer import ChatTokenizer
from dsl_lit.scaling.planner.fits import refuse_what_cannot_fit
from dsl_lit.training.build import (  # also registers ${project_root:}
    build_trainer,
    module_arguments,
    starting_weights,
)
from dsl_lit.training.build import fit as fit_run
from dsl_lit.training.pretrained import StartingWeights
from dsl_lit.training.run_tokenizer import record_run_tokenizer, starting_tokenizer
from dsl_lit.training.runs import check_vocab, require_vocab, save_resolved_config

log = logging.getLogger(__name__)


@dataclass
class PostTrainSetup:
    cfg: TrainConfig
    post: PostTrainConfig
    tokenizer: ChatTokenizer
    initial_state: StartingWeights | None
    """The starting weights, opened but not read (None: random init of ``cfg.model``)."""


def setup_posttrain(hydra_cfg: DictConfig, run_dir: str, init_from: str | None = None) -> PostTrainSetup:
    """Validated configs, the chat tokenizer and the starting weights (``init_from`` overrides the
    config's, e.g. a cold-start checkpoint)."""
    cfg = TrainConfig.from_hydra(hydra_cfg, run_dir=run_dir, post_training=True)
    post = cfg.post
    initial_state = starting_weights(cfg, init_from or cfg.init_from)
    # the tokenizer the starting checkpoint recorded, rather than the data cache's latest build
    is_default = "tokenizer_dir" in hydra_cfg and OmegaConf.is_interpolation(hydra_cfg, "tokenizer_dir")
    chosen = starting_tokenizer(post.tokenizer_dir, is_default, initial_state)
    if chosen != post.tokenizer_dir:
        post.tokenizer_dir = cfg.raw["tokenizer_dir"] = chosen
    refuse_what_cannot_fit(cfg)
    save_resolved_config(cfg)
    datamodule = PretrainDataModule(cfg.data)
    if Path(post.tokenizer_dir).resolve() == datamodule.tokenizer_dir.resolve():
        check_vocab(cfg, datamodule)  # the data's tokenizer (the default): built on first use
    try:
        tokenizer = ChatTokenizer.from_dir(post.tokenizer_dir, post.chat_template_name)
    except ValueError as error:
        raise ConfigError(str(error)) from None
    require_vocab(tokenizer.meta, cfg.model.vocab_size, f"tokenizer_dir={post.tokenizer_dir}")
    record_run_tokenizer(cfg, post.tokenizer_dir, initial_state, fix="leave tokenizer_dir unset to train with it")
    return PostTrainSetup(cfg, post, tokenizer, initial_state)


def train_for_epochs(setup: PostTrainSetup, rows: int) -> None:
    """``sft.epochs`` over ``rows`` training rows as ``trainer.max_steps``, set before the module and
    the trainer are built: validated again and written to ``resolved_config.yaml`` (written at
    setup, before the rows were known). Nothing without ``sft.epochs``."""
    epochs, cfg = setup.post.sft.epochs, setup.cfg
    if not epochs:
        return
    steps = max(1, math.ceil(epochs * rows / cfg.data.global_batch_size))
    cfg.trainer = replace(cfg.trainer, max_steps=steps)
    cfg.raw["trainer"] = {**cfg.raw.get("trainer", {}), "max_steps": steps}
    cfg.validate()
    save_resolved_config(cfg, announce=False)
    log.info("sft.epochs=%s: %d optimizer steps over %d rows", epochs, steps, rows)


def module_kwargs(setup: PostTrainSetup) -> dict[str, Any]:
    """The ``CausalLMModule`` arguments every post-training module takes, from the configs."""
    return module_arguments(setup.cfg) | {"initial_state": setup.initial_state}


def held_out_evaluation(setup: PostTrainSetup) -> dict[str, Any]:
    """The ``PostTrainModule`` arguments that make a run log held-out greedy accuracy on the task
    (``task.eval_problems`` held-out problems, replies of up to ``grpo.sampling.max_new_tokens``),
    so that each R1 stage's accuracy is measured alike; ``task.eval_problems=0`` turns it off."""
    from dsl_lit.tasks import arithmetic

    _, held_out = arithmetic.split(setup.post.task)
    eval_set = [(setup.tokenizer.encode_prompt(arithmetic.prompt(p)), p) for p in held_out]
    return {"tokenizer": setup.tokenizer, "eval_set": eval_set,
            "eval_max_new_tokens": setup.post.grpo.sampling.max_new_tokens}


def fit(setup: PostTrainSetup, module: Any, datamodule: Any) -> Any:
    """:func:`dsl_lit.training.build.fit` with the setup's config."""
    return fit_run(setup.cfg, module, datamodule)


def sample_to_file(setup: PostTrainSetup, output: Path) -> dict[str, Any]:
    """Rejection-sample the task's training prompts with the setup's starting weights on every
    process of ``trainer.devices`` x ``trainer.num_nodes`` (each the whole model: ``parallel`` is
    for training), write the kept conversations to ``output`` (JSONL, rank 0) and the counts
    beside it; returns the counts (on every rank)."""
    from dsl_lit.posttrain import RejectionSamplingModule
    from dsl_lit.posttrain.chat.datamodule import RowsDataModule
    from dsl_lit.posttrain.rejection.data import summary_of, write_samples
    from dsl_lit.tasks import arithmetic

    cfg, post = setup.cfg, setup.post
    cfg = replace(cfg, parallel=ParallelConfig(), checkpoint=replace(cfg.checkpoint, every_n_steps=0, every_minutes=0))
    cfg.validate()  # the layout of the new parallel group
    train, _ = arithmetic.split(post.task)
    problems = train[: post.rejection.num_prompts]
    module = RejectionSamplingModule(cfg.model, setup.initial_state, setup.tokenizer, problems, arithmetic.prompt,
                                     post.rejection, seed=cfg.trainer.seed)
    datamodule = RowsDataModule(cfg.data, lambda: {"index": torch.arange(len(problems))})
    datamodule.predict_batch_size = post.rejection.batch_prompts
    trainer = build_trainer(cfg)
    trainer.predict(module, datamodule=datamodule, return_predictions=False)
    summary = write_samples(output, module.records, module.stats) if trainer.is_global_zero else None
    if trainer.world_size > 1:
        torch.distributed.barrier()  # the file is complete before any rank goes on to read it
    return summary or summary_of(module.stats, output)


def cold_start_sft(hydra_cfg: DictConfig, run_dir: Path, steps: int, lr: float, shortcut_share: float = 0.0) -> Path:
    """R1's cold start: ``steps`` of SFT (peak ``lr``, cosine, 8 rows a step, packed where the model allows) of the config's
    (random) model on the task's reference replies (a ``shortcut_share`` of them answering with the
    task's shortcut rule), as a run of its own in ``<run_dir>/cold_start`` (resumable); returns that run dir,
    whose latest checkpoint is the next stage's ``init_from``. Single process only."""
    from dsl_lit.posttrain import SFTModule
    from dsl_lit.posttrain.chat.conversations import task_conversations
    from dsl_lit.posttrain.chat.datamodule import RowsDataModule
    from dsl_lit.posttrain.chat.rows import sft_rows

    if hydra_cfg.trainer.devices * hydra_cfg.trainer.num_nodes > 1:
        raise ConfigError("the cold start runs in this process: with several devices run recipes/sft.py first "
                          "and pass init_from=<its run dir>")
    import lightning as L

    directory = Path(run_dir) / "cold_start"
    # the cold start's own settings, merged before validation (so they are checked, and written to
    # its resolved_config.yaml, as any run's); its last step's checkpoint starts the next stage
    stage = {"trainer": {"max_steps": steps}, "checkpoint": {"every_n_steps": steps},
             "schedule": {"name": "cosine", "warmup_steps": min(10, steps // 5), "total_steps": steps},
             "optim": {"lr": lr}, "data": {"global_batch_size": 8, "micro_batch_size": 8}}
    setup = setup_posttrain(OmegaConf.merge(hydra_cfg, stage), str(directory))
    cfg = setup.cfg
    L.seed_everything(cfg.trainer.seed, workers=True)  # its random init: the same run for the same seed
    conversations = [setup.tokenizer.encode_conversation(c) for c in task_conversations(setup.post.task, shortcut_share)]
    rows = sft_rows(conversations, cfg.data.seq_len, setup.tokenizer.pad_id, packing=setup.post.sft.packing)
    kwargs = module_kwargs(setup) | {"total_steps": steps, "micro_batch_size": 8}
    fit(setup, SFTModule(**kwargs), RowsDataModule(cfg.data, lambda: rows))
    return directory
