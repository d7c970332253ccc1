"""DeepSeek LLM (arXiv 2401.02954): grouped-query attention and a dense SwiGLU in every block,
released in the Llama layout. Presets in ``presets``, field checks in ``validation``, the
tensor-parallel plan in ``parallelize``, the Hugging Face names in ``hf_adapter``; its FLOPs and
pipeline stage costs follow from the composition (``dsl_lit.models.common.flops``)."""

from dsl_lit.models.common.attention import GroupedQueryAttention
from dsl_lit.models.common.block import Composition
from dsl_lit.models.deepseek_llm.hf_adapter import DeepSeekLLMAdapter
from dsl_lit.models.deepseek_llm.parallelize import tp_plan
from dsl_lit.models.deepseek_llm.presets import PRESETS
from dsl_lit.models.deepseek_llm.validation import validate
from dsl_lit.models.registry import FamilySpec

HF_ADAPTER = DeepSeekLLMAdapter()

SPEC = FamilySpec(
    name="deepseek_llm",
    presets=PRESETS,
    base_preset="deepseek_llm_tiny",
    composition=Composition(attention=GroupedQueryAttention),
    validate=validate,
    tp_plan=tp_plan,
    hf_adapter=HF_ADAPTER,
    hf_readers=(HF_ADAPTER,),
)
