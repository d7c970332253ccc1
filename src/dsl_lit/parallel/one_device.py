"""The strategy of a one-process run: Lightning's single-device strategy with our sharded,
name-keyed checkpoints (:mod:`dsl_lit.parallel.checkpointing`) and the module's model transforms."""

from __future__ import annotations

from typing import Any

from lightning.pytorch.strategies import SingleDeviceStrategy

from dsl_lit.parallel.checkpointing import ShardedCheckpointing
from dsl_lit.parallel.model_transforms import is_fitting, transform_model


class OneDeviceStrategy(ShardedCheckpointing, SingleDeviceStrategy):
    """Lightning's single-device strategy with our checkpoint format, so a one-process run saves
    what a multi-process run loads and the other way round; it applies the module's model
    transforms (FP8, recompute, compile: :mod:`dsl_lit.parallel.model_transforms`) where the
    multi-process strategy applies them with its layout's, before the optimizer is built."""

    strategy_name = "dsl_lit_single"
    applies_model_transforms = True
    """The module leaves FP8, recompute and compile to this strategy (:meth:`_setup_model`)."""

    def _setup_model(self, model: Any) -> Any:
        module = self.lightning_module
        plan = getattr(module, "transform_plan", None)
        if plan is not None and getattr(module, "model", None) is not None:
            transform_model(module.model, plan, fitting=is_fitting(module.trainer))
        return super()._setup_model(model)
