"""LightningModules, one per training objective, all sharing ``CausalLMModule``'s step."""

from dsl_lit.modules.causal_lm import CausalLMModule, split_micro_batches
from dsl_lit.modules.pretrain import PretrainModule

__all__ = ["CausalLMModule", "PretrainModule", "split_micro_batches"]
