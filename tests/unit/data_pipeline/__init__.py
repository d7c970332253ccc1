"""Tests of ``data_pipeline``."""
