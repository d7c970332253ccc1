"""``python -m data_pipeline input.path=<dir|glob|file> output_dir=<dir> [stages=[...]] [k=v ...]``.

Composed by Hydra from ``conf/data_pipeline.yaml`` and its groups, validated into
``PipelineConfig`` before any work. ``+plan=true`` claims ``output_dir`` as a run would (keeping
the input's line scans there for the tasks to come), prints the steps and their units (for
schedulers) and exits.
"""

from __future__ import annotations

import json
import logging
import sys
from pathlib import Path

import hydra
from omegaconf import DictConfig, OmegaConf

from data_contract.errors import ConfigError
from data_pipeline.config import load_config

log = logging.getLogger("data_pipeline")
GROUPS_DIR = Path(__file__).resolve().parents[1] / "conf" / "data_pipeline"


@hydra.main(config_path="../conf", config_name="data_pipeline", version_base="1.3")
def main(hydra_cfg: DictConfig) -> None:
    import datasets

    from data_pipeline.runner import claim_and_plan, missing_units, run

    datasets.disable_progress_bars()
    values = OmegaConf.to_container(hydra_cfg, resolve=True)
    try:
        cfg = load_config(values)
        if values.get("plan"):
            for p in claim_and_plan(cfg):
                done = p.num_units - len(missing_units(p))
                print(f"{p.step.name:24s} units={p.num_units:<6d} done={done:<6d} {p.context.step_dir}")
            return
        stats = run(cfg)
    except ConfigError as e:  # refused before any work: the input, the output directory, a setting
        log.error("config error: %s", e)
        sys.exit(2)
    if stats is None:
        log.info(
            "step %s done for task %d of %d; later steps still to run",
            cfg.step,
            cfg.task_index,
            cfg.task_count,
        )
        return
    print(json.dumps({k: stats[k] for k in ("input", "output", "seconds")}))


def refuse_dangling_output_dir(argv: list[str]) -> None:
    """Before Hydra (which creates ``<output_dir>/logs/`` first): a dangling-link output_dir is one line."""
    from data_pipeline.io.output_dir import dangling_link_problem

    for arg in argv:
        if arg.startswith("output_dir="):
            problem = dangling_link_problem(arg.split("=", 1)[1].strip("'\""))
            if problem:
                print(f"config error: {problem}", file=sys.stderr)
                sys.exit(2)


if __name__ == "__main__":
    refuse_dangling_output_dir(sys.argv[1:])
    # The groups live in conf/data_pipeline/ beside the primary conf/data_pipeline.yaml.
    sys.argv.append(f"hydra.searchpath=[file://{GROUPS_DIR}]")
    main()
