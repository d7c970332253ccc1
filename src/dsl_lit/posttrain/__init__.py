"""Post-training (the DeepSeek-R1 pipeline): one folder per method (``sft/``, ``dpo/``, ``grpo/``,
``rejection/``: its LightningModule, its loss, its data), the chat data they share (``chat/``: the
chat tokenizer, conversations, SFT rows, the rows' DataModule), the shared base module, log-probs,
generation with the KV cache, rule rewards, and what every post-training recipe runs (``run``)."""

from dsl_lit.posttrain.dpo.module import DPOModule
from dsl_lit.posttrain.grpo.module import GRPOModule
from dsl_lit.posttrain.module import PostTrainModule
from dsl_lit.posttrain.rejection.module import RejectionSamplingModule
from dsl_lit.posttrain.sft.module import SFTModule

__all__ = ["DPOModule", "GRPOModule", "PostTrainModule", "RejectionSamplingModule", "SFTModule"]
