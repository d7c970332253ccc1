"""Tests of ``models``."""
