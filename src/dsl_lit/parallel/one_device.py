"""The strategy of a one-process run: Lightning's single-device strategy with our sharded,
name-keyed checkpoints (:mod:`dsl_lit.parallel.checkpointing`) and the module's model transforms
(:mod:`dsl_lit.parallel.model_setup`)."""

from __future__ import annotations

from lightning.pytorch.strategies import SingleDeviceStrategy

from dsl_lit.parallel.checkpointing import ShardedCheckpointing
from dsl_lit.parallel.model_setup import ModelSetup


class OneDeviceStrategy(ModelSetup, ShardedCheckpointing, SingleDeviceStrategy):
    """Lightning's single-device strategy with our checkpoint format, so a one-process run saves
    what a multi-process run loads and the other way round; it applies the module's model
    transforms (FP8, recompute, compile) in :class:`ModelSetup`'s hook, as the multi-process
    strategy does with its layout's."""

    strategy_name = "dsl_lit_single"
