"""Benchmarks: scripts that print tables of ratios measured in one run (run with python -m)."""
