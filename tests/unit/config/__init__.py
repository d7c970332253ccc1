"""Tests of ``config``."""
