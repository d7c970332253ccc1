"""Tests of ``scaling``."""
