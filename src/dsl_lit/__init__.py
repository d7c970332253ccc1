"""dsl-lit: composable Lightning recipes that reproduce DeepSeek's training stack."""

__version__ = "0.1.0"
