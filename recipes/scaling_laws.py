"""DeepSeek LLM's scaling-law studies on tiny models: a Hydra multirun (a learning-rate x batch-size
grid at a few compute budgets, and IsoFLOP curves of several model shapes), then the fitted
laws in ``scaling_laws.json`` and plots (``isoflop.png``, ``optima.png``, ``hparam_landscape.png``)
in the sweep directory. Copy this file to make your own study.

    python recipes/scaling_laws.py                       # the default toy sweep, minutes on a CPU
    python recipes/scaling_laws.py 'sweep.isoflop_budgets=[1e11,1e12]' 'sweep.lrs=[1e-3,2e-3]'
    python recipes/scaling_laws.py hydra.mode=RUN point=3   # one run of the sweep, for debugging

The default sweep (29 runs, 15804 optimizer steps) took 7 min 49 s on the shared 2-core CPU
(2026-11-22, load average ~2.5 from another job; 7 min 12 s for a variant with 3e10 as the
second IsoFLOP budget). Its grids bracket every budget's best run (lr ~3e-3, batch 2 sequences,
model [1, 16]); a best run on a grid edge is logged as a warning and listed in
``scaling_laws.json`` (``edge_optima``), since the fitted optimum there is an extrapolation. The
toy optima say little about the laws: both IsoFLOP budgets pick the same model, so M_opt's
fitted exponent is 0. Every law comes with a bootstrap interval over the runs (``bootstrap`` in
``scaling_laws.json``; the band in ``optima.png``). A best run on a grid edge is also answered with
the overrides whose runs, one step beyond it, move it inside: rerun with them into the same
``hydra.sweep.dir`` (each run's directory is its name, so finished runs are not trained again).
``make reproduce`` runs those rounds itself over four budgets (1.5 decades) with the IsoFLOP study
at the fitted batch and lr (``dsl_lit.reproduce.stages.scaling``).
"""

from __future__ import annotations

import sys

if __name__ == "__main__" and {"-h", "--help"} & set(sys.argv[1:]):  # groups and keys explained, before torch loads
    from dsl_lit.config.help import print_recipe_help

    print_recipe_help(__file__)

import hydra
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig

from dsl_lit.config.resolvers import register_resolvers
from dsl_lit.scaling.sweep import register_resolver, train_point
from dsl_lit.training.runs import exits_on_config_error

register_resolver()  # ${scaling_points:...}: the multirun's list of runs, before Hydra composes
register_resolvers()  # ${project_root:}, which the sweep's configs read too


@hydra.main(config_path="../conf", config_name="scaling_laws", version_base="1.3")
@exits_on_config_error
def main(cfg: DictConfig) -> float:
    return train_point(cfg, run_dir=HydraConfig.get().runtime.output_dir)["loss"]


if __name__ == "__main__":
    main()
