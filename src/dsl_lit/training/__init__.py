"""Training: the LightningModule every objective derives from, pretraining's objective, and what
turns a validated config into a Lightning run (callbacks, loggers, the Trainer, ``init_from``)."""

from dsl_lit.training.causal_lm import CausalLMModule
from dsl_lit.training.pretrain import PretrainModule

__all__ = ["CausalLMModule", "PretrainModule"]
