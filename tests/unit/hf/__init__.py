"""Tests of ``hf``."""
