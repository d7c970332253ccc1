"""What ``recipes/plan.py`` does with a composed config: plan, print, write ``plan.json`` (search
layouts into ``search.json``, compare with the published runs into ``published.json``). Kept here
so tests run it without a subprocess."""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from pathlib import Path

from omegaconf import DictConfig

from dsl_lit.scaling.planner.config import plan_inputs
from dsl_lit.scaling.planner.plan import Plan, make_plan, search_layouts
from dsl_lit.scaling.planner.published import compare, comparison_table


def _hydra_compose(overrides: list[str]) -> DictConfig:
    """``recipes/plan.py``'s config with ``overrides`` (Hydra initialised with ``conf/``, as in a recipe)."""
    from hydra import compose

    return compose("plan", overrides=overrides)


def search_table(plans: list[Plan]) -> str:
    lines = [f"{'dp':>5}{'tp':>4}{'pp':>4}{'ep':>4} {'schedule':<16}{'recompute':<10}{'mb':>3}{'GiB':>7}{'step s':>8}"
             f"{'tok/GPU/s':>10}{'MFU':>7}{'GPU-h/T':>9}"]
    for p in plans:
        lay, par = p.layout, p.layout.parallel
        lines.append(f"{par.dp:>5}{par.tp:>4}{par.pp:>4}{par.ep:>4} {par.pp_schedule:<16}{lay.recompute:<10}"
                     f"{lay.micro_batch_size:>3}{p.memory_per_gpu_gib:>7.1f}{p.step.total:>8.2f}"
                     f"{p.tokens_per_gpu_per_s:>10.0f}{p.mfu:>7.1%}{p.gpu_hours_per_trillion_tokens:>9.0f}")
    return "\n".join(lines)


def write_plan(cfg: DictConfig, out_dir: str | Path, overrides: Sequence[str] = (),
               compose: Callable[[list[str]], DictConfig] = _hydra_compose) -> Plan:
    """Validate every group, plan, print the table and write the JSON files into ``out_dir``.
    With ``plan.published``, also plan each published run (``compose`` makes its config; the
    ``cluster.efficiency.*`` ones among ``overrides``, the command line's, apply to every run)."""
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
    if options.published:
        extra = [o for o in overrides if o.startswith("cluster.efficiency.")]
        comparisons = compare(compose, extra=extra)
        print(f"\nthe planner against published runs and this project's measurements{' with ' + ' '.join(extra) if extra else ''}:\n"
              f"{comparison_table(comparisons)}")
        (out / "published.json").write_text(json.dumps([c.to_dict() for c in comparisons], indent=2))
    return plan
