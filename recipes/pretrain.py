"""Pretrain a DeepSeek model. Copy this file to make your own recipe.

    python recipes/pretrain.py                                  # the CPU demo
    python recipes/pretrain.py model=deepseek_llm_tiny optim.lr=1e-3 trainer.max_steps=50
    python recipes/pretrain.py -m optim.lr=1e-3,2e-3            # a sweep (Hydra multirun)
"""

from __future__ import annotations

import sys

if __name__ == "__main__" and {"-h", "--help"} & set(sys.argv[1:]):  # groups and keys explained, before torch loads
    from dsl_lit.config.help import print_recipe_help

    print_recipe_help(__file__)

import hydra
import lightning as L
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig

from dsl_lit.config import TrainConfig
from dsl_lit.data.datamodule import PretrainDataModule
from dsl_lit.scaling.planner.fits import refuse_what_cannot_fit
from dsl_lit.training import PretrainModule
from dsl_lit.training.build import fit, module_arguments, starting_weights
from dsl_lit.training.run_tokenizer import record_run_tokenizer
from dsl_lit.training.runs import check_vocab, exits_on_config_error, save_resolved_config


@hydra.main(config_path="../conf", config_name="pretrain", version_base="1.3")
@exits_on_config_error
def main(hydra_cfg: DictConfig) -> None:
    # 1. Validate everything before any data, model or process group exists; init_from's
    #    architecture (a checkpoint or an HF directory) replaces the model group.
    cfg = TrainConfig.from_hydra(hydra_cfg, run_dir=HydraConfig.get().runtime.output_dir)
    initial_state = starting_weights(cfg, cfg.init_from)
    refuse_what_cannot_fit(cfg)  # the planner's memory estimate against this machine: one line, exit 2
    save_resolved_config(cfg)
    L.seed_everything(cfg.trainer.seed, workers=True)

    # 2. Data: builds the tokenizer and packed shards on first use.
    datamodule = PretrainDataModule(cfg.data)
    check_vocab(cfg, datamodule)
    record_run_tokenizer(cfg, datamodule.tokenizer_dir, initial_state)  # init_from's or refused; copied to the run dir

    # 3. The objective and fit (resuming from the run dir's latest checkpoint; SIGTERM exits 143).
    fit(cfg, PretrainModule(**module_arguments(cfg), initial_state=initial_state), datamodule)


if __name__ == "__main__":
    main()
