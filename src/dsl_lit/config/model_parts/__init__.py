"""The parts a model config is made of, as torch-free classes: its attention (grouped-query,
latent, sparse latent, DeepSeek-V4's shared-KV), its routed experts, its multi-token prediction,
DeepSeek-V4's hyper-connections.

A part names the :class:`~dsl_lit.config.model.ModelConfig` fields it reads (``FIELDS``), checks them
(``validate``, naming ``<prefix>.<field>``) and answers the shape questions about itself (an
attention part: key/value heads, rotary width, projection weights, score FLOPs; the experts: which
layers route; MTP: how many modules). A family (``config/families/``) is a choice of parts plus its
own rules; a field no part of the chosen family reads is refused. The values stay flat on
``ModelConfig``, as in DeepSeek's and Hugging Face's ``config.json``, so every override, preset and
stored checkpoint config reads as before; the parts say what the fields mean.
"""
