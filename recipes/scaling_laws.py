"""DeepSeek LLM's scaling-law studies on tiny models: a Hydra multirun (a learning-rate x batch-size
grid at a few compute budgets, and IsoFLOP curves of several model shapes), then the fitted
laws in ``scaling_laws.json`` and plots (``isoflop.png``, ``optima.png``, ``hparam_landscape.png``)
in the sweep directory. Copy this file to make your own study.

    python recipes/scaling_laws.py                       # the default toy sweep, minutes on a CPU
    python recipes/scaling_laws.py 'sweep.isoflop_budgets=[1e11,1e12]' 'sweep.lrs=[1e-3,2e-3]'
    python recipes/scaling_laws.py hydra.mode=RUN point=3   # one run of the sweep, for debugging

The default sweep (32 runs, 6822 optimizer steps) took 5 min 30 s on a shared 2-core CPU
(2026-11-22, load average ~5), plus ~16 s the first time to build the 2048-token vocabulary.
At these toy budgets the optima sit at the grids' small-model / small-batch / low-lr edges, so the
fitted exponents mean little: the sweep shows the method, a larger ``sweep.*`` shows the laws.
"""

from __future__ import annotations

import hydra
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig

import dsl_lit.build  # noqa: F401  (registers ${project_root:})
from dsl_lit.scaling.sweep import register_resolver, train_point

register_resolver()  # ${scaling_points:...}: the multirun's list of runs, before Hydra composes


@hydra.main(config_path="../conf", config_name="scaling_laws", version_base="1.3")
def main(cfg: DictConfig) -> float:
    return train_point(cfg, run_dir=HydraConfig.get().runtime.output_dir)["loss"]


if __name__ == "__main__":
    main()
