"""Evaluate a checkpoint with EleutherAI's lm-evaluation-harness, in process, on our model.

    python recipes/evaluate.py checkpoint=outputs/pretrain/<run>          # the bundled tasks, latest step
    python recipes/evaluate.py checkpoint=<run>/checkpoints/step-200 tasks=[dsl_arithmetic] limit=32
    python recipes/evaluate.py checkpoint=hf/<dir> include_path=[my_tasks] tasks=[my_task] tokenizer_dir=<dir>
    python recipes/evaluate.py -m checkpoint=<run>/checkpoints/step-100,<run>/checkpoints/step-200

Writes lm-eval's results.json (and samples_<task>.jsonl with log_samples=true) to the run
directory (outputs/evaluate/<time>/), and to W&B with wandb.enabled=true. Nothing is downloaded:
the bundled tasks read data/eval_tasks, and a task YAML's data_files may be relative to the YAML.
Options and their defaults: conf/evaluate.yaml.
"""

from __future__ import annotations

import sys

if __name__ == "__main__" and {"-h", "--help"} & set(sys.argv[1:]):  # groups and keys explained, before torch loads
    from dsl_lit.config.help import print_recipe_help

    print_recipe_help(__file__)

from pathlib import Path

import hydra
from hydra.core.config_store import ConfigStore
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig, OmegaConf

from data_contract.schema import dataclass_from_dict
from dsl_lit.config.evaluate import EvaluateConfig
from dsl_lit.evaluation.checkpoint import evaluate_checkpoint
from dsl_lit.training.runs import exits_on_config_error

# From the config store, not conf/: there `checkpoint=` would name an option of conf/checkpoint/.
ConfigStore.instance().store(name="evaluate", node=OmegaConf.load(Path(__file__).parents[1] / "conf" / "evaluate.yaml"))


@hydra.main(config_path=None, config_name="evaluate", version_base="1.3")
@exits_on_config_error
def main(hydra_cfg: DictConfig) -> None:
    from lm_eval.utils import make_table

    values = OmegaConf.to_container(hydra_cfg, resolve=True)
    values.pop("run_name", None)
    cfg = dataclass_from_dict(EvaluateConfig, values, "evaluate")
    results = evaluate_checkpoint(cfg, HydraConfig.get().runtime.output_dir)
    print(make_table(results))


if __name__ == "__main__":
    main()
