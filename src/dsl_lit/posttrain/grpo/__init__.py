"""Post-training method ``grpo``: its LightningModule (``module``), its loss (``loss``) and its data (``data``)."""
