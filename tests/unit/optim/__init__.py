"""Tests of ``optim``."""
