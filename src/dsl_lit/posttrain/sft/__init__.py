"""Post-training method ``sft``: its LightningModule (``module``); chat data lives in ``dsl_lit.posttrain.chat``."""
