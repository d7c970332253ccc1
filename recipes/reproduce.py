"""DeepSeek in miniature, end to end: scaling laws -> data pipeline -> V3 pretraining -> YaRN ->
the R1 pipeline -> lm-eval -> one report (``outputs/reproduce/<run>/report/report.md``).

    python recipes/reproduce.py                                       # make reproduce: cpu_mini
    python recipes/reproduce.py 'reproduce.stages=[evaluate,report]'  # a subset; its inputs must be finished
    python recipes/reproduce.py reproduce=gpu_short                   # one GPU, 6 minutes, no datasets/lm-eval needed
    python recipes/reproduce.py reproduce=gpu_small                   # one GPU, an hour

Stages and what feeds what: ``dsl_lit/reproduce/stages.py``; presets: ``conf/reproduce/``. A rerun
skips finished stages and resumes an interrupted one from its checkpoints.
"""

from __future__ import annotations

import sys

if __name__ == "__main__" and {"-h", "--help"} & set(sys.argv[1:]):  # groups and keys explained, before torch loads
    from dsl_lit.config.help import print_recipe_help

    print_recipe_help(__file__)

import logging
from pathlib import Path

import hydra
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig, OmegaConf

from data_contract.schema import dataclass_from_dict
from dsl_lit.config.reproduce import ReproduceConfig
from dsl_lit.reproduce.preflight import check_commands, check_device, check_packages
from dsl_lit.reproduce.runner import StageFailed, run_stages
from dsl_lit.reproduce.stages import STAGE_TABLE
from dsl_lit.training.runs import exits_on_config_error

log = logging.getLogger(__name__)


@hydra.main(config_path="../conf", config_name="reproduce", version_base="1.3")
@exits_on_config_error
def main(hydra_cfg: DictConfig) -> None:
    values = OmegaConf.to_container(hydra_cfg.reproduce, resolve=True)
    cfg = dataclass_from_dict(ReproduceConfig, values, "reproduce").validate()
    run_dir = Path(HydraConfig.get().runtime.output_dir)
    check_device(cfg)  # a GPU preset needs a GPU here
    check_commands(cfg, STAGE_TABLE, run_dir)  # every stage's command composes and validates, before any runs
    check_packages(cfg, run_dir)  # and the packages the stages need are here (lm-eval's absence skips the evaluation)
    try:
        run_stages(cfg, STAGE_TABLE, run_dir, progress=log.info)
    except StageFailed as error:
        log.error("%s", error)
        sys.exit(1)


if __name__ == "__main__":
    main()
