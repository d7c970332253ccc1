"""``recipes/evaluate.py``'s work: tasks checked, model loaded, lm-eval run, results written.

Order matters for the user: a misspelt task or a missing data file is reported before the model
is read (which can take minutes for a large checkpoint).
"""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Any

import torch

from data_contract.errors import ConfigError
from dsl_lit.config.evaluate import EvaluateConfig
from dsl_lit.evaluation.harness import Harness, flat_metrics, write_results
from dsl_lit.evaluation.lm import DslLitLM
from dsl_lit.evaluation.source import load_eval_model
from dsl_lit.evaluation.tokenizer import EvalTokenizer

log = logging.getLogger(__name__)


def eval_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name.startswith("cuda") and not torch.cuda.is_available():
        raise ConfigError(f"device={name} but this machine has no usable CUDA GPU; use device=cpu (or auto)")
    return torch.device(name)


def evaluate_checkpoint(cfg: EvaluateConfig, run_dir: str | Path) -> dict[str, Any]:
    """Run ``cfg.tasks`` on ``cfg.checkpoint``; writes ``results.json`` to ``run_dir``, logs the
    scalars to W&B when enabled, and returns lm-eval's results."""
    device = eval_device(cfg.device)
    with Harness(cfg) as harness:
        source = load_eval_model(cfg.checkpoint, cfg.weights, device, tokenizer_dir=cfg.tokenizer_dir)
        tokenizer_dir = source.tokenizer_dir  # the run's recorded tokenizer; a given one of another hash is refused
        if tokenizer_dir is None or not Path(tokenizer_dir).is_dir():
            raise ConfigError(f"no tokenizer for {cfg.checkpoint} (looked in {tokenizer_dir}); "
                              "set tokenizer_dir=<directory with tokenizer.json>")
        tokenizer = EvalTokenizer.from_dir(tokenizer_dir)
        vocab = source.model.config.vocab_size
        if tokenizer.tokenizer.get_vocab_size() > vocab:
            raise ConfigError(f"tokenizer_dir={tokenizer_dir} has {tokenizer.tokenizer.get_vocab_size()} tokens, more "
                              f"than the model's vocab_size={vocab}: not this model's tokenizer")
        lm = DslLitLM(source.model, tokenizer, batch_size=cfg.batch_size, max_gen_toks=cfg.max_gen_toks,
                      autocast_dtype=torch.bfloat16 if cfg.precision == "bf16" else None,
                      model_info={**source.info, "tokenizer_dir": str(tokenizer_dir), "precision": cfg.precision})
        results = harness.evaluate(lm)
    path = write_results(results, run_dir)
    log.info("wrote %s", path)
    if cfg.wandb.enabled and cfg.wandb.mode != "disabled":
        log_to_wandb(cfg, run_dir, flat_metrics(results), results)
    return results


def log_to_wandb(cfg: EvaluateConfig, run_dir: str | Path, metrics: dict[str, float], results: dict[str, Any]) -> None:
    """One W&B run (offline unless WANDB_MODE says otherwise) holding the scalars and results.json."""
    import wandb

    run = wandb.init(project=cfg.wandb.project, entity=cfg.wandb.entity, dir=str(run_dir), name=Path(run_dir).name,
                     mode=os.environ.get("WANDB_MODE", cfg.wandb.mode), tags=list(cfg.wandb.tags) + ["evaluate"],
                     config={"checkpoint": cfg.checkpoint, "tasks": list(cfg.tasks), **results.get("config", {})})
    try:
        run.log(metrics)
        run.summary.update(metrics)
        run.save(str(Path(run_dir) / "results.json"), base_path=str(run_dir), policy="now")
    finally:
        run.finish()
