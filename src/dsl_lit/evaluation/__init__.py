"""Downstream evaluation with EleutherAI's lm-evaluation-harness, in process, on our models.

``lm.DslLitLM`` is the ``lm_eval.api.model.LM`` of our Transformer (batched loglikelihoods,
rolling loglikelihoods, and generation with the KV-cache generator); ``tasks`` makes task YAMLs
loadable from any working directory; ``harness`` runs ``simple_evaluate`` and writes lm-eval's
results.json; ``bundled`` made the offline tasks under ``data/eval_tasks``. Used by
``recipes/evaluate.py`` (a checkpoint) and by the training loop (``eval.every_n_steps``).
"""
