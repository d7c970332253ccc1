"""Every recipe's configuration as validated dataclasses: the bottom layer of dsl-lit.

Each Hydra group has its dataclass here (``model``, ``data``, ``optim``, ``schedule``,
``precision``, ``parallel``, ``memory``, ``objective``, the post-training sections); ``TrainConfig``
and ``PostTrainConfig`` turn a composed Hydra config into them and raise :class:`ConfigError`
naming the field and the fix before a Trainer, a process group or a dataset exists. Nothing here
imports the rest of dsl-lit, Lightning or a LightningModule (``tests/architecture/test_architecture.py``).
"""

from data_contract.errors import ConfigError
from dsl_lit.config.model import ModelConfig
from dsl_lit.config.parallel import ParallelConfig, ParallelLayout
from dsl_lit.config.train import (
    CheckpointConfig,
    LoggerConfig,
    TrainConfig,
    TrainerConfig,
    WandbConfig,
)

__all__ = [
    "CheckpointConfig",
    "ConfigError",
    "LoggerConfig",
    "ModelConfig",
    "ParallelConfig",
    "ParallelLayout",
    "TrainConfig",
    "TrainerConfig",
    "WandbConfig",
]
