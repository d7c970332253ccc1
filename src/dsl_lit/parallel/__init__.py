"""Parallelism applied from outside the models: the Lightning Strategy and its pieces."""
