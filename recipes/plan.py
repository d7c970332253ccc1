"""Plan a training run on a cluster before renting it: per-GPU memory, step time, tokens/s, MFU and
GPU-hours per trillion tokens, from first principles. Copy this file to make your own recipe.

    python recipes/plan.py plan_experiment=deepseek_v3_671b_h800
    python recipes/plan.py model=deepseek_llm_7b cluster=h100 cluster.nodes=32 plan.search=true
    python recipes/plan.py plan_experiment=deepseek_llm_67b parallel.pp=4 plan.recompute=full

Writes ``plan.json`` (and ``search.json`` with ``plan.search=true``) to the run directory.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

import hydra
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig

from dsl_lit.scaling.planner import make_plan, search_layouts
from dsl_lit.scaling.planner.config import plan_inputs

log = logging.getLogger(__name__)


@hydra.main(config_path="../conf", config_name="plan", version_base="1.3")
def main(cfg: DictConfig) -> None:
    model, layout, cluster, options = plan_inputs(cfg)  # every group validated first
    out = Path(HydraConfig.get().runtime.output_dir)
    out.mkdir(parents=True, exist_ok=True)

    plan = make_plan(model, layout, cluster)
    print(plan.table())
    (out / "plan.json").write_text(json.dumps(plan.to_dict(), indent=2))

    if options.search:
        plans = search_layouts(model, layout, cluster, runnable_only=options.search_runnable_only)
        print(f"\n{len(plans)} layouts fit; the fastest {min(options.top_k, len(plans))}:")
        print(f"{'dp':>5}{'tp':>4}{'pp':>4}{'ep':>4} {'schedule':<16}{'recompute':<10}{'mb':>3}{'GiB':>7}{'step s':>8}"
              f"{'tok/GPU/s':>10}{'MFU':>7}{'GPU-h/T':>9}")
        for p in plans[: options.top_k]:
            lay = p.layout
            print(f"{lay.dp:>5}{lay.tp:>4}{lay.pp:>4}{lay.ep:>4} {lay.pp_schedule:<16}{lay.recompute:<10}"
                  f"{lay.micro_batch_size:>3}{p.memory_per_gpu_gib:>7.1f}{p.step.total:>8.2f}{p.tokens_per_gpu_per_s:>10.0f}"
                  f"{p.mfu:>7.1%}{p.gpu_hours_per_trillion_tokens:>9.0f}")
        (out / "search.json").write_text(json.dumps([p.to_dict() for p in plans[: options.top_k]], indent=2))
    log.info("wrote %s", out / "plan.json")


if __name__ == "__main__":
    main()
