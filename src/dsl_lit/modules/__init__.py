"""LightningModules, one per training objective, all sharing ``CausalLMModule``'s step."""

from dsl_lit.modules.causal_lm import CausalLMModule
from dsl_lit.modules.dpo import DPOModule
from dsl_lit.modules.grpo import GRPOModule
from dsl_lit.modules.posttrain import PostTrainModule
from dsl_lit.modules.pretrain import PretrainModule
from dsl_lit.modules.rejection import RejectionSamplingModule
from dsl_lit.modules.sft import SFTModule

__all__ = [
    "CausalLMModule",
    "DPOModule",
    "GRPOModule",
    "PostTrainModule",
    "PretrainModule",
    "RejectionSamplingModule",
    "SFTModule",
]
