"""Tests of ``report``."""
