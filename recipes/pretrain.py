"""Pretrain a DeepSeek model. Copy this file to make your own recipe.

    python recipes/pretrain.py                                  # the CPU demo
    python recipes/pretrain.py model=deepseek_llm_tiny optim.lr=1e-3 trainer.max_steps=50
    python recipes/pretrain.py -m optim.lr=1e-3,2e-3            # a sweep (Hydra multirun)
"""

from __future__ import annotations

import logging

import hydra
import lightning as L
from hydra.core.hydra_config import HydraConfig
from lightning.pytorch.utilities.exceptions import SIGTERMException
from omegaconf import DictConfig

from dsl_lit.build import build_trainer, module_arguments, resume_path
from dsl_lit.config import TrainConfig
from dsl_lit.data.datamodule import PretrainDataModule
from dsl_lit.modules import PretrainModule
from dsl_lit.runs import check_vocab, exits_on_config_error, finish_run, save_resolved_config

log = logging.getLogger(__name__)


@hydra.main(config_path="../conf", config_name="pretrain", version_base="1.3")
@exits_on_config_error
def main(hydra_cfg: DictConfig) -> None:
    # 1. Validate everything before any data, model or process group exists.
    cfg = TrainConfig.from_hydra(hydra_cfg, run_dir=HydraConfig.get().runtime.output_dir)
    save_resolved_config(cfg)
    L.seed_everything(cfg.trainer.seed, workers=True)

    # 2. Data: builds the tokenizer and packed shards on first use.
    datamodule = PretrainDataModule(cfg.data)
    check_vocab(cfg, datamodule)

    # 3. The objective, the trainer, and fit (resuming from the run dir's latest checkpoint).
    module = PretrainModule(**module_arguments(cfg))
    trainer = build_trainer(cfg)
    try:
        trainer.fit(module, datamodule=datamodule, ckpt_path=resume_path(cfg))
    except SIGTERMException:  # preempted: the checkpoint of this step is on disk
        log.warning("SIGTERM at step %d: checkpoint saved; rerun the same command to resume", trainer.global_step)
        raise SystemExit(143) from None
    finish_run(trainer)


if __name__ == "__main__":
    main()
