"""Post-training method ``rejection``: rejection sampling's LightningModule (``module``) and data (``data``)."""
