"""Tests of ``inference``."""
