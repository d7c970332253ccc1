"""Generated tasks, deterministic in a seed: ``arithmetic`` (verifiable problems with R1-format
replies, for post-training and the bundled ``dsl_arithmetic`` evaluation) and ``passkey`` (retrieval
documents and prompts, for context extension and its evaluation). They import only ``config``."""
