"""Tests of ``data_contract``."""
