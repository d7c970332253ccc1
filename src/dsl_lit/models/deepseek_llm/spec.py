"""What DeepSeek LLM builds: grouped-query attention and a dense SwiGLU in every block (``dsl_lit.models.registry``)."""

from dsl_lit.config.families.deepseek_llm import CARD
from dsl_lit.models.common.attention import GroupedQueryAttention
from dsl_lit.models.common.block import Composition
from dsl_lit.models.common.family_spec import FamilySpec
from dsl_lit.models.deepseek_llm.hf_adapter import DeepSeekLLMAdapter
from dsl_lit.models.deepseek_llm.parallelize import tp_plan

HF_ADAPTER = DeepSeekLLMAdapter()

SPEC = FamilySpec(
    card=CARD,
    composition=Composition(attention=GroupedQueryAttention),
    tp_plan=tp_plan,
    hf_adapter=HF_ADAPTER,
    hf_readers=(HF_ADAPTER,),
)
