"""The one hook that sets a module's model up for its run, the strategy's (:mod:`dsl_lit.parallel.strategy`).

A run's model is changed from outside in one place, :func:`~dsl_lit.parallel.model_transforms.transform_model`,
and this hook is its only caller: Lightning's ``_setup_model`` (the step where a strategy would wrap
the model in DDP or FSDP) applies the module's :class:`~dsl_lit.parallel.model_transforms.TransformPlan`
and the strategy's layout steps (none on one device) in the order written there. A module under a
strategy of Lightning's own gets no transforms; it refuses a plan that asks for some
(``CausalLMModule.configure_model``) rather than train without them.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from dsl_lit.parallel.model_transforms import is_fitting, transform_model


class ModelSetup:
    """Mixin of a Lightning strategy (before Lightning's class in the bases): its ``_setup_model``
    transforms the module's model instead of wrapping it."""

    def layout_steps(self, module: Any) -> dict[str, Callable[[], None]]:
        """The layout's steps for ``module``'s model (:mod:`dsl_lit.parallel.layout_steps`): none here."""
        return {}

    def _setup_model(self, model: Any) -> Any:
        module = self.lightning_module  # type: ignore[attr-defined]
        plan = getattr(module, "transform_plan", None)  # (a sampling-only module has none)
        if plan is not None and getattr(module, "model", None) is not None:
            fitting = is_fitting(module.trainer)
            transform_model(module.model, plan, self.layout_steps(module) if fitting else {}, fitting)
        return model
