"""Tests of ``parallel``."""
