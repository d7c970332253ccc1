"""Tests of ``benchmarks``."""
