"""Tests of ``checkpoint``."""
