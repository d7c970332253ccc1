"""Scaling laws (DeepSeek LLM section 3) as tools, and a planner that takes a recipe to a cluster on paper.

- :mod:`.laws`: model scale M, the paper's hyperparameter and allocation laws.
- :mod:`.fit`: estimating those power laws from your own runs (IsoFLOP and lr/batch sweeps).
- :mod:`.planner`: per-GPU memory, step time, MFU and GPU-hours of a model + layout + cluster.
"""

from dsl_lit.scaling.fit import (
    fit_allocation,
    fit_hparam_laws,
    fit_power_law,
    hparam_optimum,
    isoflop_optimum,
)
from dsl_lit.scaling.laws import (
    PAPER_BATCH,
    PAPER_DATA_SCALE,
    PAPER_LR,
    PAPER_MODEL_SCALE,
    PowerLaw,
    flops_per_token,
    model_scale,
    non_embedding_flops_per_token,
    optimal_allocation,
    optimal_hparams,
)

__all__ = [
    "PAPER_BATCH", "PAPER_DATA_SCALE", "PAPER_LR", "PAPER_MODEL_SCALE", "PowerLaw", "fit_allocation",
    "fit_hparam_laws", "fit_power_law", "flops_per_token", "hparam_optimum", "isoflop_optimum", "model_scale",
    "non_embedding_flops_per_token", "optimal_allocation", "optimal_hparams",
]
