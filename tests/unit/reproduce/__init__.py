"""Tests of ``reproduce``."""
