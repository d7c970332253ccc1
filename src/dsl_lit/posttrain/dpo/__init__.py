"""Post-training method ``dpo``: its LightningModule (``module``), its loss (``loss``) and its data (``data``)."""
