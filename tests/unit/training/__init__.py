"""Tests of ``training``."""
