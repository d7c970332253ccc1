"""Tests of ``data``."""
