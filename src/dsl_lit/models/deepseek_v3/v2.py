"""DeepSeek-V2 (arXiv 2405.04434): the DeepSeek-V3 family's blocks (MLA + DeepSeekMoE) with
DeepSeek-V2's router, and no multi-token prediction.

The one mechanism V2 does differently is device-limited routing, ``topk_method``
``group_limited_greedy`` in its released code and in ``transformers``: softmax scores, each group of
experts (a device) ranked by its *best* expert, the ``n_limited_groups`` best groups kept and the
top-k experts picked inside them (DeepSeek-V3 ranks a group by the sum of its two best). With no
group limit it is plain top-k (``greedy``, DeepSeek-V2-Lite). Its balance loss is the expert-level
one computed per sequence, as the released code does (``seq_aux``); the device- and
communication-level balance losses of the paper are not implemented.
"""

from __future__ import annotations

import torch

from dsl_lit.config.families.deepseek_v2 import CARD
from dsl_lit.models.common.block import Composition
from dsl_lit.models.common.family_spec import FamilySpec
from dsl_lit.models.common.mla import MultiHeadLatentAttention
from dsl_lit.models.common.moe import TopKRouter
from dsl_lit.models.deepseek_v3.parallelize import tp_plan
from dsl_lit.models.deepseek_v3.v2_hf_adapter import V2_ADAPTER


class GroupLimitedGreedyRouter(TopKRouter):
    """DeepSeek-V2's router: a group of experts ranks by its best expert's score."""

    @staticmethod
    def group_scores(grouped: torch.Tensor) -> torch.Tensor:
        return grouped.amax(dim=-1)


SPEC = FamilySpec(
    card=CARD,
    composition=Composition(attention=MultiHeadLatentAttention, router=GroupLimitedGreedyRouter),
    tp_plan=tp_plan,
    hf_adapter=V2_ADAPTER,
    hf_readers=(V2_ADAPTER,),
)
