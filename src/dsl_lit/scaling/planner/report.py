"""What ``recipes/plan.py`` does with a composed config: plan, print, write ``plan.json`` (and
search layouts into ``search.json``). Kept here so tests run it without a subprocess."""

from __future__ import annotations

import json
from pathlib import Path

from omegaconf import DictConfig

from dsl_lit.scaling.planner.config import plan_inputs
from dsl_lit.scaling.planner.plan import Plan, make_plan, search_layouts


def search_table(plans: list[Plan]) -> str:
    lines = [f"{'dp':>5}{'tp':>4}{'pp':>4}{'ep':>4} {'schedule':<16}{'recompute':<10}{'mb':>3}{'GiB':>7}{'step s':>8}"
             f"{'tok/GPU/s':>10}{'MFU':>7}{'GPU-h/T':>9}"]
    for p in plans:
        lay, par = p.layout, p.layout.parallel
        lines.append(f"{par.dp:>5}{par.tp:>4}{par.pp:>4}{par.ep:>4} {par.pp_schedule:<16}{lay.recompute:<10}"
                     f"{lay.micro_batch_size:>3}{p.memory_per_gpu_gib:>7.1f}{p.step.total:>8.2f}"
                     f"{p.tokens_per_gpu_per_s:>10.0f}{p.mfu:>7.1%}{p.gpu_hours_per_trillion_tokens:>9.0f}")
    return "\n".join(lines)


def write_plan(cfg: DictConfig, out_dir: str | Path) -> Plan:
    """Validate every group, plan, print the table and write the JSON files into ``out_dir``."""
    model, layout, cluster, options = plan_inputs(cfg)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    plan = make_plan(model, layout, cluster)
    print(plan.table())
    (out / "plan.json").write_text(json.dumps(plan.to_dict(), indent=2))
    if options.search:
        plans = search_layouts(model, layout, cluster, runnable_only=options.search_runnable_only)[: options.top_k]
        print(f"\nthe fastest {len(plans)} layouts that fit:\n{search_table(plans)}")
        (out / "search.json").write_text(json.dumps([p.to_dict() for p in plans], indent=2))
    return plan
