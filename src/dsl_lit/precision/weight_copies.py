"""``precision.expert_weight_copies``: the routed experts keep their compute-dtype (bf16) weight
copies between forwards, recast only after the weights change (see
:mod:`dsl_lit.models.common.compute_copies` for why and how).

Which experts: the plain ``GroupedExperts`` stacks (the model's, and expert parallelism's local
shards); not FP8 experts, whose weights torchao quantises itself or the reference path replaces.
Copies are made at the first forward under autocast, so it does not matter where in the transform
order this runs, only that it runs after FP8 has chosen its modules.
"""

from __future__ import annotations

from torch import nn

from dsl_lit.models.common.compute_copies import COPY_OWNERS, ComputeCopies
from dsl_lit.models.common.moe import GroupedExperts


def keep_expert_weight_copies(model: nn.Module) -> int:
    """Turn copies on for ``model``'s plain routed-expert stacks; returns how many."""
    owners = [m for m in model.modules() if type(m) is GroupedExperts]
    for module in owners:
        if module.compute_copies is None:
            module.compute_copies = ComputeCopies()
    setattr(model, COPY_OWNERS, owners)
    return len(owners)


def weight_casts(model: nn.Module) -> int:
    """Weights cast into copies so far over ``model`` (tests, benchmarks)."""
    return sum(m.compute_copies.casts for m in getattr(model, COPY_OWNERS, ()) if m.compute_copies is not None)
