"""Tests of ``precision``."""
