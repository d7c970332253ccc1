"""Plan a training run on a cluster before renting it: per-GPU memory, step time, tokens/s, MFU and
GPU-hours per trillion tokens, from first principles. Copy this file to make your own recipe.

    python recipes/plan.py plan_experiment=deepseek_v3_671b_h800
    python recipes/plan.py model=deepseek_llm_7b cluster=h100 cluster.nodes=32 plan.search=true
    python recipes/plan.py plan_experiment=deepseek_llm_67b parallel.pp=4 plan.recompute=full
    python recipes/plan.py plan.published=true   # against DeepSeek-V3's three published runs

Writes ``plan.json`` (``search.json`` with ``plan.search=true``, ``published.json`` with
``plan.published=true``) to the run directory.
"""

from __future__ import annotations

import sys

if __name__ == "__main__" and {"-h", "--help"} & set(sys.argv[1:]):  # groups and keys explained, before torch loads
    from dsl_lit.config.help import print_recipe_help

    print_recipe_help(__file__)

import hydra
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig

from dsl_lit.scaling.planner.report import write_plan
from dsl_lit.training.runs import exits_on_config_error


@hydra.main(config_path="../conf", config_name="plan", version_base="1.3")
@exits_on_config_error
def main(cfg: DictConfig) -> None:
    hydra_cfg = HydraConfig.get()
    write_plan(cfg, hydra_cfg.runtime.output_dir, overrides=list(hydra_cfg.overrides.task))


if __name__ == "__main__":
    main()
