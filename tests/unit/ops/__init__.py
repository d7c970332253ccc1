"""Tests of ``ops``."""
